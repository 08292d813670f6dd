"""mha as a Hugging Face transformers attention implementation.

    import mha.transformers            # registers "mha"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="mha")
    model.set_attn_implementation("mha")   # or on a model already loaded

Importing this module registers the name "mha" with transformers'
AttentionInterface (the attention function below) and
AttentionMaskInterface (transformers' boolean SDPA masks: True takes part,
None when the mask is only causal); `register()` does it again,
idempotently. Every attention layer of a model set to "mha" then runs
mha's scaled_dot_product_attention (mha.torch: fused kernels on float32,
bfloat16 and float16, mha's backward under autograd).

The function honours what the models send: `scaling`, `is_causal`,
`dropout` (training), grouped-query heads (the key's heads divide the
query's: no repeat of K and V), `softcap` (Gemma 2), `s_aux` (GPT-OSS's
sinks, differentiated), `sliding_window` (already in the mask
transformers builds for the layer), the boolean or additive masks
(padding left or right, packed sequences) and `output_attentions` (the
weights from the fused path). A keyword it cannot honour (a position
bias, a head mask, ...) raises ValueError naming it: never a silent
fallback.
"""

import torch

from . import torch as _mt

NAME = "mha"

# Keywords the models pass that carry no attention semantics for this
# function (bookkeeping, or already folded into the mask transformers built)
_IGNORED = {
    "sliding_window",  # folded into the layer's mask by transformers
    "position_ids", "cache_position", "past_key_values", "past_key_value",
    "use_cache", "output_attentions", "output_hidden_states", "return_dict",
    "layer_idx", "attn_implementation", "is_causal_skip", "cu_seq_lens_q",
    "cu_seq_lens_k", "max_length_q", "max_length_k", "position_embeddings",
    "token_type_ids", "s_aux", "softcap", "head_mask", "position_bias",
    "sequence_length", "query_length", "kwargs", "output_router_logits",
}


def _refuse(kwargs):
    head_mask = kwargs.get("head_mask")
    if head_mask is not None:
        raise ValueError("mha attention: head_mask is not supported (prune or gate the heads "
                         "instead: mha.torch's head gates)")
    if kwargs.get("position_bias") is not None:
        raise ValueError("mha attention: position_bias (a learned additive bias, T5-style) is "
                         "not supported; give it as an additive attention mask")
    unknown = sorted(k for k, v in kwargs.items() if k not in _IGNORED and v is not None
                     and not k.startswith("_"))
    if unknown:
        raise ValueError("mha attention: keyword(s) %s not understood (mha honours scaling, "
                         "is_causal, dropout, softcap, s_aux, sliding_window in the mask, "
                         "output_attentions)" % ", ".join(unknown))


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      is_causal=None, **kwargs):
    """transformers' attention function contract: query (B, H, L, D), key
    (B, Hkv, S, D), value (B, Hkv, S, Dv), attention_mask (B or 1, 1, L, S)
    bool (True takes part) or additive, or None; returns (out (B, L, H, Dv),
    weights (B, H, L, S) or None)."""
    _refuse(kwargs)
    L, S = query.shape[2], key.shape[2]
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    mask = attention_mask
    # No mask and causal: transformers' convention (its sdpa function) is
    # top-left causal, which is also what a prefill into an empty static
    # cache needs (the cache's unwritten slots come after the L tokens):
    # the keys past L are never seen, so they are left out
    causal = mask is None and bool(is_causal) and L > 1
    if causal and S > L:
        key, value = key[:, :, :L], value[:, :, :L]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(torch.float32) if mask.dtype != torch.float32 else mask
    sinks = kwargs.get("s_aux")
    softcap = kwargs.get("softcap")
    want_weights = bool(kwargs.get("output_attentions", False))
    res = _mt.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=float(dropout or 0.0), is_causal=causal,
        scale=scaling, enable_gqa=key.shape[1] != query.shape[1],
        softcap=float(softcap) if softcap else 0.0, sinks=sinks, return_weights=want_weights)
    out, weights = res if want_weights else (res, None)
    return out.transpose(1, 2).contiguous(), weights


def register():
    """Registers "mha" with transformers' AttentionInterface and
    AttentionMaskInterface (again: idempotent). Returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


register()

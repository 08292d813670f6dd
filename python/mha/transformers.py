"""mha as a Hugging Face transformers attention implementation.

    import mha.transformers            # registers "mha"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="mha")
    model.set_attn_implementation("mha")   # or on a model already loaded

Importing this module registers the name "mha" with transformers'
AttentionInterface (the attention function below) and
AttentionMaskInterface (transformers' boolean SDPA masks: True takes part,
None when the mask is only causal); `register()` does it again,
idempotently. `flash_attn_varlen_func` is FlashAttention-2's varlen entry
(the Kernels-Hub convention: packed, padding-free batches). Every attention layer of a model set to "mha" then runs
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
        mask = mask.to(torch.float32)  # (additive; a no-op when float32)
    sinks = kwargs.get("s_aux")
    softcap = kwargs.get("softcap")
    want_weights = bool(kwargs.get("output_attentions", False))
    res = _mt.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=float(dropout or 0.0), is_causal=causal,
        scale=scaling, enable_gqa=key.shape[1] != query.shape[1],
        softcap=float(softcap) if softcap else 0.0, sinks=sinks, return_weights=want_weights)
    out, weights = res if want_weights else (res, None)
    return out.transpose(1, 2).contiguous(), weights


def _bottom_right_mask(lq, lk, window, device):
    """FlashAttention's masks for lq queries against lk keys: the queries
    are the last lq positions (bottom-right aligned), query i sits at
    position i + lk - lq; causal hides keys after it, window (left, right)
    keeps keys in [pos - left, pos + right] (-1: unbounded). True takes
    part; None when nothing is hidden."""
    left, right = window
    i = torch.arange(lq, device=device)[:, None] + (lk - lq)
    j = torch.arange(lk, device=device)[None, :]
    keep = torch.ones(lq, lk, dtype=torch.bool, device=device)
    if right >= 0:
        keep &= j <= i + right
    if left >= 0:
        keep &= j >= i - left
    return None if bool(keep.all()) else keep


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                           max_seqlen_k=None, dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None,
                           s_aux=None, **kwargs):
    """FlashAttention-2's flash_attn_varlen_func computed by mha (autograd
    through mha's backward): packed sequences without padding. q (total_q,
    H, D), k and v (total_k, Hkv, D) / (total_k, Hkv, Dv), or with
    block_table (B, max_blocks) paged k and v (num_blocks, block_size,
    Hkv, D); cu_seqlens_q / _k (B + 1) int32 offsets. Sequence b's
    queries are the last of its keys (bottom-right aligned, as
    FlashAttention): causal hides later keys, window_size (left, right)
    limits the band (-1: unbounded). softmax_scale (None: 1/sqrt(D)),
    softcap, alibi_slopes (H or (B, H)), s_aux (sinks, one per query
    head). mha is deterministic: `deterministic` changes nothing.
    return_attn_probs: returns (out, softmax_lse, None) as FlashAttention
    does, with the log-sum-exp of each row (H, total_q). Returns out
    (total_q, H, Dv)."""
    if kwargs:
        raise ValueError("flash_attn_varlen_func (mha): keyword(s) %s not understood"
                         % ", ".join(sorted(kwargs)))
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError("flash_attn_varlen_func: %s must be a torch.Tensor, got %s"
                            % (name, type(x).__name__))
    if q.dim() != 3:
        raise ValueError("flash_attn_varlen_func: q must be (total_q, H, D), got shape %s"
                         % (tuple(q.shape),))
    cq = [int(x) for x in cu_seqlens_q.tolist()]
    ck = [int(x) for x in cu_seqlens_k.tolist()]
    nseq = len(cq) - 1
    if nseq < 0 or len(ck) != nseq + 1:
        raise ValueError("flash_attn_varlen_func: cu_seqlens_q has %d entries, cu_seqlens_k %d: "
                         "both must be B + 1" % (len(cq), len(ck)))
    for name, c, total in (("cu_seqlens_q", cq, q.shape[0]), ("cu_seqlens_k", ck, None)):
        if c[0] != 0 or any(b < a for a, b in zip(c, c[1:])):
            raise ValueError("flash_attn_varlen_func: %s must start at 0 and not decrease, got %s"
                             % (name, c))
        if total is not None and c[-1] != total:
            raise ValueError("flash_attn_varlen_func: cu_seqlens_q ends at %d, q has %d rows"
                             % (c[-1], total))
    if block_table is None:
        if k.dim() != 3 or v.dim() != 3 or ck[-1] != k.shape[0] or ck[-1] != v.shape[0]:
            raise ValueError("flash_attn_varlen_func: k %s and v %s must be (total_k, Hkv, D) "
                             "with total_k = cu_seqlens_k[-1] = %d"
                             % (tuple(k.shape), tuple(v.shape), ck[-1]))
    else:
        if k.dim() != 4 or v.dim() != 4 or block_table.dim() != 2 or block_table.shape[0] != nseq:
            raise ValueError("flash_attn_varlen_func: with block_table (B, max_blocks) = %s, k %s "
                             "and v %s must be (num_blocks, block_size, Hkv, D)"
                             % (tuple(block_table.shape), tuple(k.shape), tuple(v.shape)))
        nb, bs = k.shape[0], k.shape[1]
        bad = (block_table < 0) | (block_table >= nb)
        for b in range(nseq):
            need = -(-(ck[b + 1] - ck[b]) // bs)
            if need > block_table.shape[1]:
                raise ValueError("flash_attn_varlen_func: sequence %d has %d keys: %d blocks of "
                                 "%d, block_table has %d" % (b, ck[b + 1] - ck[b], need, bs,
                                                             block_table.shape[1]))
            if bool(bad[b, :need].any()):
                raise ValueError("flash_attn_varlen_func: block_table[%d] names a block outside "
                                 "the pool of %d: %s" % (b, nb, block_table[b, :need].tolist()))
    H, hkv = q.shape[1], k.shape[-2]
    window = tuple(int(x) for x in window_size)
    if causal:
        window = (window[0], 0)
    outs, lses = [], []
    for b in range(nseq):
        lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if lq == 0:
            continue
        qb = q[cq[b]:cq[b + 1]].transpose(0, 1).unsqueeze(0)
        if block_table is None:
            kb, vb = k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]]
        else:
            need = -(-lk // k.shape[1])
            idx = block_table[b, :need].long()
            kb = k[idx].reshape(-1, hkv, k.shape[-1])[:lk]
            vb = v[idx].reshape(-1, hkv, v.shape[-1])[:lk]
        kb, vb = kb.transpose(0, 1).unsqueeze(0), vb.transpose(0, 1).unsqueeze(0)
        plain_causal = causal and window[0] < 0 and lq == lk  # (mha's own causal tiles)
        mask = None if plain_causal else _bottom_right_mask(lq, lk, window, q.device)
        sl = alibi_slopes
        if isinstance(sl, torch.Tensor) and sl.dim() == 2:  # (B, H): this sequence's
            sl = sl[b]
        if sl is not None and lq != lk:
            # ALiBi at FlashAttention's positions (query i at i + lk - lq): an
            # additive mask, as mha's own ALiBi measures from the top left
            i = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
            j = torch.arange(lk, device=q.device)[None, :]
            bias = -torch.as_tensor(sl, dtype=torch.float32).reshape(-1, 1, 1) * (i - j).abs()
            if mask is not None:
                bias = bias.masked_fill(~mask, float("-inf"))
            mask, sl = bias.unsqueeze(0), None
        res = _mt.scaled_dot_product_attention(
            qb, kb, vb, attn_mask=mask, dropout_p=float(dropout_p), is_causal=plain_causal,
            scale=softmax_scale,
            enable_gqa=hkv != H, softcap=float(softcap or 0.0), alibi_slopes=sl, sinks=s_aux)
        outs.append(res[0].transpose(0, 1))
        if return_attn_probs:
            if plain_causal:
                mask = _bottom_right_mask(lq, lk, window, q.device)
            lses.append(_row_lse(qb, kb, mask, softmax_scale, softcap, sl, s_aux, H, hkv))
    out = torch.cat(outs, 0) if outs else q.new_zeros((0, H, v.shape[-1]))
    if return_attn_probs:
        lse = torch.cat(lses, 1) if lses else q.new_zeros((H, 0))
        return out, lse, None
    return out


def _row_lse(qb, kb, mask, scale, softcap, slopes, sinks, H, hkv):
    """Each query row's log-sum-exp of its logits (H, lq), float32, in
    plain torch (what FlashAttention returns beside the output)."""
    with torch.no_grad():
        q = qb[0].float()
        k = kb[0].float().repeat_interleave(H // hkv, 0)
        d = q.shape[-1]
        s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else d ** -0.5)
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if slopes is not None:
            lq, lk = s.shape[-2:]
            i = torch.arange(lq)[:, None] + (lk - lq)
            j = torch.arange(lk)[None, :]
            s = s - torch.as_tensor(slopes, dtype=torch.float32)[:, None, None] * (i - j).abs()
        if mask is not None and mask.dtype == torch.bool:
            s = s.masked_fill(~mask, float("-inf"))
        elif mask is not None:  # (ALiBi folded into an additive mask)
            s = s + mask[0]
        if sinks is not None:
            s = torch.cat([s, sinks.float().reshape(H, 1, 1).expand(H, s.shape[1], 1)], -1)
        return torch.logsumexp(s, -1)


def register():
    """Registers "mha" with transformers' AttentionInterface and
    AttentionMaskInterface (again: idempotent). Returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


register()

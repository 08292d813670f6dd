"""mha.from_pretrained and mha.torch.from_pretrained: the attention of a
Hugging Face checkpoint's layer (random weights, saved here with
transformers' save_pretrained) against transformers' own attention block,
forward (numpy and torch APIs) and backward (the torch API's gradients of
hidden_states and of the q/k/v/o weights), with the suite's tolerance rule
(float64 transformers the reference, float32 transformers the peer).
Skipped without transformers (the venv of PyTorch 1.13 has none). The
architectures one by one: tests/hf."""

import numpy as np
import pytest
import torch

from conftest import assert_close

transformers = pytest.importorskip("transformers")
import mha  # noqa: E402
import mha.torch  # noqa: E402

N, L, E = 2, 9, 32


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=E, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=2,
                                   intermediate_size=48, max_position_embeddings=64,
                                   rope_theta=300.0, attention_bias=True)
    m = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.2)
    d = tmp_path_factory.mktemp("llama")
    m.save_pretrained(str(d))
    return str(d)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    torch.manual_seed(4)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=E, num_attention_heads=4,
                                  num_hidden_layers=2, intermediate_size=48,
                                  max_position_embeddings=64)
    m = transformers.BertModel(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.2)
    d = tmp_path_factory.mktemp("bert")
    m.save_pretrained(str(d))
    return str(d)


def hf_block(path, cls, dtype, layer, hidden, mask, pos):
    """transformers' attention block of `layer` (self_attn; BERT:
    attention.self then attention.output.dense) on hidden, with the
    arguments the model passes it; returns (output, model)."""
    model = cls.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()
    return hf_block_model(model, layer, hidden, mask, pos)


def hf_block_model(model, layer, hidden, mask, pos):
    """hf_block on a loaded model."""
    bert = isinstance(model, transformers.BertModel)
    mod = model.encoder.layer[layer].attention.self if bert else model.model.layers[layer].self_attn
    cap = {}
    h = mod.register_forward_pre_hook(lambda m, a, k: cap.update(a=list(a), k=dict(k)),
                                      with_kwargs=True)
    ids = torch.zeros(N, L, dtype=torch.long)
    kw = dict(input_ids=ids, attention_mask=mask)
    if not bert:
        kw.update(position_ids=pos, use_cache=False)
    with torch.no_grad():
        model(**kw)
    h.remove()
    args, kwargs = cap["a"], cap["k"]
    if args:
        args[0] = hidden
    else:
        kwargs["hidden_states"] = hidden
    out = mod(*args, **kwargs)[0]
    if bert:
        out = model.encoder.layer[layer].attention.output.dense(out)
    return out, model


def inputs():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(N, L, E, generator=g)
    mask = torch.ones(N, L, dtype=torch.long)
    mask[1, L - 3:] = 0  # right padding
    pos = torch.arange(L).expand(N, L).contiguous()
    return x, mask, pos


@pytest.mark.parametrize("layer", [0, 1])
def test_llama_forward_numpy_and_torch(llama_dir, layer):
    x, mask, pos = inputs()
    rows = mask.bool()
    ref, _ = hf_block(llama_dir, transformers.LlamaForCausalLM, torch.float64, layer,
                      x.double(), mask, pos)
    peer, _ = hf_block(llama_dir, transformers.LlamaForCausalLM, torch.float32, layer, x,
                       mask, pos)
    a = mha.from_pretrained(llama_dir, layer=layer)
    assert a.config["model_type"] == "llama" and a.config["is_causal"]
    assert a.config["rope_theta"] == 300.0
    got = a(x.numpy(), position_ids=pos.numpy(), attention_mask=mask.numpy())
    assert_close("numpy", torch.from_numpy(got)[rows], peer.detach()[rows],
                 ref.detach()[rows])
    t = mha.torch.from_pretrained(llama_dir, layer=layer)
    with torch.no_grad():
        got_t = t(x, position_ids=pos, attention_mask=mask)
    assert_close("torch", got_t[rows], peer.detach()[rows], ref.detach()[rows])
    # float64 hidden states: mha's reference path
    got64 = a(x.double().numpy(), position_ids=pos.numpy(), attention_mask=mask.numpy())
    assert got64.dtype == np.float64
    assert_close("numpy float64", torch.from_numpy(got64)[rows], peer.detach()[rows],
                 ref.detach()[rows])


def test_llama_backward(llama_dir):
    layer = 1
    x, mask, pos = inputs()
    rows = mask.bool()
    g = torch.randn(N, L, E, generator=torch.Generator().manual_seed(5)) * rows[..., None]
    grads = {}
    for dt in (torch.float64, torch.float32):
        xh = x.detach().to(dt).clone().requires_grad_()
        out, model = hf_block(llama_dir, transformers.LlamaForCausalLM, dt, layer, xh, mask,
                              pos)
        (out * g.to(dt)).sum().backward()
        sa = model.model.layers[layer].self_attn
        grads[dt] = {"x": xh.grad,
                     "w": torch.cat([sa.q_proj.weight.grad, sa.k_proj.weight.grad,
                                     sa.v_proj.weight.grad]),
                     "b": torch.cat([sa.q_proj.bias.grad, sa.k_proj.bias.grad,
                                     sa.v_proj.bias.grad]),
                     "o": sa.o_proj.weight.grad}
    t = mha.torch.from_pretrained(llama_dir, layer=layer)
    xm = x.detach().clone().requires_grad_()
    (t(xm, position_ids=pos, attention_mask=mask) * g).sum().backward()
    ours = {"x": xm.grad, "w": t.attn.in_proj_weight.grad, "b": t.attn.in_proj_bias.grad,
            "o": t.attn.out_proj.weight.grad}
    for k in ours:
        ref, peer = grads[torch.float64][k], grads[torch.float32][k]
        if k == "x":  # padding rows: their output's gradient is 0 (g is 0 there)
            ours[k], ref, peer = ours[k][rows], ref[rows], peer[rows]
        assert_close("grad " + k, ours[k], peer, ref)


def test_bert_forward(bert_dir):
    x, mask, _ = inputs()
    rows = mask.bool()
    for layer in (0, 1):
        ref, _ = hf_block(bert_dir, transformers.BertModel, torch.float64, layer, x.double(),
                          mask, None)
        peer, _ = hf_block(bert_dir, transformers.BertModel, torch.float32, layer, x, mask,
                           None)
        a = mha.from_pretrained(bert_dir, layer=layer)
        assert not a.config["is_causal"] and a.config["rope_mode"] == 0
        got = a(x.numpy(), attention_mask=mask.numpy())
        assert_close("bert", torch.from_numpy(got)[rows], peer.detach()[rows],
                     ref.detach()[rows])


def test_errors(llama_dir, tmp_path):
    with pytest.raises(OSError):
        mha.from_pretrained(str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="layer 5"):
        mha.from_pretrained(llama_dir, layer=5)
    (tmp_path / "config.json").write_text('{"model_type": "t5"}')
    with pytest.raises(Exception, match="t5"):
        mha.from_pretrained(str(tmp_path))
    a = mha.from_pretrained(llama_dir)
    x = np.zeros((2, 4, E), np.float32)
    with pytest.raises(ValueError, match="position_ids"):
        a(x, position_ids=np.zeros((2, 3), np.int64))
    with pytest.raises(ValueError, match="attention_mask"):
        a(x, attention_mask=np.ones((1, 4)))
    with pytest.raises(ValueError, match="hidden_states"):
        a(np.zeros((4, E), np.float32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, "auto"])
def test_llama_in_bf16(llama_dir, tmp_path, dtype):
    """mha.torch.from_pretrained(dir, dtype=torch.bfloat16) (or "auto" on a
    checkpoint whose config.json says bfloat16) loads the weight matrices as
    stored, in bf16, and on bf16 hidden states (bf16 compute where the CPU
    has it) its error against float64 transformers on the same rounded
    weights and inputs is at most 2x that of transformers in bf16."""
    x, mask, pos = inputs()
    rows = mask.bool()
    path = llama_dir
    if dtype == "auto":  # the same weights saved in bf16
        m = transformers.LlamaForCausalLM.from_pretrained(llama_dir, dtype=torch.bfloat16)
        m.save_pretrained(str(tmp_path))
        path = str(tmp_path)
    xb = x.to(torch.bfloat16)
    peer, pm = hf_block(path, transformers.LlamaForCausalLM, torch.bfloat16, 1, xb, mask, pos)
    # the float64 oracle on the bf16-rounded weights (the peer's)
    rm = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                       attn_implementation="eager").eval()
    with torch.no_grad():
        for p64, p in zip(rm.parameters(), pm.parameters()):
            p64.copy_(p.double())
    ref, _ = hf_block_model(rm, 1, xb.double(), mask, pos)
    t = mha.torch.from_pretrained(path, layer=1, dtype=dtype)
    assert t.attn.in_proj_weight.dtype == torch.bfloat16
    with torch.no_grad():
        got = t(xb, position_ids=pos, attention_mask=mask)
    assert got.dtype == torch.bfloat16
    assert mha.last_impl().endswith(" bf16") == (mha.isa() in ("amx", "avx512bf16"))
    err = (got.double() - ref)[rows].abs().max().item()
    err_pt = (peer.double() - ref)[rows].abs().max().item()
    print("llama bf16: mha err %.3g, transformers bf16 err %.3g" % (err, err_pt))
    assert err <= 2 * err_pt, (err, err_pt)

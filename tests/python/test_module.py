"""mha.torch.MultiheadAttention as a drop-in for torch.nn.MultiheadAttention:
PyTorch's test_multihead_attention-style grid (every constructor option,
every mask kind, weights averaged or per head, batched and unbatched),
forward and backward, against PyTorch in float64 with the tolerance rule;
random configurations; gradcheck through the float64 reference."""

import copy
import itertools

import numpy as np
import pytest
import torch

import mha
import mha.torch as mt
from conftest import TORCH2, assert_close

E, H = 8, 2


def make_pair(seed, **cfg):
    """(ours, torch32, torch64) with the same weights (ours initialised from
    torch's generator; torch's loaded from ours)."""
    torch.manual_seed(seed)
    ours = mt.MultiheadAttention(cfg.pop("embed_dim", E), cfg.pop("num_heads", H), **cfg)
    with torch.no_grad():  # non-zero biases, so that they are tested
        for n, p in ours.named_parameters():
            if "bias" in n:
                p.uniform_(-0.5, 0.5)
    t32 = torch.nn.MultiheadAttention(ours.embed_dim, ours.num_heads, bias=cfg.get("bias", True),
                                      add_bias_kv=cfg.get("add_bias_kv", False),
                                      add_zero_attn=cfg.get("add_zero_attn", False),
                                      kdim=cfg.get("kdim"), vdim=cfg.get("vdim"),
                                      batch_first=cfg.get("batch_first", False))
    t32.load_state_dict(ours.state_dict())
    t64 = copy.deepcopy(t32).double()
    return ours, t32, t64


def rand_masks(g, kind, N, L, S, H_):
    """(key_padding_mask, attn_mask) of a kind, leaving every row a key."""
    kpm = am = None
    if kind in ("kpm_bool", "both"):
        kpm = torch.from_numpy(g.random((N, S)) < 0.3)
        kpm[:, 0] = False
    if kind == "kpm_float":
        kpm = torch.from_numpy(np.where(g.random((N, S)) < 0.3, -1e9, g.normal(size=(N, S))))
        kpm = kpm.float()
        kpm[:, 0] = 0.0
    if kind in ("float2d", "both"):
        am = torch.from_numpy(g.normal(size=(L, S))).float()
        am[torch.from_numpy(g.random((L, S)) < 0.3)] = float("-inf")
        am[:, 0] = 0.0
    if kind == "bool3d":
        am = torch.from_numpy(g.random((N * H_, L, S)) < 0.3)
        am[:, :, 0] = False
    return kpm, am


def inputs(g, N, L, S, kdim, vdim, batch_first, dtype=torch.float32):
    def t(n, l, e):
        shape = (n, l, e) if batch_first else (l, n, e)
        return torch.from_numpy(g.normal(size=shape)).to(dtype)

    return t(N, L, E), t(N, S, kdim or E), t(N, S, vdim or E)


def run_case(ours, t32, t64, q, k, v, kpm, am, need_weights, average, grad_seed=7):
    """Forward and backward of the three; checks every output and gradient."""
    outs = {}
    for name, m, dt in (("ours", ours, torch.float32), ("t32", t32, torch.float32),
                        ("t64", t64, torch.float64)):
        m.zero_grad()
        qq, kk, vv = (x.detach().to(dt).requires_grad_() for x in (q, k, v))
        km = None if kpm is None else (kpm if kpm.dtype == torch.bool else kpm.to(dt))
        aa = None if am is None else (am if am.dtype == torch.bool else am.to(dt))
        o, w = m(qq, kk, vv, key_padding_mask=km, need_weights=need_weights, attn_mask=aa,
                 average_attn_weights=average)
        gout = torch.from_numpy(np.random.default_rng(grad_seed).normal(size=o.shape)).to(dt)
        o.backward(gout)
        pg = {n: p.grad.clone() for n, p in m.named_parameters()}
        outs[name] = (o.detach(), None if w is None else w.detach(), qq.grad, kk.grad, vv.grad,
                      pg)
    o, w, dq, dk, dv, pg = outs["ours"]
    r32, r64 = outs["t32"], outs["t64"]
    checks = [assert_close("attn_output", o, r32[0], r64[0])]
    if need_weights:
        checks.append(assert_close("attn_weights", w, r32[1], r64[1]))
    else:
        assert w is None
    for i, name in ((2, "grad_query"), (3, "grad_key"), (4, "grad_value")):
        checks.append(assert_close(name, outs["ours"][i], r32[i], r64[i]))
    assert set(pg) == set(r64[5]), (sorted(pg), sorted(r64[5]))
    for n in pg:
        checks.append(assert_close("grad " + n, pg[n], r32[5][n], r64[5][n]))
    return checks


GRID = list(itertools.product([True, False], [False, True], [False, True], [False, True],
                              [False, True],
                              ["none", "kpm_bool", "kpm_float", "float2d", "bool3d", "both"]))


@pytest.mark.parametrize("bias,bias_kv,zero_attn,kvdim,batch_first,masks", GRID)
def test_grid(bias, bias_kv, zero_attn, kvdim, batch_first, masks):
    """PyTorch's test_multihead_attention grid through the drop-in."""
    idx = GRID.index((bias, bias_kv, zero_attn, kvdim, batch_first, masks))
    g = np.random.default_rng(idx)
    kdim, vdim = (5, 7) if kvdim else (None, None)
    ours, t32, t64 = make_pair(idx, bias=bias, add_bias_kv=bias_kv, add_zero_attn=zero_attn,
                               kdim=kdim, vdim=vdim, batch_first=batch_first)
    N, L, S = 2, 4, 5
    q, k, v = inputs(g, N, L, S, kdim, vdim, batch_first)
    kpm, am = rand_masks(g, masks, N, L, S, H)
    need_weights, average = [(True, True), (True, False), (False, True)][idx % 3]
    run_case(ours, t32, t64, q, k, v, kpm, am, need_weights, average)


@pytest.mark.parametrize("need_weights", [True, False])
def test_unbatched(need_weights):
    g = np.random.default_rng(3)
    ours, t32, t64 = make_pair(3)
    q = torch.from_numpy(g.normal(size=(4, E))).float()
    k = torch.from_numpy(g.normal(size=(6, E))).float()
    am = torch.from_numpy(g.random((H, 4, 6)) < 0.3)
    am[:, :, 0] = False
    kpm = torch.zeros(6, dtype=torch.bool)
    kpm[3] = True
    run_case(ours, t32, t64, q, k, k, kpm, am, need_weights, False)


def test_self_attention_and_causal():
    """key is value is query (the packed projection); is_causal alone."""
    g = np.random.default_rng(5)
    ours, t32, t64 = make_pair(5, batch_first=True)
    x = torch.from_numpy(g.normal(size=(2, 6, E))).float()
    causal = torch.full((6, 6), float("-inf")).triu(1)
    res = {}
    for name, m, dt in (("ours", ours, torch.float32), ("t32", t32, torch.float32),
                        ("t64", t64, torch.float64)):
        xx = x.detach().to(dt).clone().requires_grad_()
        if name == "ours":
            o, w = m(xx, xx, xx, is_causal=True)
        else:
            o, w = m(xx, xx, xx, attn_mask=causal.to(dt))
        o.sum().backward()
        res[name] = (o.detach(), w.detach(), xx.grad)
    for i, n in enumerate(("attn_output", "attn_weights", "grad_x")):
        assert_close(n, res["ours"][i], res["t32"][i], res["t64"][i])
    # key=None: self-attention, the same bits as passing x three times
    o2, _ = ours(x, need_weights=False)
    assert torch.equal(o2, ours(x, x, x, need_weights=False)[0])


@pytest.mark.parametrize("seed", range(60))
def test_random_configurations(seed):
    """Random shapes and options against PyTorch float64: forward, weights and
    every gradient."""
    g = np.random.default_rng(1000 + seed)
    heads = int(g.choice([1, 2, 3, 4]))
    d = int(g.choice([2, 4, 8, 16]))
    e = heads * d
    kv = g.random() < 0.3
    kdim, vdim = (int(g.integers(1, 20)), int(g.integers(1, 20))) if kv else (None, None)
    cfg = dict(embed_dim=e, num_heads=heads, bias=bool(g.random() < 0.8),
               add_bias_kv=bool(g.random() < 0.3), add_zero_attn=bool(g.random() < 0.3),
               kdim=kdim, vdim=vdim, batch_first=bool(g.random() < 0.5))
    ours, t32, t64 = make_pair(seed, **cfg)
    N, L, S = int(g.integers(1, 4)), int(g.integers(1, 40)), int(g.integers(1, 40))

    def t(l, f):
        shape = (N, l, f) if cfg["batch_first"] else (l, N, f)
        return torch.from_numpy(g.normal(size=shape) * g.choice([0.5, 1, 3])).float()

    q, k, v = t(L, e), t(S, kdim or e), t(S, vdim or e)
    kind = str(g.choice(["none", "kpm_bool", "kpm_float", "float2d", "bool3d", "both"]))
    kpm, am = rand_masks(g, kind, N, L, S, heads)
    run_case(ours, t32, t64, q, k, v, kpm, am, bool(g.random() < 0.5), bool(g.random() < 0.5))


def test_gradcheck_reference():
    """torch.autograd.gradcheck in float64 (mha's float64 reference path)
    for query, key and value."""
    torch.manual_seed(0)
    m = mt.MultiheadAttention(6, 2, add_bias_kv=True, kdim=4, vdim=5)
    q = torch.randn(3, 2, 6, dtype=torch.float64, requires_grad=True)
    k = torch.randn(4, 2, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(4, 2, 5, dtype=torch.float64, requires_grad=True)
    am = torch.randn(3, 4, dtype=torch.float64)

    def f(q, k, v):
        return m(q, k, v, attn_mask=am, need_weights=False)[0]

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-5, rtol=1e-4)


def test_gradcheck_self_attention_dropout():
    """gradcheck in float64 with dropout in training mode: the mask is fixed
    by reseeding torch (the Philox seed is drawn from it)."""
    m = mt.MultiheadAttention(4, 2, dropout=0.3, batch_first=True).train()
    x = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)

    def f(x):
        torch.manual_seed(11)
        return m(x, x, x, is_causal=True, need_weights=False)[0]

    assert torch.autograd.gradcheck(f, (x,), eps=1e-6, atol=1e-5, rtol=1e-4)


def test_dropout_training():
    """Dropout only in training mode, repeatable under torch.manual_seed, the
    kept fraction near 1 - p, eval equal to the dropout-free module."""
    torch.manual_seed(0)
    m = mt.MultiheadAttention(16, 4, dropout=0.25, batch_first=True)
    x = torch.randn(4, 32, 16)
    torch.manual_seed(1)
    a = m(x, x, x, average_attn_weights=False)
    torch.manual_seed(1)
    b = m(x, x, x, average_attn_weights=False)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    kept = (a[1] != 0).double().mean().item()
    assert abs(kept - 0.75) < 0.03, kept
    c = m(x, x, x)
    assert not torch.equal(a[0], c[0])  # a fresh seed, a fresh mask
    m.eval()
    nodrop = mt.MultiheadAttention(16, 4, batch_first=True).eval()
    nodrop.load_state_dict(m.state_dict())
    assert torch.equal(m(x, x, x)[0], nodrop(x, x, x)[0])


def test_state_dict_and_files(tmp_path):
    torch.manual_seed(0)
    ours = mt.MultiheadAttention(8, 2, add_bias_kv=True)
    theirs = torch.nn.MultiheadAttention(8, 2, add_bias_kv=True)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    for (n, p), (n2, p2) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert n == n2 and p.shape == p2.shape
    theirs.load_state_dict(ours.state_dict())
    ours.load_state_dict(theirs.state_dict())
    path = tmp_path / "w.safetensors"
    ours.save(path)
    back = mha.MultiheadAttention.load(path)
    for n, a in back.state_dict().items():
        assert np.array_equal(a, ours.state_dict()[n].numpy()), n
    # a parameter replaced behind the module's back is copied in
    with torch.no_grad():
        ours.out_proj.weight.data = torch.ones(8, 8)
    x = torch.randn(3, 1, 8)
    theirs.load_state_dict(ours.state_dict())
    assert_close("replaced weight", ours(x, x, x)[0], theirs(x, x, x)[0],
                 copy.deepcopy(theirs).double()(x.double(), x.double(), x.double())[0])
    c = copy.deepcopy(ours)
    assert torch.equal(c(x, x, x)[0], ours(x, x, x)[0])


def test_grouped_query_heads():
    """num_kv_heads < num_heads against the formula in float64."""
    torch.manual_seed(0)
    m = mt.MultiheadAttention(12, 4, num_kv_heads=2, batch_first=True)
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    out, _ = m(x, x, x, need_weights=False)
    W, b = m.in_proj_weight.double(), m.in_proj_bias.double()
    q, k, v = (x @ W[:12].T + b[:12]), (x @ W[12:18].T + b[12:18]), (x @ W[18:].T + b[18:])
    q = q.view(2, 5, 4, 3).transpose(1, 2)
    k = k.view(2, 5, 2, 3).transpose(1, 2).repeat_interleave(2, 1)
    v = v.view(2, 5, 2, 3).transpose(1, 2).repeat_interleave(2, 1)
    ctx = torch.softmax(q @ k.transpose(-1, -2) / 3 ** 0.5, -1) @ v
    ref = ctx.transpose(1, 2).reshape(2, 5, 12) @ m.out_proj.weight.double().T + \
        m.out_proj.bias.double()
    assert (out - ref).abs().max().item() < 1e-12


def test_encoder_layer_uses_mha():
    """A TransformerEncoderLayer's self_attn swapped: its forward goes through
    mha (not torch's fused encoder path) in eval and in training."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    ref = copy.deepcopy(layer)
    sa = mt.MultiheadAttention(16, 4, batch_first=True)
    sa.load_state_dict(layer.self_attn.state_dict())
    layer.self_attn = sa
    calls = []
    sa.register_forward_hook(lambda *a: calls.append(1))
    x = torch.randn(2, 7, 16)
    for mode in (True, False):
        layer.train(mode)
        ref.train(mode)
        with torch.no_grad():
            a, b = layer(x), ref(x)
        assert (a - b).abs().max().item() < 1e-5
    assert len(calls) == 2


@pytest.mark.skipif(not TORCH2, reason="is_causal is PyTorch 2's")
def test_torch2_signature():
    torch.manual_seed(0)
    ours, t32, t64 = make_pair(0, batch_first=True)
    x = torch.randn(2, 5, E)
    causal = torch.full((5, 5), float("-inf")).triu(1)
    a = ours(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)[0]
    b = t32(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)[0]
    assert (a - b).abs().max().item() < 1e-5


@pytest.mark.skipif(not TORCH2, reason="is_causal is PyTorch 2's")
def test_is_causal_hint_as_torch():
    """is_causal with an attn_mask is PyTorch 2's hint: without a
    key_padding_mask and weights the mask is dropped (causal attention,
    whatever the mask), else the hint is (the mask alone); the numpy API
    and its backward the same."""
    torch.manual_seed(1)
    ours, t32, t64 = make_pair(0, batch_first=True)
    x = torch.randn(2, 6, E, requires_grad=True)
    mask = torch.randn(6, 6)  # not causal: shows which of the two is used
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[1, 0] = True
    causal_only = ours(x, x, x, is_causal=True, need_weights=False)[0]
    mask_only = ours(x, x, x, attn_mask=mask, need_weights=False)[0]
    for need, pad in ((False, None), (True, None), (False, kpm), (True, kpm)):
        a, aw = ours(x, x, x, attn_mask=mask, is_causal=True, need_weights=need,
                     key_padding_mask=pad)
        b, bw = t32(x, x, x, attn_mask=mask, is_causal=True, need_weights=need,
                    key_padding_mask=pad)
        assert (a - b).abs().max().item() < 1e-5, (need, pad is not None)
        if need:
            assert (aw - bw).abs().max().item() < 1e-5
        if pad is None:
            want = mask_only if need else causal_only
            assert (a - want).abs().max().item() == 0.0, need
    # autograd through the hint: the gradient of the causal attention
    g = torch.randn(2, 6, E)
    gx = torch.autograd.grad(ours(x, x, x, attn_mask=mask, is_causal=True,
                                  need_weights=False)[0], x, g)[0]
    gt = torch.autograd.grad(t32(x, x, x, attn_mask=mask, is_causal=True,
                                 need_weights=False)[0], x, g)[0]
    assert (gx - gt).abs().max().item() < 1e-4
    # the numpy API: forward and backward take the hint alike
    n = mha.MultiheadAttention(E, H, batch_first=True)
    n.load_state_dict({k: v.detach().numpy() for k, v in t32.state_dict().items()})
    xn, mn = x.detach().numpy(), mask.numpy()
    ya = n(xn, xn, xn, attn_mask=mn, is_causal=True, need_weights=False)[0]
    yb = n(xn, xn, xn, is_causal=True, need_weights=False)[0]
    assert np.array_equal(ya, yb)
    ga = n.backward(g.numpy(), xn, attn_mask=mn, is_causal=True)
    gb = n.backward(g.numpy(), xn, is_causal=True)
    assert np.array_equal(ga.query, gb.query)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_module_in_half(dtype):
    """module.to(bfloat16) / .half() (and dtype= at construction): the C
    module stores its weight matrices so (biases float32, copied in), the
    forward takes and returns that dtype on the fused path, and its error
    against float64 on the same rounded parameters and inputs is at most 2x
    that of torch.nn.MultiheadAttention in the same dtype; so are its
    gradients (in the parameters' dtype) against torch's autograd in that
    dtype. .float() goes back."""
    if dtype == torch.float16 and not TORCH2:
        pytest.skip("PyTorch 1.13 has no float16 matmul on CPU (the peer)")
    torch.manual_seed(7)
    m = mt.MultiheadAttention(96, 6, batch_first=True)
    ref = torch.nn.MultiheadAttention(96, 6, batch_first=True)
    ref.load_state_dict(m.state_dict())
    m64 = copy.deepcopy(ref).double()
    m.to(dtype), ref.to(dtype)
    assert m.in_proj_weight.dtype == dtype and m.out_proj.bias.dtype == dtype
    with torch.no_grad():  # the float64 oracle on the same rounded values
        for p64, p in zip(m64.parameters(), ref.parameters()):
            p64.copy_(p.double())
    x = torch.randn(3, 40, 96).to(dtype)
    am = torch.ones(40, 40, dtype=torch.bool).triu(1)
    with torch.no_grad():
        y, w = m(x, x, x, attn_mask=am)
        assert mha.last_impl().startswith("fused "), mha.last_impl()
        # bf16 on a CPU that computes bf16: the attention in bf16 too
        assert mha.last_impl().endswith(" bf16") == (
            dtype == torch.bfloat16 and mha.isa() in ("amx", "avx512bf16")), mha.last_impl()
        yr, _ = ref(x, x, x, attn_mask=am)
        y64, w64 = m64(x.double(), x.double(), x.double(), attn_mask=am)
    assert y.dtype == dtype and w.dtype == dtype
    err = (y.double() - y64).abs().max().item()
    err_pt = (yr.double() - y64).abs().max().item()
    print("%s module: mha err %.3g, torch err %.3g" % (dtype, err, err_pt))
    assert err <= 2 * err_pt, (err, err_pt)
    assert (w.double() - w64).abs().max().item() <= 2 ** -7
    # dtype= at construction; and back to float32
    assert mt.MultiheadAttention(96, 6, dtype=dtype).in_proj_weight.dtype == dtype
    m.float()
    with torch.no_grad():
        y32, _ = m(x.float(), x.float(), x.float(), attn_mask=am)
    assert y32.dtype == torch.float32
    # training in half precision: every gradient in the parameter's dtype,
    # within 2x the error of torch's autograd in the same dtype
    m.to(dtype)
    go = torch.randn(3, 40, 96).to(dtype)
    res = []
    for mod in (m, ref, m64):
        dt = torch.float64 if mod is m64 else dtype
        xg = x.detach().clone().to(dt).requires_grad_()
        mod(xg, xg, xg, attn_mask=am, need_weights=False)[0].backward(go.to(dt))
        if mod is m:  # the backward's: bf16 compute where the CPU computes bf16
            assert mha.last_impl().startswith("fused "), mha.last_impl()
            assert mha.last_impl().endswith(" bf16") == (
                dtype == torch.bfloat16 and mha.isa() in ("amx", "avx512bf16")), mha.last_impl()
        res.append([xg.grad] + [p.grad for p in mod.parameters()])
    names = ["query"] + [n for n, _ in m.named_parameters()]
    for n, a, b, c in zip(names, *res):
        assert a.dtype == dtype, (n, a.dtype)
        err = (a.double() - c).abs().max().item()
        err_pt = (b.double() - c).abs().max().item()
        print("%s grad %s: mha err %.3g, torch err %.3g" % (dtype, n, err, err_pt))
        assert err <= 2 * err_pt, (n, err, err_pt)
    # mixed weight dtypes: refused, naming them
    m.out_proj.weight.data = m.out_proj.weight.data.float()
    with pytest.raises(TypeError, match="all of one dtype"):
        m(x, x, x)


def test_module_autocast_bf16():
    """A float32 mha.torch.MultiheadAttention under torch.autocast("cpu",
    bfloat16), as torch's own module under it: a bf16 output (its
    projections and attention computed from bf16 weights and inputs; bf16
    compute where the CPU has it), float32 gradients on the float32
    parameters and input, each within 2x the error of torch's module under
    the same autocast against float64 on the same rounded values."""
    torch.manual_seed(3)
    E, H = 96, 6
    m = mt.MultiheadAttention(E, H, batch_first=True)
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True)
    ref.load_state_dict(m.state_dict())
    m64 = copy.deepcopy(ref).double()
    with torch.no_grad():  # the oracle: the weight matrices rounded to bf16
        for n, p in m64.named_parameters():
            if n.endswith("weight"):
                p.copy_(p.to(torch.bfloat16).double())
    x0 = torch.randn(3, 40, E)
    go = torch.randn(3, 40, E).to(torch.bfloat16)
    am = torch.ones(40, 40, dtype=torch.bool).triu(1)
    res = []
    for mod in (m, ref, m64):
        x = x0.clone().to(torch.float64 if mod is m64 else torch.float32).requires_grad_()
        if mod is m64:
            xb = x.to(torch.bfloat16).double()
            y = mod(xb, xb, xb, attn_mask=am, need_weights=False)[0]
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = mod(x, x, x, attn_mask=am, need_weights=False)[0]
            assert y.dtype == torch.bfloat16
            if mod is m:
                assert mha.last_impl().startswith("fused "), mha.last_impl()
                assert mha.last_impl().endswith(" bf16") == (
                    mha.isa() in ("amx", "avx512bf16")), mha.last_impl()
        y.backward(go.to(y.dtype))
        res.append([y.detach(), x.grad] + [p.grad for p in mod.parameters()])
    assert m.in_proj_weight.dtype == torch.float32  # the module itself unchanged
    names = ["output", "query"] + [n for n, _ in m.named_parameters()]
    for n, a, b, c in zip(names, *res):
        assert a.dtype == (torch.bfloat16 if n == "output" else torch.float32), (n, a.dtype)
        err = (a.double() - c).abs().max().item()
        err_pt = (b.double() - c).abs().max().item()
        print("autocast %s: mha err %.3g, torch err %.3g" % (n, err, err_pt))
        assert err <= 2 * err_pt, (n, err, err_pt)

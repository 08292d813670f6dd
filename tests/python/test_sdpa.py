"""mha.scaled_dot_product_attention and mha.torch.scaled_dot_product_attention
against PyTorch in float64 (the formula written out: PyTorch 1.13 has no
scaled_dot_product_attention; where PyTorch has one, against it too), with
the tolerance rule: every mask kind, broadcasting, leading dims, GQA,
custom scale, causal with L != S; gradients; gradcheck; numpy == torch."""

import numpy as np
import pytest
import torch

import mha
import mha.torch as mt
from conftest import HAS_SDPA, assert_close, sdpa_ref


def rand_mask(g, kind, shape):
    if kind == "none":
        return None
    if kind == "bool":
        m = torch.from_numpy(g.random(shape) > 0.3)
        m[..., 0] = True  # every row keeps a key
        return m
    m = torch.from_numpy(g.normal(size=shape))
    m[torch.from_numpy(g.random(shape) < 0.2)] = float("-inf")
    m[..., 0] = 0.0
    return m.float()


def config(seed):
    g = np.random.default_rng(seed)
    lead = tuple(int(x) for x in g.integers(1, 3, size=int(g.integers(0, 3))))
    hkv = int(g.choice([1, 2, 3]))
    gqa = bool(g.random() < 0.4)
    hq = hkv * int(g.choice([1, 2, 3])) if gqa else hkv
    L, S = int(g.integers(1, 30)), int(g.integers(1, 30))
    E, Ev = int(g.choice([1, 4, 8, 16])), int(g.choice([3, 8, 16]))
    causal = bool(g.random() < 0.3)
    scale = float(g.choice([0.1, 0.5, 2.0])) if g.random() < 0.3 else None
    kind = str(g.choice(["none", "bool", "float"]))
    # the mask broadcast from a smaller shape: (L, S), (1, L, S), (H, L, S), full
    full = lead + (hq, L, S)
    mshape = [(L, S), (1, L, S), (hq, 1, S), full][int(g.integers(0, 4))]
    if causal and kind == "none":
        pass
    return g, lead, hq, hkv, gqa, L, S, E, Ev, causal, scale, kind, mshape


def tensors(g, lead, hq, hkv, L, S, E, Ev):
    q = torch.from_numpy(g.normal(size=lead + (hq, L, E)))
    k = torch.from_numpy(g.normal(size=lead + (hkv, S, E)))
    v = torch.from_numpy(g.normal(size=lead + (hkv, S, Ev)))
    return q, k, v


@pytest.mark.parametrize("seed", range(120))
def test_random_vs_float64(seed):
    g, lead, hq, hkv, gqa, L, S, E, Ev, causal, scale, kind, mshape = config(seed)
    if causal and L > S:
        causal = False  # rows past S would be fully masked (torch: NaN)
    q, k, v = tensors(g, lead, hq, hkv, L, S, E, Ev)
    mask = rand_mask(g, kind, mshape)
    gout = torch.from_numpy(g.normal(size=lead + (hq, L, Ev)))
    res = {}
    for name, dt in (("ours", torch.float32), ("t32", torch.float32), ("t64", torch.float64)):
        qq, kk, vv = (x.detach().to(dt).clone().requires_grad_() for x in (q, k, v))
        mm = None if mask is None else (mask if mask.dtype == torch.bool else mask.to(dt))
        if name == "ours":
            o = mt.scaled_dot_product_attention(qq, kk, vv, attn_mask=mm, is_causal=causal,
                                                scale=scale, enable_gqa=gqa)
        else:
            o = sdpa_ref(qq, kk, vv, mm, causal, scale, gqa)
        o.backward(gout.to(dt))
        res[name] = (o.detach(), qq.grad, kk.grad, vv.grad)
    for i, n in enumerate(("out", "dq", "dk", "dv")):
        assert_close(n, res["ours"][i], res["t32"][i], res["t64"][i])
    # the numpy API: the same bits as the torch API
    qn, kn, vn = (x.float().numpy() for x in (q, k, v))
    mn = None if mask is None else mask.numpy()
    on = mha.scaled_dot_product_attention(qn, kn, vn, attn_mask=mn, is_causal=causal,
                                          scale=scale, enable_gqa=gqa)
    assert np.array_equal(on, res["ours"][0].numpy())


@pytest.mark.skipif(not HAS_SDPA, reason="PyTorch 1.13 has no scaled_dot_product_attention")
@pytest.mark.parametrize("seed", range(20))
def test_against_torch_sdpa(seed):
    """The same calls through torch's own function (PyTorch 2)."""
    g, lead, hq, hkv, gqa, L, S, E, Ev, causal, scale, kind, mshape = config(500 + seed)
    if causal and L > S:
        causal = False
    if gqa and "enable_gqa" not in torch.nn.functional.scaled_dot_product_attention.__doc__:
        gqa = False
        hq = hkv
    q, k, v = (x.float() for x in tensors(g, lead, hq, hkv, L, S, E, Ev))
    if causal:
        kind = "none"  # torch refuses a mask with is_causal
    mask = rand_mask(g, kind, mshape)
    kw = dict(attn_mask=mask, is_causal=causal, scale=scale)
    if gqa:
        kw["enable_gqa"] = True
    ours = mt.scaled_dot_product_attention(q, k, v, **kw)
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)
    ref = sdpa_ref(q.double(), k.double(), v.double(),
                   None if mask is None else (mask if mask.dtype == torch.bool else
                                              mask.double()), causal, scale, gqa)
    assert_close("out", ours, theirs, ref)


def test_gradcheck_float64():
    torch.manual_seed(0)
    q = torch.randn(2, 4, 5, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 6, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 6, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.randn(5, 6, dtype=torch.float64)

    def f(q, k, v):
        return mt.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True,
                                               scale=0.7)

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-5, rtol=1e-4)

    def g(q, k, v):
        return mt.scaled_dot_product_attention(q, k[:, :1], v[:, :1], is_causal=True)

    assert torch.autograd.gradcheck(g, (q, k, v), eps=1e-6, atol=1e-5, rtol=1e-4)


def test_shapes_2d_3d_and_broadcast():
    g = np.random.default_rng(0)
    q = g.normal(size=(5, 8)).astype(np.float32)
    k = g.normal(size=(7, 8)).astype(np.float32)
    v = g.normal(size=(7, 3)).astype(np.float32)
    o = mha.scaled_dot_product_attention(q, k, v)
    ref = sdpa_ref(*(torch.from_numpy(x).double() for x in (q, k, v)))
    assert o.shape == (5, 3) and np.abs(o - ref.numpy()).max() < 1e-5
    q3 = np.stack([q, 2 * q])
    o3 = mha.scaled_dot_product_attention(q3, k[None], v[None])  # (N, L, E), keys broadcast
    assert o3.shape == (2, 5, 3)
    assert np.array_equal(o3[0], o)
    o5 = mha.scaled_dot_product_attention(q3[None, :, None], k, v)  # (1, 2, 1, L, E)
    assert o5.shape == (1, 2, 1, 5, 3)
    assert np.array_equal(o5[0, :, 0], o3)


def test_weights_and_fully_masked_rows():
    g = np.random.default_rng(1)
    q, k, v = (g.normal(size=(1, 2, 4, 8)).astype(np.float32) for _ in range(3))
    mask = np.ones((4, 4), bool)
    mask[2] = False  # row 2 sees no key
    o, w = mha.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_weights=True)
    assert w.shape == (1, 2, 4, 4)
    assert np.all(w[:, :, 2] == 0) and np.all(o[:, :, 2] == 0)
    assert np.allclose(w[:, :, [0, 1, 3]].sum(-1), 1, atol=1e-6)


def test_strided_equals_contiguous():
    g = np.random.default_rng(2)
    base = g.normal(size=(2, 6, 3, 16)).astype(np.float32)  # (B, L, H, D) as a model holds it
    q = base.transpose(0, 2, 1, 3)  # (B, H, L, D) without a copy
    o1 = mha.scaled_dot_product_attention(q, q, q, is_causal=True)
    o2 = mha.scaled_dot_product_attention(*(np.ascontiguousarray(q),) * 3, is_causal=True)
    assert np.array_equal(o1, o2)
    t = torch.from_numpy(base).transpose(1, 2).requires_grad_()
    tc = torch.from_numpy(np.ascontiguousarray(q)).requires_grad_()
    a = mt.scaled_dot_product_attention(t, t, t)
    b = mt.scaled_dot_product_attention(tc, tc, tc)
    assert torch.equal(a, b)
    a.sum().backward()
    b.sum().backward()
    assert torch.equal(t.grad, tc.grad)


def test_half_inputs():
    g = np.random.default_rng(3)
    q, k, v = (g.normal(size=(1, 2, 5, 8)).astype(np.float16) for _ in range(3))
    o = mha.scaled_dot_product_attention(q, k, v)
    assert o.dtype == np.float16
    ref = sdpa_ref(*(torch.from_numpy(x).double() for x in (q, k, v)))
    assert np.abs(o.astype(np.float64) - ref.numpy()).max() < 2e-3


def test_dropout():
    """dropout_p: repeatable under a seed (numpy: dropout_seed; torch: its
    generator), the dropped fraction near p, kept weights scaled by 1/(1-p),
    p = 0 the dropout-free bits; gradcheck with the mask fixed by the seed."""
    g = np.random.default_rng(4)
    q, k, v = (g.normal(size=(2, 3, 40, 8)).astype(np.float32) for _ in range(3))
    o1, w1 = mha.scaled_dot_product_attention(q, k, v, dropout_p=0.3, dropout_seed=9,
                                              return_weights=True)
    o2, w2 = mha.scaled_dot_product_attention(q, k, v, dropout_p=0.3, dropout_seed=9,
                                              return_weights=True)
    assert np.array_equal(o1, o2) and np.array_equal(w1, w2)
    _, w0 = mha.scaled_dot_product_attention(q, k, v, return_weights=True)
    dropped = w1 == 0
    assert abs(dropped.mean() - 0.3) < 0.02, dropped.mean()
    assert np.allclose(w1[~dropped], w0[~dropped] / 0.7, rtol=1e-5)
    assert np.array_equal(mha.scaled_dot_product_attention(q, k, v, dropout_p=0.0),
                          mha.scaled_dot_product_attention(q, k, v))
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    torch.manual_seed(5)
    a = mt.scaled_dot_product_attention(tq, tk, tv, dropout_p=0.3)
    torch.manual_seed(5)
    b = mt.scaled_dot_product_attention(tq, tk, tv, dropout_p=0.3)
    assert torch.equal(a, b) and not torch.equal(a, mt.scaled_dot_product_attention(tq, tk, tv))
    x = torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True)

    def f(x):
        torch.manual_seed(3)
        return mt.scaled_dot_product_attention(x, x, x, dropout_p=0.4, is_causal=True)

    assert torch.autograd.gradcheck(f, (x,), eps=1e-6, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_half_fused_vs_torch_same_dtype(dtype, causal):
    """bf16 / f16 tensors take the fused path (never the reference), and its
    error against float64 on the same rounded inputs is at most 2x that of
    PyTorch computing the same call in the same dtype (the brief's rule for
    bf16/f16 paths)."""
    if dtype == torch.float16 and not HAS_SDPA:
        pytest.skip("PyTorch 1.13 has no float16 matmul on CPU (the peer)")
    g = np.random.default_rng(11 + causal)
    q, k, v = (torch.from_numpy(g.normal(size=(2, 4, 200, 64))).to(dtype) for _ in range(3))
    o = mt.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert mha.last_impl().startswith("fused "), mha.last_impl()
    assert o.dtype == dtype
    ref = sdpa_ref(q.double(), k.double(), v.double(), causal=causal)
    if HAS_SDPA:
        peer = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    else:  # PyTorch 1.13: its math path in the dtype
        s = (q @ k.transpose(-1, -2)) * (1.0 / 8.0)
        if causal:
            s = s.masked_fill(torch.ones(200, 200, dtype=torch.bool).triu(1), float("-inf"))
        peer = torch.softmax(s, -1) @ v
    err = (o.double() - ref).abs().max().item()
    err_pt = (peer.double() - ref).abs().max().item()
    print("%s causal %s: mha err %.3g, torch %s err %.3g" % (dtype, causal, err, dtype, err_pt))
    assert err <= 2 * err_pt, (err, err_pt)
    # numpy: the same bits
    qn, kn, vn = (x.view(torch.int16).numpy() if dtype == torch.bfloat16 else x.numpy()
                  for x in (q, k, v))
    if dtype == torch.float16:
        on = mha.scaled_dot_product_attention(qn, kn, vn, is_causal=causal)
        assert mha.last_impl().startswith("fused ")
        assert np.array_equal(on, o.numpy())


@pytest.mark.parametrize("causal", [False, True])
def test_numpy_bfloat16_sdpa(causal):
    """numpy bfloat16 arrays (ml_dtypes) take the fused path and give the
    bits of the same call through mha.torch; GQA and weights too."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    g = np.random.default_rng(3 + causal)
    q = torch.from_numpy(g.normal(size=(2, 4, 70, 32))).to(torch.bfloat16)
    k, v = (torch.from_numpy(g.normal(size=(2, 2, 90, 32))).to(torch.bfloat16) for _ in range(2))
    o = mt.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    qn, kn, vn = (x.view(torch.int16).numpy().view(ml_dtypes.bfloat16) for x in (q, k, v))
    on, wn = mha.scaled_dot_product_attention(qn, kn, vn, is_causal=causal, enable_gqa=True,
                                              return_weights=True)
    assert mha.last_impl().startswith("fused "), mha.last_impl()
    assert on.dtype == ml_dtypes.bfloat16 and on.shape == (2, 4, 70, 32)
    assert wn.dtype == ml_dtypes.bfloat16 and wn.shape == (2, 4, 70, 90)
    assert np.array_equal(on.view(np.int16), o.view(torch.int16).numpy())
    # the weights: float32 softmaxes of the same scores, rows summing to 1
    # within bf16's rounding
    assert np.allclose(wn.astype(np.float32).sum(-1), 1.0, atol=0.02)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_backward_fused_vs_torch_same_dtype(dtype):
    """The gradients of bf16 / f16 tensors take the fused backward (bf16 on
    a CPU that computes bf16: products in bf16, P' and dS rounded, as
    FlashAttention's), and their error against float64 autograd on the
    same rounded inputs is at most 2x that of PyTorch's autograd in the
    same dtype."""
    if dtype == torch.float16 and not HAS_SDPA:
        pytest.skip("PyTorch 1.13 has no float16 matmul on CPU (the peer)")
    g = np.random.default_rng(5)
    q, k, v = (torch.from_numpy(g.normal(size=(1, 4, 150, 32))).to(dtype) for _ in range(3))
    go = torch.from_numpy(g.normal(size=(1, 4, 150, 32))).to(dtype)

    def grads(fn, dt):
        xs = [x.detach().to(dt).requires_grad_() for x in (q, k, v)]
        fn(*xs).backward(go.to(dt))
        return [x.grad for x in xs]

    ours = grads(lambda a, b, c: mt.scaled_dot_product_attention(a, b, c, is_causal=True), dtype)
    assert mha.last_impl().startswith("fused "), mha.last_impl()
    assert mha.last_impl().endswith(" bf16") == (
        dtype == torch.bfloat16 and mha.isa() in ("amx", "avx512bf16")), mha.last_impl()
    ref = grads(lambda a, b, c: sdpa_ref(a, b, c, causal=True), torch.float64)
    if HAS_SDPA:
        peer = grads(lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(
            a, b, c, is_causal=True), dtype)
    else:
        peer = grads(lambda a, b, c: sdpa_ref(a, b, c, causal=True), dtype)
    for name, o, r, p in zip(("dq", "dk", "dv"), ours, ref, peer):
        assert o.dtype == dtype
        err = (o.double() - r).abs().max().item()
        err_pt = (p.double() - r).abs().max().item()
        print("%s %s: mha err %.3g, torch %s err %.3g" % (dtype, name, err, dtype, err_pt))
        assert err <= 2 * err_pt, (name, err, err_pt)


def test_autocast_bf16():
    """Under torch.autocast("cpu", bfloat16), float32 query, key and value
    are cast to bf16 as torch's own sdpa casts them: a bf16 output (bf16
    compute where the CPU has it), float32 gradients on the float32 leaves
    through the cast, each within 2x the error of torch's sdpa under the
    same autocast against float64 on the same rounded values."""
    g = np.random.default_rng(17)
    q, k, v = (torch.from_numpy(g.normal(size=(1, 4, 130, 32))).float() for _ in range(3))
    go = torch.from_numpy(g.normal(size=(1, 4, 130, 32))).to(torch.bfloat16)

    def run(fn):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            o = fn(*xs, is_causal=True)
        o.backward(go.to(o.dtype))
        return o, [x.grad for x in xs]

    o, grads = run(mt.scaled_dot_product_attention)
    assert o.dtype == torch.bfloat16
    assert mha.last_impl().startswith("fused "), mha.last_impl()
    assert mha.last_impl().endswith(" bf16") == (mha.isa() in ("amx", "avx512bf16"))
    assert all(x.dtype == torch.float32 for x in grads)
    xs = [x.to(torch.bfloat16).double().requires_grad_() for x in (q, k, v)]
    r = sdpa_ref(*xs, causal=True)
    r.backward(go.double())
    if not HAS_SDPA:
        return  # (PyTorch 1.13: no peer sdpa under autocast)
    po, pgrads = run(torch.nn.functional.scaled_dot_product_attention)
    assert po.dtype == torch.bfloat16
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), [o] + grads, [po] + pgrads,
                             [r] + [x.grad for x in xs]):
        err = (a.double() - c).abs().max().item()
        err_pt = (b.double() - c).abs().max().item()
        print("autocast %s: mha err %.3g, torch err %.3g" % (name, err, err_pt))
        assert err <= 2 * err_pt, (name, err, err_pt)


def logits_ref(q, k, v, causal, scale, window, softcap, slopes, sinks):
    """The logit rule of mha_attn_opts written out, in the inputs' dtype:
    s = scale q k^T, softcap tanh(s / softcap), - slope_h |i - j|, causal and
    window masks, then the softmax with each head's sink logit in its
    denominator (no value), times v. (B, H, L, E) tensors, no GQA."""
    L, S, E = q.shape[-2], k.shape[-2], q.shape[-1]
    s = (q @ k.transpose(-2, -1)) * (1 / E ** 0.5 if scale is None else scale)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(L).view(L, 1)
    j = torch.arange(S).view(1, S)
    if slopes is not None:
        s = s - slopes.to(s.dtype).view(-1, 1, 1) * (i - j).abs().to(s.dtype)
    hide = torch.zeros(L, S, dtype=torch.bool)
    if causal:
        hide |= j > i
    if window is not None:
        left, right = window
        if left is not None:
            hide |= j < i - left
        if right is not None:
            hide |= j > i + right
    s = s.masked_fill(hide, float("-inf"))
    if sinks is not None:
        col = sinks.to(s.dtype).view(1, -1, 1, 1).expand(s.shape[:-1] + (1,))
        s = torch.cat([s, col], -1)
    p = torch.softmax(s, -1)
    if sinks is not None:
        p = p[..., :-1]
    return p @ v


@pytest.mark.parametrize("seed", range(24))
def test_logit_options_vs_float64(seed):
    """softcap, alibi_slopes, sinks and window=(left, right) through both
    APIs: output and q/k/v gradients against float64 by the rule; numpy ==
    torch bits."""
    g = np.random.default_rng(1000 + seed)
    B, H, L, S, E = 2, int(g.integers(1, 4)), int(g.integers(1, 40)), 0, int(g.choice([8, 16]))
    S = L
    causal = bool(seed % 2)
    scale = 0.3 if seed % 3 == 0 else None
    window = [None, (3, None), (None, 2), (4, 1)][seed % 4]
    softcap = [0.0, 2.0, 0.7][seed % 3]
    slopes = torch.from_numpy(g.uniform(0.0, 0.3, H)) if seed % 5 != 1 else None
    sinks = torch.from_numpy(g.normal(size=H)) if seed % 4 != 3 else None
    q = torch.from_numpy(g.normal(size=(B, H, L, E)))
    k = torch.from_numpy(g.normal(size=(B, H, S, E)))
    v = torch.from_numpy(g.normal(size=(B, H, S, E)))
    gout = torch.from_numpy(g.normal(size=(B, H, L, E)))
    res = {}
    for name, dt in (("ours", torch.float32), ("t32", torch.float32), ("t64", torch.float64)):
        qq, kk, vv = (x.detach().to(dt).clone().requires_grad_() for x in (q, k, v))
        sl = None if slopes is None else slopes.to(dt)
        sk = None if sinks is None else sinks.detach().to(dt).clone().requires_grad_()
        if name == "ours":
            o = mt.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, scale=scale,
                                                window=window, softcap=softcap,
                                                alibi_slopes=sl, sinks=sk)
        else:
            o = logits_ref(qq, kk, vv, causal, scale, window, softcap, sl, sk)
        o.backward(gout.to(dt))
        res[name] = (o.detach(), qq.grad, kk.grad, vv.grad, None if sk is None else sk.grad)
    for i, n in enumerate(("out", "dq", "dk", "dv", "dsinks")):
        if res["t64"][i] is not None:
            assert_close(n, res["ours"][i], res["t32"][i], res["t64"][i])
    on = mha.scaled_dot_product_attention(
        q.float().numpy(), k.float().numpy(), v.float().numpy(), is_causal=causal, scale=scale,
        window=window, softcap=softcap,
        alibi_slopes=None if slopes is None else slopes.float().numpy(),
        sinks=None if sinks is None else sinks.float().numpy())
    assert np.array_equal(on, res["ours"][0].numpy())


def test_logit_options_refused():
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="alibi_slopes: 3 elements, expected 2"):
        mt.scaled_dot_product_attention(q, q, q, alibi_slopes=torch.zeros(3))
    with pytest.raises(ValueError, match="sinks\\[1\\]"):
        mt.scaled_dot_product_attention(q, q, q, sinks=torch.tensor([0.0, float("nan")]))
    with pytest.raises(TypeError, match="dtype"):  # MHA_ERR_DTYPE -> TypeError
        mha.scaled_dot_product_attention(q.numpy().astype(np.int32), q.numpy(), q.numpy())


def sinks_ref(q, k, v, sinks, mask=None, causal=False, scale=None, gqa=False):
    """Attention with sinks written out in the inputs' dtype: logits s = scale
    q k^T (+ mask, causal), s' = cat([s, sinks[h] as a column]), p =
    softmax(s')[..., :-1], o = p v; GQA by repeating k, v."""
    L, S, E = q.shape[-2], k.shape[-2], q.shape[-1]
    if gqa and k.shape[-3] != q.shape[-3]:
        r = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(r, dim=-3), v.repeat_interleave(r, dim=-3)
    s = (q @ k.transpose(-2, -1)) * (1 / E ** 0.5 if scale is None else scale)
    if causal:
        s = s.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    col = sinks.to(s.dtype).view(-1, 1, 1).expand(s.shape[:-1] + (1,))
    p = torch.softmax(torch.cat([s, col], -1), -1)[..., :-1]
    return p @ v


@pytest.mark.parametrize("seed", range(32))
def test_sinks_grad_vs_float64(seed):
    """The sinks' gradient through torch.autograd (with q, k, v's): GQA or
    not, causal or not, bool / float / no mask, leading dims, large sinks
    (rows they dominate); against the formula in float64 by the rule."""
    g = np.random.default_rng(3000 + seed)
    lead = (int(g.integers(1, 3)),) if seed % 3 else (2, 2)
    hkv = int(g.choice([1, 2]))
    gqa = seed % 2 == 0
    hq = hkv * (int(g.choice([2, 3])) if gqa else 1)
    L = int(g.integers(1, 40))
    S = L if seed % 4 == 1 else int(g.integers(L, 50))  # (causal: every row sees a key)
    E, Ev = int(g.choice([4, 8, 16])), int(g.choice([3, 8]))
    causal = seed % 4 in (1, 2)
    scale = 0.5 if seed % 5 == 0 else None
    kind = ["none", "bool", "float"][seed % 3]
    mask = rand_mask(g, kind, (L, S))
    sinks = torch.from_numpy(g.normal(size=hq) + (3.0 if seed % 7 == 3 else 0.0))
    q, k, v = tensors(g, lead, hq, hkv, L, S, E, Ev)
    gout = torch.from_numpy(g.normal(size=lead + (hq, L, Ev)))
    res = {}
    for name, dt in (("ours", torch.float32), ("t32", torch.float32), ("t64", torch.float64)):
        qq, kk, vv, sk = (x.detach().to(dt).clone().requires_grad_() for x in (q, k, v, sinks))
        mm = None if mask is None else (mask if mask.dtype == torch.bool else mask.to(dt))
        if name == "ours":
            o = mt.scaled_dot_product_attention(qq, kk, vv, attn_mask=mm, is_causal=causal,
                                                scale=scale, enable_gqa=gqa, sinks=sk)
        else:
            o = sinks_ref(qq, kk, vv, sk, mm, causal, scale, gqa)
        o.backward(gout.to(dt))
        res[name] = (o.detach(), qq.grad, kk.grad, vv.grad, sk.grad)
    assert res["ours"][4].dtype == torch.float32 and res["ours"][4].shape == (hq,)
    for i, n in enumerate(("out", "dq", "dk", "dv", "dsinks")):
        assert_close(n, res["ours"][i], res["t32"][i], res["t64"][i])


def test_sinks_grad_only_and_dtype():
    """Sinks alone requiring grad (q, k, v not): their gradient, in their
    dtype and shape; the numpy-free paths agree with requires_grad on all."""
    g = np.random.default_rng(7)
    q, k, v = (x.float() for x in tensors(g, (2,), 4, 2, 9, 11, 8, 8))
    sinks = torch.from_numpy(g.normal(size=4)).float().requires_grad_()
    o = mt.scaled_dot_product_attention(q, k, v, sinks=sinks, enable_gqa=True, is_causal=True)
    o.sum().backward()
    g1 = sinks.grad.clone()
    assert q.grad is None and g1.shape == (4,) and g1.dtype == torch.float32
    sinks.grad = None
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    mt.scaled_dot_product_attention(qq, kk, vv, sinks=sinks, enable_gqa=True,
                                    is_causal=True).sum().backward()
    assert torch.equal(sinks.grad, g1)
    s64 = sinks.detach().double().requires_grad_()
    mt.scaled_dot_product_attention(q, k, v, sinks=s64, enable_gqa=True,
                                    is_causal=True).sum().backward()
    assert s64.grad.dtype == torch.float64 and torch.equal(s64.grad.float(), g1)


def test_sinks_gradcheck_float64():
    """gradcheck in float64 (the reference path): q, k, v with sinks
    (GQA, causal); the sinks themselves (the binding takes them as float32,
    so a step of 1e-3: the rounding of the perturbed sinks stays 1e-4 of
    it)."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 5, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 6, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 6, 4, dtype=torch.float64, requires_grad=True)
    sinks = torch.tensor([0.5, -1.0, 1.5, 0.0], dtype=torch.float64)

    def f(q, k, v):
        return mt.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True,
                                               sinks=sinks)

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-5, rtol=1e-4)
    s = sinks.clone().requires_grad_()
    qd, kd, vd = q.detach(), k.detach(), v.detach()

    def h(s):
        return mt.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True, is_causal=True,
                                               sinks=s)

    assert torch.autograd.gradcheck(h, (s,), eps=1e-3, atol=1e-5, rtol=1e-3)

"""The numpy API: the same bits as the PyTorch API, strided inputs, files,
the backward, the KV cache, diagnostics, tracing, threads."""

import threading

import numpy as np
import pytest
import torch

import mha
import mha.torch as mt
from conftest import assert_close


def pair(seed=0, **cfg):
    """A numpy module and a torch module with the same parameters."""
    torch.manual_seed(seed)
    t = mt.MultiheadAttention(cfg.pop("embed_dim", 16), cfg.pop("num_heads", 4), **cfg)
    n = mha.MultiheadAttention(t.embed_dim, t.num_heads, kdim=t.kdim, vdim=t.vdim,
                               batch_first=t.batch_first, add_bias_kv=t.bias_k is not None,
                               num_kv_heads=t.num_kv_heads).eval()
    n.load_state_dict({k: v.detach().numpy() for k, v in t.state_dict().items()})
    return n, t.eval()


@pytest.mark.parametrize("batch_first", [False, True])
def test_numpy_equals_torch_bitwise(batch_first):
    n, t = pair(batch_first=batch_first, add_bias_kv=True)
    g = np.random.default_rng(0)
    x = g.normal(size=(3, 5, 16)).astype(np.float32)
    N, L = (3, 5) if batch_first else (5, 3)
    kpm = g.random((N, L)) < 0.2
    kpm[:, 0] = False
    am = g.normal(size=(L, L)).astype(np.float32)
    on, wn = n(x, x, x, key_padding_mask=kpm, attn_mask=am, average_attn_weights=False)
    xt = torch.from_numpy(x)
    ot, wt = t(xt, xt, xt, key_padding_mask=torch.from_numpy(kpm), attn_mask=torch.from_numpy(am),
               average_attn_weights=False)
    assert np.array_equal(on, ot.detach().numpy()) and np.array_equal(wn, wt.numpy())
    # backward: numpy API == autograd, bit for bit
    gout = g.normal(size=on.shape).astype(np.float32)
    grads = n.backward(gout, x, key_padding_mask=kpm, attn_mask=am)
    xr = xt.clone().requires_grad_()
    t.train()
    o, _ = t(xr, xr, xr, key_padding_mask=torch.from_numpy(kpm), attn_mask=torch.from_numpy(am))
    o.backward(torch.from_numpy(gout))
    assert np.array_equal(grads.query, xr.grad.numpy())
    for name, p in t.named_parameters():
        assert np.array_equal(grads.params[name], p.grad.numpy()), name


def test_strided_and_transposed_inputs():
    n, _ = pair()
    g = np.random.default_rng(1)
    x = g.normal(size=(4, 6, 16)).astype(np.float32)
    ref = n(x, need_weights=False)[0]
    xt = np.ascontiguousarray(x.transpose(1, 0, 2)).transpose(1, 0, 2)  # other strides
    assert np.array_equal(n(xt, need_weights=False)[0], ref)
    big = np.zeros((4, 6, 48), np.float32)
    big[:, :, ::3] = x  # a stride of 3 along the features
    assert np.array_equal(n(big[:, :, ::3], need_weights=False)[0], ref)
    rev = np.ascontiguousarray(x[::-1])[::-1]  # negative strides
    assert np.array_equal(n(rev, need_weights=False)[0], ref)
    assert np.abs(n(x.astype(np.float64), need_weights=False)[0] - ref).max() < 1e-5


def test_files_and_state_dict(tmp_path):
    n, _ = pair(add_bias_kv=True)
    p = tmp_path / "m.safetensors"
    n.save(p)
    m = mha.MultiheadAttention.load(p)
    assert m.num_heads == 4 and m.embed_dim == 16
    for k, a in n.state_dict().items():
        assert np.array_equal(a, m.state_dict()[k])
    fresh = mha.MultiheadAttention(16, 4, add_bias_kv=True, seed=9)
    fresh.load(p)  # on an instance: into it
    x = np.ones((2, 1, 16), np.float32)
    assert np.array_equal(fresh.eval()(x)[0], n(x)[0])
    tensors, meta = mha.load_tensors(p)
    assert meta["num_heads"] == "4" and set(tensors) == set(n.state_dict())
    mha.save_tensors(tmp_path / "x.safetensors", {"a": np.arange(6, dtype=np.float32)}, {"k": "v"})
    back, meta = mha.load_tensors(tmp_path / "x.safetensors")
    assert np.array_equal(back["a"], np.arange(6)) and meta == {"k": "v"}


def test_saves_are_atomic(tmp_path):
    """save / save_tensors go through the C library's atomic writer: a save
    over a file replaces it whole, a failing one raises OSError naming the
    path and leaves the old file and no temporary file."""
    n, _ = pair()
    p = tmp_path / "w.safetensors"
    n.save(p)
    n.save(p)  # over the old one
    assert sorted(x.name for x in tmp_path.iterdir()) == ["w.safetensors"]
    old = p.read_bytes()
    d = tmp_path / "adir"
    d.mkdir()
    with pytest.raises(OSError, match="Is a directory") as e:
        n.save(d)
    assert str(d) in str(e.value)
    with pytest.raises(OSError, match="No such file or directory") as e:
        mha.save_tensors(tmp_path / "none" / "x.safetensors", {"a": np.zeros(3, np.float32)})
    assert str(tmp_path / "none" / "x.safetensors") in str(e.value)
    assert p.read_bytes() == old
    assert sorted(x.name for x in tmp_path.iterdir()) == ["adir", "w.safetensors"]
    assert list(d.iterdir()) == []
    # a symbolic link at the target is replaced, the file it names untouched
    link = tmp_path / "latest.safetensors"
    link.symlink_to("w.safetensors")
    mha.save_tensors(link, {"a": np.zeros(3, np.float32)})
    assert not link.is_symlink() and p.read_bytes() == old
    assert np.array_equal(mha.load_tensors(link)[0]["a"], np.zeros(3))


def test_half_weights_and_pruning():
    n, _ = pair()
    x = np.random.default_rng(2).normal(size=(5, 2, 16)).astype(np.float32)
    o = n(x)[0]
    h = n.to("bf16")
    assert h.weight_dtype == "bf16"
    assert np.abs(h(x)[0] - o).max() < 0.05
    # backward of a half module: the gradients of the float32 module of its
    # (widened) weights, the weight matrices' rounded to the half type once
    g = np.random.default_rng(3).normal(size=o.shape).astype(np.float32)
    for wd in ("bf16", "f16"):
        h = n.to(wd)
        gh, gr = h.backward(g, x), h.to("f32").backward(g, x)
        assert np.array_equal(gh.query, gr.query)
        for name, a in gh.params.items():
            r = gr.params[name]
            if a.dtype == np.float32:
                assert np.array_equal(a, r), name
            elif wd == "f16":
                assert a.dtype == np.float16 and np.array_equal(a, r.astype(np.float16)), name
            else:  # bf16 bits: float32 rounded to nearest even
                b = r.view(np.uint32).astype(np.uint64)
                want = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
                assert a.dtype.itemsize == 2 and np.array_equal(a.view(np.uint16), want), name
    n.prune_heads([1, 3])
    assert n.pruned_heads == [1, 3]
    _, w = n(x, average_attn_weights=False)
    assert np.all(w[:, [1, 3]] == 0)


def test_backward_vs_torch_float64():
    """The numpy backward against PyTorch float64 (tolerance rule)."""
    n, t = pair(kdim=5, vdim=7)
    g = np.random.default_rng(4)
    q = g.normal(size=(6, 2, 16)).astype(np.float32)
    k = g.normal(size=(4, 2, 5)).astype(np.float32)
    v = g.normal(size=(4, 2, 7)).astype(np.float32)
    gout = g.normal(size=(6, 2, 16)).astype(np.float32)
    gr = n.backward(gout, q, k, v)
    ref = {}
    for dt in (torch.float32, torch.float64):
        tm = torch.nn.MultiheadAttention(16, 4, kdim=5, vdim=7).to(dt)
        tm.load_state_dict(t.state_dict())
        qq, kk, vv = (torch.from_numpy(a).to(dt).requires_grad_() for a in (q, k, v))
        o, _ = tm(qq, kk, vv)
        o.backward(torch.from_numpy(gout).to(dt))
        ref[dt] = [qq.grad, kk.grad, vv.grad, {n_: p.grad for n_, p in tm.named_parameters()}]
    for i, name in enumerate(("query", "key", "value")):
        assert_close(name, torch.from_numpy(gr[i]), ref[torch.float32][i], ref[torch.float64][i])
    for name, a in gr.params.items():
        assert_close(name, torch.from_numpy(a), ref[torch.float32][3][name],
                     ref[torch.float64][3][name])


def test_kv_cache_decode_matches_full_forward():
    n, _ = pair(batch_first=True, num_kv_heads=2)
    g = np.random.default_rng(5)
    x = g.normal(size=(2, 9, 16)).astype(np.float32)
    full = n(x, is_causal=True, need_weights=False)[0]
    cache = n.make_cache(batch=2, capacity=16)
    chunks = [x[:, :4], x[:, 4:5], x[:, 5:9]]
    outs = [n.forward_cached(c, cache) for c in chunks]
    assert cache.length() == [9, 9]
    assert np.abs(np.concatenate(outs, 1) - full).max() < 1e-5
    cache.truncate(5)
    again = n.forward_cached(x[:, 5:9], cache)
    assert np.array_equal(again, outs[2])
    # the raw cache: append then attend
    c = mha.KVCache(1, 2, 4, capacity=3)
    k = g.normal(size=(1, 2, 3, 4)).astype(np.float32)
    c.append(k, k)
    o = c.attend(g.normal(size=(1, 4, 1, 4)).astype(np.float32))
    assert o.shape == (1, 4, 1, 4)
    with pytest.raises(ValueError, match="capacity|full|length"):
        c.append(k[:, :, :1], k[:, :, :1])
    assert c.length(0) == 3


def int4_values(x):
    """What an int4 cache stores for x (..., D), as mha.h describes it: per
    group of 32 along D the scale max|x| / 7 (1 if all 0), values
    clamp(round(x / scale), -7, 7) * scale (float32 arithmetic)."""
    D = x.shape[-1]
    pad = np.zeros(x.shape[:-1] + (-D % 32,), np.float32)
    g = np.concatenate([x, pad], -1).reshape(x.shape[:-1] + (-1, 32))
    mx = np.abs(g).max(-1, keepdims=True)
    sc = np.where(mx > 0, mx / np.float32(7), np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(g / sc), -7, 7)
    return (q * sc).reshape(x.shape[:-1] + (-1,))[..., :D], sc[..., 0]


def test_kv_cache_int4():
    # dtype="int4": the attention over it equals a float64 oracle over the
    # values it stores (within 4e-6), decode (1 query) and prefill (20), a
    # head dim of 40 (a group of 32 and one of 8); every value within half
    # its group's scale; 20 + 16 bytes a row; a paged int4 cache gives the
    # contiguous one's bits through the module
    g = np.random.default_rng(11)
    B, Hkv, G, D, L = 2, 2, 2, 40, 70
    k = g.normal(size=(B, Hkv, L, D)).astype(np.float32)
    v = g.normal(size=(B, Hkv, L, D)).astype(np.float32)
    kq, ks = int4_values(k)
    vq, _ = int4_values(v)
    assert np.all(np.abs(kq - k) <= ks.repeat(32, -1)[..., :D] * (0.5 + 2.0 ** -20))
    c = mha.KVCache(B, Hkv, D, capacity=L, dtype="int4")
    assert c.nbytes == B * Hkv * L * (2 * 20 + 2 * 2 * 4)
    c.append(k, v)
    for T in (1, 20):
        q = g.normal(size=(B, Hkv * G, T, D)).astype(np.float32)
        o = c.attend(q)
        kr, vr = np.repeat(kq, G, 1).astype(np.float64), np.repeat(vq, G, 1).astype(np.float64)
        s = q.astype(np.float64) @ kr.transpose(0, 1, 3, 2) / np.sqrt(D)
        s[..., np.arange(L)[None, :] > np.arange(L - T, L)[:, None]] = -np.inf
        p = np.exp(s - s.max(-1, keepdims=True))
        want = (p / p.sum(-1, keepdims=True)) @ vr
        assert np.abs(o - want).max() <= 4e-6 * (1 + np.abs(want).max())
    n, _ = pair(num_kv_heads=2, batch_first=True)
    x = g.normal(size=(1, 30, 16)).astype(np.float32)
    cc, pc = n.make_cache(batch=1, capacity=32, dtype="int4"), n.make_paged_cache(8, 4, dtype="int4")
    sid = pc.add_sequence()
    for a, b in ((0, 20), (20, 21), (21, 30)):
        y1 = n.forward_cached(x[:, a:b], cc)
        (y2,) = n.forward_paged(pc, [sid], [x[0, a:b]])
        assert np.array_equal(y1[0], y2)


@pytest.mark.parametrize("batch_first", [True, False])
def test_paged_cache_continuous_batching(batch_first):
    # three sequences of their own lengths, fed in mixed calls (a prefill
    # chunk next to decode steps), equal their full causal forwards; a fork
    # shares its blocks; freed ids and an exhausted pool raise and change
    # nothing
    n, _ = pair(batch_first=batch_first, num_kv_heads=2)
    g = np.random.default_rng(7)
    lens = [23, 9, 15]
    xs = [g.normal(size=(L, 16)).astype(np.float32) for L in lens]
    full = []
    for x in xs:
        xb = x[None] if batch_first else x[:, None]
        y = n(xb, is_causal=True, need_weights=False)[0]
        full.append(y[0] if batch_first else y[:, 0])
    cache = n.make_paged_cache(num_blocks=16, block_size=4)
    ids = [cache.add_sequence() for _ in xs]
    done, outs = [0, 0, 0], [[], [], []]
    schedule = [[(0, 17), (1, 1), (2, 5)], [(0, 1), (1, 8), (2, 1)], [(0, 5), (2, 9)]]
    for call in schedule:
        res = n.forward_paged(cache, [ids[i] for i, _ in call],
                              [xs[i][done[i]:done[i] + k] for i, k in call])
        for (i, k), y in zip(call, res):
            assert y.shape == (k, 16)
            outs[i].append(y)
            done[i] += k
    for i in range(3):
        assert cache.length(ids[i]) == lens[i]
        assert np.abs(np.concatenate(outs[i]) - full[i]).max() < 1e-5
    used = cache.blocks_in_use()
    f = cache.fork(ids[0])
    assert cache.blocks_in_use() == used and cache.length(f) == lens[0]
    cache.free(f)
    with pytest.raises(KeyError):
        cache.length(f)
    with pytest.raises(ValueError, match="no sequence"):
        n.forward_paged(cache, [f], [xs[0][:1]])
    with pytest.raises(MemoryError, match="needs .* blocks"):
        n.forward_paged(cache, [ids[1]], [g.normal(size=(80, 16)).astype(np.float32)])
    assert [cache.length(i) for i in ids] == lens and cache.blocks_in_use() == used
    with pytest.raises(ValueError, match="chunks"):
        n.forward_paged(cache, [ids[0]], [xs[0][:, :3]])


def test_paged_cache_layouts():
    # the block-major pool (a block's KV heads side by side, read heads
    # together) gives the head-major pool's bits, forks and sharing
    # included; an unknown layout raises
    n, _ = pair(batch_first=True, num_kv_heads=2)
    g = np.random.default_rng(11)
    xs = [g.normal(size=(L, 16)).astype(np.float32) for L in (21, 13)]
    outs = {}
    for layout in ("head-major", "block-major"):
        cache = n.make_paged_cache(num_blocks=24, block_size=4, layout=layout)
        assert cache.layout == layout
        a, b = cache.add_sequence(), cache.add_sequence()
        ys = n.forward_paged(cache, [a, b], [xs[0][:17], xs[1][:6]])
        f = cache.fork(a)
        ys += n.forward_paged(cache, [a, b, f], [xs[0][17:], xs[1][6:], xs[1][:2]])
        outs[layout] = ys
    assert all(np.array_equal(p, q) for p, q in zip(outs["head-major"], outs["block-major"]))
    with pytest.raises(ValueError, match="layout 'diagonal'"):
        n.make_paged_cache(num_blocks=4, block_size=4, layout="diagonal")


def test_paged_cache_prefix_sharing():
    # a prompt's blocks, given with their token ids, are found by a second
    # sequence starting with the same tokens: it computes only the rest and
    # equals its full causal forward
    n, _ = pair(batch_first=True, num_kv_heads=2)
    g = np.random.default_rng(9)
    x = g.normal(size=(45, 16)).astype(np.float32)
    tok = g.integers(0, 1000, size=45).astype(np.int32)
    full = n(x[None], is_causal=True, need_weights=False)[0][0]
    cache = n.make_paged_cache(num_blocks=32, block_size=8)
    a = cache.add_sequence()
    n.forward_paged(cache, [a], [x[:40]], tokens=[tok[:40]])
    used = cache.blocks_in_use()
    b, cached = cache.add_prompt(tok)
    assert cached == 40 and cache.length(b) == 40 and cache.blocks_in_use() == used
    (y,) = n.forward_paged(cache, [b], [x[cached:]], tokens=[tok[cached:]])
    assert np.abs(y - full[cached:]).max() < 1e-5
    # a prompt the blocks hold whole: all but its last token cached, and
    # that token's keys and values kept from the shared block (no block taken)
    used = cache.blocks_in_use()
    w, cached = cache.add_prompt(tok[:40])
    assert cached == 39 and cache.blocks_in_use() == used
    (y,) = n.forward_paged(cache, [w], [x[39:40]], tokens=[tok[39:40]])
    assert np.abs(y - full[39:40]).max() < 1e-5
    assert cache.length(w) == 40 and cache.blocks_in_use() == used
    c, cached = cache.add_prompt(np.array([5, 6, 7], dtype=np.int32))
    assert cached == 0
    with pytest.raises(ValueError, match="token"):
        n.forward_paged(cache, [c], [x[:3]], tokens=[tok[:2]])


def test_paged_cache_streaming_llm():
    # StreamingLLM: 2 sinks and a window of 6 with RoPE; the blocks between
    # them released after each step; every token's output equals the
    # module's causal forward over the cache the paper holds for it (sinks,
    # then the window, at positions 0..)
    n, _ = pair(batch_first=True, num_kv_heads=2)
    g = np.random.default_rng(11)
    K, W, L = 2, 6, 40
    x = g.normal(size=(L, 16)).astype(np.float32)
    cache = n.make_paged_cache(num_blocks=8, block_size=4)
    s = cache.add_sequence()
    most = 0
    for p in range(L):
        (y,) = n.forward_paged(cache, [s], [x[p:p + 1]], rope="neox", window_left=W,
                               sink_tokens=K)
        cache.release(s, max(0, p + 1 - W), keep=K)
        most = max(most, cache.blocks_in_use())
        seen = list(range(min(K, max(0, p - W)))) + list(range(max(0, p - W), p + 1))
        ref = n(x[seen][None], is_causal=True, need_weights=False, rope="neox")[0][0]
        assert np.abs(y[0] - ref[-1]).max() < 1e-5, p
    assert most <= 4
    with pytest.raises(ValueError, match="released"):
        n.forward_paged(cache, [s], [x[:1]], rope="neox", window_left=W + 8, sink_tokens=K)
    assert cache.length(s) == L
    with pytest.raises(ValueError, match="sink_tokens"):
        n.forward_paged(cache, [s], [x[:1]], rope="neox", sink_tokens=K)


def test_diagnose_and_report(tmp_path):
    n, t = pair()
    x = np.random.default_rng(6).normal(size=(8, 1, 16)).astype(np.float32)
    d = mha.diagnose(n, x, is_causal=True)
    assert len(d["heads"]) == 4 and len(d["similarity"]) == 4
    h0 = d["heads"][0]
    for key in ("entropy_mean", "entropy_norm", "mean_distance", "logit_max", "dead", "rank_q",
                "singular_values"):
        assert key in h0
    assert abs(d["similarity"][1][1] - 1.0) < 1e-12 and d["nonfinite"] is None
    dt = mha.diagnose(t, torch.from_numpy(x), is_causal=True)
    assert dt["heads"] == d["heads"]
    out = tmp_path / "report"
    mha.diagnose(n, x, report=out, tokens=list("abcdefgh"))
    assert (out / "diagnostics.json").exists()
    x[3, 0, 2] = np.nan
    assert "query" in mha.diagnose(n, x)["nonfinite"]


def test_trace_steps():
    n, _ = pair(embed_dim=8, num_heads=2)
    x = np.random.default_rng(7).normal(size=(3, 1, 8)).astype(np.float32)
    steps = []
    o, _ = n(x, impl="reference", trace=lambda s, b, h, a: steps.append((s, b, h, a.shape)))
    names = [s for s, _, _, _ in steps]
    assert names[:3] == ["q", "k", "v"] and names[-2:] == ["concat", "output"]
    assert ("weights", 0, 1, (3, 3)) in steps

    def boom(*a):
        raise RuntimeError("from the trace")

    with pytest.raises(RuntimeError, match="from the trace"):
        n(x, impl="reference", trace=boom)


def test_two_threads_share_a_module():
    """Two Python threads running one module at once (the GIL released) give
    the serial bits."""
    n, _ = pair(embed_dim=64, num_heads=4, batch_first=True)
    g = np.random.default_rng(8)
    xs = [g.normal(size=(2, 96, 64)).astype(np.float32) for _ in range(2)]
    serial = [n(x, need_weights=False)[0] for x in xs]
    results = [[None] * 8 for _ in range(2)]

    def work(i):
        for r in range(8):
            results[i][r] = n(xs[i], need_weights=False)[0]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for i in range(2):
        for r in range(8):
            assert np.array_equal(results[i][r], serial[i])


def test_dropout_seeded_backward():
    n = mha.MultiheadAttention(8, 2, dropout=0.5, seed=3)  # training mode
    x = np.random.default_rng(9).normal(size=(4, 2, 8)).astype(np.float32)
    o1, _ = n(x, dropout_seed=5)
    o2, _ = n(x, dropout_seed=5)
    assert np.array_equal(o1, o2)
    o3, _ = n(x)
    assert not np.array_equal(o1, o3)
    g = n.backward(np.ones_like(o3), x)  # the last forward's mask
    assert np.isfinite(g.query).all()
    assert np.array_equal(n.eval()(x)[0], n(x)[0])


def test_packed_weights_follow_parameter_writes():
    """The module's packed weights (mha_module_params_changed) never go stale
    under Python: after a write through a parameter view (kept alive, or
    dropped before the next call) and after a torch optimizer step on
    mha.torch's parameters (views of the C storage), the fused forward,
    backward and cached decode equal a fresh module's with those
    parameters, bit for bit."""
    g = np.random.default_rng(11)
    x = g.normal(size=(2, 6, 32)).astype(np.float32)
    gout = g.normal(size=(2, 6, 32)).astype(np.float32)

    def results(m):
        y = m(x, is_causal=True, need_weights=False, impl="fused")[0]
        gr = m.backward(gout, x, is_causal=True, impl="fused")
        cache = m.make_cache(batch=2, capacity=8)
        dec = [m.forward_cached(x[:, t:t + 1], cache) for t in range(6)]
        return [y, gr.query] + [gr.params[k] for k in sorted(gr.params)] + dec

    def fresh(m):
        f = mha.MultiheadAttention(32, 4, batch_first=True, num_kv_heads=2)
        f.load_state_dict(m.state_dict())
        return f

    def same(a, b):
        return all(np.array_equal(u, v) for u, v in zip(a, b))

    n = mha.MultiheadAttention(32, 4, batch_first=True, num_kv_heads=2)
    before = results(n)
    w = dict(n.named_parameters())["in_proj_weight"]  # a view, kept alive
    results(n)  # (the packed copy filled again)
    w *= 0.5
    after = results(n)
    assert not same(before, after) and same(after, results(fresh(n)))
    results(n)
    w += 0.01  # written after a call, then dropped before the next
    del w
    assert same(results(n), results(fresh(n)))
    o = dict(n.named_parameters())["out_proj.weight"]
    results(n)
    o -= 0.02
    o = None
    assert same(results(n), results(fresh(n)))

    # mha.torch: torch's optimizer writes the C module's storage in place
    torch.manual_seed(0)
    t = mt.MultiheadAttention(32, 4, batch_first=True)
    ref = mt.MultiheadAttention(32, 4, batch_first=True)
    xt = torch.from_numpy(x)
    opt = torch.optim.SGD(t.parameters(), lr=0.1)
    for _ in range(2):
        y, _ = t(xt, xt, xt, need_weights=False)
        y.backward(torch.from_numpy(gout))
        opt.step()
        opt.zero_grad()
        ref.load_state_dict(t.state_dict())
        with torch.no_grad():
            assert torch.equal(t(xt, xt, xt, need_weights=False)[0],
                               ref(xt, xt, xt, need_weights=False)[0])


@pytest.mark.parametrize("storage", ["f32", "bf16"])
def test_kv_cache_half_queries(storage):
    """KVCache.attend with float16 and bfloat16 (ml_dtypes) queries: the
    output in q's dtype, the float32 attend on the same values rounded once."""
    g = np.random.default_rng(4)
    c = mha.KVCache(2, 2, 16, capacity=64, dtype=storage)
    c.append(g.normal(size=(2, 2, 40, 16)).astype(np.float32),
             g.normal(size=(2, 2, 40, 16)).astype(np.float32))
    dts = [np.float16]
    try:
        import ml_dtypes
        dts.append(ml_dtypes.bfloat16)
    except ImportError:  # (torch1's venv: float16 only)
        pass
    for dt in dts:
        for T in (1, 20):
            q = g.normal(size=(2, 4, T, 16)).astype(dt)
            o = c.attend(q)
            assert o.dtype == np.dtype(dt) and o.shape == (2, 4, T, 16)
            ref = c.attend(q.astype(np.float32)).astype(dt)
            assert np.array_equal(o.view(np.uint16), ref.view(np.uint16))


def test_release_scratch():
    """mha.release_scratch() frees the thread's kept scratch block: calls
    before and after it (the kept block reused, then a fresh one) give the
    same bits."""
    m = mha.MultiheadAttention(64, 4, batch_first=True)
    x = np.random.default_rng(2).normal(size=(3, 300, 64)).astype(np.float32)
    a, _ = m(x, x, x, need_weights=False, is_causal=True)
    b, _ = m(x, x, x, need_weights=False, is_causal=True)  # the kept block
    mha.release_scratch()
    mha.release_scratch()  # (nothing kept: nothing to do)
    c, _ = m(x, x, x, need_weights=False, is_causal=True)
    assert np.array_equal(a, b) and np.array_equal(a, c)


@pytest.mark.parametrize("L", [10, 40])  # the decode path (T <= 16) and a prefill
def test_cache_attend_logit_options(L):
    """KVCache.attend with soft cap, ALiBi (the paper's slopes and given
    ones) and sinks: the causal scaled_dot_product_attention's numbers."""
    g = np.random.default_rng(L)
    B, Hkv, H, D = 1, 2, 4, 16
    k = g.normal(size=(B, Hkv, L, D)).astype(np.float32)
    v = g.normal(size=(B, Hkv, L, D)).astype(np.float32)
    q = g.normal(size=(B, H, L, D)).astype(np.float32)
    c = mha.KVCache(B, Hkv, D, capacity=L)
    c.append(k, v)
    paper = 2.0 ** (-8.0 * np.arange(1, H + 1) / H)  # H a power of 2
    for opts in ({"softcap": 1.5}, {"alibi": True}, {"alibi_slopes": np.float32([.1, .2, .3, .4])},
                 {"sinks": np.float32([0.5, -1.0, 2.0, 0.0])}):
        got = c.attend(q, **opts)
        sd = dict(opts)
        if sd.pop("alibi", False):
            sd["alibi_slopes"] = paper.astype(np.float32)
        want = mha.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, **sd)
        err = np.abs(got - want).max()
        assert err <= 1e-5 * (1 + np.abs(want).max()), (opts, err)
    with pytest.raises(ValueError, match="dropout"):
        c._c.attend(q, mha._alloc, dropout_p=0.5)

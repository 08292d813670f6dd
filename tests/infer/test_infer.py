#!/usr/bin/python3
"""test_infer.py: the inference API (RoPE, grouped-query mha_sdpa, the KV
cache) against PyTorch 1.13 written from the papers' formulas.

Loads libmha with ctypes. References are computed in float64 with torch:
  RoPE          rotate_half (GPT-NeoX / Hugging Face Llama) and interleaved
                pairs (RoFormer / GPT-J), theta, partial rotary, per-batch
                position offsets; the inverse rotation undoes it
  GQA / MQA     mha_sdpa (reference and fused) with Hkv dividing H against
                softmax(q k^T / sqrt(d)) v with k, v repeat_interleave'd
  sdpa backward mha_sdpa_backward (reference and fused): dq, dk, dv against
                torch.autograd through softmax(scale q k^T + mask) v, GQA,
                causal with L != S, windows, bool and float masks broadcast
                from (L, S) or (1, H, L, S), key padding, custom scale
  sdpa dropout  mha_sdpa (out, weights) and mha_sdpa_backward with dropout_p
                (reference and fused) against torch with the same keep mask,
                rebuilt here from mha.h's documented Philox4x32-10 rule
                (itself checked against mha_philox4x32_10 and Random123's
                known answer)
  KV cache      random chunk schedules (decode: 1..16 queries, split-KV;
                prefill chunks: > 16, flash) with per-sequence counts,
                windows, GQA: every chunk's output against full causal
                attention at the same positions; truncate then re-decode
                gives the same bits; a full cache refuses an append and keeps
                its lengths

Tolerance, per output tensor (the project's rule; torch32 is the same
formula in float32):
    max|ours - ref64| <= max(4 * max|torch32 - ref64|, 4e-6 * (1 + max|ref64|))

Usage: /usr/bin/python3 tests/infer/test_infer.py --lib build/libmha.so [-v]
Before its last line it states the worst err/tol of that rule, "infer: worst
error/bound R (CHECK)", and of the narrow caches' bounds (bf16, f16, int8,
int4 against a float32 cache). Ends with "N passed, M failed"; exits 1 when
anything failed.
"""

import argparse
import ctypes as C
import math
import os
import sys

try:
    import numpy as np
    import torch
except Exception as exc:  # pragma: no cover - environment problem
    print("test_infer: cannot import torch/numpy (%s: %s)" % (type(exc).__name__, exc))
    print("0 passed, 1 failed")
    sys.exit(1)

# The floor of the rule: FLOOR * (1 + max|ref64|).
FLOOR = 4e-6

MAX_DIMS = 8
F32, BOOL, F64 = 0, 3, 7
IMPL_AUTO, IMPL_REFERENCE, IMPL_FUSED = 0, 1, 2
ROPE_NEOX, ROPE_INTERLEAVED = 1, 2


class Tensor(C.Structure):
    __slots__ = ()  # (a misspelt field is an error, not a new attribute)
    _fields_ = [("data", C.c_void_p), ("dtype", C.c_int), ("ndim", C.c_int),
                ("shape", C.c_int64 * MAX_DIMS), ("stride", C.c_int64 * MAX_DIMS)]


class Rope(C.Structure):
    __slots__ = ()  # (a misspelt field is an error, not a new attribute)
    _fields_ = [("mode", C.c_int), ("theta", C.c_double), ("dim", C.c_int64)]


class AttnOpts(C.Structure):  # mha_attn_opts
    __slots__ = ()  # (a misspelt field is an error, not a new attribute)
    _fields_ = [("is_causal", C.c_bool), ("window_left", C.c_int64),
                ("window_right", C.c_int64), ("scale", C.c_double), ("softcap", C.c_float),
                ("alibi", C.c_bool), ("alibi_slopes", C.POINTER(C.c_float)),
                ("sinks", C.POINTER(C.c_float)), ("sink_tokens", C.c_int64),
                ("dropout_p", C.c_float), ("dropout_seed", C.c_uint64),
                ("dropout_offset", C.c_uint64)]


class SdpaArgs(C.Structure):
    __slots__ = ()  # (a misspelt field is an error, not a new attribute)
    _fields_ = [("q", C.POINTER(Tensor)), ("k", C.POINTER(Tensor)),
                ("v", C.POINTER(Tensor)), ("attn_mask", C.POINTER(Tensor)),
                ("key_padding_mask", C.POINTER(Tensor)), ("opts", AttnOpts),
                ("impl", C.c_int), ("save", C.c_void_p)]


class VarlenArgs(C.Structure):
    __slots__ = ()  # (a misspelt field is an error, not a new attribute)
    _fields_ = [("cu_seqlens_q", C.POINTER(C.c_int64)), ("cu_seqlens_k", C.POINTER(C.c_int64)),
                ("num_seqs", C.c_int64), ("opts", AttnOpts)]


class AttendArgs(C.Structure):
    __slots__ = ()  # (a misspelt field is an error, not a new attribute)
    _fields_ = [("opts", AttnOpts), ("sink_q", C.POINTER(Tensor))]


def tensor(a):
    """A view of numpy array a (kept alive by the caller)."""
    t = Tensor()
    t.data = a.ctypes.data
    t.dtype = F64 if a.dtype == np.float64 else F32
    t.ndim = a.ndim
    for i in range(a.ndim):
        t.shape[i] = a.shape[i]
        t.stride[i] = a.strides[i] // a.itemsize
    return t


class Lib:
    def __init__(self, path):
        L = C.CDLL(path)
        L.mha_last_error.restype = C.c_char_p
        L.mha_rope_apply.argtypes = [C.POINTER(Tensor), C.POINTER(Rope), C.c_void_p,
                                     C.POINTER(C.c_int64), C.POINTER(C.c_int64),
                                     C.c_int64, C.c_bool]
        L.mha_sdpa_args_init.argtypes = [C.POINTER(SdpaArgs)]
        L.mha_sdpa.argtypes = [C.POINTER(Tensor), C.POINTER(Tensor), C.POINTER(SdpaArgs)]
        L.mha_sdpa_backward.argtypes = ([C.POINTER(Tensor)] * 3 + [C.POINTER(C.c_float)] +
                                        [C.POINTER(Tensor), C.POINTER(SdpaArgs)])
        L.mha_philox4x32_10.argtypes = [C.POINTER(C.c_uint32)] * 3
        L.mha_kv_cache_create.argtypes = [C.POINTER(C.c_void_p)] + [C.c_int64] * 5 + [C.c_int]
        L.mha_kv_cache_bytes.argtypes = [C.c_void_p]
        L.mha_kv_cache_bytes.restype = C.c_size_t
        L.mha_kv_cache_destroy.argtypes = [C.c_void_p]
        L.mha_kv_cache_length.argtypes = [C.c_void_p, C.c_int64]
        L.mha_kv_cache_length.restype = C.c_int64
        L.mha_kv_cache_append.argtypes = [C.c_void_p, C.POINTER(Tensor), C.POINTER(Tensor),
                                          C.POINTER(C.c_int64)]
        L.mha_kv_cache_truncate.argtypes = [C.c_void_p, C.c_int64, C.c_int64]
        L.mha_cache_attend_args_init.argtypes = [C.POINTER(AttendArgs)]
        L.mha_kv_cache_attend.argtypes = [C.POINTER(Tensor), C.POINTER(Tensor), C.c_void_p,
                                          C.POINTER(AttendArgs), C.POINTER(C.c_int64)]
        L.mha_varlen_args_init.argtypes = [C.POINTER(VarlenArgs)]
        L.mha_sdpa_varlen.argtypes = [C.POINTER(Tensor)] * 4 + [C.POINTER(VarlenArgs)]
        self.L = L

    def err(self):
        return self.L.mha_last_error().decode()


class Checker:
    def __init__(self, verbose):
        self.passed = self.failed = 0
        self.verbose = verbose
        self.worst = {}  # kind -> (err / bound, what)

    def note(self, kind, ratio, what):
        if ratio != ratio:  # NaN
            ratio = float("inf")
        if kind not in self.worst or ratio > self.worst[kind][0]:
            self.worst[kind] = (ratio, what)

    def check(self, ok, what):
        if ok:
            self.passed += 1
            if self.verbose:
                print("ok   " + what)
        else:
            self.failed += 1
            print("FAIL " + what)

    def close(self, what, ours, ref64, t32):
        ours = np.asarray(ours, dtype=np.float64)
        ref64 = np.asarray(ref64, dtype=np.float64)
        t32 = np.asarray(t32, dtype=np.float64)
        if ref64.size == 0:
            self.check(ours.size == 0, what)
            return
        err = float(np.max(np.abs(ours - ref64)))
        tol = max(4.0 * float(np.max(np.abs(t32 - ref64))),
                  FLOOR * (1.0 + float(np.max(np.abs(ref64)))))
        self.note("rule", err / tol, what)
        self.check(err <= tol, "%s: err %.3g tol %.3g" % (what, err, tol))


# ---------------------------------------------------------------------------
# References (torch, any dtype)

def rope_ref(x, mode, theta, dim, start):
    """x (B, H, T, D) torch tensor; positions start[b] + t."""
    B, H, T, D = x.shape
    dim = D if dim == 0 else dim
    half = dim // 2
    i = torch.arange(half, dtype=torch.float64)
    inv = theta ** (-2.0 * i / dim)
    pos = torch.tensor([[start[b] + t for t in range(T)] for b in range(B)],
                       dtype=torch.float64)
    ang = pos[:, :, None] * inv[None, None, :]                  # (B, T, half)
    cos, sin = ang.cos().to(x.dtype)[:, None], ang.sin().to(x.dtype)[:, None]
    out = x.clone()
    if mode == ROPE_NEOX:
        # rotate_half: cat(-x2, x1); q * cat(cos, cos) + rotate_half(q) * cat(sin, sin)
        x1, x2 = x[..., :half], x[..., half:dim]
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half:dim] = x2 * cos + x1 * sin
    else:
        xe, xo = x[..., 0:dim:2], x[..., 1:dim:2]
        out[..., 0:dim:2] = xe * cos - xo * sin
        out[..., 1:dim:2] = xo * cos + xe * sin
    return out


def attention_ref(q, k, v, pos, window=(-1, -1), scale=None):
    """q (H, T, D) at positions pos (T), k (Hkv, S, D), v (Hkv, S, Dv):
    causal (key j <= position), window, GQA by repeat_interleave."""
    H, Hkv = q.shape[0], k.shape[0]
    k = k.repeat_interleave(H // Hkv, dim=0)
    v = v.repeat_interleave(H // Hkv, dim=0)
    S = k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    j = torch.arange(S)[None, :]
    p = torch.tensor(pos)[:, None]
    hide = j > p
    if window[0] >= 0:
        hide = hide | (j < p - window[0])
    if window[1] >= 0:
        hide = hide | (j > p + window[1])
    s = s.masked_fill(hide[None], float("-inf"))
    w = torch.softmax(s, dim=-1)
    w = torch.nan_to_num(w, nan=0.0)
    return torch.matmul(w, v)


# ---------------------------------------------------------------------------
# Tests

def test_rope(lib, ck, rng):
    for case in range(40):
        B, H, T = int(rng.integers(1, 3)), int(rng.integers(1, 4)), int(rng.integers(1, 9))
        D = int(rng.choice([2, 4, 8, 16, 64, 80]))
        dim = int(rng.choice([0, D, 2 * int(rng.integers(1, D // 2 + 1))]))
        mode = ROPE_NEOX if case % 2 == 0 else ROPE_INTERLEAVED
        theta = float(rng.choice([10000.0, 500000.0, 100.0]))
        start = [int(rng.integers(0, 5000)) for _ in range(B)]
        x = rng.standard_normal((B, H, T, D)).astype(np.float32)
        ours = x.copy()
        t = tensor(ours)
        r = Rope(mode, theta, dim)
        st_arr = (C.c_int64 * B)(*start)
        rc = lib.L.mha_rope_apply(C.byref(t), C.byref(r), None, st_arr, None, 0, False)
        ck.check(rc == 0, "rope %d: status %d %s" % (case, rc, lib.err() if rc else ""))
        xt = torch.from_numpy(x)
        ref64 = rope_ref(xt.double(), mode, theta, dim, start).numpy()
        t32 = rope_ref(xt, mode, theta, dim, start).numpy()
        ck.close("rope %d (%s D %d dim %d theta %g)" % (case, "neox" if mode == 1 else "interleaved",
                                                       D, dim, theta), ours, ref64, t32)
        back = ours.copy()
        tb = tensor(back)
        lib.L.mha_rope_apply(C.byref(tb), C.byref(r), None, st_arr, None, 0, True)
        ck.check(np.max(np.abs(back - x)) <= 1e-5 * (1 + np.max(np.abs(x))),
                 "rope %d: inverse undoes the rotation" % case)
    # errors: odd dims, dims beyond D
    x = np.zeros((1, 1, 1, 8), dtype=np.float32)
    t = tensor(x)
    for dim in (3, 10):
        r = Rope(ROPE_NEOX, 10000.0, dim)
        rc = lib.L.mha_rope_apply(C.byref(t), C.byref(r), None, None, None, 0, False)
        ck.check(rc != 0 and "rope" in lib.err(), "rope dim %d refused: %s" % (dim, lib.err()))


def test_gqa(lib, ck, rng):
    for case in range(30):
        B, Hkv = int(rng.integers(1, 3)), int(rng.choice([1, 2, 3]))
        H = Hkv * int(rng.choice([1, 2, 4]))
        L, S, D = int(rng.integers(1, 150)), int(rng.integers(1, 150)), int(rng.choice([8, 16, 64]))
        causal = bool(case % 2)
        q = rng.standard_normal((B, H, L, D)).astype(np.float32)
        k = rng.standard_normal((B, Hkv, S, D)).astype(np.float32)
        v = rng.standard_normal((B, Hkv, S, D)).astype(np.float32)
        for impl in (IMPL_REFERENCE, IMPL_FUSED):
            out = np.zeros((B, H, L, D), dtype=np.float32)
            tq, tk, tv, to = tensor(q), tensor(k), tensor(v), tensor(out)
            a = SdpaArgs()
            lib.L.mha_sdpa_args_init(C.byref(a))
            a.q, a.k, a.v = C.pointer(tq), C.pointer(tk), C.pointer(tv)
            a.opts.is_causal = causal
            a.impl = impl
            rc = lib.L.mha_sdpa(C.byref(to), None, C.byref(a))
            ck.check(rc == 0, "gqa %d: status %d %s" % (case, rc, lib.err() if rc else ""))
            refs = []
            for dt in (torch.float64, torch.float32):
                rows = []
                for b in range(B):
                    pos = list(range(L)) if causal else [10 ** 9] * L
                    rows.append(attention_ref(torch.from_numpy(q[b]).to(dt),
                                              torch.from_numpy(k[b]).to(dt),
                                              torch.from_numpy(v[b]).to(dt), pos).numpy())
                refs.append(np.stack(rows))
            ck.close("gqa %d %s (B %d H %d Hkv %d L %d S %d D %d causal %d)"
                     % (case, "reference" if impl == IMPL_REFERENCE else "fused", B, H, Hkv,
                        L, S, D, causal), out, refs[0], refs[1])
    # Hkv not dividing H: an error naming the shapes
    q = np.zeros((1, 3, 2, 4), dtype=np.float32)
    k = np.zeros((1, 2, 2, 4), dtype=np.float32)
    out = np.zeros((1, 3, 2, 4), dtype=np.float32)
    tq, tk, to = tensor(q), tensor(k), tensor(out)
    a = SdpaArgs()
    lib.L.mha_sdpa_args_init(C.byref(a))
    a.q, a.k, a.v = C.pointer(tq), C.pointer(tk), C.pointer(tk)
    rc = lib.L.mha_sdpa(C.byref(to), None, C.byref(a))
    ck.check(rc != 0 and "Hkv" in lib.err(), "gqa: 3 heads over 2 KV heads refused")



def sdpa_grad_ref(q, k, v, dout, allowed, scale, dt):
    """dq, dk, dv of sum(out * dout), out = softmax(scale q k^T + bias) v in
    dtype dt (torch autograd), k and v repeat_interleave'd over the group;
    allowed: the additive mask (0 or -inf, or float values) (B|1, H, L, S)."""
    G = q.shape[1] // k.shape[1]
    tq, tk, tv = (torch.tensor(x, dtype=dt, requires_grad=True) for x in (q, k, v))
    kk, vv = tk.repeat_interleave(G, dim=1), tv.repeat_interleave(G, dim=1)
    s = scale * tq @ kk.transpose(-1, -2) + torch.tensor(allowed, dtype=dt)
    out = torch.softmax(s, dim=-1) @ vv
    (out * torch.tensor(dout, dtype=dt)).sum().backward()
    return tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()


def test_sdpa_backward(lib, ck, rng):
    for case in range(40):
        B, Hkv = int(rng.integers(1, 3)), int(rng.choice([1, 2, 3]))
        H = Hkv * int(rng.choice([1, 2, 3]))
        L, S = int(rng.integers(1, 90)), int(rng.integers(1, 90))
        D = int(rng.choice([4, 8, 16, 64]))
        Dv = D if case % 3 else int(rng.choice([4, 8, 16]))
        causal, custom = bool(case % 2), case % 4 == 3
        wl = int(rng.integers(0, 10)) if case % 5 == 2 else -1
        wr = int(rng.integers(0, 10)) if case % 7 == 4 else -1
        scale = 0.3 if custom else 1.0 / math.sqrt(D)
        q = rng.standard_normal((B, H, L, D)).astype(np.float32)
        k = rng.standard_normal((B, Hkv, S, D)).astype(np.float32)
        v = rng.standard_normal((B, Hkv, S, Dv)).astype(np.float32)
        dout = rng.standard_normal((B, H, L, Dv)).astype(np.float32)
        # the mask as mha reads it, and the same as an additive bias
        bias = np.zeros((B, H, L, S))
        i = np.arange(L)[:, None]
        j = np.arange(S)[None, :]
        hidden = np.zeros((L, S), dtype=bool)
        if causal:
            hidden |= j > i
        if wl >= 0:
            hidden |= j < i - wl
        if wr >= 0:
            hidden |= j > i + wr
        am = kpm = None
        kind = case % 4
        if kind == 1:  # bool (L, S): True hides
            am = rng.random((L, S)) < 0.2
            hidden = hidden | am
        elif kind == 2:  # float (1, H, L, S), added
            am = (0.5 * rng.standard_normal((1, H, L, S))).astype(np.float32)
            bias += am
        if case % 3 == 1:
            kpm = rng.random((B, S)) < 0.2
            bias[np.broadcast_to(kpm[:, None, None, :], bias.shape)] = -np.inf
        bias[np.broadcast_to(hidden, bias.shape)] = -np.inf
        # a row with no visible key: mha's rule is a zero gradient through it
        # (softmax would give NaN); its dout is 0 for both, its bias 0 for torch
        full = np.isinf(bias).all(axis=-1)
        bias[full] = 0.0
        dout[full] = 0.0
        refs = [sdpa_grad_ref(q, k, v, dout, bias, scale, dt) for dt in (torch.float64, torch.float32)]
        tq, tk, tv, tdo = tensor(q), tensor(k), tensor(v), tensor(dout)
        keep = [am, kpm]
        tam = tkpm = None
        if am is not None:
            amc = np.ascontiguousarray(am if am.dtype != bool else am.astype(np.uint8))
            keep.append(amc)
            tam = tensor(amc)
            if am.dtype == bool:
                tam.dtype = BOOL
        if kpm is not None:
            kpc = np.ascontiguousarray(kpm.astype(np.uint8))
            keep.append(kpc)
            tkpm = tensor(kpc)
            tkpm.dtype = BOOL
        for impl in (IMPL_REFERENCE, IMPL_FUSED):
            dq = np.zeros_like(q)
            dk = np.zeros_like(k)
            dv = np.zeros_like(v)
            tdq, tdk, tdv = tensor(dq), tensor(dk), tensor(dv)
            a = SdpaArgs()
            lib.L.mha_sdpa_args_init(C.byref(a))
            a.q, a.k, a.v = C.pointer(tq), C.pointer(tk), C.pointer(tv)
            a.attn_mask = C.pointer(tam) if tam is not None else None
            a.key_padding_mask = C.pointer(tkpm) if tkpm is not None else None
            a.opts.is_causal, a.opts.window_left, a.opts.window_right = causal, wl, wr
            a.opts.scale = scale if custom else 0.0
            a.impl = impl
            rc = lib.L.mha_sdpa_backward(C.byref(tdq), C.byref(tdk), C.byref(tdv), None,
                                         C.byref(tdo), C.byref(a))
            what = "sdpa backward %d %s (B %d H %d Hkv %d L %d S %d D %d Dv %d causal %d window %d/%d mask %d kpm %d)" % (
                case, "reference" if impl == IMPL_REFERENCE else "fused", B, H, Hkv, L, S, D, Dv,
                causal, wl, wr, kind, kpm is not None)
            ck.check(rc == 0, "%s: status %d %s" % (what, rc, lib.err() if rc else ""))
            for name, ours, r64, r32 in zip(("dq", "dk", "dv"), (dq, dk, dv), refs[0], refs[1]):
                ck.close(what + " " + name, ours, r64, r32)

PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
U32 = 0xFFFFFFFF


def philox4x32_10(ctr, key):
    """Random123's philox4x32 with 10 rounds on arrays: ctr four uint64
    arrays of 32-bit words, key two ints; returns four arrays."""
    c0, c1, c2, c3 = (np.asarray(x, dtype=np.uint64) for x in ctr)
    k0, k1 = key
    for r in range(10):
        if r > 0:
            k0, k1 = (k0 + PHILOX_W0) & U32, (k1 + PHILOX_W1) & U32
        p0 = np.uint64(PHILOX_M0) * c0
        p1 = np.uint64(PHILOX_M1) * c2
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ np.uint64(k0), p1 & np.uint64(U32),
                          (p0 >> np.uint64(32)) ^ c3 ^ np.uint64(k1), p0 & np.uint64(U32))
    return c0, c1, c2, c3


def dropout_keep(shape, p, seed, offset):
    """The keep mask (B, H, L, S) of mha.h's rule: element idx = ((b H + h)
    L + i) S + j kept iff (r >> 8) 2^-24 >= p, r = word idx % 4 of
    philox(ctr {lo, hi of idx / 4, lo, hi of offset}, key {lo, hi of seed})."""
    idx = np.arange(int(np.prod(shape)), dtype=np.uint64)
    blk = idx // np.uint64(4)
    n = idx.size
    words = philox4x32_10((blk & np.uint64(U32), blk >> np.uint64(32),
                           np.full(n, offset & U32, dtype=np.uint64),
                           np.full(n, offset >> 32, dtype=np.uint64)),
                          (seed & U32, seed >> 32))
    r = np.choose((idx % np.uint64(4)).astype(np.int64), words)
    u = (r >> np.uint64(8)).astype(np.float64) * 2.0 ** -24
    return (u >= float(np.float32(p))).reshape(shape)


def lib_philox(lib, ctr, key):
    out = (C.c_uint32 * 4)()
    c = (C.c_uint32 * 4)(*ctr)
    k = (C.c_uint32 * 2)(*key)
    lib.L.mha_philox4x32_10(out, c, k)
    return list(out)


def sdpa_dropout_ref(q, k, v, dout, bias, full, keep, p, scale, dt):
    """out, weights and dq, dk, dv of sum(out * dout) with out = P' v,
    P' = softmax(scale q k^T + bias) * keep / (1 - p) (rows in full: 0), in
    dtype dt (torch autograd), k and v repeat_interleave'd over the group."""
    G = q.shape[1] // k.shape[1]
    tq, tk, tv = (torch.tensor(x, dtype=dt, requires_grad=True) for x in (q, k, v))
    kk, vv = tk.repeat_interleave(G, dim=1), tv.repeat_interleave(G, dim=1)
    s = scale * tq @ kk.transpose(-1, -2) + torch.tensor(bias, dtype=dt)
    factor = keep * (~full)[..., None] / (1.0 - float(np.float32(p)))
    w = torch.softmax(s, dim=-1) * torch.tensor(factor, dtype=dt)
    out = w @ vv
    (out * torch.tensor(dout, dtype=dt)).sum().backward()
    return (out.detach().numpy(), w.detach().numpy(), tq.grad.numpy(), tk.grad.numpy(),
            tv.grad.numpy())


def test_sdpa_dropout(lib, ck, rng):
    # the Python Philox against Random123's known answer and mha's
    kat = [int(w) for w in np.array(philox4x32_10(([0x243f6a88], [0x85a308d3], [0x13198a2e],
                                                    [0x03707344]), (0xa4093822, 0x299f31d0)))[:, 0]]
    ck.check(kat == [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1],
             "philox (Python) vs Random123's known answer: %s" % [hex(w) for w in kat])
    for t in range(20):
        ctr = [int(x) for x in rng.integers(0, 2 ** 32, 4)]
        key = [int(x) for x in rng.integers(0, 2 ** 32, 2)]
        mine = [int(w[0]) for w in philox4x32_10(tuple([c] for c in ctr), tuple(key))]
        ck.check(mine == lib_philox(lib, ctr, key), "philox (Python) vs mha_philox4x32_10 %d" % t)
    for case in range(16):
        B, Hkv = int(rng.integers(1, 3)), int(rng.choice([1, 2]))
        H = Hkv * int(rng.choice([1, 2, 3]))
        L, S = int(rng.integers(1, 80)), int(rng.integers(1, 150))
        D = int(rng.choice([4, 8, 16, 64]))
        Dv = D if case % 3 else int(rng.choice([4, 8, 16]))
        causal, custom = bool(case % 2), case % 4 == 3
        p = float(rng.choice([0.1, 0.3, 0.5, 0.8]))
        seed, offset = int(rng.integers(0, 2 ** 63)), int(rng.integers(0, 2 ** 40))
        scale = 0.3 if custom else 1.0 / math.sqrt(D)
        q = rng.standard_normal((B, H, L, D)).astype(np.float32)
        k = rng.standard_normal((B, Hkv, S, D)).astype(np.float32)
        v = rng.standard_normal((B, Hkv, S, Dv)).astype(np.float32)
        dout = rng.standard_normal((B, H, L, Dv)).astype(np.float32)
        bias = np.zeros((B, H, L, S))
        if causal:
            bias[..., np.arange(S)[None, :] > np.arange(L)[:, None]] = -np.inf
        kpm = rng.random((B, S)) < 0.2 if case % 3 == 1 else None
        if kpm is not None:
            bias[np.broadcast_to(kpm[:, None, None, :], bias.shape)] = -np.inf
        full = np.isinf(bias).all(axis=-1)  # no visible key: mha gives 0
        bias[full] = 0.0
        keep = dropout_keep((B, H, L, S), p, seed, offset)
        refs = [sdpa_dropout_ref(q, k, v, dout, bias, full, keep, p, scale, dt)
                for dt in (torch.float64, torch.float32)]
        tq, tk, tv, tdo = tensor(q), tensor(k), tensor(v), tensor(dout)
        tkpm = None
        if kpm is not None:
            kpc = np.ascontiguousarray(kpm.astype(np.uint8))
            tkpm = tensor(kpc)
            tkpm.dtype = BOOL
        for impl in (IMPL_REFERENCE, IMPL_FUSED):
            a = SdpaArgs()
            lib.L.mha_sdpa_args_init(C.byref(a))
            a.q, a.k, a.v = C.pointer(tq), C.pointer(tk), C.pointer(tv)
            a.key_padding_mask = C.pointer(tkpm) if tkpm is not None else None
            a.opts.is_causal = causal
            a.opts.scale = scale if custom else 0.0
            a.impl = impl
            a.opts.dropout_p, a.opts.dropout_seed, a.opts.dropout_offset = p, seed, offset
            out = np.zeros((B, H, L, Dv), dtype=np.float32)
            w = np.zeros((B, H, L, S), dtype=np.float32)
            to, tw = tensor(out), tensor(w)
            rc = lib.L.mha_sdpa(C.byref(to), C.byref(tw), C.byref(a))
            dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
            tdq, tdk, tdv = tensor(dq), tensor(dk), tensor(dv)
            rc = rc or lib.L.mha_sdpa_backward(C.byref(tdq), C.byref(tdk), C.byref(tdv), None,
                                               C.byref(tdo), C.byref(a))
            what = "sdpa dropout %d %s (B %d H %d Hkv %d L %d S %d D %d Dv %d causal %d kpm %d p %g)" % (
                case, "reference" if impl == IMPL_REFERENCE else "fused", B, H, Hkv, L, S, D, Dv,
                causal, kpm is not None, p)
            ck.check(rc == 0, "%s: status %d %s" % (what, rc, lib.err() if rc else ""))
            for name, ours, r64, r32 in zip(("out", "weights", "dq", "dk", "dv"),
                                            (out, w, dq, dk, dv), refs[0], refs[1]):
                ck.close(what + " " + name, ours, r64, r32)


def test_cache(lib, ck, rng, cases):
    for case in range(cases):
        B, Hkv = int(rng.integers(1, 3)), int(rng.choice([1, 2]))
        G = int(rng.choice([1, 2, 3]))
        H, D, Dv = Hkv * G, int(rng.choice([8, 16, 64])), int(rng.choice([8, 16, 64]))
        total = int(rng.integers(1, 1400))
        cap = total + int(rng.integers(0, 5))
        window = (-1, -1)
        if rng.random() < 0.3:
            window = (int(rng.choice([0, 3, 40, 600])), -1)
        # the same token stream for every sequence, chunks of random sizes
        K = rng.standard_normal((B, Hkv, total, D)).astype(np.float32)
        V = rng.standard_normal((B, Hkv, total, Dv)).astype(np.float32)
        Q = rng.standard_normal((B, H, total, D)).astype(np.float32)
        cache = C.c_void_p()
        rc = lib.L.mha_kv_cache_create(C.byref(cache), B, Hkv, D, Dv, cap, 0)
        ck.check(rc == 0, "cache %d: create %s" % (case, lib.err() if rc else ""))
        sched = []
        n = 0
        while n < total:
            x = rng.random()
            T = 1 if x < 0.4 else int(rng.integers(2, 17)) if x < 0.7 else int(rng.integers(17, 300))
            T = min(T, total - n)
            sched.append((n, T))
            n += T
        args = AttendArgs()
        lib.L.mha_cache_attend_args_init(C.byref(args))
        args.opts.window_left, args.opts.window_right = window
        outs = np.zeros((B, H, total, Dv), dtype=np.float32)
        bad_status = 0
        for (n0, T) in sched:
            k = np.ascontiguousarray(K[:, :, n0:n0 + T])
            v = np.ascontiguousarray(V[:, :, n0:n0 + T])
            q = np.ascontiguousarray(Q[:, :, n0:n0 + T])
            o = np.zeros((B, H, T, Dv), dtype=np.float32)
            tk, tv, tq, to = tensor(k), tensor(v), tensor(q), tensor(o)
            rc1 = lib.L.mha_kv_cache_append(cache, C.byref(tk), C.byref(tv), None)
            rc2 = lib.L.mha_kv_cache_attend(C.byref(to), C.byref(tq), cache, C.byref(args), None)
            bad_status += (rc1 != 0) + (rc2 != 0)
            outs[:, :, n0:n0 + T] = o
        ck.check(bad_status == 0, "cache %d: append/attend statuses %s" % (case, lib.err()))
        refs = []
        for dt in (torch.float64, torch.float32):
            rows = [attention_ref(torch.from_numpy(Q[b]).to(dt), torch.from_numpy(K[b]).to(dt),
                                  torch.from_numpy(V[b]).to(dt), list(range(total)), window).numpy()
                    for b in range(B)]
            refs.append(np.stack(rows))
        ck.close("cache %d (B %d H %d Hkv %d D %d Dv %d tokens %d chunks %d window %s)"
                 % (case, B, H, Hkv, D, Dv, total, len(sched), window), outs, refs[0], refs[1])
        # rollback to a random length, re-decode the rest one token at a time:
        # the same bits as the first pass's one-token steps
        if total > 2:
            cut = int(rng.integers(1, total))
            rc = lib.L.mha_kv_cache_truncate(cache, -1, cut)
            ck.check(rc == 0 and lib.L.mha_kv_cache_length(cache, 0) == cut,
                     "cache %d: truncate to %d" % (case, cut))
            same = True
            first = {}
            for (n0, T) in sched:
                if T == 1:
                    first[n0] = outs[:, :, n0]
            for n0 in range(cut, total):
                k = np.ascontiguousarray(K[:, :, n0:n0 + 1])
                v = np.ascontiguousarray(V[:, :, n0:n0 + 1])
                q = np.ascontiguousarray(Q[:, :, n0:n0 + 1])
                o = np.zeros((B, H, 1, Dv), dtype=np.float32)
                tk, tv, tq, to = tensor(k), tensor(v), tensor(q), tensor(o)
                lib.L.mha_kv_cache_append(cache, C.byref(tk), C.byref(tv), None)
                lib.L.mha_kv_cache_attend(C.byref(to), C.byref(tq), cache, C.byref(args), None)
                if n0 in first and not np.array_equal(first[n0], o[:, :, 0]):
                    same = False
            ck.check(same, "cache %d: rollback to %d and re-decode gives the same bits" % (case, cut))
        # full: refused, lengths kept
        before = [lib.L.mha_kv_cache_length(cache, b) for b in range(B)]
        extra = cap - before[0] + 1
        k = np.zeros((B, Hkv, extra, D), dtype=np.float32)
        v = np.zeros((B, Hkv, extra, Dv), dtype=np.float32)
        tk, tv = tensor(k), tensor(v)
        rc = lib.L.mha_kv_cache_append(cache, C.byref(tk), C.byref(tv), None)
        after = [lib.L.mha_kv_cache_length(cache, b) for b in range(B)]
        ck.check(rc != 0 and "full" in lib.err() and before == after,
                 "cache %d: full cache refuses %d tokens (%s)" % (case, extra, lib.err()))
        lib.L.mha_kv_cache_destroy(cache)


def test_counts(lib, ck, rng):
    """Per-sequence counts: sequences of a batch at different lengths."""
    B, Hkv, G, D = 3, 2, 2, 16
    H = Hkv * G
    lens = [5, 40, 700]
    total = max(lens)
    K = rng.standard_normal((B, Hkv, total, D)).astype(np.float32)
    V = rng.standard_normal((B, Hkv, total, D)).astype(np.float32)
    Q = rng.standard_normal((B, H, total, D)).astype(np.float32)
    cache = C.c_void_p()
    lib.L.mha_kv_cache_create(C.byref(cache), B, Hkv, D, D, total, 0)
    # prefill each sequence up to its length minus one (counts), then decode
    # one token for all
    counts = (C.c_int64 * B)(*[l - 1 for l in lens])
    T = total - 1
    k, v, q = (np.ascontiguousarray(X[:, :, :T]) for X in (K, V, Q))
    o = np.zeros((B, H, T, D), dtype=np.float32)
    tk, tv, tq, to = tensor(k), tensor(v), tensor(q), tensor(o)
    rc = lib.L.mha_kv_cache_append(cache, C.byref(tk), C.byref(tv), counts)
    rc |= lib.L.mha_kv_cache_attend(C.byref(to), C.byref(tq), cache, None, counts)
    ck.check(rc == 0, "counts: prefill statuses (%s)" % lib.err())
    for b in range(B):
        ref = attention_ref(torch.from_numpy(Q[b, :, :lens[b] - 1]).double(),
                            torch.from_numpy(K[b, :, :lens[b] - 1]).double(),
                            torch.from_numpy(V[b, :, :lens[b] - 1]).double(),
                            list(range(lens[b] - 1))).numpy()
        t32 = attention_ref(torch.from_numpy(Q[b, :, :lens[b] - 1]),
                            torch.from_numpy(K[b, :, :lens[b] - 1]),
                            torch.from_numpy(V[b, :, :lens[b] - 1]), list(range(lens[b] - 1))).numpy()
        ck.close("counts: prefill of sequence %d (%d tokens)" % (b, lens[b] - 1),
                 o[b, :, :lens[b] - 1], ref, t32)
        ck.check(np.all(o[b, :, lens[b] - 1:] == 0), "counts: padding rows of sequence %d are 0" % b)
    # one more token each: token lens[b]-1 of each sequence
    k1 = np.ascontiguousarray(np.stack([K[b, :, lens[b] - 1:lens[b]] for b in range(B)]))
    v1 = np.ascontiguousarray(np.stack([V[b, :, lens[b] - 1:lens[b]] for b in range(B)]))
    q1 = np.ascontiguousarray(np.stack([Q[b, :, lens[b] - 1:lens[b]] for b in range(B)]))
    o1 = np.zeros((B, H, 1, D), dtype=np.float32)
    tk, tv, tq, to = tensor(k1), tensor(v1), tensor(q1), tensor(o1)
    rc = lib.L.mha_kv_cache_append(cache, C.byref(tk), C.byref(tv), None)
    rc |= lib.L.mha_kv_cache_attend(C.byref(to), C.byref(tq), cache, None, None)
    ck.check(rc == 0, "counts: decode statuses")
    for b in range(B):
        full = [attention_ref(torch.from_numpy(Q[b, :, :lens[b]]).to(dt),
                              torch.from_numpy(K[b, :, :lens[b]]).to(dt),
                              torch.from_numpy(V[b, :, :lens[b]]).to(dt),
                              list(range(lens[b]))).numpy()[:, -1] for dt in (torch.float64, torch.float32)]
        ck.close("counts: decode of sequence %d at position %d" % (b, lens[b] - 1),
                 o1[b, :, 0], full[0], full[1])
    lib.L.mha_kv_cache_destroy(cache)


def test_threads(lib, ck, rng):
    """Decode (split-KV) and prefill over a long cache: the same bits with
    1, 2 and 8 OpenMP threads."""
    try:
        gomp = C.CDLL("libgomp.so.1")
    except OSError:  # (a skip; under CI=true, where the install has it, a failure)
        ck.check(os.environ.get("CI") != "true", "threads: no libgomp, skipped")
        return
    B, Hkv, G, D, n = 1, 2, 3, 64, 5000
    H = Hkv * G
    K = rng.standard_normal((B, Hkv, n, D)).astype(np.float32)
    V = rng.standard_normal((B, Hkv, n, D)).astype(np.float32)
    Q = rng.standard_normal((B, H, 40, D)).astype(np.float32)
    cache = C.c_void_p()
    lib.L.mha_kv_cache_create(C.byref(cache), B, Hkv, D, D, n, 0)
    tk, tv = tensor(K), tensor(V)
    lib.L.mha_kv_cache_append(cache, C.byref(tk), C.byref(tv), None)
    results = []
    for nt in (1, 2, 8):
        gomp.omp_set_num_threads(nt)
        outs = []
        for T in (1, 40):  # decode, prefill-sized chunk (the last T positions)
            q = np.ascontiguousarray(Q[:, :, :T])
            o = np.zeros((B, H, T, D), dtype=np.float32)
            tq, to = tensor(q), tensor(o)
            lib.L.mha_kv_cache_attend(C.byref(to), C.byref(tq), cache, None, None)
            outs.append(o)
        results.append(outs)
    gomp.omp_set_num_threads(2)
    for i, nt in enumerate((2, 8)):
        ck.check(all(np.array_equal(results[0][j], results[i + 1][j]) for j in range(2)),
                 "threads: 1 vs %d threads, same bits (decode and prefill)" % nt)
    lib.L.mha_kv_cache_destroy(cache)


def attention_general(q, k, v, causal, window, slopes, softcap):
    """q (H, L, D), k (Hkv, S, D), v (Hkv, S, Dv): top-left causal/window,
    ALiBi -slope |i - j|, soft cap on the scaled scores; fully masked rows 0."""
    H, Hkv = q.shape[0], k.shape[0]
    k = k.repeat_interleave(H // Hkv, dim=0)
    v = v.repeat_interleave(H // Hkv, dim=0)
    L, S = q.shape[1], k.shape[1]
    s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
    if slopes is not None:
        s = s - torch.tensor(slopes, dtype=s.dtype)[:, None, None] * (i - j).abs().to(s.dtype)
    hide = torch.zeros((L, S), dtype=torch.bool)
    if causal:
        hide = hide | (j > i)
    if window[0] >= 0:
        hide = hide | (j < i - window[0])
    if window[1] >= 0:
        hide = hide | (j > i + window[1])
    s = s.masked_fill(hide[None], float("-inf"))
    w = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    return torch.matmul(w, v)


def test_varlen(lib, ck, rng):
    for case in range(30):
        nseq = int(rng.integers(0, 5))
        Hkv = int(rng.choice([1, 2]))
        H = Hkv * int(rng.choice([1, 2, 3]))
        D, Dv = int(rng.choice([8, 16, 64])), int(rng.choice([8, 32]))
        lq = [int(rng.integers(0, 300)) for _ in range(nseq)]
        lk = lq[:] if rng.random() < 0.6 else [int(rng.integers(0, 300)) for _ in range(nseq)]
        cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int64)
        ckk = np.concatenate([[0], np.cumsum(lk)]).astype(np.int64)
        q = rng.standard_normal((int(cq[-1]), H, D)).astype(np.float32)
        k = rng.standard_normal((int(ckk[-1]), Hkv, D)).astype(np.float32)
        v = rng.standard_normal((int(ckk[-1]), Hkv, Dv)).astype(np.float32)
        out = np.full((int(cq[-1]), H, Dv), np.nan, dtype=np.float32)
        causal = bool(rng.random() < 0.5)
        window = (int(rng.choice([-1, -1, 5, 60])), int(rng.choice([-1, -1, 7])))
        slopes = [float(np.float32(2.0 ** (-(h + 1)))) for h in range(H)] if rng.random() < 0.3 else None
        softcap = float(rng.choice([0.0, 0.0, 3.0]))
        a = VarlenArgs()
        lib.L.mha_varlen_args_init(C.byref(a))
        cq_c = (C.c_int64 * (nseq + 1))(*cq.tolist())
        ck_c = (C.c_int64 * (nseq + 1))(*ckk.tolist())
        a.cu_seqlens_q, a.cu_seqlens_k, a.num_seqs = cq_c, ck_c, nseq
        a.opts.is_causal = causal
        a.opts.window_left, a.opts.window_right = window
        sl = (C.c_float * H)(*slopes) if slopes else None
        if sl is not None:
            a.opts.alibi_slopes = sl
        a.opts.softcap = softcap
        tq, tk, tv, to = tensor(q), tensor(k), tensor(v), tensor(out)
        rc = lib.L.mha_sdpa_varlen(C.byref(to), C.byref(tq), C.byref(tk), C.byref(tv), C.byref(a))
        ck.check(rc == 0, "varlen %d: status %d %s" % (case, rc, lib.err() if rc else ""))
        refs = [np.zeros_like(out, dtype=np.float64), np.zeros_like(out, dtype=np.float64)]
        for b in range(nseq):
            for r, dt in enumerate((torch.float64, torch.float32)):
                if lq[b] == 0:
                    continue
                qq = torch.from_numpy(q[cq[b]:cq[b + 1]]).to(dt).transpose(0, 1)
                kk = torch.from_numpy(k[ckk[b]:ckk[b + 1]]).to(dt).transpose(0, 1)
                vv = torch.from_numpy(v[ckk[b]:ckk[b + 1]]).to(dt).transpose(0, 1)
                o = attention_general(qq, kk, vv, causal, window, slopes, softcap)
                refs[r][cq[b]:cq[b + 1]] = o.transpose(0, 1).numpy()
        ck.close("varlen %d (seqs %s / %s, H %d Hkv %d causal %d window %s alibi %d softcap %g)"
                 % (case, lq, lk, H, Hkv, causal, window, slopes is not None, softcap),
                 out, refs[0], refs[1])
    # offsets that do not add up: refused with the values
    q = np.zeros((4, 1, 8), dtype=np.float32)
    out = np.zeros((4, 1, 8), dtype=np.float32)
    a = VarlenArgs()
    lib.L.mha_varlen_args_init(C.byref(a))
    cu = (C.c_int64 * 3)(0, 3, 5)
    a.cu_seqlens_q = a.cu_seqlens_k = cu
    a.num_seqs = 2
    tq, to = tensor(q), tensor(out)
    rc = lib.L.mha_sdpa_varlen(C.byref(to), C.byref(tq), C.byref(tq), C.byref(tq), C.byref(a))
    ck.check(rc != 0 and "cu_seqlens_q" in lib.err(), "varlen: bad offsets refused (%s)" % lib.err())


def test_cache_dtypes(lib, ck, rng):
    """bf16 / f16 / int8 caches against a float32 cache on the same stream
    (decode steps and prefill chunks): the documented bound
    max|out - out_f32| <= 4 u (1 + max|s|) max|v|; int4 within mha.h's
    bound computed from the data (its maxima taken over every key, a
    superset of each query's: still a bound), plus float32's rounding,
    FLOOR (1 + |out_f32|) per element."""
    units = {1: ("bf16", 2.0 ** -8, 2), 2: ("f16", 2.0 ** -11, 2), 3: ("int8", 1.0 / 127, 1),
             4: ("int4", None, 0.5)}
    for case in range(12):
        B, Hkv, G, D = int(rng.integers(1, 3)), int(rng.choice([1, 2])), int(rng.choice([1, 3])), 64
        H, total = Hkv * G, int(rng.integers(20, 1500))
        K = rng.standard_normal((B, Hkv, total, D)).astype(np.float32)
        V = rng.standard_normal((B, Hkv, total, D)).astype(np.float32)
        Q = rng.standard_normal((B, H, total, D)).astype(np.float32)
        sched, n = [], 0
        while n < total:
            T = min(1 if rng.random() < 0.5 else int(rng.integers(17, 200)), total - n)
            sched.append((n, T))
            n += T
        outs = {}
        for dt in (0, 1, 2, 3, 4):
            cache = C.c_void_p()
            rc = lib.L.mha_kv_cache_create(C.byref(cache), B, Hkv, D, D, total, dt)
            ck.check(rc == 0, "cache dtype %d: create (%s)" % (dt, lib.err() if rc else ""))
            if dt:
                want = int(B * Hkv * total * 2 * D * units[dt][2]) + \
                    (B * Hkv * total * 8 if dt == 3 else B * Hkv * total * 8 * (D // 32) if dt == 4 else 0)
                ck.check(lib.L.mha_kv_cache_bytes(cache) == want,
                         "cache %s: %d bytes held" % (units[dt][0], lib.L.mha_kv_cache_bytes(cache)))
            out = np.zeros((B, H, total, D), dtype=np.float32)
            for (n0, T) in sched:
                k = np.ascontiguousarray(K[:, :, n0:n0 + T])
                v = np.ascontiguousarray(V[:, :, n0:n0 + T])
                q = np.ascontiguousarray(Q[:, :, n0:n0 + T])
                o = np.zeros((B, H, T, D), dtype=np.float32)
                tk, tv, tq, to = tensor(k), tensor(v), tensor(q), tensor(o)
                lib.L.mha_kv_cache_append(cache, C.byref(tk), C.byref(tv), None)
                lib.L.mha_kv_cache_attend(C.byref(to), C.byref(tq), cache, None, None)
                out[:, :, n0:n0 + T] = o
            outs[dt] = out
            lib.L.mha_kv_cache_destroy(cache)
        Kr = np.repeat(K, G, axis=1)  # the scaled scores' largest magnitude
        smax = max(float(np.max(np.abs(Q[b] @ Kr[b].transpose(0, 2, 1)))) for b in range(B)) / math.sqrt(D)
        vmax = float(np.max(np.abs(V)))
        # int4: the group scales, e_j per (query, key), the bound per element
        def scales(X):
            return np.maximum(np.abs(X.reshape(X.shape[:-1] + (D // 32, 32))).max(-1), 1e-30) / 7.0
        sk, sv = np.repeat(scales(K), G, 1), np.repeat(scales(V), G, 1)  # (B, H, total, D / 32)
        xa = np.abs(Q.astype(np.float64)).reshape(B, H, total, D // 32, 32).sum(-1) / math.sqrt(D)
        emax = (xa @ (sk / 2).transpose(0, 1, 3, 2)).max(-1)  # (B, H, total)
        vterm = np.repeat(sv.max(2) / 2, 32, -1)  # (B, H, D)
        vabs = np.repeat(np.abs(V).max(2), G, 1)  # (B, H, D)
        bnd4 = vterm[:, :, None] + np.expm1(2 * emax)[..., None] * vabs[:, :, None]
        e4 = np.abs(outs[4].astype(np.float64) - outs[0])
        full4 = bnd4 + FLOOR * (1 + np.abs(outs[0]))
        over = float(np.max(e4 - full4))
        ck.note("narrow", float(np.max(e4 / full4)), "int4 case %d" % case)
        ck.check(over <= 0, "cache int4 %d (B %d H %d Hkv %d tokens %d): err vs f32 %.3g, "
                 "outside the bound by %.3g" % (case, B, H, Hkv, total, float(e4.max()), over))
        for dt in (1, 2, 3):
            name, u, _ = units[dt]
            e = float(np.max(np.abs(outs[dt].astype(np.float64) - outs[0])))
            bound = 4 * u * (1 + smax) * vmax
            ck.note("narrow", e / bound, "%s case %d" % (name, case))
            ck.check(e <= bound, "cache %s %d (B %d H %d Hkv %d tokens %d): err vs f32 %.3g "
                     "bound %.3g" % (name, case, B, H, Hkv, total, e, bound))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--cases", type=int, default=40)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("-v", action="store_true")
    args = ap.parse_args()
    lib = Lib(args.lib)
    ck = Checker(args.v)
    rng = np.random.default_rng(args.seed)
    test_rope(lib, ck, rng)
    test_gqa(lib, ck, rng)
    test_sdpa_backward(lib, ck, rng)
    test_cache(lib, ck, rng, args.cases)
    test_counts(lib, ck, rng)
    test_threads(lib, ck, rng)
    test_varlen(lib, ck, rng)
    test_cache_dtypes(lib, ck, rng)
    test_sdpa_dropout(lib, ck, np.random.default_rng(args.seed + 1000))
    if "narrow" in ck.worst:
        print("infer: narrow caches (bf16, f16, int8, int4 vs a float32 cache): worst "
              "error/bound %.3g (%s)" % ck.worst["narrow"])
    if "rule" in ck.worst:
        print("infer: worst error/bound %.3g (%s)" % ck.worst["rule"])
    print("%d passed, %d failed" % (ck.passed, ck.failed))
    return 1 if ck.failed else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""backward.py: `mha backward` (and dropout in `mha forward`) against PyTorch
autograd.

Every case is a set of float32 weights, inputs and grad_attn_output (plus
masks and flags, the forward suite's option space: conformance.py's
random_case). The same numbers go to three computations:

  ref64    float64 torch autograd through a mirror of PyTorch 1.13's
           F.multi_head_attention_forward that follows libmha's rule for
           fully masked rows (weights 0, head result 0, no gradient through
           the attention for those rows) and applies libmha's dropout masks
           (Philox4x32-10, reimplemented here in numpy),
  torch32  PyTorch's own float32 error: F.multi_head_attention_forward's
           float32 autograd where it is defined (no fully masked rows, no
           dropout), else the mirror in float32,
  ours     `mha backward` (and `mha forward`) on safetensors files.

Rule, per output tensor (attn_output, attn_output_weights, grad_query,
grad_key, grad_value, grad_<parameter>):

  max|ours - ref64| <= max(4 * max|torch32 - ref64|, 4e-6 * (1 + max|ref64|))

(conf.tolerance, conformance.py's FLOOR). A tensor outside it gets
conformance.py's second measure of torch32's error (the largest over
perturbations of the inputs by at most 2 ulps: conf.PERTURBATIONS,
conf.peer_errors), which stands in when larger; such cases are listed at
the end. The line before the last one states the worst err/tol over every
group, "backward: worst error/bound R (config ID, TENSOR)".

The mirror is checked against PyTorch itself on every case: without fully
masked rows its output and every gradient must agree with float64
F.multi_head_attention_forward's autograd to 1e-12 (relative to the tensor's
magnitude; with dropout, PyTorch runs in training mode with libmha's mask
injected in place of its own dropout); with fully masked rows its output
must agree with the forward suite's patched PyTorch expectation. With
fully masked rows or dropout, and inputs of moderate scale, its gradients
must also agree with central finite differences of itself along a random
direction (1e-6, relative).

Groups:
  grid      --configs random configs, eval mode (no dropout), every tensor.
            Configs where i % 6 == 5 are self-attention with key and value
            left out of the inputs file: grad_query is then the input's whole
            gradient (the sum of the parts through the query, key and value
            paths, as Python's backward gives it), and there is no
            grad_key / grad_value.
  dropout   random configs with --train --dropout P [--out-dropout P2]
            --seed S --dropout-offset O: `mha backward` (every tensor) and
            `mha forward --need-weights` (output and post-dropout weights).
  eval      every 10th grid config again with --dropout 0.5 --out-dropout
            0.25 --seed/--dropout-offset but no --train: bitwise equal to the
            plain run.
  large     --large-configs cases with L, S up to 96 and E up to 128,
            masks, fully masked rows, half of them with dropout.
  masks     the Philox4x32-10 known answers; seeds/offsets give different
            masks and the same ones give the same (bitwise) result; on a
            large config the zeros of the per-head weights and of the output
            are exactly the Philox masks, the kept fraction is 1 - p (|z| <=
            5), with OMP_NUM_THREADS=1 and 2.

Usage:
  /usr/bin/python3 tests/conformance/backward.py --mha build/mha \\
      --tmp /tmp/bw --configs 300 [--seed 1] [--only ID[,ID...]] [-v]
IDs: N (grid config N), d:N (dropout config N), e:N (eval check of grid
config N), l:N (large config N), philox, seeds, fraction.

Ends with the line "N passed, M failed"; exits 1 when anything failed or
torch cannot be imported.
"""

import argparse
import copy
import math
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
HERE = os.path.dirname(os.path.abspath(__file__))

try:
    import numpy as np
    import torch
    import torch.nn.functional as F
except Exception as exc:  # pragma: no cover - environment problem
    print("backward: cannot import torch/numpy (%s: %s); run this suite "
          "with a Python that has PyTorch, e.g. Debian's /usr/bin/python3 "
          "with python3-torch" % (type(exc).__name__, exc))
    print("0 passed, 1 failed")
    sys.exit(1)

sys.path.insert(0, HERE)
import conformance as conf  # noqa: E402  (safetensors, configs, masks, rule)

PARAM_NAMES = ("in_proj_weight", "q_proj_weight", "k_proj_weight",
               "v_proj_weight", "in_proj_bias", "out_proj.weight",
               "out_proj.bias", "bias_k", "bias_v")
INPUT_NAMES = ("query", "key", "value")

# Seeds of the groups' generators (conformance.random_case(seed, i)), so the
# configs differ from the forward suite's.
GRID_SEED_BASE = 0x62770000
IMPL = [None]  # --impl, passed on to every CLI run
DROPOUT_SEED_BASE = 0x64700000
LAYOUT_SEED_BASE = 0x6c790000

# ---------------------------------------------------------------------------
# Philox4x32-10 (Random123) and libmha's dropout masks (src/philox.h)

_U64 = np.uint64
_M32 = _U64(0xFFFFFFFF)
_PHILOX_M0, _PHILOX_M1 = _U64(0xD2511F53), _U64(0xCD9E8D57)
_PHILOX_W0, _PHILOX_W1 = _U64(0x9E3779B9), _U64(0xBB67AE85)
_S32, _S8 = _U64(32), _U64(8)
STREAM_ATTN = (0x00000000, 0x00000000)
STREAM_OUT = (0x9E3779B9, 0x7F4A7C15)

# Random123 tests/kat_vectors, "philox4x32 10" lines: ctr, key, expected.
PHILOX_KATS = [
    ((0, 0, 0, 0), (0, 0), (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
    ((0xffffffff,) * 4, (0xffffffff, 0xffffffff),
     (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
    ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344),
     (0xa4093822, 0x299f31d0),
     (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1)),
]


def philox4x32_10(ctr, key):
    """ctr: four uint32 values or equal-length arrays; key: two ints.
    Returns the four output words as uint64 arrays (values < 2^32)."""
    c0, c1, c2, c3 = (np.asarray(x, dtype=np.uint64) for x in ctr)
    k0, k1 = _U64(key[0]), _U64(key[1])
    for r in range(10):
        if r > 0:
            k0 = (k0 + _PHILOX_W0) & _M32
            k1 = (k1 + _PHILOX_W1) & _M32
        p0 = _PHILOX_M0 * c0  # < 2^64: exact in uint64
        p1 = _PHILOX_M1 * c2
        c0, c1, c2, c3 = ((p1 >> _S32) ^ c1 ^ k0, p1 & _M32,
                          (p0 >> _S32) ^ c3 ^ k1, p0 & _M32)
    return c0, c1, c2, c3


def dropout_keep(seed, offset, stream, n, p):
    """Keep flags (bool, n) of elements 0..n-1 of a stream (philox.h):
    block = idx / 4, lane = idx % 4, ctr = {lo(block), hi(block), lo(offset),
    hi(offset)}, key = {lo(seed) ^ xl, hi(seed) ^ xh}; keep iff
    (r >> 8) * 2^-24 >= p, p as the float32 the CLI passes on."""
    nb = (n + 3) // 4
    blocks = np.arange(nb, dtype=np.uint64)
    off = np.full(nb, offset, dtype=np.uint64)
    r = philox4x32_10((blocks & _M32, blocks >> _S32, off & _M32, off >> _S32),
                      ((seed & 0xFFFFFFFF) ^ stream[0],
                       (seed >> 32) ^ stream[1]))
    r = np.stack(r, axis=1).reshape(-1)[:n]  # idx = 4 * block + lane
    u = (r >> _S8).astype(np.float64) * 2.0 ** -24
    return u >= float(np.float32(p))


def philox_kats():
    """The known answers: the embedded kat_vectors lines, plus every vector
    of tests/test_philox.c when it is there. Returns (n checked, errors)."""
    kats = list(PHILOX_KATS)
    src = os.path.join(HERE, "..", "test_philox.c")
    if os.path.isfile(src):
        text = open(src).read()
        hexes = r"\{\s*(0x[0-9a-fA-F]+(?:\s*,\s*0x[0-9a-fA-F]+)*)\s*\}"
        pat = re.compile(r"\{\s*\"[^\"]*\"\s*,\s*" + hexes + r"\s*,\s*" + hexes
                         + r"\s*,\s*" + hexes + r"\s*\}")
        for m in pat.finditer(text):
            c, k, e = ([int(x, 16) for x in g.split(",")] for g in m.groups())
            if len(c) == 4 and len(k) == 2 and len(e) == 4:
                kats.append((tuple(c), tuple(k), tuple(e)))
    errors = []
    for ctr, key, want in kats:
        got = tuple(int(x) for x in philox4x32_10(ctr, key))
        if got != tuple(want):
            errors.append("philox4x32_10(%s, %s) = %s, expected %s"
                          % ([hex(x) for x in ctr], [hex(x) for x in key],
                             [hex(x) for x in got], [hex(x) for x in want]))
    return len(kats), errors


# ---------------------------------------------------------------------------
# Cases


class BCase:
    """A conformance.Case (config, parameters, inputs, masks) plus what the
    backward needs: grad_attn_output, self-attention, dropout options."""

    def __init__(self, case, group, cid, rng, self_attn=False):
        self.c = case
        self.c.cid = cid
        self.c.group = group
        self.cid = cid
        self.group = group
        self.self_attn = self_attn
        oshape = case.shapes_in()[0]
        self.grad_out = rng.standard_normal(oshape).astype(np.float32)
        self.train = False
        self.p = 0.0
        self.p_out = 0.0
        self.seed = 0
        self.offset = 0
        self.eval_flags = False  # dropout flags without --train

    def describe(self):
        s = self.c.describe()
        if self.self_attn:
            s += " self-attention"
        if self.train or self.eval_flags:
            s += (" %s dropout=%g out_dropout=%g seed=%d offset=%d"
                  % ("train" if self.train else "eval", self.p, self.p_out,
                     self.seed, self.offset))
        return s

    def dropout_args(self):
        a = []
        if self.train or self.eval_flags:
            a += ["--dropout", repr(self.p), "--out-dropout", repr(self.p_out),
                  "--seed", str(self.seed), "--dropout-offset",
                  str(self.offset)]
        if self.train:
            a.append("--train")
        return a

    def write_files(self, wpath, xpath, gpath):
        c = self.c
        conf.st_save(wpath, c.params, c.weights_metadata())
        xs = [("query", c.query)]
        if not self.self_attn:
            xs += [("key", c.key), ("value", c.value)]
        if c.key_padding_mask is not None:
            xs.append(("key_padding_mask", c.key_padding_mask))
        if c.attn_mask is not None:
            xs.append(("attn_mask", c.attn_mask))
        conf.st_save(xpath, xs)
        conf.st_save(gpath, [("grad_attn_output", self.grad_out)])

    def backward_cmd(self, mha, w, x, g, y):
        cmd = self.c.cli_args(mha, w, x, y, IMPL[0])
        cmd[1] = "backward"
        return cmd + ["--grad-output", g] + self.dropout_args()

    def forward_cmd(self, mha, w, x, y):
        return self.c.cli_args(mha, w, x, y, IMPL[0]) + self.dropout_args()

    def masks(self):
        """(attn keep (Nb*H, L, S') or None, out keep (Nb, L, E) or None)."""
        if not self.train:
            return None, None
        c = self.c
        Sp = c.S + int(c.add_bias_kv) + int(c.add_zero_attn)
        na = c.Nb * c.H * c.L * Sp
        ka = dropout_keep(self.seed, self.offset, STREAM_ATTN, na, self.p)
        no = c.Nb * c.L * c.E
        ko = dropout_keep(self.seed, self.offset, STREAM_OUT, no, self.p_out)
        return ka.reshape(c.Nb * c.H, c.L, Sp), ko.reshape(c.Nb, c.L, c.E)


def alibi_slopes(H):
    """The ALiBi paper's slopes (BLOOM's get_slopes)."""
    def pow2(n):
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        return [start * start ** i for i in range(n)]
    if math.log2(H).is_integer():
        return pow2(H)
    closest = 2 ** math.floor(math.log2(H))
    return pow2(closest) + alibi_slopes(2 * closest)[0::2][:H - closest]


def rope_torch(x, H, rope):
    """RoPE on x (T, Nb, E) per head of E / H features, positions start + t:
    rotate_half (neox) or interleaved pairs, the first dim features."""
    mode, theta, dim, start = rope
    T, Nb, E = x.shape
    d = E // H
    dim = d if dim == 0 else dim
    half = dim // 2
    xh = x.reshape(T, Nb, H, d)
    i = torch.arange(half, dtype=torch.float64)
    ang = (torch.arange(T, dtype=torch.float64) + start)[:, None] * theta ** (-2.0 * i / dim)
    cos = ang.cos().to(x.dtype)[:, None, None, :]
    sin = ang.sin().to(x.dtype)[:, None, None, :]
    if mode == "neox":
        x1, x2 = xh[..., :half], xh[..., half:dim]
        rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, xh[..., dim:]], dim=-1)
    else:
        xe, xo = xh[..., 0:dim:2], xh[..., 1:dim:2]
        re, ro = xe * cos - xo * sin, xo * cos + xe * sin
        pairs = torch.stack([re, ro], dim=-1).reshape(T, Nb, H, dim)
        rot = torch.cat([pairs, xh[..., dim:]], dim=-1)
    return rot.reshape(T, Nb, E)


def with_position_options(c, seed, i):
    """Some configurations get RoPE, ALiBi and/or a soft cap (own stream)."""
    r = np.random.default_rng([seed, 0x726f7065, i])
    d = c.d
    if r.random() < 0.3 and d % 2 == 0:
        dim = int(r.choice([0, 2 * int(r.integers(1, d // 2 + 1))]))
        c.rope = (str(r.choice(["neox", "interleaved"])), float(r.choice([10000.0, 100.0])),
                  dim, int(r.integers(0, 50)))
    if r.random() < 0.2:
        c.alibi = True
    if r.random() < 0.2:
        c.softcap = float(r.choice([2.0, 5.0, 30.0]))
    return c


def with_gqa(c, seed, i):
    """Some configurations (H > 1) get grouped-query / multi-query attention:
    num_kv_heads a divisor of H below H, and parameters of those shapes
    drawn again (own stream; the other configurations are unchanged)."""
    r = np.random.default_rng([seed, 0x677161, i])
    divs = [k for k in range(1, c.H) if c.H % k == 0]
    if r.random() < 0.3 and divs:
        c.num_kv_heads = int(r.choice(divs))
        c.set_params_random(r)
    return c


def with_layout(c, seed, i):
    """The layouts of real checkpoints (own stream): a head dim other than
    E / H (Eq = H d features of q, out_proj.weight (E, Eq)), grouped-query
    heads or not, separate q/k/v matrices (with kdim = vdim = E too), no
    out_proj.bias, a custom query scale; parameters of those shapes drawn
    again."""
    r = np.random.default_rng([seed, 0x6c6179, i])
    c.head_dim = int(r.choice([1, 2, 3, 4, 5, 6, 8]))
    divs = [k for k in range(1, c.H + 1) if c.H % k == 0]
    kv = int(r.choice(divs))
    c.num_kv_heads = kv if kv < c.H else None
    c.separate_qkv = bool(r.random() < 0.5)
    c.no_out_bias = bool(c.bias and r.random() < 0.5)
    if r.random() < 0.5:
        c.qscale = float(r.choice([0.05, 0.2, 0.5, 1.0, 2.0]))
    c.sinks = bool(r.random() < 0.35)
    c.set_params_random(r)
    # QK-norm (a stream of its own: the draws above unchanged), its
    # weights appended to the parameters
    # (not with --impl fused: that path refuses qk_norm, auto takes the
    # reference)
    r2 = np.random.default_rng([seed, 0x716b6e, i])
    if r2.random() < 0.35 and IMPL[0] != "fused":
        c.qk_norm = "head" if r2.random() < 0.5 else "all"
        nq, nk = (c.d, c.d) if c.qk_norm == "head" else (c.Eq, c.Ekv)
        c.params = c.params + [
            ("q_norm.weight", r2.uniform(0.5, 1.5, nq).astype(np.float32)),
            ("k_norm.weight", r2.uniform(0.5, 1.5, nk).astype(np.float32))]
    return c


QK_NORM_EPS = 1e-6  # the loader's default (mha_config.qk_norm_eps 0)


def qk_norm_torch(x, w, groups):
    """RMSNorm of x (..., F) over `groups` equal groups of its F features
    (F / groups each): x / sqrt(mean(x^2) + eps) * w (Qwen3RMSNorm, OLMo 2)."""
    s = x.shape
    xg = x.reshape(*s[:-1], groups, s[-1] // groups)
    ms = (xg * xg).mean(dim=-1, keepdim=True)
    # w: (F / groups) per group ("head"), or (F) with groups = 1 ("all")
    return (xg * torch.rsqrt(ms + QK_NORM_EPS) * w).reshape(s)


def layout_case(seed, i):
    """A grid configuration with a checkpoint layout (with_layout), RoPE,
    ALiBi and the soft cap (with_position_options, after it: RoPE needs an
    even head dim) and, for i % 4 == 3, dropout."""
    sa = i % 6 == 5
    c = conf.random_case(LAYOUT_SEED_BASE + seed, i, self_attn=sa)
    # inputs of moderate scale (at most 3, where the mirror's gradients are
    # also checked by finite differences): the grid group covers the
    # extreme scales (up to 300, near one-hot rows), where PyTorch's own
    # float32 error, the tolerance's yardstick, varies between runs
    xs = float(c.info.split("=")[1])
    if xs > 3.0:
        f = np.float32(3.0 / xs)
        c.query, c.key, c.value = (c.query * f, c.key * f, c.value * f)
        if sa:
            c.key = c.value = c.query
        c.info = "scale=%g" % 3.0
    with_layout(c, LAYOUT_SEED_BASE + seed, i)
    with_position_options(c, LAYOUT_SEED_BASE + seed, i)
    rng = np.random.default_rng([seed, 0x6c6179, i])
    b = BCase(c, "layout", "y:%d" % i, rng, self_attn=sa)
    if i % 4 == 3:
        b.train = True
        b.p = float(rng.choice([0.1, 0.25, 0.5]))
        b.p_out = float(rng.choice([0.0, 0.2]))
        b.seed = int(rng.integers(0, 2 ** 63 - 1))
        b.offset = int(rng.integers(0, 1000))
    return b


def grid_case(seed, i):
    sa = i % 6 == 5
    c = conf.random_case(GRID_SEED_BASE + seed, i, self_attn=sa)
    with_position_options(c, GRID_SEED_BASE + seed, i)
    with_gqa(c, GRID_SEED_BASE + seed, i)
    rng = np.random.default_rng([seed, 0x627764, i])
    return BCase(c, "grid", str(i), rng, self_attn=sa)


def dropout_case(seed, i):
    sa = i % 6 == 5
    c = conf.random_case(DROPOUT_SEED_BASE + seed, i, self_attn=sa)
    with_position_options(c, DROPOUT_SEED_BASE + seed, i)
    with_gqa(c, DROPOUT_SEED_BASE + seed, i)
    rng = np.random.default_rng([seed, 0x64726f70, i])
    b = BCase(c, "dropout", "d:%d" % i, rng, self_attn=sa)
    b.train = True
    b.p = float(rng.choice([0.0, 0.1, 0.25, 0.5, 0.5, 0.75, 0.9]))
    b.p_out = float(rng.choice([0.0, 0.0, 0.2, 0.5]))
    if b.p == 0.0 and b.p_out == 0.0:
        b.p_out = 0.3
    x = rng.random()
    b.seed = (int(rng.integers(0, 1000)) if x < 0.4
              else int(rng.integers(0, 2 ** 63 - 1)))
    x = rng.random()
    b.offset = (0 if x < 0.3 else int(rng.integers(1, 100)) if x < 0.6
                else int(rng.integers(0, 2 ** 62)))
    return b


# ---------------------------------------------------------------------------
# References


def _to_torch(a, dtype):
    return torch.from_numpy(np.ascontiguousarray(a)).to(dtype)


def leaves(b, dtype):
    """Input and parameter leaf tensors in dtype (self-attention: separate
    leaves with the query's values, so each gets its own part)."""
    c = b.c
    X = {n: _to_torch(getattr(c, n), dtype).requires_grad_(True)
         for n in INPUT_NAMES}
    P = {n: _to_torch(a, dtype).requires_grad_(True) for n, a in c.params}
    return X, P


def mirror_forward(b, X, P, dtype, keeps=(None, None)):
    """libmha's forward in torch ops, mirroring PyTorch 1.13's
    F.multi_head_attention_forward step by step. Fully masked rows: a finite
    fill before the softmax, then probabilities 0 (no NaN anywhere in the
    graph). keeps: the dropout masks (or None). Returns (attn_output in the
    query's layout, weights (Nb, H, L, S') after dropout)."""
    c = b.c
    E, H, L, S, Nb = c.E, c.H, c.L, c.S, c.Nb
    # the head dim d (E / H unless head_dim) and the queries' width Eq = H d
    d, Eq = c.d, c.Eq
    # grouped-query attention: K and V have Hkv heads (Ekv features); query
    # head h reads KV head h // (H / Hkv) (repeat_interleave)
    Hkv, Ekv = c.Hkv, c.Ekv
    q, k, v = X["query"], X["key"], X["value"]
    if not c.batched:
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
    elif c.batch_first:
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if "in_proj_weight" in P:
        Wq, Wk, Wv = P["in_proj_weight"].split([Eq, Ekv, Ekv])
    else:
        Wq, Wk, Wv = P["q_proj_weight"], P["k_proj_weight"], P["v_proj_weight"]
    if "in_proj_bias" in P:
        bq, bk, bv = P["in_proj_bias"].split([Eq, Ekv, Ekv])
    else:
        bq = bk = bv = None
    Q, K, V = F.linear(q, Wq, bq), F.linear(k, Wk, bk), F.linear(v, Wv, bv)
    if c.qk_norm:  # after the biases, before RoPE and the bias key
        Q = qk_norm_torch(Q, P["q_norm.weight"], H if c.qk_norm == "head" else 1)
        K = qk_norm_torch(K, P["k_norm.weight"], Hkv if c.qk_norm == "head" else 1)
    if c.rope is not None:  # after the projections, before the bias key
        Q = rope_torch(Q, H, c.rope)
        K = rope_torch(K, Hkv, c.rope)
    if c.add_bias_kv:
        K = torch.cat([K, P["bias_k"].expand(1, Nb, Ekv)])
        V = torch.cat([V, P["bias_v"].expand(1, Nb, Ekv)])
    Qh = Q.contiguous().view(L, Nb * H, d).transpose(0, 1)
    Kh = K.contiguous().view(K.shape[0], Nb * Hkv, d).transpose(0, 1)
    Vh = V.contiguous().view(V.shape[0], Nb * Hkv, d).transpose(0, 1)
    if c.add_zero_attn:
        z = torch.zeros((Nb * Hkv, 1, d), dtype=dtype)
        Kh = torch.cat([Kh, z], dim=1)
        Vh = torch.cat([Vh, z], dim=1)
    if Hkv != H:  # (Nb Hkv, S', d) -> (Nb H, S', d)
        G = H // Hkv
        Kh = Kh.view(Nb, Hkv, -1, d).repeat_interleave(G, dim=1).view(Nb * H, -1, d)
        Vh = Vh.view(Nb, Hkv, -1, d).repeat_interleave(G, dim=1).view(Nb * H, -1, d)
    Sp = Kh.shape[1]
    M, FM = conf.combined_mask(c)
    Mp = np.zeros((Nb * H, L, Sp))
    Mp[:, :, :S] = M
    Mp[FM] = 0.0  # finite fill: no NaN from an all -inf softmax
    if c.qscale:  # a custom query scale instead of 1 / sqrt(d)
        A = torch.bmm(Qh * c.qscale, Kh.transpose(-2, -1))
    else:
        A = torch.bmm(Qh / math.sqrt(d), Kh.transpose(-2, -1))
    if c.softcap > 0:
        A = c.softcap * torch.tanh(A / c.softcap)
    if c.alibi:
        slopes = torch.tensor(np.float32(alibi_slopes(H)), dtype=dtype)
        dist = (torch.arange(L)[:, None] - torch.arange(Sp)[None, :]).abs().to(dtype)
        A = A - (slopes[:, None, None] * dist[None]).repeat(Nb, 1, 1)
    A = A + _to_torch(Mp, dtype)
    if c.sinks:  # one more logit per head in each row's softmax, no value
        sk = P["sinks"].repeat(Nb).view(Nb * H, 1, 1).expand(Nb * H, L, 1)
        W = torch.softmax(torch.cat([A, sk], dim=-1), dim=-1)[..., :Sp]
    else:
        W = torch.softmax(A, dim=-1)
    if FM.any():
        W = torch.where(torch.from_numpy(FM)[:, :, None],
                        torch.zeros((), dtype=dtype), W)
    ka, ko = keeps
    if ka is not None:
        pa = float(np.float32(b.p))
        W = W * _to_torch(ka.astype(np.float64) / (1.0 - pa), dtype)
    ctx = torch.bmm(W, Vh).transpose(0, 1).contiguous().view(L * Nb, Eq)
    out = F.linear(ctx, P["out_proj.weight"], P.get("out_proj.bias"))
    out = out.view(L, Nb, E)
    if ko is not None:
        s = ko.astype(np.float64) / (1.0 - float(np.float32(b.p_out)))
        out = out * _to_torch(s.transpose(1, 0, 2), dtype)
    if not c.batched:
        out = out.squeeze(1)
    elif c.batch_first:
        out = out.transpose(0, 1)
    return out, W.view(Nb, H, L, Sp)


def weights_view(b, W):
    c = b.c
    if c.average:
        W = W.sum(dim=1) / c.H
    if not c.batched:
        W = W.squeeze(0)
    return W


def _grads(out, G, X, P):
    names = ["grad_" + n for n in INPUT_NAMES] + ["grad_" + n for n in P]
    ts = [X[n] for n in INPUT_NAMES] + list(P.values())
    gs = torch.autograd.grad(out, ts, G, allow_unused=True)
    res = {}
    for n, t, g in zip(names, ts, gs):
        g = torch.zeros_like(t) if g is None else g
        res[n] = g.detach().to(torch.float64).numpy().copy()
    return res


def mirror_expected(b, dtype, keeps=(None, None), need_weights=None):
    """Everything `mha backward` writes, from the mirror in dtype, as float64
    numpy arrays (attn_output_weights when need_weights)."""
    X, P = leaves(b, dtype)
    out, W = mirror_forward(b, X, P, dtype, keeps)
    res = {"attn_output": out.detach().to(torch.float64).numpy().copy()}
    if need_weights if need_weights is not None else b.c.need_weights:
        res["attn_output_weights"] = (weights_view(b, W.detach())
                                      .to(torch.float64).numpy().copy())
    res.update(_grads(out, _to_torch(b.grad_out, dtype), X, P))
    return res


def _torch_masks(c, dtype):
    """The masks handed to F.multi_head_attention_forward, chosen as the
    forward suite does (only used without fully masked rows)."""
    M, _ = conf.combined_mask(c)
    kpm, am = c.key_padding_mask, c.attn_mask
    kpm_float = kpm is not None and kpm.dtype != np.bool_
    if c.causal or c.windowed or (kpm_float and am is not None):
        return _to_torch(M, dtype), None

    def native(m):
        if m is None:
            return None
        if m.dtype == np.bool_:
            return torch.from_numpy(np.ascontiguousarray(m))
        return _to_torch(m, dtype)
    return native(am), native(kpm)


def torch_expected(b, dtype, keeps=(None, None)):
    """Everything `mha backward` writes, from PyTorch's own
    F.multi_head_attention_forward autograd in dtype (no fully masked rows).
    With dropout masks (keeps), PyTorch runs in training mode with its
    dropout on the attention weights replaced by libmha's mask (F.dropout
    patched for the call), and the output dropout is applied after it."""
    ka, ko = keeps
    X, P = leaves(b, dtype)
    saved_dropout = F.dropout
    if ka is not None:
        pa = float(np.float32(b.p))
        scale_a = _to_torch(ka.astype(np.float64) / (1.0 - pa), dtype)

        def fixed_dropout(x, p=0.5, training=True, inplace=False):
            assert abs(p - pa) < 1e-12
            assert tuple(x.shape) == tuple(scale_a.shape)
            return x * scale_a
        F.dropout = fixed_dropout
    try:
        return _torch_expected(b, dtype, X, P, ka is not None, ko)
    finally:
        F.dropout = saved_dropout


def _torch_expected(b, dtype, X, P, training, ko):
    c = b.c
    q, k, v = X["query"], X["key"], X["value"]
    if c.batched and c.batch_first:
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    t_am, t_kpm = _torch_masks(c, dtype)
    sep = "in_proj_weight" not in P
    out, w = F.multi_head_attention_forward(
        q, k, v, c.E, c.H, P.get("in_proj_weight"), P.get("in_proj_bias"),
        P.get("bias_k"), P.get("bias_v"), c.add_zero_attn,
        float(np.float32(b.p)) if training else 0.0,
        P["out_proj.weight"], P.get("out_proj.bias"), training=training,
        key_padding_mask=t_kpm, need_weights=c.need_weights, attn_mask=t_am,
        use_separate_proj_weight=sep, q_proj_weight=P.get("q_proj_weight"),
        k_proj_weight=P.get("k_proj_weight"),
        v_proj_weight=P.get("v_proj_weight"),
        average_attn_weights=c.average)
    if ko is not None:
        s = ko.astype(np.float64) / (1.0 - float(np.float32(b.p_out)))
        s = s.transpose(1, 0, 2)  # (L, Nb, E)
        out = out * _to_torch(s if c.batched else s[:, 0], dtype)
    if c.batched and c.batch_first:
        out = out.transpose(0, 1)
    res = {"attn_output": out.detach().to(torch.float64).numpy().copy()}
    if c.need_weights:
        res["attn_output_weights"] = (w.detach().to(torch.float64).numpy()
                                      .copy())
    res.update(_grads(out, _to_torch(b.grad_out, dtype), X, P))
    return res


def rel_diff(a, b):
    if a.size == 0:
        return 0.0
    d = np.abs(a - b)
    if np.isnan(d).any():
        return float("inf")
    return float(np.max(d)) / (1.0 + float(np.max(np.abs(b))))


MIRROR_TOL = 1e-12  # mirror vs PyTorch, float64, relative to the magnitude
FD_TOL = 1e-6       # directional derivative vs central difference, relative


def fd_check(b, ref, dtype=torch.float64, keeps=(None, None)):
    """Central difference of sum(G * out) along a random direction of every
    input and parameter, against the mirror's gradients. Returns the
    relative error."""
    rng = np.random.default_rng([0xfd, len(b.cid)] + [ord(ch) for ch in b.cid])
    X, P = leaves(b, dtype)
    dirs = {}
    for n, t in list(X.items()) + list(P.items()):
        dirs[n] = torch.from_numpy(rng.standard_normal(tuple(t.shape)))
    G = _to_torch(b.grad_out, dtype)
    h = 1e-6

    def f(sign):
        Xs = {n: (t + sign * h * dirs[n]).detach() for n, t in X.items()}
        Ps = {n: (t + sign * h * dirs[n]).detach() for n, t in P.items()}
        out, _ = mirror_forward(b, Xs, Ps, dtype, keeps)
        return float((out * G).sum())

    fd = (f(1.0) - f(-1.0)) / (2 * h)
    an = mag = 0.0
    for n in list(X) + list(P):
        g = ref["grad_" + n]
        prod = g * dirs[n].numpy()
        an += float(prod.sum())
        mag += float(np.abs(prod).sum())
    return abs(fd - an) / (1.0 + mag)


def references(b, info=None):
    """(ref64, torch32, harness notes, harness errors) for a case. info (a
    dict) receives fm (fully masked rows), mirror (mirror vs PyTorch, rel)
    and fd (finite-difference check, rel) where they apply."""
    c = b.c
    _, FM = conf.combined_mask(c)
    keeps = b.masks()
    ref = mirror_expected(b, torch.float64, keeps)
    notes, errors = [], []
    info = {} if info is None else info
    info["fm"] = bool(FM.any())

    def check_mirror_by_fd():
        """The mirror's own gradients against central differences (at input
        scales where differences are accurate)."""
        if float(c.info.split("=")[1]) <= 3.0:
            e = fd_check(b, ref, keeps=keeps)
            info["fd"] = e
            notes.append("mirror gradients vs central differences: %.3g" % e)
            if e > FD_TOL:
                errors.append("harness: mirror gradients differ from central "
                              "differences by %.3g (rel)" % e)
    if (c.rope is not None or c.alibi or c.softcap > 0 or c.num_kv_heads
            or c.head_dim or c.separate_qkv or c.no_out_bias or c.qscale or c.sinks
            or c.qk_norm):
        # F.multi_head_attention_forward has none of these: the reference is
        # the mirror (RoPE, ALiBi and the soft cap written from the papers'
        # formulas, grouped-query attention as repeat_interleave of the KV
        # heads, the checkpoint layouts: head dim, separate matrices, no
        # out_proj.bias, the query scale) under torch autograd, its
        # gradients checked by finite differences
        t32 = mirror_expected(b, torch.float32, keeps)
        notes.append("torch32: the mirror in float32 (rope/alibi/softcap/gqa/layout)")
        check_mirror_by_fd()
        return ref, t32, notes, errors
    if b.train:
        t32 = mirror_expected(b, torch.float32, keeps)
        notes.append("torch32: the mirror in float32 (dropout)")
        if not FM.any():
            pt = torch_expected(b, torch.float64, keeps)
            worst = max(rel_diff(ref[n], pt[n]) for n in pt)
            info["mirror"] = worst
            notes.append("mirror vs PyTorch float64 autograd with libmha's "
                         "masks injected: %.3g (rel)" % worst)
            if worst > MIRROR_TOL:
                errors.append("harness: the dropout mirror differs from "
                              "PyTorch's training-mode autograd with the same "
                              "masks by %.3g (rel)" % worst)
        check_mirror_by_fd()
        return ref, t32, notes, errors
    if FM.any():
        t32 = mirror_expected(b, torch.float32)
        notes.append("torch32: the mirror in float32 (fully masked rows)")
        pt = conf.torch_expected(c, torch.float64)  # patched forward
        for n in pt:
            e = rel_diff(ref[n], pt[n])
            if e > MIRROR_TOL:
                errors.append("harness: mirror %s differs from the forward "
                              "suite's patched PyTorch value by %.3g (rel)"
                              % (n, e))
            info["mirror"] = max(info.get("mirror", 0.0), e)
        check_mirror_by_fd()
        return ref, t32, notes, errors
    pt64 = torch_expected(b, torch.float64)
    worst = 0.0
    for n in pt64:
        e = rel_diff(ref[n], pt64[n])
        worst = max(worst, e)
        if e > MIRROR_TOL:
            errors.append("harness: mirror %s differs from float64 "
                          "F.multi_head_attention_forward autograd by %.3g "
                          "(rel)" % (n, e))
    notes.append("mirror vs PyTorch float64 autograd: %.3g (rel)" % worst)
    info["mirror"] = worst
    t32 = torch_expected(b, torch.float32)
    return ref, t32, notes, errors


# ---------------------------------------------------------------------------
# Comparison and running


def peer_expected(b, need_weights=None):
    """conf.peer_errors' expected(k) for BCase b: the references of b
    with its inputs perturbed (conf.perturbed_inputs), torch32 chosen as
    references() does (PyTorch's autograd where it applies, else the mirror
    in float32); need_weights: as mirror_expected's."""
    def expected(k):
        bp = copy.copy(b)
        bp.c = copy.copy(b.c)
        c = bp.c
        c.query, c.key, c.value = conf.perturbed_inputs(b.c, k)
        keeps = bp.masks()
        ref = mirror_expected(bp, torch.float64, keeps, need_weights)
        _, FM = conf.combined_mask(c)
        if (need_weights is not None or bp.train or FM.any() or c.rope is not None
                or c.alibi or c.softcap > 0 or c.num_kv_heads or c.head_dim
                or c.separate_qkv or c.no_out_bias or c.qscale or c.sinks or c.qk_norm):
            t32 = mirror_expected(bp, torch.float32, keeps, need_weights)
        else:
            t32 = torch_expected(bp, torch.float32)
        return ref, t32
    return expected


def fold_self(res):
    """The references of a self-attention case as `mha backward` writes
    them: grad_query the input's whole gradient (the sum of the three
    paths' parts), no grad_key, grad_value."""
    if "grad_key" not in res:
        return res
    res = dict(res)
    res["grad_query"] = res["grad_query"] + res.pop("grad_key") + res.pop("grad_value")
    return res


def compare(ref, t32, ours, expect_names, peer=None, first=None, self_attn=False):
    """Every tensor of ref against ours by the rule. Returns (ok, lines,
    stats name -> (err, tol)). peer: conf.peer_errors' expected(k) for the
    second measure of torch32's error of a tensor outside its bound (None:
    none); first (a dict) receives name -> err / (the first bound) of such
    a tensor."""
    if isinstance(ours, str):
        return False, [ours], {}
    if self_attn:
        ref, t32 = fold_self(ref), fold_self(t32)
        if peer is not None:
            peer = (lambda p: lambda k: tuple(fold_self(r) for r in p(k)))(peer)
    ok, lines, stats = True, [], {}
    again = {}  # name -> the re-measured torch32 error
    redone = set()  # the tensors it stands in for
    extra = sorted(set(ours) - set(expect_names))
    if extra:
        ok = False
        lines.append("unexpected tensors in the output: %s" % ", ".join(extra))
    for name in expect_names:
        if name not in ours:
            ok = False
            lines.append("%s missing from the output file" % name)
            continue
        got, r, t = ours[name], ref[name], t32[name]
        if tuple(got.shape) != tuple(r.shape):
            ok = False
            lines.append("%s shape %s, expected %s"
                         % (name, list(got.shape), list(r.shape)))
            continue
        err = conf.max_err(got, r)
        tol, e32 = conf.tolerance(r, t)
        if not err <= tol and peer is not None and math.isfinite(err):
            if not again:
                again.update(conf.peer_errors(peer, [n for n in expect_names
                                                     if n in ref]))
            if first is not None:
                first[name] = err / tol
            redone.add(name)
            tol, e32 = conf.tolerance(r, t, again[name])
        stats[name] = (err, tol)
        good = err <= tol
        ok &= good
        line = ("%s: max|ours-ref64|=%.3g tol=%.3g (torch32 err %.3g, "
                "max|ref64| %.3g)%s%s"
                % (name, err, tol, e32,
                   float(np.max(np.abs(r))) if r.size else 0.0,
                   "" if name not in redone else
                   " (torch32 err re-measured on %d perturbations of the inputs "
                   "by <= %d ulps: largest %.3g)"
                   % (conf.PERTURBATIONS, conf.PERTURB_ULPS, again[name]),
                   "" if good else "  FAIL"))
        if not good and got.size:
            diff = np.abs(got.astype(np.float64) - r)
            diff = np.where(np.isnan(diff), np.inf, diff)
            idx = np.unravel_index(int(np.argmax(diff)), diff.shape)
            line += "\n      worst at %s: ours %r ref64 %r torch32 %r" % (
                [int(x) for x in idx], float(got[idx]), float(r[idx]),
                float(t[idx]))
        lines.append(line)
    return ok, lines, stats


def run_cli(cmd, ypath, timeout, env=None):
    """Runs the CLI; returns the output tensors (dict) or an error string."""
    if os.path.exists(ypath):
        os.remove(ypath)
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return "CLI timed out after %ds: %s" % (timeout, " ".join(cmd))
    except OSError as exc:
        return "CLI could not start: %s" % exc
    if p.returncode != 0:
        return ("CLI exit status %d: %s\n      stderr: %s"
                % (p.returncode, " ".join(cmd),
                   p.stderr.decode("utf-8", "replace").strip()[:2000]))
    try:
        tensors, _, dtypes = conf.st_load(ypath)
    except (OSError, ValueError) as exc:
        return "cannot read the CLI's output: %s" % exc
    for name, dt in dtypes.items():
        if dt != "F32":
            return "output %s has dtype %s, expected F32" % (name, dt)
    return tensors


def expected_names(b, backward, need_weights):
    c = b.c
    names = ["attn_output"]
    if need_weights:
        names.append("attn_output_weights")
    if backward:
        names += ["grad_" + n for n in (("query",) if b.self_attn else INPUT_NAMES)]
        names += ["grad_" + n for n, _ in c.params]
    return names


class Runner:
    def __init__(self, args):
        self.args = args
        self.pool = ThreadPoolExecutor(max_workers=max(1, args.jobs))
        self.pending = []
        self.counts = {}    # group -> [passed, failed]
        self.failures = []
        self.worst = {}     # group -> (err/tol, cid, tensor)
        self.remeasured = []  # tensors whose torch32 error was re-measured
        self.keep_ours = {}  # cid -> ours (for the eval checks)
        self.stats = {}      # group -> case counts and harness checks
        self.want_ours = set()

    def paths(self, cid, tag):
        safe = cid.replace(":", "_")
        return [os.path.join(self.args.tmp, "b%s_%s_%s.safetensors"
                             % (safe, tag, s)) for s in "wxgy"]

    def submit(self, b):
        """Backward (and for dropout cases also the forward with
        --need-weights) of one case, checked against the references."""
        a = self.args
        info = {}
        try:
            ref, t32, notes, herr = references(b, info)
        except Exception as exc:
            self.record(b, False, ["harness error computing the reference: "
                                   "%s: %s" % (type(exc).__name__, exc)])
            return
        st = self.stats.setdefault(b.group, {"fm": 0, "self": 0, "train": 0,
                                             "mirror": 0, "fd": 0,
                                             "mirror_worst": 0.0,
                                             "fd_worst": 0.0})
        st["fm"] += info["fm"]
        st["self"] += b.self_attn
        st["train"] += b.train
        for k in ("mirror", "fd"):
            if k in info:
                st[k] += 1
                st[k + "_worst"] = max(st[k + "_worst"], info[k])
        w, x, g, y = self.paths(b.cid, "bw")
        b.write_files(w, x, g)
        runs = [(b.backward_cmd(a.mha, w, x, g, y), y, True, b.c.need_weights)]
        if b.train:
            yf = self.paths(b.cid, "fw")[3]
            nw = b.c.need_weights
            b.c.need_weights = True  # the forward returns the weights too
            cmd = b.forward_cmd(a.mha, w, x, yf)
            b.c.need_weights = nw
            runs.append((cmd, yf, False, True))
        futs = [self.pool.submit(run_cli, cmd, yp, a.timeout)
                for cmd, yp, _, _ in runs]
        self.pending.append((b, ref, t32, notes, herr, runs, futs,
                             (w, x, g, y) + tuple(r[1] for r in runs[1:])))
        while len(self.pending) > 4 * max(1, a.jobs):
            self.finish_one()

    def finish_one(self):
        b, ref, t32, notes, herr, runs, futs, files = self.pending.pop(0)
        ok = not herr
        lines = list(herr) + list(notes)
        ref_w = None
        n_remeasured = len(self.remeasured)
        for (cmd, yp, backward, need_w), fut in zip(runs, futs):
            ours = fut.result()
            r, t, peer = ref, t32, peer_expected(b)
            if need_w and "attn_output_weights" not in ref:
                if ref_w is None:
                    keeps = b.masks()
                    ref_w = (mirror_expected(b, torch.float64, keeps, True),
                             mirror_expected(b, torch.float32, keeps, True))
                r, t = ref_w
                peer = peer_expected(b, True)
            names = expected_names(b, backward, need_w)
            first = {}
            good, ls, stats = compare(r, t, ours, names, peer, first, b.self_attn)
            tag = "backward" if backward else "forward"
            lines += ["%s %s" % (tag, ln) for ln in ls]
            for name, fr in first.items():
                self.remeasured.append("%s %s %s (%.3g of the first bound, %.3g of "
                                       "the second)" % (b.cid, tag, name, fr,
                                                        stats[name][0] / stats[name][1]))
            for name, (err, tol) in stats.items():
                wst = self.worst.get(b.group)
                if wst is None or err / tol > wst[0]:
                    self.worst[b.group] = (err / tol, b.cid,
                                           "%s %s" % (tag, name))
            if not good:
                lines.append("reproduce: %s" % " ".join(cmd))
            ok &= good
            if backward and b.cid in self.want_ours and isinstance(ours, dict):
                self.keep_ours[b.cid] = ours
        if ok and not self.args.keep:
            for f in files:
                try:
                    os.remove(f)
                except OSError:
                    pass
        # a case whose torch32 error was re-measured is shown even when it passes
        self.record(b, ok, lines, show=len(self.remeasured) > n_remeasured)

    def record(self, b, ok, lines, group=None, cid=None, what=None, show=False):
        group = group or b.group
        cnt = self.counts.setdefault(group, [0, 0])
        cnt[0 if ok else 1] += 1
        if not ok:
            self.failures.append(cid or b.cid)
        if not ok or show or self.args.verbose:
            print("%s %s" % ("ok  " if ok else "FAIL",
                             what or b.describe()))
            for ln in lines:
                print("      " + ln)
            sys.stdout.flush()

    def check(self, group, cid, what, ok, lines):
        """A check that is not one case: what is its one-line description
        (starting with [cid])."""
        self.record(None, ok, lines, group=group, cid=cid, what=what)

    def drain(self):
        while self.pending:
            self.finish_one()


# ---------------------------------------------------------------------------
# The eval and mask checks


def eval_check(runner, b_plain, ours_plain):
    """The grid config again with dropout options but no --train: bitwise
    the plain result."""
    a = runner.args
    b = b_plain
    b.eval_flags = True
    b.p, b.p_out, b.seed, b.offset = 0.5, 0.25, 12345, 7
    cid = "e:" + b.cid
    w, x, g, y = runner.paths(cid, "ev")
    b.write_files(w, x, g)
    cmd = b.backward_cmd(a.mha, w, x, g, y)
    ours = run_cli(cmd, y, a.timeout)
    lines = []
    ok = isinstance(ours, dict) and isinstance(ours_plain, dict)
    if not ok:
        lines.append(ours if isinstance(ours, str) else "no plain result")
    else:
        if set(ours) != set(ours_plain):
            ok = False
            lines.append("tensors %s vs %s"
                         % (sorted(ours), sorted(ours_plain)))
        for n in sorted(set(ours) & set(ours_plain)):
            same = (ours[n].shape == ours_plain[n].shape and
                    ours[n].tobytes() == ours_plain[n].tobytes())
            if not same:
                ok = False
                lines.append("%s differs from the run without dropout options "
                             "(max diff %.3g)" % (n, conf.max_err(
                                 ours[n], ours_plain[n].astype(np.float64))))
        lines.append("%d tensors bitwise equal to the plain run" % len(ours)
                     if ok else "reproduce: %s" % " ".join(cmd))
    if ok and not a.keep:
        for f in (w, x, g, y):
            if os.path.exists(f):
                os.remove(f)
    runner.check("eval", cid, "%s (eval check %s)" % (b.describe(), cid), ok,
                 lines)


def philox_check(runner):
    n, errors = philox_kats()
    runner.check("masks", "philox", "[philox] Philox4x32-10 known-answer "
                 "vectors (%d)" % n, not errors, errors)


def large_case(seed, i):
    """Longer sequences and wider heads than the grid (L, S up to 96, E up
    to 128), with masks, fully masked rows and (odd i) dropout."""
    rng = np.random.default_rng([seed, 0x6c617267, i])
    H = int(rng.choice([2, 4, 8]))
    E = H * int(rng.choice([8, 16]))
    L, S = int(rng.integers(33, 97)), int(rng.integers(33, 97))
    N = [None, 1, 2, 3][i % 4]
    kdim = vdim = E
    if i % 3 == 1:
        kdim, vdim = int(rng.integers(5, 40)), int(rng.integers(5, 40))
    c = conf.Case("l:%d" % i, "large", E, H, L, S, N, kdim=kdim, vdim=vdim,
                  bias=rng.random() < 0.8, add_bias_kv=i % 5 == 2,
                  add_zero_attn=i % 7 == 3, batch_first=rng.random() < 0.5,
                  causal=rng.random() < 0.4, need_weights=rng.random() < 0.5,
                  average=rng.random() < 0.5)
    c.set_params_random(rng)
    qs, ks, vs = c.shapes_in()
    c.query = rng.standard_normal(qs).astype(np.float32)
    c.key = rng.standard_normal(ks).astype(np.float32)
    c.value = rng.standard_normal(vs).astype(np.float32)
    Nb = c.Nb
    if i % 2 == 0:
        am = rng.random((L, S) if i % 4 == 0 else (Nb * H, L, S)) < 0.3
        c.attn_mask = am
    else:
        am = (2.0 * rng.standard_normal((L, S))).astype(np.float32)
        am[rng.random((L, S)) < 0.2] = conf.NEG_INF
        c.attn_mask = am
    kp = rng.random((N, S) if c.batched else (S,)) < 0.2
    if rng.random() < 0.5:
        kp = np.where(kp, conf.NEG_INF, rng.standard_normal(kp.shape)).astype(
            np.float32)
    if i % 3 == 0:  # fully masked rows (unless appended keys are there)
        c.attn_mask = np.array(c.attn_mask)
        c.attn_mask[..., 3, :] = (True if c.attn_mask.dtype == np.bool_
                                  else conf.NEG_INF)
    c.key_padding_mask = kp
    c.info = "scale=1"
    b = BCase(c, "large", "l:%d" % i, rng)
    if i % 2 == 1:
        b.train = True
        b.p = float(rng.choice([0.1, 0.5]))
        b.p_out = float(rng.choice([0.0, 0.2]))
        b.seed = int(rng.integers(0, 2 ** 63 - 1))
        b.offset = int(rng.integers(0, 1000))
    return b


def fixed_case(cid, E, H, L, S, N, seed, average=False):
    c = conf.Case(cid, "masks", E, H, L, S, N, need_weights=True,
                  average=average)
    rng = np.random.default_rng([seed, 0x6d61736b] + [ord(x) for x in cid])
    c.set_params_random(rng)
    qs, ks, vs = c.shapes_in()
    c.query = rng.standard_normal(qs).astype(np.float32)
    c.key = rng.standard_normal(ks).astype(np.float32)
    c.value = rng.standard_normal(vs).astype(np.float32)
    c.info = "scale=1"
    b = BCase(c, "masks", cid, rng)
    b.train = True
    return b


def run_forward_checked(runner, b, env=None, tag="fw"):
    """mha forward --train --need-weights; returns (ours or error string,
    ok, lines) checked against the mirror."""
    a = runner.args
    w, x, g, y = runner.paths(b.cid, tag)
    b.write_files(w, x, g)
    cmd = b.forward_cmd(a.mha, w, x, y)
    ours = run_cli(cmd, y, a.timeout, env=env)
    keeps = b.masks()
    ref = mirror_expected(b, torch.float64, keeps, True)
    t32 = mirror_expected(b, torch.float32, keeps, True)
    ok, lines, stats = compare(ref, t32, ours, expected_names(b, False, True), None, None,
                               b.self_attn)
    for name, (err, tol) in stats.items():
        wst = runner.worst.get("masks")
        if wst is None or err / tol > wst[0]:
            runner.worst["masks"] = (err / tol, b.cid, "forward " + name)
    if not ok:
        lines.append("reproduce: %s%s" % (
            "".join("%s=%s " % kv for kv in (env or {}).items()
                    if kv[0] == "OMP_NUM_THREADS"), " ".join(cmd)))
    elif not a.keep:
        for f in (w, x, g, y):
            if os.path.exists(f):
                os.remove(f)
    return ours, ok, lines


def seeds_check(runner, seed):
    """Different seeds / offsets: different masks (Philox side and CLI
    side), each matching the mirror; the same ones: bitwise the same."""
    base = fixed_case("seeds", 16, 4, 12, 10, 3, seed)
    base.p, base.p_out = 0.5, 0.3
    s0, o0 = 0x1234567, 5
    variants = [("base", s0, o0), ("seed+1", s0 + 1, o0),
                ("offset+1", s0, o0 + 1),
                ("seed high word", s0 | (1 << 40), o0),
                ("offset high word", s0, o0 | (1 << 33))]
    results = {}
    ok_all, lines = True, []
    for name, s, o in variants:
        base.seed, base.offset = s, o
        ours, ok, ls = run_forward_checked(runner, base, tag="s")
        ok_all &= ok
        if not ok:
            lines += ["%s: %s" % (name, ln) for ln in ls]
        results[name] = (ours, base.masks())
    b_ours, (b_ka, b_ko) = results["base"]
    for name, _, _ in variants[1:]:
        ours, (ka, ko) = results[name]
        fa, fo = float(np.mean(ka == b_ka)), float(np.mean(ko == b_ko))
        differ = fa < 0.9 and fo < 0.9
        out_differ = (isinstance(ours, dict) and isinstance(b_ours, dict) and
                      not np.array_equal(ours["attn_output_weights"],
                                         b_ours["attn_output_weights"]) and
                      not np.array_equal(ours["attn_output"],
                                         b_ours["attn_output"]))
        lines.append("%s vs base: masks equal on %.3f (attn) %.3f (out) of "
                     "elements; CLI results differ: %s"
                     % (name, fa, fo, out_differ))
        if not (differ and out_differ):
            ok_all = False
            lines[-1] += "  FAIL"
    # the same seed and offset again: bitwise the same result
    base.seed, base.offset = s0, o0
    again, ok, ls = run_forward_checked(runner, base, tag="s2")
    same = (isinstance(again, dict) and isinstance(b_ours, dict) and
            all(again[n].tobytes() == b_ours[n].tobytes() for n in b_ours))
    lines.append("same seed and offset again: bitwise equal: %s" % same)
    ok_all &= ok and same
    runner.check("masks", "seeds", "%s: seeds and offsets" % base.describe(),
                 ok_all, lines)


def fraction_check(runner, seed):
    """A large config: the zeros of the per-head weights and of the output
    are exactly the Philox masks; kept fractions about 1 - p; the same with 1
    and 2 OpenMP threads; the backward within the rule."""
    b = fixed_case("fraction", 32, 4, 64, 64, 4, seed)
    b.p, b.p_out, b.seed, b.offset = 0.3, 0.2, 2024, 3
    ka, ko = b.masks()
    ok_all, lines = True, []
    outs = {}
    for nt in ("1", "2"):
        env = dict(os.environ, OMP_NUM_THREADS=nt)
        ours, ok, ls = run_forward_checked(runner, b, env=env, tag="f" + nt)
        ok_all &= ok
        lines += ["threads %s: %s" % (nt, ln) for ln in ls]
        if not isinstance(ours, dict):
            continue
        outs[nt] = ours
        Wt = ours["attn_output_weights"].reshape(ka.shape)
        Ot = ours["attn_output"].transpose(1, 0, 2)  # (N, L, E)
        for what, kept_cli, keep, p in (("weights", Wt != 0, ka, b.p),
                                        ("output", Ot != 0, ko, b.p_out)):
            n = keep.size
            frac = float(np.mean(kept_cli))
            z = (frac - (1 - p)) / math.sqrt(p * (1 - p) / n)
            exact = np.array_equal(kept_cli, keep)
            good = exact and abs(z) <= 5.0
            ok_all &= good
            lines.append("threads %s %s: kept %.4f of %d (1-p = %.2f, z=%+.2f)"
                         ", zeros exactly the Philox mask: %s%s"
                         % (nt, what, frac, n, 1 - p, z, exact,
                            "" if good else "  FAIL"))
    if len(outs) == 2:
        same = all(outs["1"][n].tobytes() == outs["2"][n].tobytes()
                   for n in outs["1"])
        lines.append("1 vs 2 threads: bitwise equal: %s (not required)" % same)
    runner.check("masks", "fraction", "%s: masks and kept fractions"
                 % b.describe(), ok_all, lines)
    # and the backward of the same large config
    b.c.need_weights = False
    runner.submit(b)
    runner.drain()


# ---------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mha", help="path to the mha CLI binary")
    ap.add_argument("--tmp", default=None, help="scratch directory")
    ap.add_argument("--configs", type=int, default=300,
                    help="random grid size (default 300)")
    ap.add_argument("--dropout-configs", type=int, default=None,
                    help="dropout group size (default configs / 2)")
    ap.add_argument("--large-configs", type=int, default=12,
                    help="large group size (default 12)")
    ap.add_argument("--layout-configs", type=int, default=None,
                    help="layout group size (default configs / 3): head_dim, "
                         "separate q/k/v, no out_proj.bias, custom scale")
    ap.add_argument("--impl", default=None, help="pass --impl NAME to the CLI")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--only", default=None,
                    help="comma-separated ids: N, d:N, e:N, y:N, l:N, philox, "
                         "seeds, fraction")
    ap.add_argument("--jobs", type=int, default=2, help="parallel CLI runs")
    ap.add_argument("--timeout", type=int, default=60,
                    help="seconds per CLI run")
    ap.add_argument("--keep", action="store_true",
                    help="keep the files of passing cases")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()

    torch.set_num_threads(1)
    # The CLI runs --jobs at a time next to this process, each with OpenMP
    # threads: with libgomp's default spin-waiting an oversubscribed
    # backward (many parallel regions) takes 100x longer. Sleep instead.
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")
    if args.tmp is None:
        args.tmp = os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                "mha_backward_%d" % os.getpid())
    os.makedirs(args.tmp, exist_ok=True)
    if (not args.mha or not os.path.isfile(args.mha)
            or not os.access(args.mha, os.X_OK)):
        print("backward: the mha CLI %r is not an executable file "
              "(pass --mha PATH)" % args.mha)
        print("0 passed, 1 failed")
        return 1
    args.mha = os.path.abspath(args.mha)
    IMPL[0] = args.impl
    n_drop = (args.dropout_configs if args.dropout_configs is not None
              else max(1, args.configs // 2))
    n_layout = (args.layout_configs if args.layout_configs is not None
                else max(1, args.configs // 3))

    t0 = time.time()
    only = None
    if args.only:
        only = set(s.strip() for s in args.only.split(",") if s.strip())

    def ids(prefix, n):
        if only is None:
            return list(range(n))
        return sorted(int(s[len(prefix):]) for s in only
                      if s.startswith(prefix) and s[len(prefix):].isdigit())

    runner = Runner(args)
    grid_ids = ids("", args.configs)
    eval_ids = [i for i in grid_ids if i % 10 == 0] if only is None else []
    if only is not None:
        eval_ids = ids("e:", 0)
        grid_ids = sorted(set(grid_ids) | set(eval_ids))
    runner.want_ours = set(str(i) for i in eval_ids)
    timings = {}

    t = time.time()
    if only is None or "philox" in only:
        philox_check(runner)
    for i in grid_ids:
        runner.submit(grid_case(args.seed, i))
    runner.drain()
    timings["grid"] = time.time() - t

    t = time.time()
    for i in eval_ids:
        eval_check(runner, grid_case(args.seed, i),
                   runner.keep_ours.get(str(i), "the plain run failed"))
    timings["eval"] = time.time() - t

    t = time.time()
    for i in ids("d:", n_drop):
        runner.submit(dropout_case(args.seed, i))
    runner.drain()
    timings["dropout"] = time.time() - t

    t = time.time()
    for i in ids("y:", n_layout):
        runner.submit(layout_case(args.seed, i))
    runner.drain()
    timings["layout"] = time.time() - t

    t = time.time()
    for i in ids("l:", args.large_configs):
        runner.submit(large_case(args.seed, i))
    runner.drain()
    timings["large"] = time.time() - t

    t = time.time()
    if only is None or "seeds" in only:
        seeds_check(runner, args.seed)
    if only is None or "fraction" in only:
        fraction_check(runner, args.seed)
    timings["masks"] = time.time() - t
    runner.pool.shutdown()

    total_p = total_f = 0
    for g in ("grid", "eval", "dropout", "layout", "large", "masks"):
        p, f = runner.counts.get(g, [0, 0])
        total_p, total_f = total_p + p, total_f + f
        wst = runner.worst.get(g)
        print("%-8s %4d passed, %d failed  (%.1fs)%s"
              % (g + ":", p, f, timings.get(g, 0.0),
                 ("  largest err/tol %.3g ([%s] %s)" % wst) if wst else ""))
    for g in ("grid", "dropout", "layout", "large"):
        st = runner.stats.get(g)
        if st:
            print("%-8s %d with fully masked rows, %d self-attention, %d "
                  "training; mirror vs PyTorch checked on %d (worst %.3g "
                  "rel), finite differences on %d (worst %.3g rel)"
                  % (g + ":", st["fm"], st["self"], st["train"],
                     st["mirror"], st["mirror_worst"], st["fd"],
                     st["fd_worst"]))
    if runner.failures:
        shown = runner.failures[:40]
        print("failed: %s%s" % (", ".join(shown),
                                " ..." if len(runner.failures) > 40 else ""))
    print("time: %.1fs (seed %d)" % (time.time() - t0, args.seed))
    conf.report_bounds(runner, "backward")
    if total_p + total_f == 0:
        print("backward: no cases ran")
        total_f = 1
    print("%d passed, %d failed" % (total_p, total_f))
    return 1 if total_f else 0


if __name__ == "__main__":
    sys.exit(main())

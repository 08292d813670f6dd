#!/usr/bin/python3
"""conformance.py: the `mha` CLI against PyTorch's multi_head_attention_forward.

Every case is a set of float32 weights and inputs (plus masks and flags). The
same numbers go to three computations:

  ref64    PyTorch 1.13, torch.nn.functional.multi_head_attention_forward,
           in float64 (the reference),
  torch32  the same PyTorch call in float32 (PyTorch's own error),
  ours     `mha forward` on safetensors files written by this script.

Rule, per output tensor (attn_output, attn_output_weights):

  max|ours - ref64| <= max(4 * max|torch32 - ref64|, 4e-6 * (1 + max|ref64|))

A tensor outside that bound gets a second measure of torch32's error: the
largest over 8 copies of the case with the inputs moved by at most 2 ulps
(PERTURBATIONS, peer_errors below), which stands in when larger; such
tensors are listed at the end with both ratios.

Fully masked rows (every score of a (batch, head, query) row is -inf) follow
libmha's rule: weights 0 and head result 0, so the module's output there is
out_proj.bias. PyTorch gives NaN there; the expected values are patched: the
row is unmasked in the mask handed to torch (rows are independent), its
per-head weights are set to 0, and output rows that contain such a head are
recomputed from torch's per-head weights and the value projection.

Groups: a seeded random grid (--configs of them) and the cases of PyTorch's
own test_multihead_attention tests (test/nn/test_multihead_attention.py),
replayed through the CLI.

Usage:
  /usr/bin/python3 tests/conformance/conformance.py --mha build/mha \
      --tmp /tmp/conf --configs 500 [--seed 1] [--only ID[,ID...]] [-v]
  /usr/bin/python3 tests/conformance/conformance.py --self-test

The line before the last one states the worst err/tol over every case,
"conformance: worst error/bound R (config ID, TENSOR)". Ends with the line
"N passed, M failed"; exits 1 when anything failed or torch cannot be
imported.
"""

import argparse
import copy
import json
import math
import os
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

try:
    import numpy as np
    import torch
    import torch.nn.functional as F
except Exception as exc:  # pragma: no cover - environment problem
    print("conformance: cannot import torch/numpy (%s: %s); run this suite "
          "with a Python that has PyTorch, e.g. Debian's /usr/bin/python3 "
          "with python3-torch" % (type(exc).__name__, exc))
    print("0 passed, 1 failed")
    sys.exit(1)

NEG_INF = float("-inf")

# ---------------------------------------------------------------------------
# safetensors

_ST_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # read as bit patterns, widened to float32 below
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("u1"),  # one byte, 0 or 1
}


def _st_name_of(arr):
    if arr.dtype == np.bool_:
        return "BOOL"
    for name, dt in _ST_DTYPES.items():
        if name != "BOOL" and arr.dtype.newbyteorder("<") == dt:
            return name
    raise ValueError("no safetensors dtype for numpy %s" % arr.dtype)


def st_save(path, tensors, metadata=None):
    """tensors: list of (name, ndarray); written in that order."""
    header = {}
    blobs = []
    off = 0
    for name, arr in tensors:
        arr = np.asarray(arr)
        dname = _st_name_of(arr)
        if dname == "BOOL":
            data = np.ascontiguousarray(arr, dtype=np.bool_).view(np.uint8)
            data = (data != 0).astype(np.uint8).tobytes()
        else:
            data = np.ascontiguousarray(arr, dtype=_ST_DTYPES[dname]).tobytes()
        header[name] = {"dtype": dname, "shape": [int(s) for s in arr.shape],
                        "data_offsets": [off, off + len(data)]}
        off += len(data)
        blobs.append(data)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    h += b" " * ((-len(h)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def st_load(path):
    """Returns (dict name -> ndarray, metadata dict, dtype names dict).
    Checks the layout strictly; raises ValueError on any problem."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise ValueError("%s: %d bytes, shorter than the 8-byte header length"
                         % (path, len(raw)))
    (n,) = struct.unpack("<Q", raw[:8])
    if n > len(raw) - 8:
        raise ValueError("%s: header length %d beyond the file (%d bytes)"
                         % (path, n, len(raw)))
    try:
        header = json.loads(raw[8:8 + n].decode("utf-8"))
    except Exception as exc:
        raise ValueError("%s: header is not JSON: %s" % (path, exc))
    if not isinstance(header, dict):
        raise ValueError("%s: header is not a JSON object" % path)
    data = raw[8 + n:]
    meta = header.pop("__metadata__", {}) or {}
    if not isinstance(meta, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise ValueError("%s: __metadata__ is not a string map" % path)
    out, dtypes, spans = {}, {}, []
    for name, ent in header.items():
        try:
            dname = ent["dtype"]
            shape = [int(s) for s in ent["shape"]]
            b, e = (int(x) for x in ent["data_offsets"])
        except Exception:
            raise ValueError("%s: bad entry for %r: %r" % (path, name, ent))
        if dname not in _ST_DTYPES:
            raise ValueError("%s: %r has unknown dtype %r" % (path, name, dname))
        if any(s < 0 for s in shape):
            raise ValueError("%s: %r has a negative dim" % (path, name))
        numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        dt = _ST_DTYPES[dname]
        if e - b != numel * dt.itemsize or b < 0 or e > len(data):
            raise ValueError("%s: %r offsets [%d, %d] do not fit shape %s %s "
                             "in a %d-byte buffer"
                             % (path, name, b, e, shape, dname, len(data)))
        arr = np.frombuffer(data[b:e], dtype=dt).reshape(shape)
        if dname == "BOOL":
            if np.any(arr > 1):
                raise ValueError("%s: %r BOOL bytes other than 0/1" % (path, name))
            arr = arr.astype(np.bool_)
        if dname == "BF16":  # bfloat16: the high half of a float32
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[name] = arr.copy()
        dtypes[name] = dname
        spans.append((b, e, name))
    spans.sort()
    pos = 0
    for b, e, name in spans:
        if b != pos:
            raise ValueError("%s: %r starts at %d, expected %d (gap/overlap)"
                             % (path, name, b, pos))
        pos = e
    if pos != len(data):
        raise ValueError("%s: tensors cover %d of %d data bytes"
                         % (path, pos, len(data)))
    return out, meta, dtypes


# ---------------------------------------------------------------------------
# Cases


class Case:
    """One forward: module config, float32 parameters, inputs, flags."""

    def __init__(self, cid, group, E, H, L, S, N, kdim=None, vdim=None,
                 bias=True, add_bias_kv=False, add_zero_attn=False,
                 batch_first=False, causal=False, need_weights=False,
                 average=True, heads_via="meta", info=""):
        self.cid = str(cid)
        self.group = group
        self.E, self.H, self.L, self.S, self.N = E, H, L, S, N
        self.kdim = kdim if kdim else E
        self.vdim = vdim if vdim else E
        self.bias = bias
        self.add_bias_kv = add_bias_kv
        self.add_zero_attn = add_zero_attn
        self.batch_first = batch_first
        self.causal = causal
        self.need_weights = need_weights
        self.average = average
        self.heads_via = heads_via
        self.info = info
        self.window_left = -1     # sliding window (-1: unbounded)
        self.window_right = -1
        self.weights_heads = None  # (begin, end): a block of the weights
        self.weights_rows = None
        # RoPE / ALiBi / soft cap (backward.py's mirror checks these; the
        # forward suite's F.multi_head_attention_forward has none of them)
        self.rope = None          # (mode "neox"|"interleaved", theta, dim, start)
        self.alibi = False
        self.softcap = 0.0
        # grouped-query attention (backward.py's mirror checks it; PyTorch's
        # module has none): None or a divisor of H below H
        self.num_kv_heads = None
        # the layouts of real checkpoints (backward.py's mirror checks them):
        # a head dim other than E / H (None: E / H), separate q/k/v matrices
        # with kdim = vdim = E, no out_proj.bias, a custom query scale
        # (None: 1 / sqrt(d))
        self.head_dim = None
        self.separate_qkv = False
        self.no_out_bias = False
        self.qscale = None
        self.sinks = False        # attention sinks: a "sinks" (H) parameter
        # QK-norm (backward.py's mirror checks it): None, "head" (q_norm /
        # k_norm.weight (d)) or "all" ((Eq), (Ekv)); eps 1e-6 (the
        # loader's default: a file cannot carry it)
        self.qk_norm = None
        self.params = []      # list of (name, float32 array), file order
        self.query = self.key = self.value = None
        self.key_padding_mask = None
        self.attn_mask = None

    @property
    def batched(self):
        return self.N is not None

    @property
    def Nb(self):
        return self.N if self.N is not None else 1

    @property
    def Hkv(self):
        return self.num_kv_heads if self.num_kv_heads else self.H

    @property
    def d(self):
        return self.head_dim if self.head_dim else self.E // self.H

    @property
    def Eq(self):
        return self.H * self.d

    @property
    def Ekv(self):
        return self.Hkv * self.d

    def param(self, name):
        for n, a in self.params:
            if n == name:
                return a
        return None

    def mask_kind(self, m):
        if m is None:
            return "none"
        return ("bool" if m.dtype == np.bool_ else "float") + "%dd" % m.ndim

    def describe(self):
        return ("[%s] E=%d H=%d d=%d kdim=%d vdim=%d L=%d S=%d N=%s bias=%d "
                "bias_kv=%d zero_attn=%d batch_first=%d kpm=%s attn_mask=%s "
                "causal=%d need_weights=%d average=%d heads=%s%s"
                % (self.cid, self.E, self.H, self.d, self.kdim,
                   self.vdim, self.L, self.S,
                   self.N if self.batched else "unbatched", self.bias,
                   self.add_bias_kv, self.add_zero_attn, self.batch_first,
                   self.mask_kind(self.key_padding_mask),
                   self.mask_kind(self.attn_mask), self.causal,
                   self.need_weights, self.average, self.heads_via,
                   (" " + self.info) if self.info else "")
                + (" window=(%d,%d)" % (self.window_left, self.window_right)
                   if self.windowed else "")
                + (" weights_block=heads%s,rows%s" % (self.weights_heads,
                                                      self.weights_rows)
                   if self.wblock else "")
                + (" rope=%s" % (self.rope,) if self.rope else "")
                + (" alibi" if self.alibi else "")
                + (" softcap=%g" % self.softcap if self.softcap > 0 else "")
                + (" kv_heads=%d" % self.num_kv_heads if self.num_kv_heads else "")
                + (" separate_qkv" if self.separate_qkv else "")
                + (" no_out_bias" if self.no_out_bias else "")
                + (" qscale=%g" % self.qscale if self.qscale else "")
                + (" sinks" if self.sinks else "")
                + (" qk_norm=%s" % self.qk_norm if self.qk_norm else ""))

    @property
    def windowed(self):
        return self.window_left >= 0 or self.window_right >= 0

    @property
    def wblock(self):
        return self.weights_heads is not None or self.weights_rows is not None

    def weights_from_heads(self, Pw):
        """The weights libmha returns, from per-head weights (Nb, H, L, S')
        (numpy or torch): the selected block, averaged over its heads when
        average is set, without the batch dim when unbatched."""
        h0, h1 = self.weights_heads or (0, self.H)
        r0, r1 = self.weights_rows or (0, self.L)
        W = Pw[:, h0:h1, r0:r1]
        if self.average:
            W = W.sum(1) / (h1 - h0)
        return W if self.batched else W[0]

    def set_params_random(self, rng, wscale=1.0):
        # Ekv: the K/V projections' width (E unless grouped-query); Eq the
        # queries' (E unless head_dim)
        E, k, v, Ekv, Eq = self.E, self.kdim, self.vdim, self.Ekv, self.Eq

        def unif(shape, fan_in, fan_out):
            a = math.sqrt(6.0 / (fan_in + fan_out)) * wscale
            return rng.uniform(-a, a, size=shape).astype(np.float32)

        ps = []
        if k == E and v == E and not self.separate_qkv:
            ps.append(("in_proj_weight", unif((Eq + 2 * Ekv, E), E, Eq + 2 * Ekv)))
        else:
            ps.append(("q_proj_weight", unif((Eq, E), E, Eq)))
            ps.append(("k_proj_weight", unif((Ekv, k), k, Ekv)))
            ps.append(("v_proj_weight", unif((Ekv, v), v, Ekv)))
        if self.bias:
            ps.append(("in_proj_bias",
                       (0.5 * rng.standard_normal(Eq + 2 * Ekv)).astype(np.float32)))
        ps.append(("out_proj.weight", unif((E, Eq), Eq, E)))
        if self.bias and not self.no_out_bias:
            ps.append(("out_proj.bias",
                       (0.5 * rng.standard_normal(E)).astype(np.float32)))
        if self.add_bias_kv:
            ps.append(("bias_k", rng.standard_normal((1, 1, Ekv)).astype(np.float32)))
            ps.append(("bias_v", rng.standard_normal((1, 1, Ekv)).astype(np.float32)))
        if self.sinks:
            ps.append(("sinks", rng.standard_normal(self.H).astype(np.float32)))
        # shuffle the file order a little: the CLI must find tensors by name
        if rng.random() < 0.3:
            order = rng.permutation(len(ps))
            ps = [ps[i] for i in order]
        self.params = ps

    def set_params_from_module(self, mod):
        sd = mod.state_dict()
        ps = []
        for name in ("in_proj_weight", "q_proj_weight", "k_proj_weight",
                     "v_proj_weight", "in_proj_bias", "out_proj.weight",
                     "out_proj.bias", "bias_k", "bias_v"):
            t = sd.get(name)
            if t is not None:
                ps.append((name, t.detach().to(torch.float32).numpy().copy()))
        self.params = ps

    def shapes_in(self):
        L, S, E = self.L, self.S, self.E
        if not self.batched:
            return (L, E), (S, self.kdim), (S, self.vdim)
        N = self.N
        if self.batch_first:
            return (N, L, E), (N, S, self.kdim), (N, S, self.vdim)
        return (L, N, E), (S, N, self.kdim), (S, N, self.vdim)

    def cli_args(self, mha, wpath, xpath, ypath, impl=None):
        cmd = [mha, "forward", "--weights", wpath, "--inputs", xpath,
               "--out", ypath]
        if self.heads_via in ("arg", "both"):
            cmd += ["--num-heads", str(self.H)]
        # grouped-query: the weights' shapes tell num_kv_heads ("arg"), and
        # so does __metadata__ ("meta"); "both" also passes it
        if self.num_kv_heads and self.heads_via == "both":
            cmd += ["--num-kv-heads", str(self.num_kv_heads)]
        if self.batch_first:
            cmd.append("--batch-first")
        if self.causal:
            cmd.append("--causal")
        if self.add_zero_attn:
            cmd.append("--add-zero-attn")
        if self.need_weights:
            cmd.append("--need-weights")
            if not self.average:
                cmd.append("--no-average-weights")
            if self.weights_heads is not None:
                cmd += ["--weights-heads", "%d:%d" % self.weights_heads]
            if self.weights_rows is not None:
                cmd += ["--weights-rows", "%d:%d" % self.weights_rows]
        if self.rope is not None:
            mode, theta, dim, start = self.rope
            cmd += ["--rope", mode, "--rope-theta", repr(theta), "--rope-start", str(start)]
            if dim:
                cmd += ["--rope-dim", str(dim)]
        if self.alibi:
            cmd.append("--alibi")
        if self.softcap > 0:
            cmd += ["--softcap", repr(self.softcap)]
        if self.qscale:
            cmd += ["--scale", repr(self.qscale)]
        if self.window_left >= 0:
            cmd += ["--window-left", str(self.window_left)]
        if self.window_right >= 0:
            cmd += ["--window-right", str(self.window_right)]
        if impl:
            cmd += ["--impl", impl]
        return cmd

    def weights_metadata(self):
        if self.heads_via not in ("meta", "both"):
            return None
        meta = {"num_heads": str(self.H)}
        if self.num_kv_heads:
            meta["num_kv_heads"] = str(self.num_kv_heads)
        return meta

    def write_files(self, wpath, xpath):
        st_save(wpath, self.params, self.weights_metadata())
        xs = [("query", self.query), ("key", self.key), ("value", self.value)]
        if self.key_padding_mask is not None:
            xs.append(("key_padding_mask", self.key_padding_mask))
        if self.attn_mask is not None:
            xs.append(("attn_mask", self.attn_mask))
        st_save(xpath, xs)


# ---------------------------------------------------------------------------
# Expected values through PyTorch


def combined_mask(case):
    """Float64 (Nb*H, L, S) sum of all masks (bool -> -inf, causal -> -inf
    for j > i) and the (Nb*H, L) fully-masked-row flags."""
    Nb, H, L, S = case.Nb, case.H, case.L, case.S
    M = np.zeros((Nb, H, L, S), dtype=np.float64)
    am = case.attn_mask
    if am is not None:
        af = (np.where(am, NEG_INF, 0.0) if am.dtype == np.bool_
              else am.astype(np.float64))
        if af.ndim == 2:
            M += af[None, None]
        else:
            M += af.reshape(Nb, H, L, S)
    kp = case.key_padding_mask
    if kp is not None:
        kf = (np.where(kp, NEG_INF, 0.0) if kp.dtype == np.bool_
              else kp.astype(np.float64))
        M += kf.reshape(Nb, S)[:, None, None, :]
    if case.causal:
        M += np.where(np.triu(np.ones((L, S)), 1) > 0, NEG_INF, 0.0)[None, None]
    ii, jj = np.arange(L)[:, None], np.arange(S)[None, :]
    if case.window_left >= 0:
        M += np.where(jj < ii - case.window_left, NEG_INF, 0.0)[None, None]
    if case.window_right >= 0:
        M += np.where(jj > ii + case.window_right, NEG_INF, 0.0)[None, None]
    FM = np.all(M == NEG_INF, axis=-1)
    if case.add_bias_kv or case.add_zero_attn:
        FM[...] = False  # the appended keys are never masked
    return M.reshape(Nb * H, L, S), FM.reshape(Nb * H, L)


def torch_expected(case, dtype):
    """attn_output (and attn_output_weights) as libmha defines them, computed
    by PyTorch in `dtype`; returned as float64 numpy arrays."""
    E, H, L, S, Nb = case.E, case.H, case.L, case.S, case.Nb
    d = E // H

    def T(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(dtype)

    q, k, v = T(case.query), T(case.key), T(case.value)
    if case.batched and case.batch_first:
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)

    M, FM = combined_mask(case)
    fm_any = bool(FM.any())
    kpm, am = case.key_padding_mask, case.attn_mask
    kpm_float = kpm is not None and kpm.dtype != np.bool_
    # torch 1.13 has no is_causal; it merges a float key_padding_mask with an
    # attn_mask wrongly (bool: logical_or of floats) or not at all (float:
    # masked_fill wants bool); fully masked rows give NaN. Those cases get one
    # combined float mask; otherwise the masks go to torch as they are.
    if case.causal or case.windowed or fm_any or (kpm_float and am is not None):
        Mt = M.copy()
        Mt[FM] = 0.0
        t_am, t_kpm = T(Mt), None
    else:
        def native(m):
            if m is None:
                return None
            if m.dtype == np.bool_:
                return torch.from_numpy(np.ascontiguousarray(m))
            return T(m)
        t_am, t_kpm = native(am), native(kpm)

    ipw = case.param("in_proj_weight")
    sep = ipw is None

    def P(name):
        a = case.param(name)
        return None if a is None else T(a)

    ipw_t, ipb_t = P("in_proj_weight"), P("in_proj_bias")
    qw, kw, vw = P("q_proj_weight"), P("k_proj_weight"), P("v_proj_weight")
    ow, ob = P("out_proj.weight"), P("out_proj.bias")
    bk, bv = P("bias_k"), P("bias_v")

    need_w = case.need_weights or fm_any
    avg = case.average and not fm_any and not case.wblock
    with torch.no_grad():
        out, w = F.multi_head_attention_forward(
            q, k, v, E, H, ipw_t, ipb_t, bk, bv, case.add_zero_attn, 0.0,
            ow, ob, training=False, key_padding_mask=t_kpm,
            need_weights=need_w, attn_mask=t_am,
            use_separate_proj_weight=sep, q_proj_weight=qw, k_proj_weight=kw,
            v_proj_weight=vw, average_attn_weights=avg)

        if fm_any:
            # (no add_bias_kv / add_zero_attn here, so S' == S)
            out_sf = out if case.batched else out.unsqueeze(1)   # (L, Nb, E)
            Pw = w if case.batched else w.unsqueeze(0)            # (Nb,H,L,S)
            fm = torch.from_numpy(FM.reshape(Nb, H, L))
            Pw = Pw.masked_fill(fm.unsqueeze(-1), 0.0)
            val = v if case.batched else v.unsqueeze(1)            # (S,Nb,vdim)
            Wv = vw if sep else ipw_t[2 * E:]
            bvv = None if ipb_t is None else ipb_t[2 * E:]
            V = F.linear(val, Wv, bvv)                             # (S,Nb,E)
            Vh = V.reshape(S, Nb, H, d).permute(1, 2, 0, 3)        # (Nb,H,S,d)
            heads = torch.matmul(Pw, Vh)                           # (Nb,H,L,d)
            cat = heads.permute(2, 0, 1, 3).reshape(L, Nb, E)
            recon = F.linear(cat, ow, ob)                          # (L,Nb,E)
            rows = fm.any(dim=1).transpose(0, 1).unsqueeze(-1)     # (L,Nb,1)
            out_sf = torch.where(rows, recon, out_sf)
            out = out_sf if case.batched else out_sf.squeeze(1)
            if case.need_weights:
                w = case.weights_from_heads(Pw)
            else:
                w = None
        elif case.need_weights and case.wblock:  # w: per head
            w = case.weights_from_heads(w if case.batched else w.unsqueeze(0))

        if case.batched and case.batch_first:
            out = out.transpose(0, 1)
    res = {"attn_output": out.to(torch.float64).numpy().copy()}
    if case.need_weights:
        res["attn_output_weights"] = w.to(torch.float64).numpy().copy()
    return res


def numpy_forward(case, dtype=np.float32):
    """An independent implementation of libmha's semantics in numpy, used by
    --self-test to check the harness (torch side, patching, tolerance)."""
    E, H, L, S, Nb = case.E, case.H, case.L, case.S, case.Nb
    d = E // H
    c = lambda a: np.asarray(a, dtype=dtype)
    q, k, v = c(case.query), c(case.key), c(case.value)
    if not case.batched:
        q, k, v = q[:, None], k[:, None], v[:, None]
    elif case.batch_first:
        q, k, v = (x.transpose(1, 0, 2) for x in (q, k, v))
    ipw = case.param("in_proj_weight")
    if ipw is not None:
        Wq, Wk, Wv = c(ipw[:E]), c(ipw[E:2 * E]), c(ipw[2 * E:])
    else:
        Wq, Wk, Wv = (c(case.param(n)) for n in
                      ("q_proj_weight", "k_proj_weight", "v_proj_weight"))
    ipb = case.param("in_proj_bias")
    zero = np.zeros(E, dtype)
    bq, bk_, bv_ = ((c(ipb[:E]), c(ipb[E:2 * E]), c(ipb[2 * E:]))
                    if ipb is not None else (zero, zero, zero))
    Q = q @ Wq.T + bq
    K = k @ Wk.T + bk_
    V = v @ Wv.T + bv_
    if case.add_bias_kv:
        K = np.concatenate([K, np.broadcast_to(c(case.param("bias_k")), (1, Nb, E))])
        V = np.concatenate([V, np.broadcast_to(c(case.param("bias_v")), (1, Nb, E))])
    Qh = Q.reshape(L, Nb, H, d).transpose(1, 2, 0, 3)
    Kh = K.reshape(-1, Nb, H, d).transpose(1, 2, 0, 3)
    Vh = V.reshape(-1, Nb, H, d).transpose(1, 2, 0, 3)
    if case.add_zero_attn:
        z = np.zeros((Nb, H, 1, d), dtype)
        Kh = np.concatenate([Kh, z], axis=2)
        Vh = np.concatenate([Vh, z], axis=2)
    Sp = Kh.shape[2]
    sc = (Qh / dtype(math.sqrt(d))) @ Kh.transpose(0, 1, 3, 2)
    M, _ = combined_mask(case)
    Mp = np.zeros((Nb, H, L, Sp), dtype)
    Mp[..., :S] = M.reshape(Nb, H, L, S)
    sc = sc + Mp
    mx = sc.max(axis=-1, keepdims=True)
    fm = mx == NEG_INF
    with np.errstate(invalid="ignore"):
        e = np.exp(sc - np.where(fm, 0, mx))
    e = np.where(fm, 0, e)
    ssum = e.sum(axis=-1, keepdims=True)
    Pw = np.where(fm, 0, e / np.where(ssum == 0, 1, ssum))
    O = (Pw @ Vh).transpose(2, 0, 1, 3).reshape(L, Nb, E)
    ob = case.param("out_proj.bias")
    O = O @ c(case.param("out_proj.weight")).T + (c(ob) if ob is not None else zero)
    if not case.batched:
        O = O[:, 0]
    elif case.batch_first:
        O = O.transpose(1, 0, 2)
    res = {"attn_output": O.astype(np.float32)}
    if case.need_weights:
        W = case.weights_from_heads(Pw)
        res["attn_output_weights"] = W.astype(np.float32)
    return res


# ---------------------------------------------------------------------------
# The random grid

ATTN_KINDS = ["none", "bool2d", "bool3d", "float2d", "float3d"]
KPM_KINDS = ["none", "bool", "float"]


def random_case(seed, i, self_attn=False):
    """Config i of the grid under seed. self_attn=True (used by backward.py)
    forces self-attention shapes (S = L, kdim = vdim = E) and key = value =
    query, with the same random draws otherwise."""
    rng = np.random.default_rng([seed, 0x6d6861, i])
    r = rng.random
    H = int(rng.choice([1, 2, 3, 4, 8]))
    d = int(rng.choice([1, 2, 3, 4, 5, 8, 16]))
    E = H * d

    def seqlen():
        x = r()
        if x < 0.15:
            return 1
        if x < 0.25:
            return int(rng.integers(2, 4))
        return int(rng.integers(1, 21))

    L, S = seqlen(), seqlen()
    if i % 17 == 3:
        L = S  # self-attention shapes
    N = None if r() < 0.2 else int(rng.integers(1, 5))
    kdim = vdim = E
    x = r()
    if x < 0.2:
        kdim = vdim = int(rng.integers(1, 21))
    elif x < 0.4:
        kdim, vdim = int(rng.integers(1, 21)), int(rng.integers(1, 21))
    elif x < 0.45:
        kdim = int(rng.integers(1, 21))
    elif x < 0.5:
        vdim = int(rng.integers(1, 21))
    if self_attn:
        S, kdim, vdim = L, E, E
    # stratified so every mask combination gets its share
    attn_kind = ATTN_KINDS[i % 5]
    kpm_kind = KPM_KINDS[(i // 5) % 3]
    causal = r() < 0.25
    need_weights = r() < 0.6
    average = r() < 0.5
    heads_via = str(rng.choice(["meta", "meta", "meta", "arg", "both"]))
    bias = r() < 0.8
    add_bias_kv = r() < 0.25
    add_zero_attn = r() < 0.25
    batch_first = r() < 0.4
    scale = 1.0
    x = r()
    if x < 0.08:
        scale = float(rng.choice([0.01, 0.1]))
    elif x < 0.25:
        scale = float(rng.choice([3.0, 10.0, 30.0, 100.0, 300.0]))
    full = r() < 0.2  # try to produce fully masked rows

    c = Case(i, "random", E, H, L, S, N, kdim=kdim, vdim=vdim, bias=bias,
             add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn,
             batch_first=batch_first, causal=causal,
             need_weights=need_weights, average=average, heads_via=heads_via)
    c.set_params_random(rng)
    qs, ks, vs = c.shapes_in()
    c.query = (scale * rng.standard_normal(qs)).astype(np.float32)
    c.key = (scale * rng.standard_normal(ks)).astype(np.float32)
    c.value = (scale * rng.standard_normal(vs)).astype(np.float32)
    if self_attn:
        c.key = c.value = c.query
    Nb = c.Nb

    def float_vals(shape):
        a = (2.0 * rng.standard_normal(shape)).astype(np.float32)
        if r() < 0.5:
            a[rng.random(shape) < float(rng.choice([0.1, 0.3]))] = NEG_INF
        return a

    if attn_kind != "none":
        shape = (L, S)
        if attn_kind.endswith("3d"):
            shape = (Nb * H, L, S)
        if attn_kind.startswith("bool"):
            am = rng.random(shape) < float(rng.choice([0.1, 0.3, 0.5]))
        else:
            am = float_vals(shape)
        if full:
            if am.ndim == 2:
                row = am[int(rng.integers(0, L))]
            else:
                row = am[int(rng.integers(0, am.shape[0])), int(rng.integers(0, L))]
            row[...] = True if am.dtype == np.bool_ else NEG_INF
        c.attn_mask = am
    if kpm_kind != "none":
        shape = (N, S) if c.batched else (S,)
        if kpm_kind == "bool":
            kp = rng.random(shape) < float(rng.choice([0.1, 0.3, 0.5]))
        else:
            kp = float_vals(shape)
        if full:
            fill = True if kp.dtype == np.bool_ else NEG_INF
            if causal and r() < 0.5:
                kp[..., 0] = fill  # with causal, query row 0 sees nothing
            elif c.batched:
                kp[int(rng.integers(0, N))] = fill
            else:
                kp[...] = fill
        c.key_padding_mask = kp
    c.info = "scale=%g" % scale
    # sliding windows, from their own stream (the draws above stay as they
    # were before windows existed)
    rw = np.random.default_rng([seed, 0x77696e, i])
    if rw.random() < 0.25:
        c.window_left = int(rw.choice([-1, 0, 1, 2, 5]))
        c.window_right = int(rw.choice([-1, 0, 1, 3]))
        if c.window_left < 0 and c.window_right < 0:
            c.window_left = 1
    return c


def with_weights_block(c, seed, i):
    """Config c asking for a random block of the weights (some of the time
    when it needs weights)."""
    rb = np.random.default_rng([seed, 0x626c6b, i])
    if c.need_weights and rb.random() < 0.3:
        h0 = int(rb.integers(0, c.H))
        c.weights_heads = (h0, int(rb.integers(h0 + 1, c.H + 1)))
        r0 = int(rb.integers(0, c.L + 1))
        c.weights_rows = (r0, int(rb.integers(r0, c.L + 1)))
    return c


# ---------------------------------------------------------------------------
# PyTorch's own tests (test/nn/test_multihead_attention.py, test_nn.py)

# _multihead_attn_test_helper variants; saved_kv (static_k/static_v) has no
# CLI equivalent, so the saved_kv variants run without it (all_arguments2 is
# an expected AssertionError in PyTorch and is left out).
HELPER_VARIANTS = [
    ("no_masking", {}),
    ("key_padding_mask", {"add_key_padding_mask": True}),
    ("add_bias_kv", {"add_bias_kv": True}),
    ("add_zero_attn", {"add_zero_attn": True}),
    ("add_bias_kv_zero_attn", {"add_key_padding_mask": True,
                               "add_bias_kv": True, "add_zero_attn": True}),
    ("all_arguments1_no_saved_kv", {"add_key_padding_mask": True,
                                    "add_zero_attn": True}),
    ("all_arguments3_no_saved_kv", {"add_key_padding_mask": True,
                                    "add_zero_attn": True,
                                    "same_embed_dim": True}),
    # beyond the helper: kdim != vdim, bool attn_mask, float key_padding_mask
    ("kdim_vdim", {"add_key_padding_mask": True, "kdim_ne_vdim": True}),
    ("bool_masks", {"add_key_padding_mask": True, "bool_attn_mask": True}),
    ("float_key_padding_mask", {"add_key_padding_mask": True,
                                "float_kpm": True, "same_embed_dim": True}),
]


def _torch_seed(*parts):
    h = 1469598103934665603
    for p in parts:
        for ch in str(p).encode():
            h = ((h ^ ch) * 1099511628211) & ((1 << 63) - 1)
    torch.manual_seed(h)
    return np.random.default_rng(h)


def helper_case(seed, vname, kw, average, it):
    cid = "pt:%s:avg%d:%d" % (vname, int(average), it)
    rng = _torch_seed(seed, cid)
    batch_sz, seq_len = int(rng.integers(2, 11)), int(rng.integers(2, 11))
    d_head = int(rng.integers(3, 11))
    nheads = int(rng.integers(2, 6)) * 2
    d_model = d_head * nheads
    if kw.get("same_embed_dim"):
        kdim = vdim = d_model
    else:
        kdim = vdim = int(rng.integers(5, 21))
        if kw.get("kdim_ne_vdim"):
            while vdim == kdim:
                vdim = int(rng.integers(5, 21))
    mod = torch.nn.MultiheadAttention(
        d_model, nheads, add_bias_kv=kw.get("add_bias_kv", False),
        add_zero_attn=kw.get("add_zero_attn", False), kdim=kdim, vdim=vdim)
    c = Case(cid, "pytorch", d_model, nheads, 1, seq_len, batch_sz,
             kdim=kdim, vdim=vdim, bias=True,
             add_bias_kv=kw.get("add_bias_kv", False),
             add_zero_attn=kw.get("add_zero_attn", False),
             need_weights=True, average=average)
    c.set_params_from_module(mod)
    decoder_state = rng.random((batch_sz, d_model))
    K = rng.random((batch_sz, seq_len, kdim))
    V = K if kdim == vdim else rng.random((batch_sz, seq_len, vdim))
    c.query = decoder_state[None].astype(np.float32)              # (1, N, E)
    c.key = K.transpose(1, 0, 2).astype(np.float32)               # (S, N, k)
    c.value = V.transpose(1, 0, 2).astype(np.float32)
    attn = rng.integers(0, 2, size=(1, seq_len))
    if kw.get("bool_attn_mask"):
        c.attn_mask = attn == 0
    else:
        c.attn_mask = np.where(attn == 0, NEG_INF, 0.0).astype(np.float32)
    if kw.get("add_key_padding_mask"):
        seq_mask = rng.integers(0, 2, (1, seq_len))
        kpm = np.repeat(seq_mask, batch_sz, axis=0) == 1
        if kw.get("float_kpm"):
            kpm = np.where(kpm, NEG_INF, 0.0).astype(np.float32)
        c.key_padding_mask = kpm
    return c


def attn3d_cases(seed, rep):
    """test_multihead_attn_3d_attn_mask: a 3-D mask (N*H, T, S) versus each
    batch element alone with its 2-D mask."""
    embed_dim, num_heads, batch_size, src_len, tgt_len = 8, 4, 8, 3, 2
    base = "pt:3d_attn_mask:%d" % rep
    rng = _torch_seed(seed, base)
    mod = torch.nn.MultiheadAttention(embed_dim, num_heads)
    query = rng.random((batch_size, tgt_len, embed_dim)).astype(np.float32)
    key = rng.random((batch_size, src_len, embed_dim)).astype(np.float32)
    m = rng.integers(0, 2, (batch_size, tgt_len, src_len))
    mask = np.where(m == 0, NEG_INF, 0.0).astype(np.float32)
    c3 = Case(base + ":3d", "pytorch", embed_dim, num_heads, tgt_len, src_len,
              batch_size, need_weights=(rep % 2 == 1), average=(rep % 4 == 1))
    c3.set_params_from_module(mod)
    c3.query = np.ascontiguousarray(query.transpose(1, 0, 2))
    c3.key = np.ascontiguousarray(key.transpose(1, 0, 2))
    c3.value = c3.key
    c3.attn_mask = np.repeat(mask, num_heads, axis=0)
    out = [c3]
    for i in range(batch_size):
        c2 = Case(base + ":2d:%d" % i, "pytorch", embed_dim, num_heads,
                  tgt_len, src_len, 1, need_weights=c3.need_weights,
                  average=c3.average)
        c2.params = c3.params
        c2.query = np.ascontiguousarray(query[i][:, None])
        c2.key = np.ascontiguousarray(key[i][:, None])
        c2.value = c2.key
        c2.attn_mask = mask[i]
        out.append(c2)
    return out


def small_module_cases(seed):
    out = []
    # test_multihead_self_attn_two_masks_fast_path: bool attn_mask (S, S) and
    # bool key_padding_mask, batch_first self-attention
    for rep in range(6):
        cid = "pt:two_masks:%d" % rep
        rng = _torch_seed(seed, cid)
        E, H, N, S = 14, 7, 8, 5
        mod = torch.nn.MultiheadAttention(E, H, batch_first=True)
        c = Case(cid, "pytorch", E, H, S, S, N, batch_first=True,
                 need_weights=rep % 2 == 1, average=rep % 3 != 0)
        c.set_params_from_module(mod)
        x = rng.random((N, S, E)).astype(np.float32)
        c.query = c.key = c.value = x
        c.attn_mask = rng.integers(0, 2, (S, S)).astype(np.bool_)
        c.key_padding_mask = rng.integers(0, 2, (N, S)).astype(np.bool_)
        out.append(c)
    # test_multihead_attn_fast_path_small_test: E = H = 4, batch_first
    for rep in range(2):
        cid = "pt:fast_path_small:%d" % rep
        rng = _torch_seed(seed, cid)
        mod = torch.nn.MultiheadAttention(4, 4, batch_first=True)
        c = Case(cid, "pytorch", 4, 4, 4, 4, 4, batch_first=True,
                 need_weights=rep == 1, average=True)
        c.set_params_from_module(mod)
        c.query = c.key = c.value = rng.standard_normal((4, 4, 4)).astype(np.float32)
        out.append(c)
    # test_multihead_attn_in_proj_bias_none / test_multihead_attn_no_bias
    for rep in range(2):
        cid = "pt:no_bias:%d" % rep
        rng = _torch_seed(seed, cid)
        E, H = (2, 2) if rep == 0 else (8, 4)
        mod = torch.nn.MultiheadAttention(E, H, bias=False)
        assert mod.in_proj_bias is None and mod.out_proj.bias is None
        c = Case(cid, "pytorch", E, H, 2, 2, 2, bias=False, need_weights=True,
                 average=rep == 0)
        c.set_params_from_module(mod)
        c.query = c.key = c.value = rng.random((2, 2, E)).astype(np.float32)
        out.append(c)
    # test_multihead_attn_in_proj_weight_none: kdim = vdim = 2 != E
    for rep in range(2):
        cid = "pt:in_proj_weight_none:%d" % rep
        rng = _torch_seed(seed, cid)
        mod = torch.nn.MultiheadAttention(4, 4, kdim=2, vdim=2)
        c = Case(cid, "pytorch", 4, 4, 4, 4, 4, kdim=2, vdim=2,
                 need_weights=True, average=rep == 0)
        c.set_params_from_module(mod)
        c.query = rng.random((4, 4, 4)).astype(np.float32)
        c.key = c.value = rng.random((4, 4, 2)).astype(np.float32)
        out.append(c)
    # unbatched inputs (test_multihead_attn_invalid_shape's valid shapes)
    for rep in range(4):
        cid = "pt:unbatched:%d" % rep
        rng = _torch_seed(seed, cid)
        mod = torch.nn.MultiheadAttention(4, 4 if rep < 2 else 2)
        H = 4 if rep < 2 else 2
        c = Case(cid, "pytorch", 4, H, 4, 4, None, need_weights=True,
                 average=rep % 2 == 0)
        c.set_params_from_module(mod)
        c.query = rng.standard_normal((4, 4)).astype(np.float32)
        c.key = rng.standard_normal((4, 4)).astype(np.float32)
        c.value = rng.standard_normal((4, 4)).astype(np.float32)
        c.key_padding_mask = np.array([False, False, True, True])
        if rep >= 2:
            c.attn_mask = rng.random((H, 4, 4)) < 0.3
        out.append(c)
    return out


def pytorch_cases(seed, iters):
    cases = []
    for vname, kw in HELPER_VARIANTS:
        for average in (True, False):
            for it in range(iters):
                cases.append(helper_case(seed, vname, kw, average, it))
    groups = []
    for rep in range(4):
        g = attn3d_cases(seed, rep)
        groups.append(g)
        cases.extend(g)
    cases.extend(small_module_cases(seed))
    return cases, groups


# ---------------------------------------------------------------------------
# Comparison


# The floor of the rule: 4e-6 (about 34 float32 ulps at 1) times 1 + max|ref64|.
FLOOR = 4e-6


def tolerance(ref, t32, e32_more=0.0):
    """(bound, torch32's error); e32_more: a re-measured torch32 error
    (peer_errors) that stands in when larger."""
    e32 = float(np.max(np.abs(t32 - ref))) if ref.size else 0.0
    mref = float(np.max(np.abs(ref))) if ref.size else 0.0
    return max(4.0 * max(e32, e32_more), FLOOR * (1.0 + mref)), e32


# PyTorch float32's error on one input is one draw: where the scores are
# large (inputs of scale 30 to 300, near one-hot softmax rows) a one-ulp
# change of an input moves it by 10x and more either way. A tensor outside
# its bound therefore gets a second measure of the peer error: torch32's
# error (each against its own float64 reference) on PERTURBATIONS copies of
# the case whose float32 inputs (query, key, value) are moved by at most
# PERTURB_ULPS ulps each; the largest of them stands in for torch32's error
# when larger (the ours-vs-ref64 error stays the one on the case itself).
# On a well-conditioned case those errors stay torch32's own size (inputs of
# scale 1: within 2x of it, and under the floor), so a 10x loss of accuracy
# still fails; the line of such a case says so.
PERTURBATIONS = 8
PERTURB_ULPS = 2


def perturbed_inputs(c, k):
    """Copies (query, key, value) of Case c's inputs moved by at most
    PERTURB_ULPS ulps each (perturbation k, seeded); self-attention's shared
    array stays shared."""
    rng = np.random.default_rng([0x756c70, k])

    def bump(a):
        a = np.asarray(a, dtype=np.float32)
        n = rng.integers(-PERTURB_ULPS, PERTURB_ULPS + 1, size=a.shape)
        out = a.copy()
        for _ in range(PERTURB_ULPS):
            out = np.where(n > 0, np.nextafter(out, np.float32(np.inf)),
                           np.where(n < 0, np.nextafter(out, np.float32(-np.inf)), out))
            n = n - np.sign(n)
        return out.astype(np.float32)

    q = bump(c.query)
    k_ = q if c.key is c.query else bump(c.key)
    v = q if c.value is c.query else (k_ if c.value is c.key else bump(c.value))
    return q, k_, v


def peer_errors(expected, names):
    """The largest torch32 error per tensor name over PERTURBATIONS
    perturbed copies; expected(k) -> (ref64, torch32) dicts of copy k."""
    worst = dict.fromkeys(names, 0.0)
    for k in range(PERTURBATIONS):
        r, t = expected(k)
        for n in names:
            if n in r and n in t:
                worst[n] = max(worst[n], max_err(t[n], r[n]))
    return worst


def forward_peer(case):
    """peer_errors' expected(k) for the forward suite's Case."""
    def expected(k):
        c = copy.copy(case)
        c.query, c.key, c.value = perturbed_inputs(case, k)
        return torch_expected(c, torch.float64), torch_expected(c, torch.float32)
    return expected


def report_bounds(runner, suite):
    """The run's re-measured tensors (if any) and its worst error/bound
    line, "SUITE: worst error/bound R (config ID, TENSOR)", from a runner's
    remeasured list and worst dict (group -> (err/tol, cid, tensor))."""
    if runner.remeasured:
        print("torch32 error re-measured on perturbed inputs (a tensor outside "
              "its first bound): %s" % ", ".join(runner.remeasured))
    if runner.worst:
        wst = max(runner.worst.values(), key=lambda w: w[0])
        print("%s: worst error/bound %.3g (config %s, %s)" % ((suite,) + wst))


def max_err(a, b):
    if a.size == 0:
        return 0.0
    diff = np.abs(a.astype(np.float64) - b)
    if np.isnan(diff).any():
        return float("inf")
    return float(np.max(diff))


def compare(case, ours, ref, t32, peer=None, first=None):
    """ours: dict name -> array (or an error string). Returns (ok, lines,
    stats) where stats maps tensor name -> (err, tol). peer: peer_errors'
    expected(k), for the second measure of the peer error of a tensor
    outside its bound (None: no second measure); first (a dict) receives
    name -> err / (the first bound) of such a tensor."""
    if isinstance(ours, str):
        return False, [ours], {}
    lines, stats, ok = [], {}, True
    again = {}  # name -> the re-measured torch32 error
    redone = set()  # the tensors it stands in for
    for name in ("attn_output", "attn_output_weights"):
        if name not in ref:
            if name in ours:
                ok = False
                lines.append("%s present without --need-weights" % name)
            continue
        if name not in ours:
            ok = False
            lines.append("%s missing from the output file" % name)
            continue
        got = ours[name]
        if tuple(got.shape) != tuple(ref[name].shape):
            ok = False
            lines.append("%s shape %s, expected %s"
                         % (name, list(got.shape), list(ref[name].shape)))
            continue
        err = max_err(got, ref[name])
        tol, e32 = tolerance(ref[name], t32[name])
        if not err <= tol and peer is not None and math.isfinite(err):
            if not again:
                again.update(peer_errors(peer, [n for n in ("attn_output",
                                                            "attn_output_weights")
                                                if n in ref]))
            if first is not None:
                first[name] = err / tol
            redone.add(name)
            tol, e32 = tolerance(ref[name], t32[name], again[name])
        stats[name] = (err, tol)
        good = err <= tol
        ok &= good
        line = ("%s: max|ours-ref64|=%.3g tol=%.3g (torch32 err %.3g, "
                "max|ref64| %.3g)%s%s" % (name, err, tol, e32,
                                          float(np.max(np.abs(ref[name])))
                                          if ref[name].size else 0.0,
                                          "" if name not in redone else
                                          " (torch32 err re-measured on %d "
                                          "perturbations of the inputs by <= %d "
                                          "ulps: largest %.3g)"
                                          % (PERTURBATIONS, PERTURB_ULPS, again[name]),
                                          "" if good else "  FAIL"))
        if not good and got.size:
            diff = np.abs(got.astype(np.float64) - ref[name])
            diff = np.where(np.isnan(diff), np.inf, diff)
            idx = np.unravel_index(int(np.argmax(diff)), diff.shape)
            line += "\n      worst at %s: ours %r ref64 %r torch32 %r" % (
                list(int(x) for x in idx), float(got[idx]),
                float(ref[name][idx]), float(t32[name][idx]))
        lines.append(line)
    return ok, lines, stats


# ---------------------------------------------------------------------------
# Running the CLI


def run_cli(cmd, ypath, timeout):
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return "CLI timed out after %ds: %s" % (timeout, " ".join(cmd))
    except OSError as exc:
        return "CLI could not start: %s" % exc
    if p.returncode != 0:
        return ("CLI exit status %d: %s\n      stderr: %s"
                % (p.returncode, " ".join(cmd),
                   p.stderr.decode("utf-8", "replace").strip()[:2000]))
    try:
        tensors, _, dtypes = st_load(ypath)
    except (OSError, ValueError) as exc:
        return "cannot read the CLI's output: %s" % exc
    for name, dt in dtypes.items():
        if dt != "F32":
            return "output %s has dtype %s, expected F32" % (name, dt)
    return tensors


class Runner:
    def __init__(self, args):
        self.args = args
        self.pool = ThreadPoolExecutor(max_workers=max(1, args.jobs))
        self.pending = []
        self.results = {}   # cid -> (ok, ours)
        self.counts = {}    # group -> [passed, failed]
        self.failures = []
        self.worst = {}     # group -> (err/tol, cid, tensor)
        self.remeasured = []  # cases whose torch32 error was re-measured

    def submit(self, case):
        a = self.args
        try:
            ref = torch_expected(case, torch.float64)
            t32 = torch_expected(case, torch.float32)
        except Exception as exc:
            self._record(case, False, ["harness error computing the torch "
                                       "reference: %s: %s"
                                       % (type(exc).__name__, exc)], None, None)
            return
        safe = case.cid.replace(":", "_")
        w = os.path.join(a.tmp, "c%s_w.safetensors" % safe)
        x = os.path.join(a.tmp, "c%s_x.safetensors" % safe)
        y = os.path.join(a.tmp, "c%s_y.safetensors" % safe)
        if os.path.exists(y):
            os.remove(y)
        case.write_files(w, x)
        cmd = case.cli_args(a.mha, w, x, y, a.impl)
        fut = self.pool.submit(run_cli, cmd, y, a.timeout)
        self.pending.append((case, ref, t32, fut, cmd, (w, x, y)))
        while len(self.pending) > 4 * max(1, a.jobs):
            self._finish_one()

    def _finish_one(self):
        case, ref, t32, fut, cmd, files = self.pending.pop(0)
        ours = fut.result()
        first = {}
        ok, lines, stats = compare(case, ours, ref, t32, forward_peer(case), first)
        for name, r in first.items():
            self.remeasured.append("%s %s (%.3g of the first bound, %.3g of the second)"
                                   % (case.cid, name, r, stats[name][0] / stats[name][1]))
        if first and ok and not self.args.verbose:  # say so even when it passes
            print("ok   %s" % case.describe())
            for ln in lines:
                print("      " + ln)
        for name, (err, tol) in stats.items():
            w = self.worst.get(case.group)
            if w is None or err / tol > w[0]:
                self.worst[case.group] = (err / tol, case.cid, name)
        if not ok:
            lines.append("reproduce: %s" % " ".join(cmd))
        elif not self.args.keep:
            for f in files:
                try:
                    os.remove(f)
                except OSError:
                    pass
        self._record(case, ok, lines, ours if ok else None, ref)

    def _record(self, case, ok, lines, ours, ref):
        cnt = self.counts.setdefault(case.group, [0, 0])
        cnt[0 if ok else 1] += 1
        self.results[case.cid] = (ok, ours)
        if not ok:
            self.failures.append(case.cid)
        if not ok or self.args.verbose:
            print("%s %s" % ("ok  " if ok else "FAIL", case.describe()))
            for ln in lines:
                print("      " + ln)
            sys.stdout.flush()

    def drain(self):
        while self.pending:
            self._finish_one()


def check_3d_groups(runner, groups):
    """Extra check of test_multihead_attn_3d_attn_mask: the CLI's output for
    the 3-D mask equals its outputs per batch element with the 2-D masks."""
    passed = failed = 0
    for g in groups:
        c3, rest = g[0], g[1:]
        ok3, o3 = runner.results.get(c3.cid, (False, None))
        if not ok3 or any(not runner.results.get(c.cid, (False,))[0] for c in rest):
            continue  # already counted as failures
        worst = 0.0
        scale = float(np.max(np.abs(o3["attn_output"]))) + 1.0
        for i, c2 in enumerate(rest):
            o2 = runner.results[c2.cid][1]
            worst = max(worst, max_err(o3["attn_output"][:, i:i + 1],
                                       o2["attn_output"].astype(np.float64)))
        good = worst <= 1e-5 * scale
        if good:
            passed += 1
        else:
            failed += 1
            runner.failures.append(c3.cid + ":consistency")
        if not good or runner.args.verbose:
            print("%s [%s] 3-D mask output vs per-batch 2-D mask outputs: "
                  "max diff %.3g (allowed %.3g)"
                  % ("ok  " if good else "FAIL", c3.cid, worst, 1e-5 * scale))
    cnt = runner.counts.setdefault("pytorch", [0, 0])
    cnt[0] += passed
    cnt[1] += failed


# ---------------------------------------------------------------------------
# Self-test (no CLI needed)


def self_test(args):
    passed = failed = 0

    def check(cond, what):
        nonlocal passed, failed
        if cond:
            passed += 1
        else:
            failed += 1
            print("self-test FAIL: %s" % what)

    os.makedirs(args.tmp, exist_ok=True)
    # 1. safetensors round trip
    path = os.path.join(args.tmp, "selftest.safetensors")
    rng = np.random.default_rng(5)
    ts = [("a.b", rng.standard_normal((3, 4)).astype(np.float32)),
          ("mask", rng.random((2, 5)) < 0.5),
          ("d", rng.standard_normal(7)),
          ("scalar", np.array(2.5, dtype=np.float32)),
          ("empty", np.zeros((0, 3), dtype=np.float32)),
          ("u8", np.arange(5, dtype=np.uint8))]
    st_save(path, ts, {"num_heads": "4"})
    got, meta, dts = st_load(path)
    check(meta == {"num_heads": "4"}, "metadata round trip %r" % meta)
    for name, arr in ts:
        check(name in got and got[name].shape == arr.shape
              and got[name].dtype == arr.dtype and np.array_equal(got[name], arr),
              "round trip of %s" % name)
    check(dts["mask"] == "BOOL" and dts["a.b"] == "F32" and dts["d"] == "F64",
          "dtype names %r" % dts)
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    check(n % 8 == 0, "header padded to 8")
    hdr = json.loads(raw[8:8 + n])
    check(hdr["mask"]["dtype"] == "BOOL"
          and hdr["mask"]["data_offsets"][1] - hdr["mask"]["data_offsets"][0] == 10,
          "BOOL is one byte per element")
    check(raw[8 + n:8 + n + 4] == struct.pack("<f", float(ts[0][1].flat[0])),
          "data little-endian, first tensor at data offset 0")
    for bad in (raw[:5], raw[:-1], raw + b"\0"):
        with open(path, "wb") as f:
            f.write(bad)
        try:
            st_load(path)
            check(False, "truncated/extended file accepted")
        except ValueError:
            check(True, "")
    os.remove(path)

    def tiny_case(E, H, L, S, mask, bias_out, cid):
        c = Case(cid, "self", E, H, L, S, None, bias=True, need_weights=True,
                 average=False)
        c.params = [("in_proj_weight", np.concatenate([np.eye(E)] * 3).astype(np.float32)),
                    ("in_proj_bias", np.zeros(3 * E, np.float32)),
                    ("out_proj.weight", np.eye(E, dtype=np.float32)),
                    ("out_proj.bias", np.array(bias_out, np.float32))]
        c.query = np.array([[1.0, 2.0], [0.5, -1.0]], np.float32)[:L]
        c.key = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)[:S]
        c.value = np.array([[3.0, 4.0], [-5.0, 6.0]], np.float32)[:S]
        c.attn_mask = mask
        return c

    # 2. hand-computed fully masked rows, H = 1: row 0 sees nothing, row 1
    # sees key 0 only -> out row 0 = out_proj.bias, row 1 = v0 + bias
    c = tiny_case(2, 1, 2, 2, np.array([[True, True], [False, True]]),
                  [0.5, -0.25], "hand1")
    for dt in (torch.float64, torch.float32):
        r = torch_expected(c, dt)
        check(np.allclose(r["attn_output"], [[0.5, -0.25], [3.5, 3.75]]),
              "hand case 1 output %r" % r["attn_output"])
        check(np.allclose(r["attn_output_weights"], [[[0, 0], [1, 0]]]),
              "hand case 1 weights %r" % r["attn_output_weights"])
    c.average = True
    r = torch_expected(c, torch.float64)
    check(np.allclose(r["attn_output_weights"], [[0, 0], [1, 0]]),
          "hand case 1 averaged weights")
    # H = 2 (d = 1), 3-D mask: head 0 fully masked on row 0, head 1 row 0
    # sees key 1 only -> row 0 = [0, v1[1]] + bias = [0.5, 5.75]; row 1:
    # head 0 sees key 0 only (3), head 1 sees both keys.
    m = np.array([[[True, True], [False, True]],
                  [[True, False], [False, False]]])
    c = tiny_case(2, 2, 2, 2, m, [0.5, -0.25], "hand2")
    # head 1, row 1: q = -1 (feature 1), keys' feature 1: 0 and 1
    s = np.array([0.0, -1.0])
    p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
    h1 = p[0] * 4.0 + p[1] * 6.0
    want = np.array([[0.5, 6.0 - 0.25], [3.0 + 0.5, h1 - 0.25]])
    for dt in (torch.float64, torch.float32):
        r = torch_expected(c, dt)
        check(np.allclose(r["attn_output"], want, atol=1e-6),
              "hand case 2 output %r want %r" % (r["attn_output"], want))
        check(np.allclose(r["attn_output_weights"],
                          [[[0, 0], [1, 0]], [[0, 1], p]], atol=1e-6),
              "hand case 2 weights %r" % r["attn_output_weights"])
    check(np.allclose(numpy_forward(c)["attn_output"], want, atol=1e-6),
          "numpy model on hand case 2")

    # 3. random configs: torch (with the fully-masked patching) against the
    # independent numpy model in float64; the numpy model in float32 against
    # the tolerance rule (what a float32 C implementation faces)
    n_full = n_cases = 0
    worst_ratio = 0.0
    worst_case = None
    for i in range(args.self_test_configs):
        c = with_weights_block(random_case(args.seed, i), args.seed, i)
        _, FM = combined_mask(c)
        n_full += bool(FM.any())
        ref = torch_expected(c, torch.float64)
        t32 = torch_expected(c, torch.float32)
        m64 = numpy_forward(c, np.float64)
        for k in ref:
            # float64 against float64: rounding differences only
            e = max_err(m64[k].astype(np.float64), ref[k])
            check(e <= 1e-6 * (1 + float(np.max(np.abs(ref[k]), initial=0.0))),
                  "numpy float64 model vs torch float64 on %s %s: %.3g"
                  % (c.describe(), k, e))
        m32 = numpy_forward(c, np.float32)
        ok, lines, stats = compare(c, m32, ref, t32)
        n_cases += 1
        for k, (e, tol) in stats.items():
            if tol > 0 and e / tol > worst_ratio:
                worst_ratio, worst_case = e / tol, (c.describe(), k)
        if not ok and args.verbose:
            print("numpy float32 model outside tolerance: %s" % c.describe())
            for ln in lines:
                print("      " + ln)
        check(ok or not args.strict_model,
              "numpy float32 model within tolerance on %s" % c.cid)
    print("self-test: %d random configs (%d with fully masked rows); numpy "
          "float32 model: worst err/tol %.3g %s"
          % (n_cases, n_full, worst_ratio, worst_case or ""))
    # 4. PyTorch-case generators build and evaluate
    cases, _ = pytorch_cases(args.seed, 2)
    for c in cases:
        ref = torch_expected(c, torch.float64)
        m64 = numpy_forward(c, np.float64)
        for k in ref:
            e = max_err(m64[k].astype(np.float64), ref[k])
            check(e <= 1e-6 * (1 + float(np.max(np.abs(ref[k]), initial=0.0))),
                  "numpy model vs torch on %s %s: %.3g" % (c.cid, k, e))
    print("self-test: %d pytorch cases checked" % len(cases))
    print("%d passed, %d failed" % (passed, failed))
    return 1 if failed else 0


# ---------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mha", help="path to the mha CLI binary")
    ap.add_argument("--tmp", default=None, help="scratch directory")
    ap.add_argument("--configs", type=int, default=500,
                    help="random grid size (default 500)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--only", default=None,
                    help="comma-separated case ids: N (random config N) or "
                         "pt:... ids as printed")
    ap.add_argument("--pt-iters", type=int, default=100,
                    help="iterations per _multihead_attn_test_helper "
                         "variant and averaging mode (default 100, as PyTorch)")
    ap.add_argument("--impl", default=None, help="pass --impl NAME to the CLI")
    ap.add_argument("--jobs", type=int, default=2, help="parallel CLI runs")
    ap.add_argument("--timeout", type=int, default=60,
                    help="seconds per CLI run")
    ap.add_argument("--keep", action="store_true",
                    help="keep the files of passing cases")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--self-test", action="store_true",
                    help="check the harness itself (no CLI needed)")
    ap.add_argument("--self-test-configs", type=int, default=300)
    ap.add_argument("--strict-model", action="store_true",
                    help="self-test: the numpy float32 model must pass too")
    args = ap.parse_args()

    torch.set_num_threads(1)
    if args.tmp is None:
        args.tmp = os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                "mha_conformance_%d" % os.getpid())
    os.makedirs(args.tmp, exist_ok=True)

    if args.self_test:
        return self_test(args)

    if not args.mha or not os.path.isfile(args.mha) or not os.access(args.mha, os.X_OK):
        print("conformance: the mha CLI %r is not an executable file "
              "(pass --mha PATH)" % args.mha)
        print("0 passed, 1 failed")
        return 1
    args.mha = os.path.abspath(args.mha)

    t0 = time.time()
    only = None
    if args.only:
        only = set(s.strip() for s in args.only.split(",") if s.strip())

    runner = Runner(args)
    random_ids = range(args.configs)
    if only is not None:
        random_ids = sorted(int(s) for s in only if s.isdigit())
    for i in random_ids:
        runner.submit(with_weights_block(random_case(args.seed, i), args.seed, i))
    runner.drain()
    t_random = time.time() - t0

    groups = []
    want_pt = (args.pt_iters > 0 if only is None
               else any(s.startswith("pt:") for s in only))
    if want_pt:
        pcases, groups = pytorch_cases(args.seed, max(args.pt_iters, 100
                                                      if only else 0))
        if only is not None:
            pcases = [c for c in pcases if c.cid in only]
            groups = [g for g in groups if all(c.cid in only for c in g)]
        for c in pcases:
            runner.submit(c)
        runner.drain()
        check_3d_groups(runner, groups)
    runner.pool.shutdown()

    rp, rf = runner.counts.get("random", [0, 0])
    pp, pf = runner.counts.get("pytorch", [0, 0])
    print("random grid (seed %d): %d passed, %d failed" % (args.seed, rp, rf))
    print("pytorch cases: %d passed, %d failed (saved_kv variants run without "
          "static_k/static_v, which the CLI cannot express)" % (pp, pf))
    for g in ("random", "pytorch"):
        if g in runner.worst:
            print("%s: largest err/tol %.3g ([%s] %s)"
                  % (g, *runner.worst[g]))
    if runner.failures:
        shown = runner.failures[:40]
        print("failed: %s%s" % (", ".join(shown),
                                " ..." if len(runner.failures) > 40 else ""))
    print("time: %.1fs (random grid %.1fs)" % (time.time() - t0, t_random))
    report_bounds(runner, "conformance")
    total_p, total_f = rp + pp, rf + pf
    if total_p + total_f == 0:
        print("conformance: no cases ran")
        total_f = 1
    print("%d passed, %d failed" % (total_p, total_f))
    return 1 if total_f else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""test_rope_scaling.py: RoPE scaling (linear, dynamic NTK, YaRN, llama3)
and RoPE positions against Hugging Face transformers (5.x, the torch2 venv).

(a) mha_rope_frequencies (ctypes into libmha) against transformers'
    ROPE_INIT_FUNCTIONS (modeling_rope_utils.py) for every type and several
    configs: head dims, partial rotary (dim = head_dim * partial_rotary_factor),
    dynamic below and above the original length (seq_len given as an int,
    transformers' Python-double path, and as a tensor, its forward's float32
    path), YaRN with and without mscale / mscale_all_dim / attention_factor /
    truncate / betas, llama3 with its three bands. transformers computes the
    frequencies in float32 and mha in double, so inv_freq must agree within
    float32 rounding: |mha - hf| <= 2^-24 (8 + 4 |ln theta'|) |mha| (theta'
    the effective base: the exponent 2i/dim and the base are rounded to
    float32 before the power). attention_factor (a Python float in
    transformers) to 1e-12 relative. Also against this file's float64
    transcription of the formulas (inv64 below) to 1e-12 relative: the double
    computation is the formula itself.
(b) `mha forward` and `mha backward` (--impl reference and fused; through
    the CLI, --rope-scaling ... and the inputs' position_ids, including
    left-padding-style and repeated positions) against a float64 torch
    forward / autograd with cos and sin from inv64 (times the attention
    factor); torch32, the same computation in float32 with transformers' own
    float32 frequencies (LlamaRotaryEmbedding for the neox full-rotary cases,
    so its dynamic update and attention_scaling are the ones used), gives
    the tolerance rule of the project:
        max|ours - ref64| <= max(4 max|torch32 - ref64|, 4e-6 (1 + max|ref64|))
    (conformance.py's tolerance; its worst err/tol is stated before the
    last line, "rope: worst error/bound R (CASE, TENSOR)"),
    and `--incremental` (the KV cache, mha_forward_cached with position_ids
    per chunk) against the full forward within 2e-5 (1 + max|full|), for the
    types whose frequencies do not depend on the call (dynamic: chunk = the
    whole sequence).

Usage: python tests/rope/test_rope_scaling.py --lib build/libmha.so
           --mha build/mha --tmp DIR [-v]
Exits 77 (skipped) when torch or transformers cannot be imported; ends with
"N passed, M failed" and exits 1 when anything failed.
"""

import argparse
import ctypes as C
import math
import os
import subprocess
import sys

try:
    import numpy as np
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.utils import logging as hf_logging
except Exception as exc:  # pragma: no cover - environment
    print("test_rope_scaling: skipped (cannot import torch/transformers: %s: %s)"
          % (type(exc).__name__, exc))
    sys.exit(77)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                "conformance"))
import conformance as conf  # noqa: E402  (st_save, st_load)

hf_logging.set_verbosity_error()
TYPES = {"none": 0, "linear": 1, "dynamic": 2, "yarn": 3, "llama3": 4}
EPS32 = 2.0 ** -24


class Rope(C.Structure):
    _fields_ = [("mode", C.c_int), ("theta", C.c_double), ("dim", C.c_int64)]


class Scaling(C.Structure):
    _fields_ = [("type", C.c_int), ("factor", C.c_double),
                ("original_max_position", C.c_int64), ("low_freq_factor", C.c_double),
                ("high_freq_factor", C.c_double), ("beta_fast", C.c_double),
                ("beta_slow", C.c_double), ("mscale", C.c_double),
                ("mscale_all_dim", C.c_double), ("attention_factor", C.c_double),
                ("truncate", C.c_bool)]


def mha_freqs(lib, cfg, seq):
    r = Rope(1, cfg["theta"], cfg["dim"] if cfg["dim"] != cfg["head_dim"] else 0)
    s = Scaling()
    lib.mha_rope_scaling_init(C.byref(s), TYPES[cfg["type"]])
    for k in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
              "mscale", "mscale_all_dim", "attention_factor"):
        if k in cfg:
            setattr(s, k, cfg[k])
    if "orig" in cfg:
        s.original_max_position = cfg["orig"]
    if "truncate" in cfg:
        s.truncate = cfg["truncate"]
    half = cfg["dim"] // 2
    inv = (C.c_double * half)()
    af = C.c_double()
    st = lib.mha_rope_frequencies(inv, C.byref(af), C.byref(r), C.byref(s),
                                  C.c_int64(cfg["head_dim"]), C.c_int64(seq))
    if st != 0:
        raise RuntimeError("mha_rope_frequencies: %s" % lib.mha_last_error().decode())
    return np.array(inv[:], dtype=np.float64), af.value


def hf_config(cfg):
    """A LlamaConfig carrying cfg's RoPE (dynamic: max_position_embeddings is
    the original length; the others keep original_max_position_embeddings
    in rope_parameters)."""
    rp = {"rope_type": cfg["type"] if cfg["type"] != "none" else "default",
          "rope_theta": cfg["theta"]}
    if cfg["dim"] != cfg["head_dim"]:
        rp["partial_rotary_factor"] = cfg["dim"] / cfg["head_dim"]
    for k in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
              "mscale", "mscale_all_dim", "attention_factor", "truncate"):
        if k in cfg:
            rp[k] = cfg[k]
    maxpos = cfg.get("orig", 64)
    if cfg["type"] in ("yarn", "llama3"):
        rp["original_max_position_embeddings"] = cfg["orig"]
        maxpos = int(cfg["orig"] * cfg.get("factor", 1.0))
    return LlamaConfig(hidden_size=cfg["head_dim"] * 2, num_attention_heads=2,
                       num_key_value_heads=2, head_dim=cfg["head_dim"],
                       max_position_embeddings=maxpos, rope_parameters=rp)


def hf_freqs(cfg, seq, tensor_seq=True):
    if cfg["type"] == "none":  # (linear with factor 1: transformers' partial rotary)
        if cfg["dim"] == cfg["head_dim"]:
            inv, af = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_config(cfg))
            return inv.double().numpy(), af
        cfg = dict(cfg, type="linear", factor=1.0)
    c = hf_config(cfg)
    sl = None if seq is None else (torch.tensor(seq) if tensor_seq else seq)
    inv, af = ROPE_INIT_FUNCTIONS[cfg["type"]](c, "cpu", seq_len=sl)
    return inv.double().numpy(), float(af)


def inv64(cfg, seq):
    """transformers' formulas, transcribed in float64."""
    dim, theta, t = cfg["dim"], cfg["theta"], cfg["type"]
    i = np.arange(0, dim, 2, dtype=np.float64)
    af = 1.0
    if t == "dynamic":
        orig, f = cfg["orig"], cfg["factor"]
        s = max(seq, orig)
        theta = theta * ((f * s / orig) - (f - 1)) ** (dim / (dim - 2))
    inv = 1.0 / theta ** (i / dim)
    if t == "linear":
        inv = inv / cfg["factor"]
    elif t == "yarn":
        f, orig = cfg["factor"], cfg["orig"]

        def ms(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        af = cfg.get("attention_factor") or None
        if af is None:
            m, ma = cfg.get("mscale"), cfg.get("mscale_all_dim")
            af = ms(f, m) / ms(f, ma) if (m and ma) else ms(f)
        bf, bs = cfg.get("beta_fast") or 32, cfg.get("beta_slow") or 1

        def cd(nrot):
            return dim * math.log(orig / (nrot * 2 * math.pi)) / (2 * math.log(theta))
        lo, hi = cd(bf), cd(bs)
        if cfg.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - lo) / (hi - lo), 0, 1)
        e = 1 - ramp
        inv = inv / f * (1 - e) + inv * e
    elif t == "llama3":
        f, lo_f, hi_f, orig = cfg["factor"], cfg["low_freq_factor"], cfg["high_freq_factor"], \
            cfg["orig"]
        wl = 2 * math.pi / inv
        out = np.where(wl > orig / lo_f, inv / f, inv)
        sm = (orig / wl - lo_f) / (hi_f - lo_f)
        med = ~(wl < orig / hi_f) & ~(wl > orig / lo_f)
        inv = np.where(med, (1 - sm) * out / f + sm * out, out)
    return inv, af


def theta_eff(cfg, seq):
    if cfg["type"] != "dynamic":
        return cfg["theta"]
    orig, f, dim = cfg["orig"], cfg["factor"], cfg["dim"]
    return cfg["theta"] * ((f * max(seq, orig) / orig) - (f - 1)) ** (dim / (dim - 2))


def freq_configs():
    out = []
    for hd, dim in ((16, 16), (64, 64), (64, 32), (128, 128), (128, 32), (80, 40)):
        for theta in (10000.0, 500000.0):
            base = {"head_dim": hd, "dim": dim, "theta": theta}
            out.append(dict(base, type="none"))
            for f in (0.5, 2.0, 4.0):
                out.append(dict(base, type="linear", factor=f))
            for f in (2.0, 8.0):
                out.append(dict(base, type="dynamic", factor=f, orig=64))
            out.append(dict(base, type="yarn", factor=4.0, orig=64))
            out.append(dict(base, type="yarn", factor=40.0, orig=4096, mscale=1.0,
                            mscale_all_dim=1.0))
            out.append(dict(base, type="yarn", factor=16.0, orig=256, mscale=0.707,
                            mscale_all_dim=0.5))
            out.append(dict(base, type="yarn", factor=8.0, orig=2048, truncate=False))
            out.append(dict(base, type="yarn", factor=2.0, orig=128, beta_fast=16.0,
                            beta_slow=2.0, attention_factor=1.3))
            out.append(dict(base, type="yarn", factor=0.5, orig=32))
            out.append(dict(base, type="llama3", factor=8.0, orig=8192, low_freq_factor=1.0,
                            high_freq_factor=4.0))
            out.append(dict(base, type="llama3", factor=32.0, orig=64, low_freq_factor=2.0,
                            high_freq_factor=3.0))
    return out


def check_freqs(lib, verbose):
    passed = failed = 0
    worst = 0.0
    for cfg in freq_configs():
        seqs = [0, 50, 64, 65, 200, 5000] if cfg["type"] == "dynamic" else [0]
        for seq in seqs:
            for tensor_seq in ((True, False) if cfg["type"] == "dynamic" else (True,)):
                desc = "%s seq %d%s" % (cfg, seq, " (tensor)" if tensor_seq else " (int)")
                ours, af = mha_freqs(lib, cfg, seq)
                # transformers' dynamic at init (seq None) uses
                # max_position_embeddings, as mha for any seq below it
                hf, hf_af = hf_freqs(cfg, seq if seq else None, tensor_seq)
                r64, af64 = inv64(cfg, seq)
                if cfg["type"] == "llama3":  # a band edge within float32 rounding
                    wl = 2 * math.pi / (1.0 / cfg["theta"] ** (
                        np.arange(0, cfg["dim"], 2) / cfg["dim"]))
                    edges = np.array([cfg["orig"] / cfg["low_freq_factor"],
                                      cfg["orig"] / cfg["high_freq_factor"]])
                    if np.min(np.abs(wl[:, None] / edges[None, :] - 1)) < 1e-5:
                        print("note: %s has a wavelength at a band edge" % desc)
                bound = EPS32 * (8 + 4 * abs(math.log(theta_eff(cfg, seq))))
                rel32 = float(np.max(np.abs(ours - hf) / np.abs(ours)))
                rel64 = float(np.max(np.abs(ours - r64) / np.abs(ours)))
                ok = (ours.shape == hf.shape and rel32 <= bound and rel64 <= 1e-12 and
                      abs(af - hf_af) <= 1e-12 * abs(hf_af) and abs(af - af64) <= 1e-12 * af64)
                worst = max(worst, rel32 / bound)
                if ok:
                    passed += 1
                    if verbose:
                        print("ok   freqs %s: rel vs hf %.3g (bound %.3g), vs f64 %.3g, af %r"
                              % (desc, rel32, bound, rel64, af))
                else:
                    failed += 1
                    print("FAIL freqs %s: rel vs hf %.3g (bound %.3g), vs f64 %.3g, af %r hf %r "
                          "f64 %r" % (desc, rel32, bound, rel64, af, hf_af, af64))
    print("frequencies: %d passed, %d failed; worst error %.2f of the bound"
          % (passed, failed, worst))
    return passed, failed


# ---------------------------------------------------------------------------
# (b) the module forward and backward through the CLI


def rope_apply(x, cos, sin, dim, interleaved):
    """x (N, H, L, d); cos, sin (N, L, dim/2): rotate the first dim
    features (neox: halves; interleaved: pairs), the rest pass through."""
    half = dim // 2
    c, s = cos[:, None], sin[:, None]
    if interleaved:
        a, b = x[..., 0:dim:2], x[..., 1:dim:2]
        ra, rb = a * c - b * s, b * c + a * s
        rot = torch.stack((ra, rb), dim=-1).reshape(x[..., :dim].shape)
    else:
        a, b = x[..., :half], x[..., half:dim]
        rot = torch.cat((a * c - b * s, b * c + a * s), dim=-1)
    return torch.cat((rot, x[..., dim:]), dim=-1)


def torch_mha(x, W, pos, cos, sin, H, dim, interleaved, causal, dtype):
    """Self-attention (N, L, E) with RoPE; returns (out, grads dict)."""
    N, L, E = x.shape
    d = E // H
    xt = torch.tensor(x, dtype=dtype, requires_grad=True)
    w = {k: torch.tensor(v, dtype=dtype, requires_grad=True) for k, v in W.items()}
    qkv = xt @ w["in_proj_weight"].T + w["in_proj_bias"]
    q, k, v = (t.reshape(N, L, H, d).transpose(1, 2) for t in qkv.split(E, dim=-1))
    c = torch.tensor(cos, dtype=dtype)
    s = torch.tensor(sin, dtype=dtype)
    q, k = rope_apply(q, c, s, dim, interleaved), rope_apply(k, c, s, dim, interleaved)
    sc = q @ k.transpose(-1, -2) / math.sqrt(d)
    if causal:
        sc = sc.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    ctx = (sc.softmax(-1) @ v).transpose(1, 2).reshape(N, L, E)
    out = ctx @ w["out_proj.weight"].T + w["out_proj.bias"]
    g = torch.tensor(W["_gout"], dtype=dtype)
    (out * g).sum().backward()
    grads = {"grad_in": xt.grad.double().numpy(),
             "grad_in_proj_weight": w["in_proj_weight"].grad.double().numpy(),
             "grad_out_proj.weight": w["out_proj.weight"].grad.double().numpy()}
    return out.detach().double().numpy(), grads


def cos_sin64(cfg, pos):
    seq = int(pos.max()) + 1
    inv, af = inv64(cfg, seq)
    ang = pos[..., None].astype(np.float64) * inv
    return np.cos(ang) * af, np.sin(ang) * af


def cos_sin32(cfg, pos, interleaved):
    """transformers' float32 cos/sin: LlamaRotaryEmbedding (its dynamic
    update, attention_scaling) for neox full rotary, else its frequencies."""
    pt = torch.tensor(pos, dtype=torch.int64)
    if not interleaved and cfg["dim"] == cfg["head_dim"]:
        emb = LlamaRotaryEmbedding(hf_config(cfg))
        cos, sin = emb(torch.zeros(1, dtype=torch.float32), pt)
        half = cfg["dim"] // 2
        return cos[..., :half].numpy(), sin[..., :half].numpy()
    inv, af = hf_freqs(cfg, int(pos.max()) + 1)
    inv = torch.tensor(inv, dtype=torch.float32)
    f = pt[..., None].float() * inv
    return (f.cos() * af).numpy(), (f.sin() * af).numpy()


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return p.returncode, p.stderr.strip()


def scaling_flags(cfg):
    if cfg["type"] == "none":
        return []
    f = ["--rope-scaling", cfg["type"]]
    names = {"factor": "--rope-factor", "orig": "--rope-original-max",
             "low_freq_factor": "--rope-low-freq-factor",
             "high_freq_factor": "--rope-high-freq-factor", "beta_fast": "--rope-beta-fast",
             "beta_slow": "--rope-beta-slow", "mscale": "--rope-mscale",
             "mscale_all_dim": "--rope-mscale-all-dim",
             "attention_factor": "--rope-attention-factor"}
    for k, flag in names.items():
        if k in cfg:
            f += [flag, repr(cfg[k])]
    if cfg.get("truncate", True) is False:
        f.append("--rope-no-truncate")
    return f


def module_configs():
    d = 16
    out = []
    sc = [{"type": "none"}, {"type": "linear", "factor": 4.0},
          {"type": "dynamic", "factor": 3.0, "orig": 8},
          {"type": "dynamic", "factor": 3.0, "orig": 64},
          {"type": "yarn", "factor": 8.0, "orig": 8},
          {"type": "yarn", "factor": 16.0, "orig": 4, "mscale": 1.0, "mscale_all_dim": 0.5,
           "truncate": False},
          {"type": "yarn", "factor": 4.0, "orig": 8, "attention_factor": 1.5},
          {"type": "llama3", "factor": 8.0, "orig": 16, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0}]
    for i, s in enumerate(sc):
        for mode in ("neox", "interleaved"):
            for dim in (d, d // 2):
                c = dict(s, head_dim=d, dim=dim, theta=100.0 if i % 2 else 10000.0,
                         mode=mode)
                out.append(c)
    return out


def positions(kind, N, L, rng):
    if kind == "default":
        return None, np.tile(np.arange(L), (N, 1))
    if kind == "leftpad":  # transformers' cumsum(mask) - 1, padding at 1
        p = np.zeros((N, L), dtype=np.int64)
        for n in range(N):
            pad = int(rng.integers(0, L // 2 + 1))
            p[n, pad:] = np.arange(L - pad)
            p[n, :pad] = 1
        return p, p
    if kind == "repeat":  # repeated and unordered positions
        p = rng.integers(0, 3 * L, size=(N, L)).astype(np.int64)
        p[:, 1] = p[:, 0]
        return p, p
    p = np.tile(np.arange(L) + 40, (N, 1)).astype(np.int64)  # an offset
    return p, p


# The worst err/tol of (b)'s rule: [ratio, case, tensor].
WORST = [0.0, None, None]


def check_module(mha, tmp, verbose):
    rng = np.random.default_rng(7)
    passed = failed = 0
    H, d = 2, 16
    E = H * d
    w = os.path.join(tmp, "w.safetensors")
    rc, err = run([mha, "init", "--embed-dim", str(E), "--num-heads", str(H), "--seed", "5",
                   "--out", w])
    if rc:
        print("FAIL mha init: %s" % err)
        return 0, 1
    W = {k: v.astype(np.float64) for k, v in conf.st_load(w)[0].items()}
    for ci, cfg in enumerate(module_configs()):
        kind = ("default", "leftpad", "repeat", "offset")[ci % 4]
        N, L = 2, int(rng.integers(5, 24))
        causal = ci % 3 != 0
        x = rng.standard_normal((N, L, E)).astype(np.float32)
        g = rng.standard_normal((N, L, E)).astype(np.float32)
        pfile, pos = positions(kind, N, L, rng)
        xp = os.path.join(tmp, "x%d.safetensors" % ci)
        gp = os.path.join(tmp, "g%d.safetensors" % ci)
        conf.st_save(xp, [("query", x)] + ([("position_ids", pfile)] if pfile is not None
                                            else []))
        conf.st_save(gp, [("grad_attn_output", g)])
        inter = cfg["mode"] == "interleaved"
        W["_gout"] = g.astype(np.float64)
        c64, s64 = cos_sin64(cfg, pos)
        c32, s32 = cos_sin32(cfg, pos, inter)
        ref, gref = torch_mha(x.astype(np.float64), W, pos, c64, s64, H, cfg["dim"], inter,
                              causal, torch.float64)
        t32, g32 = torch_mha(x, {k: v.astype(np.float32) for k, v in W.items()}, pos, c32,
                             s32, H, cfg["dim"], inter, causal, torch.float32)
        # the case must tell the scaling apart: the unscaled forward is far
        # outside the tolerance (dynamic below its original length: equal)
        if cfg["type"] != "none":
            cn, sn = cos_sin64(dict(cfg, type="none"), pos)
            un, _ = torch_mha(x.astype(np.float64), W, pos, cn, sn, H, cfg["dim"], inter,
                              causal, torch.float64)
            below = cfg["type"] == "dynamic" and int(pos.max()) + 1 <= cfg["orig"]
            dn = float(np.max(np.abs(un - ref)))
            tol, _ = conf.tolerance(ref, t32)
            if (dn == 0.0) if below else (dn > 10 * tol):
                passed += 1
            else:
                failed += 1
                print("FAIL [%d] %s: unscaled differs by %.3g (tol %.3g)" % (ci, cfg, dn, tol))
        flags = ["--batch-first", "--num-heads", str(H), "--rope", cfg["mode"],
                 "--rope-theta", repr(cfg["theta"])] + scaling_flags(cfg)
        if cfg["dim"] != d:
            flags += ["--rope-dim", str(cfg["dim"])]
        if causal:
            flags.append("--causal")
        desc = "[%d] %s positions %s causal %d L %d" % (ci, cfg, kind, causal, L)
        full = None
        for impl in ("reference", "fused"):
            y = os.path.join(tmp, "y%d_%s.safetensors" % (ci, impl))
            gy = os.path.join(tmp, "gy%d_%s.safetensors" % (ci, impl))
            rc, err = run([mha, "forward", "--weights", w, "--inputs", xp, "--out", y,
                           "--impl", impl] + flags)
            rc2, err2 = (0, "") if rc else run(
                [mha, "backward", "--weights", w, "--inputs", xp, "--grad-output", gp,
                 "--out", gy, "--impl", impl] + flags)
            if rc or rc2:
                print("FAIL %s %s: %s" % (desc, impl, err or err2))
                failed += 1
                continue
            out = conf.st_load(y)[0]["attn_output"]
            gt = conf.st_load(gy)[0]
            got = {"out": out,
                   # (self-attention: grad_query is the input's whole gradient)
                   "grad_in": gt["grad_query"].astype(np.float64),
                   "grad_in_proj_weight": gt["grad_in_proj_weight"],
                   "grad_out_proj.weight": gt["grad_out_proj.weight"]}
            refs = dict(gref, out=ref)
            t32s = dict(g32, out=t32)
            msgs, ok = [], True
            for name in got:
                tol, e32 = conf.tolerance(refs[name], t32s[name])
                e = conf.max_err(got[name], refs[name])
                ok &= e <= tol
                r = e / tol if e == e else float("inf")  # tol >= conf.FLOOR
                if WORST[1] is None or r > WORST[0]:
                    WORST[:] = [r, "[%d] %s" % (ci, impl), name]
                msgs.append("%s err %.3g tol %.3g (torch32 %.3g)" % (name, e, tol, e32))
            if impl == "fused":
                full = out
            if ok:
                passed += 1
                if verbose:
                    print("ok   %s %s: %s" % (desc, impl, "; ".join(msgs)))
            else:
                failed += 1
                print("FAIL %s %s: %s" % (desc, impl, "; ".join(msgs)))
        # the KV cache: chunk by chunk (dynamic: one chunk, the frequencies
        # being those of each call's largest position)
        if causal and full is not None:
            chunks = [L] if cfg["type"] == "dynamic" else [1, 3]
            for ch in chunks:
                y = os.path.join(tmp, "inc%d_%d.safetensors" % (ci, ch))
                rc, err = run([mha, "forward", "--weights", w, "--inputs", xp, "--out", y,
                               "--incremental", "--chunk", str(ch)] + flags)
                if rc:
                    print("FAIL %s incremental chunk %d: %s" % (desc, ch, err))
                    failed += 1
                    continue
                inc = conf.st_load(y)[0]["attn_output"].astype(np.float64)
                e = float(np.max(np.abs(inc - full)))
                tol = 2e-5 * (1 + float(np.max(np.abs(full))))
                if e <= tol:
                    passed += 1
                    if verbose:
                        print("ok   %s incremental chunk %d: err %.3g tol %.3g"
                              % (desc, ch, e, tol))
                else:
                    failed += 1
                    print("FAIL %s incremental chunk %d: err %.3g tol %.3g"
                          % (desc, ch, e, tol))
    print("module: %d passed, %d failed" % (passed, failed))
    return passed, failed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--mha", required=True)
    ap.add_argument("--tmp", required=True)
    ap.add_argument("-v", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.tmp, exist_ok=True)
    lib = C.CDLL(args.lib)
    lib.mha_last_error.restype = C.c_char_p
    lib.mha_rope_frequencies.restype = C.c_int
    torch.manual_seed(0)
    p1, f1 = check_freqs(lib, args.v)
    p2, f2 = check_module(args.mha, args.tmp, args.v)
    if WORST[1] is not None:
        print("rope: worst error/bound %.3g (%s, %s)" % tuple(WORST))
    print("%d passed, %d failed" % (p1 + p2, f1 + f2))
    return 1 if f1 + f2 else 0


if __name__ == "__main__":
    sys.exit(main())

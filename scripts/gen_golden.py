#!/usr/bin/python3
"""gen_golden.py: writes tests/golden/*.safetensors, PyTorch's float64
results on a fixed core set of configurations, so that tests/test_golden.c
checks the library against PyTorch on a machine without PyTorch.

Regenerate (Debian 12: /usr/bin/python3 with python3-torch 1.13 and
python3-numpy, i.e. scripts/install-deps.sh --test), from the repository
root:

    /usr/bin/python3 scripts/gen_golden.py            # rewrites tests/golden/
    /usr/bin/python3 scripts/gen_golden.py --check    # compares, writes nothing
    /usr/bin/python3 scripts/gen_golden.py --list     # the configurations

then rebuild and run `ctest -R test_golden`. Regenerate only when the set
below or the file format changes (bump GOLDEN_VERSION, and the C test's,
when the format changes); commit the files with the change.

The references are computed exactly as the conformance suites compute them
(tests/conformance/conformance.py and backward.py, imported here: the same
Case objects, parameter names, input layout and masks):

  ref64    backward.references(): float64 torch autograd through the
           suite's mirror of F.multi_head_attention_forward, which is checked
           on every case against PyTorch itself (float64
           F.multi_head_attention_forward autograd, to 1e-12 relative;
           grouped-query and fully masked cases, which PyTorch 1.13's
           function cannot express, against central finite differences of
           the mirror and, for fully masked rows, the patched PyTorch
           forward),
  torch32  PyTorch's own float32 result on the same numbers
           (F.multi_head_attention_forward autograd; the mirror in float32
           for grouped-query and fully masked cases): its max error against
           ref64, per output tensor, is stored so that the C test applies
           the project's rule exactly:

    max|mha - ref64| <= max(4 * max|torch32 - ref64|, 4e-6 * (1 + max|ref64|))

Each file (one configuration, llm.c style: a magic and a version):
  __metadata__  "mha_golden": "1" (GOLDEN_VERSION), "name", "description"
                (conformance.Case.describe()), "num_heads", "num_kv_heads"
                (grouped-query only), the forward options as "0"/"1":
                "batch_first", "add_zero_attn", "is_causal", "need_weights",
                "average_attn_weights", "self_attention" (key and value are
                the query: absent from the file, and grad_key / grad_value
                are the parts through those paths), "reference" (which
                computation ref64 and torch32 are), "torch" (its version) and
                "torch32_err.<tensor>" ("%.17g") for every expected tensor.
  parameters    under PyTorch's state_dict names (in_proj_weight or
                q/k/v_proj_weight, in_proj_bias, out_proj.weight,
                out_proj.bias, bias_k, bias_v), F32;
  inputs        query, key, value (seq-first (L, N, E), batch-first
                (N, L, E) or unbatched (L, E), as the CLI reads them),
                key_padding_mask and attn_mask (BOOL, or F32 with -inf)
                when used, grad_attn_output: F32;
  expected      attn_output, attn_output_weights (need_weights: averaged
                (N, L, S') or per head (N, H, L, S')), grad_query, grad_key,
                grad_value and grad_<parameter> for every parameter: F64,
                as `mha backward` names them.

Deterministic: fixed seeds, torch on one thread; the inputs and parameters
are the same bits on every machine, the expected values up to the last bits
of the machine's float64 kernels (--check allows 1e-12 relative there).
"""

import argparse
import os
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "conformance"))

try:
    import numpy as np
    import torch
except Exception as exc:  # pragma: no cover - environment problem
    sys.exit("gen_golden: cannot import torch/numpy (%s: %s); run it with "
             "Debian's /usr/bin/python3 and python3-torch" %
             (type(exc).__name__, exc))

import conformance as conf  # noqa: E402  (Case, masks, safetensors)
import backward as bw       # noqa: E402  (references: ref64, torch32)

GOLDEN_VERSION = "1"
SEED = 0x676f6c64  # "gold"
NEG_INF = float("-inf")

# The core set. Keys: the conformance.Case arguments, plus kpm / am (mask
# kinds: "bool", "float"; am also "bool3d", "float3d"), kv_heads, self_attn,
# scale (input scale) and full (a fully masked row: every key of batch
# element 0 padded).
CONFIGS = [
    ("packed_basic", dict(E=8, H=2, L=5, S=6, N=2, need_weights=True)),
    ("packed_no_bias_per_head", dict(E=12, H=3, L=4, S=7, N=2, bias=False,
                                     need_weights=True, average=False)),
    ("separate_kdim_vdim", dict(E=12, H=4, L=6, S=5, N=3, kdim=5, vdim=9,
                                need_weights=True)),
    ("separate_kdim_no_bias", dict(E=8, H=2, L=3, S=4, N=2, kdim=6,
                                   bias=False, kpm="float")),
    ("add_bias_kv", dict(E=8, H=2, L=5, S=4, N=2, add_bias_kv=True, kpm="bool",
                         need_weights=True, average=False)),
    ("add_zero_attn", dict(E=8, H=4, L=3, S=5, N=2, add_zero_attn=True,
                           am="float", need_weights=True, average=False)),
    ("bias_kv_zero_attn_batch_first", dict(E=12, H=2, L=4, S=6, N=2,
                                           add_bias_kv=True,
                                           add_zero_attn=True,
                                           batch_first=True, am="bool3d",
                                           need_weights=True)),
    ("batch_first_kpm_float", dict(E=16, H=4, L=6, S=6, N=3, batch_first=True,
                                   kpm="float", need_weights=True)),
    ("unbatched_masks", dict(E=6, H=2, L=5, S=7, N=None, am="bool",
                             kpm="bool", need_weights=True, average=False)),
    ("unbatched_mask3d_float", dict(E=9, H=3, L=4, S=6, N=None, am="float3d",
                                    need_weights=True)),
    ("attn_mask_float3d_kpm_bool", dict(E=8, H=2, L=5, S=6, N=2, am="float3d",
                                        kpm="bool")),
    ("attn_mask_bool2d_kpm_float", dict(E=8, H=2, L=4, S=5, N=3, am="bool",
                                        kpm="float", need_weights=True)),
    ("causal", dict(E=8, H=2, L=7, S=7, N=2, causal=True, need_weights=True,
                    average=False)),
    ("causal_rect_kpm_float", dict(E=12, H=3, L=5, S=9, N=2, causal=True,
                                   kpm="float", am="float")),
    ("fully_masked_row", dict(E=8, H=2, L=4, S=5, N=2, kpm="bool", full=True,
                              need_weights=True)),
    ("gqa_packed", dict(E=16, H=4, L=6, S=8, N=2, kv_heads=2, kpm="bool",
                        need_weights=True, average=False)),
    ("mqa_separate_causal", dict(E=8, H=4, L=6, S=6, N=2, kv_heads=1, kdim=7,
                                 vdim=5, causal=True, am="float")),
    ("gqa_bias_kv_zero_attn_batch_first", dict(E=12, H=6, L=4, S=5, N=2,
                                               kv_heads=3, add_bias_kv=True,
                                               add_zero_attn=True,
                                               batch_first=True,
                                               need_weights=True)),
    ("self_attention", dict(E=10, H=5, L=6, S=6, N=2, self_attn=True,
                            causal=True, need_weights=True)),
    ("odd_head_dim_1", dict(E=7, H=7, L=1, S=13, N=1, kpm="bool")),
    ("odd_long_tiles", dict(E=8, H=2, L=70, S=135, N=1, causal=True,
                            kpm="bool", am="bool")),
    ("scaled_inputs", dict(E=12, H=3, L=6, S=7, N=2, scale=10.0,
                           need_weights=True)),
]


def build(idx, name, o):
    """The backward.BCase of configuration idx (its own seeded stream)."""
    rng = np.random.default_rng([SEED, idx])
    c = conf.Case(name, "golden", o["E"], o["H"], o["L"], o["S"], o["N"],
                  kdim=o.get("kdim"), vdim=o.get("vdim"),
                  bias=o.get("bias", True),
                  add_bias_kv=o.get("add_bias_kv", False),
                  add_zero_attn=o.get("add_zero_attn", False),
                  batch_first=o.get("batch_first", False),
                  causal=o.get("causal", False),
                  need_weights=o.get("need_weights", False),
                  average=o.get("average", True))
    c.num_kv_heads = o.get("kv_heads")
    c.set_params_random(rng)
    # parameters in state_dict order (set_params_random may shuffle them)
    order = {n: i for i, n in enumerate(bw.PARAM_NAMES)}
    c.params.sort(key=lambda p: order[p[0]])
    scale = o.get("scale", 1.0)
    qs, ks, vs = c.shapes_in()
    c.query = (scale * rng.standard_normal(qs)).astype(np.float32)
    c.key = (scale * rng.standard_normal(ks)).astype(np.float32)
    c.value = (scale * rng.standard_normal(vs)).astype(np.float32)
    self_attn = o.get("self_attn", False)
    if self_attn:
        assert c.L == c.S and c.kdim == c.E and c.vdim == c.E
        c.key = c.value = c.query
    Nb, H, L, S = c.Nb, c.H, c.L, c.S

    def float_mask(shape):  # values and some -inf (never a whole row)
        a = (2.0 * rng.standard_normal(shape)).astype(np.float32)
        hide = rng.random(shape) < 0.25
        hide[..., 0] = False
        a[hide] = NEG_INF
        return a

    am = o.get("am")
    if am:
        shape = (Nb * H, L, S) if am.endswith("3d") else (L, S)
        if am.startswith("bool"):
            m = rng.random(shape) < 0.3
            m[..., 0] = False  # every query row keeps key 0
            c.attn_mask = m
        else:
            c.attn_mask = float_mask(shape)
    kpm = o.get("kpm")
    if kpm:
        shape = (c.N, S) if c.batched else (S,)
        if kpm == "bool":
            m = rng.random(shape) < 0.3
            m[..., 0] = False
            if o.get("full"):
                m[0] = True  # batch element 0: every key padded
            c.key_padding_mask = m
        else:
            c.key_padding_mask = float_mask(shape)
    c.info = "scale=%g" % scale  # (backward.references reads the scale)
    return bw.BCase(c, "golden", name, rng, self_attn=self_attn)


def golden(idx, name, o):
    """(tensors [(name, array)], metadata) of one configuration."""
    b = build(idx, name, o)
    c = b.c
    info = {}
    ref, t32, notes, errors = bw.references(b, info)
    if errors:
        sys.exit("gen_golden: %s: the reference failed its own checks:\n  %s"
                 % (name, "\n  ".join(errors)))
    if info["fm"] != bool(o.get("full")):
        sys.exit("gen_golden: %s: fully masked rows: %s, expected %s"
                 % (name, info["fm"], bool(o.get("full"))))
    names = bw.expected_names(b, True, c.need_weights)
    if set(names) != set(ref):
        sys.exit("gen_golden: %s: reference tensors %s, expected %s"
                 % (name, sorted(ref), sorted(names)))
    tensors = list(c.params)
    tensors.append(("query", c.query))
    if not b.self_attn:
        tensors += [("key", c.key), ("value", c.value)]
    if c.key_padding_mask is not None:
        tensors.append(("key_padding_mask", c.key_padding_mask))
    if c.attn_mask is not None:
        tensors.append(("attn_mask", c.attn_mask))
    tensors.append(("grad_attn_output", b.grad_out))
    meta = {
        "mha_golden": GOLDEN_VERSION,
        "name": name,
        "description": b.describe(),
        "num_heads": str(c.H),
        "batch_first": str(int(c.batch_first)),
        "add_zero_attn": str(int(c.add_zero_attn)),
        "is_causal": str(int(c.causal)),
        "need_weights": str(int(c.need_weights)),
        "average_attn_weights": str(int(c.average)),
        "self_attention": str(int(b.self_attn)),
        "reference": "; ".join([
            "ref64: float64 autograd through backward.py's mirror of "
            "F.multi_head_attention_forward"] + notes + (
            [] if c.num_kv_heads or info["fm"] else
            ["torch32: F.multi_head_attention_forward float32 autograd"])),
        "torch": torch.__version__,
    }
    if c.num_kv_heads:
        meta["num_kv_heads"] = str(c.num_kv_heads)
    for n in names:
        r = ref[n]
        tensors.append((n, np.asarray(r, dtype=np.float64)))
        _, e32 = conf.tolerance(r, t32[n])
        meta["torch32_err." + n] = "%.17g" % e32
    return tensors, meta


def compare_files(path, tensors, meta):
    """Differences between the file at path and what would be written."""
    try:
        old, old_meta, old_dt = conf.st_load(path)
    except (OSError, ValueError) as exc:
        return ["cannot read: %s" % exc]
    diffs = []
    if set(old) != set(n for n, _ in tensors):
        diffs.append("tensors %s, now %s" % (sorted(old),
                                             sorted(n for n, _ in tensors)))
    for n, a in tensors:
        if n not in old:
            continue
        o = old[n]
        if o.shape != a.shape or old_dt[n] != conf._st_name_of(a):
            diffs.append("%s: %s %s, now %s %s" % (n, old_dt[n], o.shape,
                                                   conf._st_name_of(a),
                                                   a.shape))
        elif a.dtype == np.float64:
            e = conf.max_err(o, a) / (1.0 + float(np.max(np.abs(a), initial=0)))
            if e > 1e-12:
                diffs.append("%s: differs by %.3g (relative)" % (n, e))
        elif o.tobytes() != a.tobytes():
            diffs.append("%s: not the same bits" % n)
    for k in sorted(set(meta) | set(old_meta)):
        if k.startswith("torch32_err.") and k in meta and k in old_meta:
            a, o = float(meta[k]), float(old_meta[k])
            if abs(a - o) > 0.25 * max(abs(a), abs(o)):
                diffs.append("%s: %s, now %s" % (k, old_meta[k], meta[k]))
        elif k != "torch" and meta.get(k) != old_meta.get(k):
            diffs.append("metadata %s: %r, now %r" % (k, old_meta.get(k),
                                                      meta.get(k)))
    return diffs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "golden"),
                    help="directory of the files (default tests/golden)")
    ap.add_argument("--check", action="store_true",
                    help="compare with the files there, write nothing")
    ap.add_argument("--list", action="store_true",
                    help="print the configurations and exit")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.list:
        for i, (name, o) in enumerate(CONFIGS):
            print("%-36s %s" % (name, build(i, name, o).describe()))
        return 0
    if not args.check:
        os.makedirs(args.out, exist_ok=True)
    wanted = set()
    bad = total = 0
    for i, (name, o) in enumerate(CONFIGS):
        tensors, meta = golden(i, name, o)
        path = os.path.join(args.out, name + ".safetensors")
        wanted.add(os.path.basename(path))
        if args.check:
            diffs = compare_files(path, tensors, meta)
            bad += bool(diffs)
            print("%s %s" % ("ok  " if not diffs else "DIFF", name))
            for d in diffs:
                print("      " + d)
            continue
        conf.st_save(path, tensors, meta)
        back, back_meta, _ = conf.st_load(path)  # round trip
        assert back_meta == meta and set(back) == set(n for n, _ in tensors)
        size = os.path.getsize(path)
        total += size
        print("%-36s %6d bytes  torch32 err of attn_output %.3g"
              % (name, size, float(meta["torch32_err.attn_output"])))
    stale = sorted(f for f in os.listdir(args.out)
                   if f.endswith(".safetensors") and f not in wanted) \
        if os.path.isdir(args.out) else []
    if args.check:
        for f in stale:
            print("DIFF %s: not in the set" % f)
        bad += len(stale)
        print("%d of %d configurations differ" % (bad, len(CONFIGS)))
        return 1 if bad else 0
    for f in stale:
        os.remove(os.path.join(args.out, f))
        print("removed %s (not in the set)" % f)
    print("%d files, %d bytes in %s" % (len(CONFIGS), total, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

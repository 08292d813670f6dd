#!/usr/bin/python3
"""test_incremental.py: `mha forward --incremental [--chunk N]` (the module's
causal self-attention through a KV cache, mha_forward_cached) against the
full causal forward `mha forward --causal`, on random configurations:
packed or separate projections, batch_first or not, unbatched, RoPE (both
layouts, partial, theta), ALiBi, soft cap, sliding windows, chunk sizes 1
(decode), 2..16 and > 16 (flash prefill chunks).

Rule: max|incremental - full| <= 2e-5 * (1 + max|full|) (the forward's
tolerance floor; both are float32 paths of the same computation). The full
forward itself is checked against PyTorch by the conformance suites.

Usage: /usr/bin/python3 tests/infer/test_incremental.py --mha build/mha
           --tmp DIR [--configs N] [-v]
Ends with "N passed, M failed"; exits 1 when anything failed.
"""

import argparse
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                "conformance"))
import conformance as conf  # noqa: E402  (st_save, st_load)


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return p.returncode, p.stderr.strip()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mha", required=True)
    ap.add_argument("--tmp", required=True)
    ap.add_argument("--configs", type=int, default=60)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("-v", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.tmp, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    passed = failed = 0
    for i in range(args.configs):
        H = int(rng.choice([1, 2, 3, 4]))
        d = int(rng.choice([2, 4, 8, 16]))
        E = H * d
        L = int(rng.integers(1, 300))
        N = None if rng.random() < 0.2 else int(rng.integers(1, 4))
        bf = bool(rng.random() < 0.4)
        w = os.path.join(args.tmp, "w%d.safetensors" % i)
        x = os.path.join(args.tmp, "x%d.safetensors" % i)
        init = [args.mha, "init", "--embed-dim", str(E), "--num-heads", str(H), "--out", w,
                "--seed", str(i)]
        if rng.random() < 0.2:
            init.append("--no-bias")
        rc, err = run(init)
        if rc:
            print("FAIL [%d] mha init: %s" % (i, err))
            failed += 1
            continue
        shape = (L, E) if N is None else ((N, L, E) if bf else (L, N, E))
        q = (rng.standard_normal(shape) * float(rng.choice([0.5, 1.0, 3.0]))).astype(np.float32)
        conf.st_save(x, [("query", q)])
        opts = ["--num-heads", str(H)]
        if bf:
            opts.append("--batch-first")
        desc = "E %d H %d L %d N %s bf %d" % (E, H, L, N, bf)
        if rng.random() < 0.5 and d % 2 == 0:
            mode = str(rng.choice(["neox", "interleaved"]))
            dim = int(rng.choice([0, 2 * int(rng.integers(1, d // 2 + 1))]))
            opts += ["--rope", mode, "--rope-theta", str(float(rng.choice([10000.0, 50.0])))]
            if dim:
                opts += ["--rope-dim", str(dim)]
            desc += " rope %s dim %d" % (mode, dim)
        if rng.random() < 0.25:
            opts.append("--alibi")
            desc += " alibi"
        if rng.random() < 0.25:
            cap = float(rng.choice([1.0, 5.0]))
            opts += ["--softcap", repr(cap)]
            desc += " softcap %g" % cap
        if rng.random() < 0.25:
            wl = int(rng.choice([0, 3, 50]))
            opts += ["--window-left", str(wl)]
            desc += " window %d" % wl
        full = os.path.join(args.tmp, "full%d.safetensors" % i)
        rc, err = run([args.mha, "forward", "--weights", w, "--inputs", x, "--out", full,
                       "--causal"] + opts)
        if rc:
            print("FAIL [%d] %s: full forward: %s" % (i, desc, err))
            failed += 1
            continue
        ref = conf.st_load(full)[0]["attn_output"].astype(np.float64)
        tol = 2e-5 * (1.0 + float(np.max(np.abs(ref))))
        if i % 4 == 0:  # --dtype bf16 / f16 storage of the inputs and output
            for dname, dfile, u in (("bf16", "BF16", 2.0 ** -8), ("f16", "F16", 2.0 ** -11)):
                y = os.path.join(args.tmp, "dt%d_%s.safetensors" % (i, dname))
                rc, err = run([args.mha, "forward", "--weights", w, "--inputs", x, "--out", y,
                               "--causal", "--dtype", dname] + opts)
                if rc:
                    print("FAIL [%d] %s --dtype %s: %s" % (i, desc, dname, err))
                    failed += 1
                    continue
                t, _, dts = conf.st_load(y)
                got = t["attn_output"].astype(np.float64)
                e = float(np.max(np.abs(got - ref))) if ref.size else 0.0
                bound = 16 * u * (1.0 + float(np.max(np.abs(ref))))
                if dts["attn_output"] == dfile and e <= bound:
                    passed += 1
                else:
                    failed += 1
                    print("FAIL [%d] %s --dtype %s: output %s, err %.3g bound %.3g"
                          % (i, desc, dname, dts["attn_output"], e, bound))
        if i % 4 == 1:  # --weight-dtype: the module's weights stored as bf16 / f16
            for dname in ("bf16", "f16"):
                # weights written rounded (mha init --weight-dtype), then run
                # (a) kept as dname, full causal and incremental, and (b)
                # widened into a float32 module: (a) must equal (b) exactly
                wh = os.path.join(args.tmp, "wh%d_%s.safetensors" % (i, dname))
                outs = [os.path.join(args.tmp, "wd%d_%s_%d.safetensors" % (i, dname, k))
                        for k in range(3)]
                cmds = [[args.mha, "init", "--embed-dim", str(E), "--num-heads", str(H), "--out",
                         wh, "--seed", str(i), "--weight-dtype", dname] +
                        (["--no-bias"] if "--no-bias" in init else []),
                        [args.mha, "forward", "--weights", wh, "--inputs", x, "--out", outs[0],
                         "--causal", "--weight-dtype", dname] + opts,
                        [args.mha, "forward", "--weights", wh, "--inputs", x, "--out", outs[1],
                         "--causal"] + opts,
                        [args.mha, "forward", "--weights", wh, "--inputs", x, "--out", outs[2],
                         "--incremental", "--chunk", "3", "--weight-dtype", dname] + opts]
                rc, err = 0, ""
                for c in cmds:
                    rc, err = run(c)
                    if rc:
                        break
                if rc:
                    print("FAIL [%d] %s --weight-dtype %s: %s" % (i, desc, dname, err))
                    failed += 1
                    continue
                got, wid, inc = (conf.st_load(o)[0]["attn_output"] for o in outs)
                scale = 1.0 + float(np.max(np.abs(wid))) if wid.size else 1.0
                ei = float(np.max(np.abs(inc.astype(np.float64) - got))) if got.size else 0.0
                if np.array_equal(got, wid) and ei <= 2e-5 * scale:
                    passed += 1
                else:
                    failed += 1
                    print("FAIL [%d] %s --weight-dtype %s: half vs widened float32 equal %s, "
                          "incremental err %.3g (tol %.3g)" % (i, desc, dname,
                                                              np.array_equal(got, wid), ei,
                                                              2e-5 * scale))
        for chunk in (1, int(rng.integers(2, 17)), int(rng.integers(17, 120))):
            y = os.path.join(args.tmp, "inc%d_%d.safetensors" % (i, chunk))
            rc, err = run([args.mha, "forward", "--weights", w, "--inputs", x, "--out", y,
                           "--incremental", "--chunk", str(chunk)] + opts)
            if rc:
                print("FAIL [%d] %s chunk %d: %s" % (i, desc, chunk, err))
                failed += 1
                continue
            got = conf.st_load(y)[0]["attn_output"].astype(np.float64)
            e = float(np.max(np.abs(got - ref))) if ref.size else 0.0
            ok = got.shape == ref.shape and e <= tol
            if ok:
                passed += 1
                if args.v:
                    print("ok   [%d] %s chunk %d: err %.3g tol %.3g" % (i, desc, chunk, e, tol))
            else:
                failed += 1
                print("FAIL [%d] %s chunk %d: err %.3g tol %.3g" % (i, desc, chunk, e, tol))
    print("%d passed, %d failed" % (passed, failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

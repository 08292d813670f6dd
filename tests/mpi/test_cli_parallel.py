#!/usr/bin/python3
"""test_cli_parallel.py: `mpiexec -n P mha forward|backward --parallel S`
reads the same files and writes the same outputs as the single-process
command: byte for byte with --parallel heads and ulysses, within the
tolerance rule with heads-fast and ring (seq-first and batch-first files); 1-4 ranks; a bad input ends every rank with one message.

Usage: /usr/bin/python3 tests/mpi/test_cli_parallel.py --mha build/mha
           --mpiexec mpiexec --tmp DIR
Ends with "N passed, M failed"; exits 1 when anything failed.
"""
import argparse
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                "conformance"))
import conformance as conf  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mha", required=True)
    ap.add_argument("--mpiexec", required=True)
    ap.add_argument("--tmp", required=True)
    args = ap.parse_args()
    os.makedirs(args.tmp, exist_ok=True)
    passed = failed = 0

    def check(ok, what):
        nonlocal passed, failed
        if ok:
            passed += 1
        else:
            failed += 1
            print("FAIL " + what)

    mpi = [args.mpiexec, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
           "-x", "OMP_NUM_THREADS=1", "-n"]
    rng = np.random.default_rng(11)
    configs = [dict(E=32, H=4, Hkv=4, L=17, N=2, causal=True, bf=False),
               dict(E=48, H=6, Hkv=3, L=9, N=1, causal=False, bf=False),
               dict(E=32, H=4, Hkv=2, L=13, N=2, causal=True, bf=True)]
    for ci, c in enumerate(configs):
        E, H, Hkv, L, N = c["E"], c["H"], c["Hkv"], c["L"], c["N"]
        Ekv = Hkv * E // H
        w = [("in_proj_weight", (rng.standard_normal((E + 2 * Ekv, E)) * 0.3).astype(np.float32)),
             ("in_proj_bias", (rng.standard_normal(E + 2 * Ekv) * 0.1).astype(np.float32)),
             ("out_proj.weight", (rng.standard_normal((E, E)) * 0.2).astype(np.float32)),
             ("out_proj.bias", (rng.standard_normal(E) * 0.1).astype(np.float32))]
        wp = os.path.join(args.tmp, "w%d.safetensors" % ci)
        meta = {"num_heads": str(H)}
        if Hkv != H:
            meta["num_kv_heads"] = str(Hkv)
        conf.st_save(wp, w, meta)
        xp = os.path.join(args.tmp, "x%d.safetensors" % ci)
        shape = (N, L, E) if c["bf"] else (L, N, E)
        conf.st_save(xp, [("query", rng.standard_normal(shape).astype(np.float32))])
        gp = os.path.join(args.tmp, "g%d.safetensors" % ci)
        conf.st_save(gp, [("grad_attn_output", rng.standard_normal(shape).astype(np.float32))])
        extra = (["--causal"] if c["causal"] else []) + (["--batch-first"] if c["bf"] else [])
        for cmd in ("forward", "backward"):
            base = [cmd, "--weights", wp, "--inputs", xp] + extra + (
                ["--grad-output", gp] if cmd == "backward" else [])
            ref = os.path.join(args.tmp, "ref%d_%s.safetensors" % (ci, cmd))
            p = subprocess.run([args.mha] + base + ["--out", ref, "--impl", "fused"],
                               capture_output=True, text=True, timeout=60)
            check(p.returncode == 0, "single %s rc %d: %s" % (cmd, p.returncode, p.stderr))
            want = conf.st_load(ref)[0]
            for P in (1, 2, 3, 4):
                for scheme in ("heads", "heads-fast", "ulysses", "ring"):
                    out = os.path.join(args.tmp, "par%d_%s_%s_%d.safetensors" % (ci, cmd, scheme, P))
                    p = subprocess.run(mpi + [str(P), args.mha] + base +
                                       ["--out", out, "--parallel", scheme],
                                       capture_output=True, text=True, timeout=120)
                    what = "config %d %s --parallel %s, %d ranks" % (ci, cmd, scheme, P)
                    check(p.returncode == 0, "%s: rc %d: %s" % (what, p.returncode, p.stderr[-500:]))
                    if p.returncode:
                        continue
                    got = conf.st_load(out)[0]
                    check(sorted(got) == sorted(want), "%s: tensors %s vs %s" % (what, sorted(got), sorted(want)))
                    for k in want:
                        if k not in got:
                            continue
                        a, b = np.asarray(want[k]), np.asarray(got[k])
                        if scheme not in ("heads-fast", "ring"):
                            check(a.tobytes() == b.tobytes(), "%s: %s differs (max %g)" %
                                  (what, k, float(np.max(np.abs(a - b))) if a.shape == b.shape else -1))
                        else:
                            tol = (1e-4 if k.startswith("grad") else 2e-5) * (1 + float(np.max(np.abs(a))))
                            err = float(np.max(np.abs(a - b)))
                            check(err <= tol, "%s: %s err %g tol %g" % (what, k, err, tol))
    # ring with 1 and 2 OpenMP threads per rank: the same bytes (work large
    # enough for the threads to be used)
    E, H, L, N = 64, 4, 400, 2
    w = [("in_proj_weight", (rng.standard_normal((3 * E, E)) * 0.2).astype(np.float32)),
         ("in_proj_bias", (rng.standard_normal(3 * E) * 0.1).astype(np.float32)),
         ("out_proj.weight", (rng.standard_normal((E, E)) * 0.2).astype(np.float32)),
         ("out_proj.bias", (rng.standard_normal(E) * 0.1).astype(np.float32))]
    wp, xp, gp = (os.path.join(args.tmp, n + "_thr.safetensors") for n in ("w", "x", "g"))
    conf.st_save(wp, w, {"num_heads": str(H)})
    conf.st_save(xp, [("query", rng.standard_normal((L, N, E)).astype(np.float32))])
    conf.st_save(gp, [("grad_attn_output", rng.standard_normal((L, N, E)).astype(np.float32))])
    for cmd in ("forward", "backward"):
        outs = []
        for t in (1, 2):
            out = os.path.join(args.tmp, "thr_%s_%d.safetensors" % (cmd, t))
            mt = [args.mpiexec, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
                  "-x", "OMP_NUM_THREADS=%d" % t, "-n", "2"]
            p = subprocess.run(mt + [args.mha, cmd, "--weights", wp, "--inputs", xp, "--out", out,
                                     "--parallel", "ring", "--causal"] +
                               (["--grad-output", gp] if cmd == "backward" else []),
                               capture_output=True, text=True, timeout=120)
            check(p.returncode == 0, "ring %s, %d threads: rc %d: %s" % (cmd, t, p.returncode, p.stderr[-300:]))
            outs.append(open(out, "rb").read() if p.returncode == 0 else b"")
        check(outs[0] == outs[1] and outs[0], "ring %s: 1 and 2 threads per rank differ" % cmd)
    # a bad input (every rank reads it): rc 1 on every rank, one message, no hang
    bad = os.path.join(args.tmp, "bad.safetensors")
    conf.st_save(bad, [("query", rng.standard_normal((5, 1, 31)).astype(np.float32))])
    p = subprocess.run(mpi + ["3", args.mha, "forward", "--weights",
                              os.path.join(args.tmp, "w0.safetensors"), "--inputs", bad,
                              "--out", os.path.join(args.tmp, "bad_out.safetensors"),
                              "--parallel", "heads"], capture_output=True, text=True, timeout=120)
    check(p.returncode != 0, "bad input: rc %d" % p.returncode)
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("mha forward:")]
    check(len(lines) == 1 and "31" in lines[0], "bad input: one message naming 31: %r" % lines)
    print("%d passed, %d failed" % (passed, failed))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

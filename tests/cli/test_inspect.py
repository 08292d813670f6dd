#!/usr/bin/python3
"""test_inspect.py: `mha inspect` writes DIR/diagnostics.json with the
documented fields; known answers through the CLI: a head whose W_Q rows are
zero attends uniformly (entropy ln S, dead, rank_q 0); a NaN in the query is
reported with its location.

Usage: /usr/bin/python3 tests/cli/test_inspect.py --mha build/mha --tmp DIR
Ends with "N passed, M failed"; exits 1 when anything failed.
"""
import argparse
import json
import math
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                "conformance"))
import conformance as conf  # noqa: E402

FIELDS = ["head", "entropy_mean", "entropy_min", "mean_distance", "dead", "rank_q", "rank_k",
          "rank_v", "rank_o", "logit_max", "logit_std"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mha", required=True)
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

    E, H, L, d = 32, 4, 9, 8
    rng = np.random.default_rng(3)
    w = {"in_proj_weight": (rng.standard_normal((3 * E, E)) * 0.3).astype(np.float32),
         "in_proj_bias": np.zeros(3 * E, np.float32),
         "out_proj.weight": (rng.standard_normal((E, E)) * 0.2).astype(np.float32),
         "out_proj.bias": np.zeros(E, np.float32)}
    w["in_proj_weight"][:d] = 0  # head 0: W_Q rows zero -> uniform attention
    wp = os.path.join(args.tmp, "w.safetensors")
    conf.st_save(wp, list(w.items()))
    x = rng.standard_normal((L, 1, E)).astype(np.float32)
    xp = os.path.join(args.tmp, "x.safetensors")
    conf.st_save(xp, [("query", x)])
    out = os.path.join(args.tmp, "inspect")
    p = subprocess.run([args.mha, "inspect", "--weights", wp, "--inputs", xp, "--out", out,
                        "--num-heads", str(H)], capture_output=True, text=True)
    check(p.returncode == 0, "mha inspect rc %d: %s" % (p.returncode, p.stderr.strip()))
    js = json.load(open(os.path.join(out, "diagnostics.json")))
    heads = js["heads"]
    check(len(heads) == H, "%d heads" % len(heads))
    check(all(all(f in h for f in FIELDS) for h in heads), "documented fields present")
    sim = js["similarity"]
    check(len(sim) == H and all(len(r) == H for r in sim), "similarity is H x H")
    check(all(abs(sim[i][i] - 1) < 1e-12 for i in range(H)), "similarity diagonal 1")
    h0 = heads[0]
    check(abs(h0["entropy_mean"] - math.log(L)) < 1e-9,
          "uniform head entropy %r vs ln S %r" % (h0["entropy_mean"], math.log(L)))
    check(h0["dead"] is True and h0["rank_q"] == 0, "uniform head dead, rank_q 0")
    check(all(h["rank_k"] == d and h["rank_v"] == d for h in heads), "full K/V ranks")
    check(js["nonfinite"] is None, "no non-finite value reported")

    x[4, 0, 11] = np.nan
    conf.st_save(xp, [("query", x)])
    p = subprocess.run([args.mha, "inspect", "--weights", wp, "--inputs", xp, "--out", out,
                        "--num-heads", str(H)], capture_output=True, text=True)
    js = json.load(open(os.path.join(out, "diagnostics.json")))
    nf = js["nonfinite"] or ""
    check(p.returncode == 0 and nf.startswith("query[4, 0, 11] = nan"), "NaN reported: %r" % nf)
    print("%d passed, %d failed" % (passed, failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

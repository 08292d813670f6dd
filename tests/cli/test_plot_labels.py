#!/usr/bin/env python3
"""Every text label of every picture the CLI draws lies inside its canvas.

The pictures' labels all go through plot_text (tools/plot/plot.c), which
with MHA_PLOT_LABELS=FILE appends each label's canvas size and ink box in
pixels to FILE. This runs the commands that draw pictures on workloads
that stress the layouts (mha inspect: a few heads, 24 heads, zero singular
values, long token labels, a longer sequence; mha train --plot; mha train
plot with several runs and a title; mha demo heads) and checks every box
against its canvas: spectra.png drew its bottom x-axis label at y = 738 of
732. Skipped (77) when this mha draws no pictures (built without cairo).

Usage: test_plot_labels.py --mha PATH/TO/mha --tmp TMPDIR
Prints one line per workload, then "N passed, M failed"; exits 1 on any
failure. Python 3 standard library only.
"""

import argparse
import json
import math
import os
import shutil
import struct
import subprocess
import sys


def write_st(path, tensors):
    """tensors: [(name, shape, values)], float32."""
    header, data = {}, b""
    for name, shape, vals in tensors:
        blob = struct.pack("<%df" % len(vals), *vals)
        header[name] = {"dtype": "F32", "shape": list(shape),
                        "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)
    return path


def query(L, N, E, seed=0):
    return ("query", (L, N, E), [math.sin(0.37 * i + seed) for i in range(L * N * E)])


def boxes(path):
    """[(W, H, x0, y0, x1, y1, text)] of the labels recorded in path."""
    out = []
    if not os.path.exists(path):
        return out
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            parts = line.rstrip("\n").split(" ", 6)
            w, h = int(parts[0]), int(parts[1])
            x0, y0, x1, y1 = (float(p) for p in parts[2:6])
            out.append((w, h, x0, y0, x1, y1, parts[6] if len(parts) > 6 else ""))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mha", required=True)
    ap.add_argument("--tmp", required=True)
    a = ap.parse_args()
    mha = os.path.abspath(a.mha)
    tmp = os.path.abspath(a.tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    P = lambda name: os.path.join(tmp, name)  # noqa: E731
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))

    def run(args, labels=None):
        e = dict(env)
        if labels:
            e["MHA_PLOT_LABELS"] = labels
        return subprocess.run([mha] + [str(x) for x in args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=e, timeout=300)

    def init(name, E, H, *extra):
        p = run(["init", "--embed-dim", E, "--num-heads", H, "--out", P(name)] + list(extra))
        if p.returncode:
            sys.exit("mha init failed: %s" % p.stderr.decode())
        return P(name)

    # does this mha draw pictures? (built without cairo: inspect says so)
    W4 = init("w4.safetensors", 16, 4)
    X6 = write_st(P("x6.safetensors"), [query(6, 2, 16)])
    probe = run(["inspect", "--weights", W4, "--inputs", X6, "--out", P("probe")])
    if probe.returncode or not os.path.exists(os.path.join(P("probe"), "spectra.png")):
        print("mha draws no pictures here (built without cairo?): skipped; %s"
              % probe.stderr.decode().strip())
        return 77

    with open(P("tokens.txt"), "w") as f:
        f.write("\n".join("a-rather-long-token-label-%d" % i for i in range(40)) + "\n")
    for i, seed in ((1, 0), (2, 1)):
        with open(P("run%d.csv" % i), "w") as f:
            f.write("step,loss,train_acc,eval_acc,tokens_per_s\n")
            for s in range(100, 3100, 100):
                f.write("%d,%g,%g,%g,40000\n" % (s, 3 * math.exp(-s / 700 - seed), 0.1 + 0.9 *
                                                 (1 - math.exp(-s / 900)),
                                                 0.1 + 0.85 * (1 - math.exp(-s / 1000))))

    W24 = init("w24.safetensors", 48, 24)
    X24 = write_st(P("x24.safetensors"), [query(5, 1, 48)])
    W0 = init("w0.safetensors", 16, 4, "--init", "zeros")
    X40 = write_st(P("x40.safetensors"), [query(40, 1, 16)])
    workloads = [
        ("inspect, 4 heads", ["inspect", "--weights", W4, "--inputs", X6, "--out", P("i4")]),
        ("inspect, 24 heads", ["inspect", "--weights", W24, "--inputs", X24, "--out",
                               P("i24")]),
        ("inspect, zero weights (the zero band)",
         ["inspect", "--weights", W0, "--inputs", X6, "--out", P("i0")]),
        ("inspect, 40 positions with long token labels",
         ["inspect", "--weights", W4, "--inputs", X40, "--tokens", P("tokens.txt"), "--out",
          P("itok"), "--causal"]),
        ("train --plot", ["train", "--steps", 20, "--eval-every", 10, "--eval-size", 50,
                          "--quiet", "--plot", P("train.png")]),
        ("train plot, 2 runs and a title",
         ["train", "plot", "--out", P("cmp.png"), "--title",
          "recall: two runs of the tiny transformer, compared", P("run1.csv"), P("run2.csv")]),
        ("demo heads", ["demo", "heads", "--steps", 20, "--quiet", "--out", P("heads")]),
    ]
    passed = failed = 0
    for i, (name, args) in enumerate(workloads):
        rec = P("labels%d.txt" % i)
        p = run(args, rec)
        problems = []
        if p.returncode:
            problems.append("exit status %d: %s" % (p.returncode,
                                                    p.stderr.decode().strip()[-300:]))
        got = boxes(rec)
        canvases = sorted({(b[0], b[1]) for b in got})
        if not got:
            problems.append("no labels recorded (MHA_PLOT_LABELS)")
        for w, h, x0, y0, x1, y1, text in got:
            if x0 < 0 or y0 < 0 or x1 > w or y1 > h:
                problems.append("%r: box x %.1f..%.1f, y %.1f..%.1f outside the %d x %d canvas"
                                % (text, x0, x1, y0, y1, w, h))
        if problems:
            failed += 1
            print("FAIL  %s: %s" % (name, "; ".join(problems[:8])))
        else:
            passed += 1
            print("ok    %s: %d labels inside %d canvases (%s)"
                  % (name, len(got), len(canvases),
                     ", ".join("%dx%d" % c for c in canvases)))
    print("%d passed, %d failed" % (passed, failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""decode_table.py: the decode step over a KV cache, every layout and storage
type asked for, in rounds that take turns, so that a noisy machine's slow
spells fall on every configuration alike.

For each configuration it runs `build/mha bench --decode --json` (12 heads,
d 64, 2 threads unless told otherwise) once per round; a round runs every
configuration once, in order. It prints, per configuration, the median over
the rounds of the per-run medians, the fraction of the read bandwidth each
run measured in its own process (the median of those fractions), and, for
scattered blocks, the fraction of the random-pieces ceiling the bench
measures in the same process. Then the ratio of every storage type's time to
bf16's in the same layout and length, per round and as the median over the
rounds (each ratio from times taken minutes apart at most).

Layouts: `c` the contiguous cache, `B` blocks of B tokens scattered over the
pool (mha bench's default), `Bs` blocks of B taken in order; a trailing `b`
(`16b`, `16sb`): the block-major pool (`--pool-layout block-major`), else
head-major.

    bench/decode_table.py                             # 32k and 256k, f32 bf16 int4, c 16 16s
    bench/decode_table.py --lens 262144 --dtypes bf16 int4 --layouts c --rounds 7
    bench/decode_table.py --jsonl runs.jsonl          # every run's JSON line too

Standard library only (any python3).
"""
import argparse
import json
import statistics
import subprocess
import sys


def run_one(mha, length, dtype, layout, threads, repeat, extra):
    cmd = [mha, "bench", "--decode", "--json", "--kv-len", str(length), "--embed-dim", "768",
           "--num-heads", "12", "--threads", str(threads), "--kv-dtype", dtype,
           "--repeat", str(repeat)] + extra
    if layout != "c":
        if layout.endswith("b"):
            cmd += ["--pool-layout", "block-major"]
            layout = layout[:-1]
        if layout.endswith("s"):
            cmd += ["--block-size", layout[:-1], "--pool-order", "sequential"]
        else:
            cmd += ["--block-size", layout]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    lines = [l for l in out.splitlines() if l.startswith("{")]
    if not lines:
        sys.exit("no JSON line from: " + " ".join(cmd))
    return json.loads(lines[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mha", default="build/mha")
    ap.add_argument("--lens", type=int, nargs="+", default=[32768, 262144])
    ap.add_argument("--dtypes", nargs="+", default=["f32", "bf16", "int4"])
    ap.add_argument("--layouts", nargs="+", default=["c", "16", "16s"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=10, help="timed steps per run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--jsonl", help="append every run's JSON line to this file")
    a = ap.parse_args()
    configs = [(L, t, l) for L in a.lens for l in a.layouts for t in a.dtypes]
    runs = {c: [] for c in configs}
    for r in range(a.rounds):
        for c in configs:
            d = run_one(a.mha, c[0], c[1], c[2], a.threads, a.repeat, [])
            runs[c].append(d)
            if a.jsonl:
                with open(a.jsonl, "a") as f:
                    f.write(json.dumps(d) + "\n")
            print(f"round {r + 1}: {c[0]} tokens {c[1]} {c[2]}: {d['median_ms']:.2f} ms, "
                  f"{100 * d['bandwidth_fraction']:.0f}% of {d['read_bandwidth_gbps']:.1f} GB/s",
                  file=sys.stderr, flush=True)
    print(f"decode step, 12 heads x 1 query, d 64, {a.threads} threads, {a.rounds} rounds "
          f"of {a.repeat} steps (median of the per-run medians)")
    print("| tokens | KV | layout | ms | of the read bandwidth | of the random-pieces ceiling |")
    print("|---:|---|---|---:|---:|---:|")
    med = {}
    for c in configs:
        ds = runs[c]
        med[c] = statistics.median(d["median_ms"] for d in ds)
        frac = statistics.median(d["bandwidth_fraction"] for d in ds)
        pieces = [d["kv_gbps"] / d["random_pieces_gbps"] for d in ds
                  if d.get("random_pieces_gbps", 0) > 0]
        pc = f"{100 * statistics.median(pieces):.0f}%" if pieces else ""
        lay = c[2].rstrip("b")
        name = {"c": "contiguous"}.get(c[2], f"blocks of {lay.rstrip('s')}, "
                                       + ("in order" if lay.endswith("s") else "scattered")
                                       + (", block-major" if c[2].endswith("b") else ""))
        print(f"| {c[0]} | {c[1]} | {name} | {med[c]:.2f} | {100 * frac:.0f}% | {pc} |")
    if "bf16" in a.dtypes:
        print("\nbf16 time / this type's time (> 1: faster than bf16), per round and median:")
        for c in configs:
            if c[1] == "bf16":
                continue
            base = (c[0], "bf16", c[2])
            per = [b["median_ms"] / d["median_ms"] for b, d in zip(runs[base], runs[c])]
            print(f"  {c[0]} tokens {c[1]} {c[2]}: "
                  + " ".join(f"{x:.2f}" for x in per)
                  + f"  median {statistics.median(per):.2f}")


if __name__ == "__main__":
    main()

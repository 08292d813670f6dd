#!/usr/bin/env python3
"""`mha backward`'s input gradients, as Python's MultiheadAttention.backward
names them: with key and value in the inputs file, grad_query, grad_key and
grad_value are the gradients of those three inputs; with them left out
(self-attention), grad_query is the input's whole gradient (the parts
through the query, key and value paths summed in that order, in float32:
bit for bit the explicit run's (grad_query + grad_key) + grad_value) and
there is no grad_key or grad_value.

Usage: test_cli_grads.py --mha PATH/TO/mha --tmp TMPDIR (Python 3
standard library only; exits 1 on a failure)."""

import argparse
import math
import os
import shutil
import struct
import subprocess
import sys

from test_cli_errors import read_st  # the suites' safetensors reader and writer
from test_cli_options import write_st


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def run(args):
    p = subprocess.run(args, capture_output=True)
    if p.returncode != 0:
        sys.exit("FAIL %s: exit %d: %s" % (" ".join(args), p.returncode,
                                          p.stderr.decode(errors="replace")))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mha", required=True)
    ap.add_argument("--tmp", required=True)
    a = ap.parse_args()
    tmp = a.tmp
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    L, N, E = 5, 2, 8
    x = [math.sin(0.37 * i + 0.1) for i in range(L * N * E)]
    g = [math.cos(0.23 * i) for i in range(L * N * E)]
    w = os.path.join(tmp, "w.safetensors")
    run([a.mha, "init", "--embed-dim", str(E), "--num-heads", "2", "--seed", "3", "--out", w])
    shape = [L, N, E]
    write_st(os.path.join(tmp, "self.safetensors"), [("query", "F32", shape, x)])
    write_st(os.path.join(tmp, "qkv.safetensors"),
             [(n, "F32", shape, x) for n in ("query", "key", "value")])
    write_st(os.path.join(tmp, "g.safetensors"), [("grad_attn_output", "F32", shape, g)])
    outs = {}
    for name in ("self", "qkv"):
        y = os.path.join(tmp, name + ".out.safetensors")
        run([a.mha, "backward", "--weights", w, "--inputs", os.path.join(tmp, name + ".safetensors"),
             "--grad-output", os.path.join(tmp, "g.safetensors"), "--out", y, "--causal"])
        outs[name] = {n: v[2] for n, v in read_st(y)[0].items()}
    fails = []
    s, e = outs["self"], outs["qkv"]
    if "grad_key" in s or "grad_value" in s:
        fails.append("self-attention output holds grad_key / grad_value")
    if not all(n in e for n in ("grad_query", "grad_key", "grad_value")):
        fails.append("the explicit run lacks grad_query / grad_key / grad_value")
    else:
        want = [f32(f32(q + k) + v) for q, k, v in zip(e["grad_query"], e["grad_key"],
                                                        e["grad_value"])]
        if s.get("grad_query") != want:
            fails.append("self-attention grad_query != (grad_query + grad_key) + grad_value "
                         "of the explicit run")
    for k in s:  # every other tensor the same bits
        if k != "grad_query" and s[k] != e.get(k):
            fails.append("%s differs between the two runs" % k)
    for f in fails:
        print("FAIL " + f)
    print("%d tensors compared, %d failures" % (len(s), len(fails)))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())

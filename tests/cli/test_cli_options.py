#!/usr/bin/env python3
"""Every documented option of every `mha` command, run at least once.

Finds the commands from `mha --help` (and the subcommands their usage lines
name: `mha demo heads`, `mha train plot`), reads the options each one's
--help documents (every `--name` in its text), and runs the cases below:
each a tiny workload with valid values, which must exit with status 0 (or
the status the case documents) and print no usage error (stderr neither
"(see mha ..." nor "needs ..."). The test fails when a documented option is
used by no case (a newly documented option needs a case here), when a
command has no case, or when a case uses an option its command does not
document; and when `mha bench` prints a fraction above 100% that is
neither capped nor flagged. Inputs are made with `mha init` and small safetensors files
written below (a tiny llama checkpoint, a tiny BERT model for `mha embed`).

Exemptions are listed in EXEMPT with their reason, printed on every run.
--parallel runs as one MPI process (an MPI singleton); an mha built
without MPI says so and the case counts as exercised (printed).

Usage: test_cli_options.py --mha PATH/TO/mha --tmp TMPDIR
Prints one line per case, then the coverage and "N passed, M failed";
exits 1 on any failure. Python 3 standard library only.
"""

import argparse
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import time

# ---------------------------------------------------------------------------
# Small safetensors files (stdlib only).

FMT = {"F32": "<f", "I64": "<q"}


def bf16_bits(x):
    """float -> bfloat16 bits (round to nearest even)."""
    b = struct.unpack("<I", struct.pack("<f", x))[0]
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


def values(n, seed=0, scale=0.5):
    return [math.sin(0.7 * (i + 1) + seed) * scale for i in range(n)]


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def write_st(path, tensors, metadata=None):
    """tensors: [(name, dtype, shape, values)]; dtype F32, BF16 or I64."""
    header, data = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape, vals in tensors:
        assert len(vals) == numel(shape), name
        if dtype == "BF16":
            blob = b"".join(struct.pack("<H", bf16_bits(v)) for v in vals)
        else:
            blob = b"".join(struct.pack(FMT[dtype], v) for v in vals)
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)
    return path


def f32(name, shape, seed=0, scale=0.5):
    return (name, "F32", shape, values(numel(shape), seed, scale))


# ---------------------------------------------------------------------------
# The commands and the options their --help documents.

OPT_RE = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def run(mha, args, timeout=300, cwd=None):
    t0 = time.time()
    env = None
    if "--parallel" in args:
        # Open MPI's own allocations at exit are not freed: no LeakSanitizer
        # report for them in an instrumented build (as the mpi tests; the
        # library's leaks are every other case's and tests/alloc's)
        env = dict(os.environ)
        env["ASAN_OPTIONS"] = "detect_leaks=0" + (
            ":" + env["ASAN_OPTIONS"] if env.get("ASAN_OPTIONS") else "")
    try:
        p = subprocess.run([mha] + [str(a) for a in args], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, timeout=timeout, cwd=cwd, env=env)
    except subprocess.TimeoutExpired:
        return None, time.time() - t0
    return p, time.time() - t0


def commands(mha):
    """{command: help text}: the commands of `mha --help` and the
    subcommands their usage lines name ("mha demo heads [options]") that
    have a --help of their own (`mha train plot --help` prints train's:
    plot's options are documented there, and its cases count for train);
    and the set of every subcommand."""
    p, _ = run(mha, ["--help"])
    if p is None or p.returncode != 0:
        sys.exit("mha --help failed")
    text = p.stdout.decode()
    names = []
    in_cmds = False
    for line in text.splitlines():
        if line.startswith("Commands:"):
            in_cmds = True
            continue
        m = re.match(r"^  ([a-z][a-z0-9-]*)\s", line)
        if in_cmds and m:
            names.append(m.group(1))
    out, subs = {}, set()
    for name in names:
        p, _ = run(mha, [name, "--help"])
        if p is None or p.returncode != 0:
            sys.exit("mha %s --help failed" % name)
        out[name] = p.stdout.decode()
        for sub in re.findall(r"mha %s ([a-z][a-z0-9-]*)\b" % re.escape(name), out[name]):
            key = name + " " + sub
            if key in out or key in subs:
                continue
            subs.add(key)
            q, _ = run(mha, [name, sub, "--help"])
            if q is not None and q.returncode == 0 and q.stdout.decode() != out[name]:
                out[key] = q.stdout.decode()
    return out, subs


def documented(help_text):
    """The options a --help names (every `--name` in its text), and --help
    itself (`mha <command> --help for details`, says mha --help)."""
    return set(OPT_RE.findall(help_text)) | {"--help"}


def refers_to(help_text):
    """The command whose options a --help takes by reference ("[the
    forward's options]"), or None."""
    m = re.search(r"the ([a-z]+)'s options", help_text)
    return m.group(1) if m else None


# Options a command's --help names that no case can run here, with why.
EXEMPT = {}

# ---------------------------------------------------------------------------
# The cases: (command, argv after the command, expected status).
# A command with subcommands: "demo heads" is argv ["demo", "heads", ...].

E, H, L, N = 8, 2, 4, 2  # the module: embed dim, heads; query length, batch


def make_inputs(mha, tmp):
    P = lambda name: os.path.join(tmp, name)
    made = {}

    def init(name, *args):
        path = P(name)
        p, _ = run(mha, ["init", "--embed-dim", str(E), "--num-heads", str(H), "--out",
                         path] + list(args))
        if p is None or p.returncode != 0:
            sys.exit("mha init %s failed: %s" % (" ".join(args), p and p.stderr.decode()))
        made[name] = path

    init("w.safetensors")
    init("w_gqa.safetensors", "--num-kv-heads", "1")
    # inputs: query (L, N, E) self-attention; batch-first (N, L, E); bf16;
    # cross-attention with key/value (S = 3)
    write_st(P("x.safetensors"), [f32("query", (L, N, E))])
    write_st(P("x_bf.safetensors"), [f32("query", (N, L, E))])
    write_st(P("x_bf16.safetensors"), [("query", "BF16", (L, N, E), values(L * N * E))])
    write_st(P("x_cross.safetensors"), [f32("query", (L, N, E)), f32("key", (3, N, E), 1),
                                        f32("value", (3, N, E), 2)])
    write_st(P("g.safetensors"), [f32("grad_attn_output", (L, N, E), 3)])
    write_st(P("x_pos.safetensors"), [f32("query", (N, L, E)),
                                      ("position_ids", "I64", (N, L),
                                       [i % L for i in range(N * L)])])
    with open(P("tokens.txt"), "w") as f:
        f.write("a\nb\nc\nd\n")
    # a tiny llama checkpoint (--checkpoint DIR --layer I)
    ck = P("ck_llama")
    os.makedirs(ck, exist_ok=True)
    with open(os.path.join(ck, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "hidden_size": E, "num_attention_heads": H,
                   "num_key_value_heads": 1, "num_hidden_layers": 1}, f)
    d = E // H
    pre = "model.layers.0.self_attn."
    write_st(os.path.join(ck, "model.safetensors"),
             [f32(pre + "q_proj.weight", (E, E)), f32(pre + "k_proj.weight", (d, E), 1),
              f32(pre + "v_proj.weight", (d, E), 2), f32(pre + "o_proj.weight", (E, E), 3)])
    write_st(P("x_ck.safetensors"), [f32("hidden_states", (N, L, E))])
    # a tiny BERT sentence-transformers model (mha embed)
    bert = P("bert")
    os.makedirs(bert, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "man", "is", "eating",
             "food", "the", "cat", "sat", "##s", ".", ","]
    V, I, maxpos = len(vocab), 16, 16
    with open(os.path.join(bert, "vocab.txt"), "w") as f:
        f.write("\n".join(vocab) + "\n")
    with open(os.path.join(bert, "config.json"), "w") as f:
        json.dump({"model_type": "bert", "hidden_act": "gelu", "vocab_size": V,
                   "hidden_size": E,
                   "num_hidden_layers": 1, "num_attention_heads": H,
                   "intermediate_size": I, "max_position_embeddings": maxpos,
                   "type_vocab_size": 2, "layer_norm_eps": 1e-12}, f)
    with open(os.path.join(bert, "tokenizer_config.json"), "w") as f:
        json.dump({"do_lower_case": True}, f)
    with open(os.path.join(bert, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": 12}, f)
    ones = lambda name, n: (name, "F32", (n,), [1.0] * n)
    zeros = lambda name, n: (name, "F32", (n,), [0.0] * n)
    t = [f32("embeddings.word_embeddings.weight", (V, E)),
         f32("embeddings.position_embeddings.weight", (maxpos, E), 1),
         f32("embeddings.token_type_embeddings.weight", (2, E), 2),
         ones("embeddings.LayerNorm.weight", E), zeros("embeddings.LayerNorm.bias", E)]
    lp = "encoder.layer.0."
    for i, part in enumerate(("attention.self.query", "attention.self.key",
                              "attention.self.value", "attention.output.dense")):
        t += [f32(lp + part + ".weight", (E, E), 4 + i), zeros(lp + part + ".bias", E)]
    t += [ones(lp + "attention.output.LayerNorm.weight", E),
          zeros(lp + "attention.output.LayerNorm.bias", E),
          f32(lp + "intermediate.dense.weight", (I, E), 9), zeros(lp + "intermediate.dense.bias", I),
          f32(lp + "output.dense.weight", (E, I), 10), zeros(lp + "output.dense.bias", E),
          ones(lp + "output.LayerNorm.weight", E), zeros(lp + "output.LayerNorm.bias", E)]
    write_st(os.path.join(bert, "model.safetensors"), t)
    with open(P("sentences.txt"), "w") as f:
        f.write("A man is eating food.\nThe cats sat.\n")
    return P


def cases(P):
    W, Wg, X, Xbf, Xbf16, Xc, G = (P("w.safetensors"), P("w_gqa.safetensors"),
                                   P("x.safetensors"), P("x_bf.safetensors"),
                                   P("x_bf16.safetensors"), P("x_cross.safetensors"),
                                   P("g.safetensors"))
    Y = P("y.safetensors")
    fwd = ["--weights", W, "--inputs", X, "--out", Y]
    ck = ["--checkpoint", P("ck_llama"), "--layer", "0", "--inputs", P("x_ck.safetensors")]
    ins = ["--weights", W, "--inputs", X, "--out", P("inspect")]
    e, h = str(E), str(H)
    c = []
    add = lambda cmd, args, status=0: c.append((cmd, [str(a) for a in args], status))

    # mha init
    init = ["--embed-dim", e, "--num-heads", h]
    add("init", init + ["--out", P("i1.safetensors"), "--num-kv-heads", 1, "--seed", 3,
                        "--init", "xavier_normal", "--gain", 0.5, "--weight-dtype", "bf16",
                        "--head-gate", "static", "--qk-norm", "head", "--prune-heads", "1"])
    add("init", init + ["--out", P("i2.safetensors"), "--head-dim", 3, "--kdim", 5,
                        "--vdim", 6, "--no-out-bias", "--add-bias-kv", "--init", "normal",
                        "--std", 0.1, "--head-gate", "dynamic", "--qk-norm", "all"])
    add("init", init + ["--out", P("i3.safetensors"), "--separate-qkv", "--no-bias",
                        "--init", "orthogonal"])
    add("init", ["--help"])

    # mha forward
    add("forward", fwd + ["--num-heads", h, "--causal", "--impl", "reference"])
    add("forward", ["--weights", W, "--inputs", Xbf, "--out", Y, "--batch-first",
                    "--window-left", 1, "--window-right", 1, "--add-zero-attn"])
    add("forward", ["--weights", Wg, "--inputs", X, "--out", Y, "--num-kv-heads", 1,
                    "--incremental", "--chunk", 2, "--kv-dtype", "int8"])
    add("forward", ["--weights", W, "--inputs", Xbf16, "--out", Y, "--dtype", "bf16",
                    "--weight-dtype", "bf16"])
    add("forward", fwd + ["--rope", "neox", "--rope-theta", 500, "--rope-dim", 2,
                          "--rope-start", 3])
    add("forward", fwd + ["--rope", "interleaved", "--rope-scaling", "linear",
                          "--rope-factor", 2])
    add("forward", fwd + ["--rope", "neox", "--rope-scaling", "llama3", "--rope-factor", 2,
                          "--rope-original-max", 2, "--rope-low-freq-factor", 1,
                          "--rope-high-freq-factor", 4])
    add("forward", fwd + ["--rope", "neox", "--rope-scaling", "yarn", "--rope-factor", 2,
                          "--rope-original-max", 2, "--rope-beta-fast", 32,
                          "--rope-beta-slow", 1, "--rope-mscale", 1,
                          "--rope-mscale-all-dim", 1, "--rope-attention-factor", 1.1,
                          "--rope-no-truncate"])
    add("forward", fwd + ["--alibi", "--softcap", 30, "--scale", 0.5])
    add("forward", ["--weights", W, "--inputs", Xc, "--out", Y, "--need-weights",
                    "--no-average-weights", "--weights-heads", "0:1", "--weights-rows", "1:"])
    add("forward", fwd + ["--train", "--dropout", 0.1, "--out-dropout", 0.1, "--seed", 7,
                          "--dropout-offset", 5])
    add("forward", ["--out", Y] + ck)
    add("forward", fwd + ["--parallel", "heads"])
    add("forward", ["--help"])

    # mha backward
    bwd = ["--weights", W, "--inputs", X, "--grad-output", G, "--out", P("grads.safetensors")]
    add("backward", bwd)
    add("backward", bwd + ["--train", "--dropout", 0.1, "--seed", 2, "--dropout-offset", 1])
    add("backward", ["--help"])

    # mha inspect
    add("inspect", ins + ["--num-heads", h, "--causal", "--tokens", P("tokens.txt"),
                          "--max-rows", 2, "--batch-index", 1, "--plot-len", 3])
    add("inspect", ["--weights", Wg, "--inputs", Xbf, "--out", P("inspect2"),
                    "--num-kv-heads", 1, "--batch-first", "--window-left", 1,
                    "--window-right", 1, "--add-zero-attn", "--alibi", "--softcap", 20,
                    "--scale", 0.4])
    add("inspect", ["--weights", W, "--inputs", Xbf16, "--out", P("inspect3"), "--dtype",
                    "bf16", "--weight-dtype", "bf16", "--rope", "neox", "--rope-theta", 100,
                    "--rope-dim", 2, "--rope-start", 1, "--rope-scaling", "linear"])
    add("inspect", ["--out", P("inspect4")] + ck)
    add("inspect", ["--help"])

    # mha train (and train plot)
    csv = P("run.csv")
    tiny = ["--steps", 4, "--batch", 4, "--d-model", 16, "--heads", 2, "--eval-size", 8,
            "--eval-every", 2, "--quiet"]
    add("train", tiny + ["--task", "tworel", "--pairs", 2, "--layers", 1, "--d-ff", 16,
                         "--optim", "sgd", "--lr", 0.05, "--weight-decay", 0,
                         "--warmup", 1, "--schedule", "constant", "--clip", 0.5,
                         "--dropout", 0.1, "--causal", "--seed", 3, "--csv", csv])
    add("train", tiny + ["--task", "recall", "--plot", P("curve.png")])
    add("train plot", ["--out", P("plot.png"), "--title", "tiny", csv])
    add("train", ["--help"])

    # mha demo (and demo heads)
    add("demo", ["--no-bert"])
    add("demo", ["--batch", 1, "--tokens", 8])
    add("demo heads", ["--out", P("heads"), "--steps", 3, "--heads", 2, "--pairs", 2,
                       "--layers", 1, "--seed", 2, "--quiet"])
    add("demo heads", ["--help"])
    add("demo", ["--help"])

    # mha bench: tiny shapes, one timed run
    b1 = ["--threads", 1, "--repeat", 1, "--warmup", 0]
    add("bench", ["--batch", 2, "--seq", 8, "--kv-seq", 6, "--embed-dim", 16,
                  "--num-heads", 2, "--causal", "--window", 2, "--impl", "fused",
                  "--isa", "scalar", "--workspace", "--seed", 1, "--json"] + b1)
    add("bench", ["--seq", 8, "--embed-dim", 16, "--num-heads", 2, "--backward",
                  "--no-save"] + b1)
    add("bench", ["--seq", 8, "--embed-dim", 16, "--num-heads", 2, "--core",
                  "--backward"] + b1)
    add("bench", ["--seq", 8, "--embed-dim", 16, "--num-heads", 4, "--dtype", "bf16",
                  "--weight-dtype", "bf16", "--prune-heads", 1, "--head-gate", "static"] + b1)
    add("bench", ["--decode", "--kv-len", 64, "--embed-dim", 16, "--num-heads", 2,
                  "--num-kv-heads", 1, "--kv-dtype", "int8", "--block-size", 16,
                  "--pool-order", "sequential", "--pool-layout", "block-major"] + b1)
    add("bench", ["--decode", "--module", "--kv-len", 32, "--seq", 2, "--embed-dim", 16,
                  "--num-heads", 4, "--weight-dtype", "bf16", "--head-gate", "dynamic",
                  "--prune-heads", 1] + b1)
    add("bench", ["--serve", "--sequences", 2, "--seq", 8, "--gen", 4, "--embed-dim", 16,
                  "--num-heads", 2, "--block-size", 8, "--pool-layout", "block-major",
                  "--kv-dtype", "bf16", "--threads", 1])
    add("bench", ["--parallel", "heads", "--seq", 8, "--embed-dim", 16, "--num-heads", 2,
                  "--repeat", 1])
    add("bench", ["--help"])

    # mha embed
    bert = P("bert")
    emb = P("emb.safetensors")
    add("embed", ["--model", bert, "--sentences", P("sentences.txt"), "--out", emb,
                  "--max-length", 8, "--batch-size", 1, "--time", 1])
    add("embed", ["--model", bert, "--out", emb, "a man", "the cat"])
    add("embed", ["--help"])

    # mha info, version
    add("info", [])
    add("info", ["--isas"])
    add("info", ["--help"])
    add("version", [])
    add("version", ["--help"])
    return c


# What a case's run may say on stderr without being a usage error: an mha
# built without an optional part names it (the option was still parsed).
OPTIONAL_PARTS = [
    ("needs an mha built with MPI", "this mha was built without MPI"),
    ("needs cairo", "this mha was built without cairo"),
]

USAGE_RE = re.compile(r"\(see mha [a-z ]+--help\)|\bneeds\b")


def fractions_over_100(out):
    """`mha bench` prints no fraction above 100% silently: the lines with a
    percentage above 100 that are neither capped nor a warning, and the JSON
    *_fraction fields above 1."""
    bad = []
    for line in out.splitlines():
        if "capped" in line or line.strip().startswith("warning"):
            continue
        if any(float(v) > 100.0 for v in re.findall(r"(\d+(?:\.\d+)?)%", line)):
            bad.append(line.strip())
        for k, v in re.findall(r'"(\w*_fraction)": ([0-9.eE+-]+)', line):
            if float(v) > 1.0:
                bad.append("%s %s" % (k, v))
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mha", required=True)
    ap.add_argument("--tmp", required=True)
    a = ap.parse_args()
    mha = os.path.abspath(a.mha)
    tmp = os.path.abspath(a.tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    t_start = time.time()

    helps, subs = commands(mha)
    P = make_inputs(mha, tmp)
    all_cases = cases(P)
    passed = failed = 0
    used = {k: set() for k in helps}
    for cmd, args, status in all_cases:
        argv = cmd.split() + args
        # the help that documents the case's options: its own, else (a
        # subcommand without one) its parent's
        own = cmd if cmd in helps else cmd.split()[0] if cmd in subs else None
        if own is None:
            print("FAIL  mha %s: not a command of mha --help" % cmd)
            failed += 1
            continue
        opts = set(OPT_RE.findall(" ".join(a for a in args if a.startswith("--"))))
        # a command's options count for it, a subcommand's for it and its parent
        used[own] |= opts
        if " " in own:
            used[own.split()[0]] |= opts
        allowed = documented(helps[own])
        if " " in own:
            allowed |= documented(helps[own.split()[0]])
        ref = refers_to(helps[own])
        if ref in helps:
            allowed |= documented(helps[ref])
        undocumented = opts - allowed
        p, secs = run(mha, argv, cwd=tmp)
        label = "mha " + " ".join(argv).replace(tmp + os.sep, "")
        if p is None:
            print("FAIL  %s: timed out" % label)
            failed += 1
            continue
        err = p.stderr.decode(errors="replace")
        problems = []
        note = ""
        for needle, why in OPTIONAL_PARTS:
            if needle in err and p.returncode != 0:
                note = " (%s: the option was parsed, its run skipped)" % why
                break
        if not note:
            if p.returncode != status:
                problems.append("exit status %d, expected %d" % (p.returncode, status))
            m = USAGE_RE.search(err)
            if m:
                problems.append("usage error on stderr: %r" % err.strip().splitlines()[-1])
        if cmd == "bench":
            over = fractions_over_100(p.stdout.decode(errors="replace"))
            if over:
                problems.append("a fraction above 100%% printed silently: %s" % over[0])
        if undocumented:
            problems.append("options not in its --help: %s" % " ".join(sorted(undocumented)))
        if problems:
            failed += 1
            print("FAIL  %s [%.1f s]: %s" % (label, secs, "; ".join(problems)))
            tail = err.strip().splitlines()[-3:]
            for line in tail:
                print("        stderr: " + line)
        else:
            passed += 1
            print("ok    %s [%.1f s]%s" % (label, secs, note))

    # coverage: every documented option of every command used by some case
    print()
    for cmd in sorted(helps):
        doc = documented(helps[cmd])
        exempt = EXEMPT.get(cmd, {})
        for opt, why in sorted(exempt.items()):
            print("exempt  mha %s %s: %s" % (cmd, opt, why))
        missing = sorted(doc - used[cmd] - set(exempt))
        ran = any(c == cmd or (c in subs and c.split()[0] == cmd and c not in helps)
                  for c, _, _ in all_cases)
        if not ran:
            failed += 1
            print("FAIL  mha %s: no case runs this command" % cmd)
        elif missing:
            failed += 1
            print("FAIL  mha %s: documented but exercised by no case: %s"
                  % (cmd, " ".join(missing)))
        else:
            passed += 1
            print("ok    mha %s: all %d documented options exercised" % (cmd, len(doc)))
    print("%d passed, %d failed (%.1f s)" % (passed, failed, time.time() - t_start))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

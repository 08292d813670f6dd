#!/usr/bin/env python3
"""A Hugging Face model generating with attn_implementation="mha".

    python3 examples/hf_generate.py                      # a random llama
    python3 examples/hf_generate.py --arch gemma2        # another architecture
    python3 examples/hf_generate.py --model DIR --prompt "The capital of France is"

With --model, a local model directory (config.json, weights and a
tokenizer; nothing is downloaded); without it, a small model of --arch
with random weights, prompted with random token ids. Generates greedily
with "mha" and with "eager", prints both, and exits 1 when the tokens
differ. Needs PyTorch 2 and transformers 5 (the torch2 venv).
"""

import argparse
import sys
import time

import torch

import mha.transformers  # registers "mha"
from transformers import AutoConfig, AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a local model directory (else random weights)")
    ap.add_argument("--arch", default="llama", help="the random model's architecture")
    ap.add_argument("--prompt", default="Attention is")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens")
    a = ap.parse_args()
    tok = None
    if a.model:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(a.model)
        model = AutoModelForCausalLM.from_pretrained(a.model, attn_implementation="mha").eval()
        ids = tok(a.prompt, return_tensors="pt").input_ids
    else:
        cfg = AutoConfig.for_model(a.arch, vocab_size=256, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=512,
                                   pad_token_id=0, eos_token_id=1, bos_token_id=2)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="mha").eval()
        ids = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    out = {}
    for impl in ("mha", "eager"):
        model.set_attn_implementation(impl)
        t0 = time.perf_counter()
        out[impl] = model.generate(ids, max_new_tokens=a.tokens, do_sample=False)
        new = out[impl][0, ids.shape[1]:]
        text = tok.decode(new) if tok else " ".join(map(str, new.tolist()))
        print("%-5s (%.2f s): %s" % (impl, time.perf_counter() - t0, text))
    same = torch.equal(out["mha"], out["eager"])
    print("the same tokens" if same else "the tokens differ")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Serving: mha's paged cache against what a PyTorch user would write.

The workload of `mha bench --serve`: N sequences share a prompt of P
tokens, then decode together (one step = one token for every sequence still
running), each stopping at its own length (uniform in [G/4, G], seeded).
Both sides run the same module (E, H heads, Hkv KV heads, RoPE neox, the
same weights) in this process, on the same threads:

- mha: `MultiheadAttention.forward_paged` over a `PagedKVCache` (the prompt
  prefilled once, then forked: its blocks shared; a finished sequence's
  blocks freed);
- torch: one contiguous cache per sequence (N, Hkv, P + G, d) preallocated,
  the prompt's K/V copied into each, per step one batched projection,
  RoPE at each sequence's position, the new K/V written into each cache,
  and one F.scaled_dot_product_attention over the longest history with a
  mask hiding the others' padding (GQA via enable_gqa where torch has it).

mha's side and the workload's inputs are bench/serve_common.py's (shared
with bench/serve_llamacpp.py). Prints tokens/s of both, their ratio, the
caches' memory, and the largest difference of the first step's outputs. Run with the torch2 venv, e.g.
    /opt/mha-venvs/torch2/bin/python bench/serve_torch.py
(PYTHONPATH pointing at an installed mha, as scripts/python-tests.sh builds
it)."""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_common  # noqa: E402

args = serve_common.parse(__doc__)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import mha  # noqa: E402

torch.set_num_threads(args.threads)
w = serve_common.Workload(args)
N, P, G, E, H, Hkv, d, stops = w.N, w.P, w.G, w.E, w.H, w.Hkv, w.d, w.stops
m = mha.MultiheadAttention(E, H, num_kv_heads=Hkv, batch_first=True)
sd = m.state_dict()
w_in = torch.from_numpy(np.asarray(sd["in_proj_weight"])).clone()
b_in = torch.from_numpy(np.asarray(sd["in_proj_bias"])).clone()
w_out = torch.from_numpy(np.asarray(sd["out_proj.weight"])).clone()
b_out = torch.from_numpy(np.asarray(sd["out_proj.bias"])).clone()
w.make_inputs()
prompt, steps_x = w.prompt, w.steps_x

# ---- mha: paged cache, prefill once, forks, continuous batching (serve_common)
r = serve_common.run_mha(m, w)
prefill_mha, t_mha, tokens, mem_mha = r.prefill_s, r.decode_s, r.tokens, r.mem_bytes
first_mha = r.first

# ---- torch: a contiguous cache per sequence
inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))


def rope(x, pos):  # x (n, h, T, d), pos (n, T): neox (rotate half)
    ang = pos[..., None].double() * inv  # (n, T, d/2)
    cos = torch.cat([ang.cos(), ang.cos()], -1).float()[:, None]
    sin = torch.cat([ang.sin(), ang.sin()], -1).float()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def project(x):  # x (n, T, E) -> q (n, H, T, d), k, v (n, Hkv, T, d)
    qkv = F.linear(x, w_in, b_in)
    n, T = x.shape[0], x.shape[1]
    q = qkv[..., :E].view(n, T, H, d).transpose(1, 2)
    k = qkv[..., E:E + Hkv * d].view(n, T, Hkv, d).transpose(1, 2)
    v = qkv[..., E + Hkv * d:].view(n, T, Hkv, d).transpose(1, 2)
    return q, k, v


gqa = {"enable_gqa": True} if Hkv != H else {}
with torch.no_grad():
    cap = P + G
    t0 = time.perf_counter()
    kc = torch.zeros(N, Hkv, cap, d)
    vc = torch.zeros(N, Hkv, cap, d)
    xp = torch.from_numpy(prompt)[None]
    pos = torch.arange(P)[None]
    q, k, v = project(xp)
    k = rope(k, pos)
    kc[:, :, :P] = k  # the prompt's K/V in every sequence's cache
    vc[:, :, :P] = v
    prefill_torch = time.perf_counter() - t0  # (its attention not computed: mha's includes it)
    lens = torch.full((N,), P, dtype=torch.long)
    seq = list(range(N))  # slot -> sequence; the running ones in slots [0, n)
    n, first_torch, tokens_t = N, None, 0
    t0 = time.perf_counter()
    for s in range(G):
        if n == 0:
            break
        x = torch.from_numpy(steps_x[s][seq[:n]])[:, None]
        q, k, v = project(x)
        p_ = lens[:n][:, None]
        q, k = rope(q, p_), rope(k, p_)
        rows = torch.arange(n)
        kc[rows, :, lens[:n]] = k[:, :, 0]
        vc[rows, :, lens[:n]] = v[:, :, 0]
        lens[:n] += 1
        Lm = int(lens[:n].max())
        mask = torch.arange(Lm)[None, :] < lens[:n][:, None]  # (n, Lm): True = take part
        o = F.scaled_dot_product_attention(q, kc[:n, :, :Lm], vc[:n, :, :Lm],
                                           attn_mask=mask[:, None, None, :], **gqa)
        y = F.linear(o.transpose(1, 2).reshape(n, 1, E), w_out, b_out)[:, 0]
        if s == 0:  # (slot order = sequence order at the first step)
            first_torch = y.numpy().copy()
        tokens_t += n
        j = 0
        while j < n:  # a finished sequence's slot gets the last running one's
            if s + 1 >= stops[seq[j]]:
                n -= 1
                if j != n:
                    kc[j], vc[j] = kc[n].clone(), vc[n].clone()
                    lens[j] = lens[n]
                    seq[j], seq[n] = seq[n], seq[j]
            else:
                j += 1
    t_torch = time.perf_counter() - t0
    mem_torch = kc.numel() * 4 * 2

diff = float(np.abs(first_mha - first_torch).max())
print(f"serving: {N} sequences sharing a {P}-token prompt, up to {G} new tokens each "
      f"(stops in [{G // 4}, {G}]), E {E}, {H} heads, {Hkv} KV heads, RoPE, {args.threads} threads; "
      f"mha {mha.__version__} ({mha.isa()}), torch {torch.__version__}")
print(f"| | decode tokens/s | decode s | prefill ms | cache MiB |")
print(f"|---|---:|---:|---:|---:|")
print(f"| mha paged (forks share the prompt) | {tokens / t_mha:.0f} | {t_mha:.3f} | "
      f"{prefill_mha * 1e3:.1f} | {mem_mha / 2**20:.1f} (peak) |")
print(f"| torch SDPA, a cache per sequence | {tokens_t / t_torch:.0f} | {t_torch:.3f} | "
      f"{prefill_torch * 1e3:.1f} (K/V only) | {mem_torch / 2**20:.1f} |")
print(f"mha / torch tokens/s: {(tokens / t_mha) / (tokens_t / t_torch):.2f}; memory torch / mha: "
      f"{mem_torch / mem_mha:.1f}; first step's outputs, max |mha - torch|: {diff:.2e}")
assert tokens == tokens_t

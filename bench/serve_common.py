"""The serving workload of bench/serve_torch.py and bench/serve_llamacpp.py,
and mha's side of it (one place, so that both compare against the same run).

The workload of `mha bench --serve`: N sequences share a prompt of P
tokens, then decode together (one step = one token for every sequence still
running), each stopping at its own length (uniform in [G/4, G], seeded).

mha's side: `MultiheadAttention.forward_paged` over a `PagedKVCache` (the
prompt prefilled once in chunks of 512 tokens, then forked: its blocks
shared; a finished sequence's blocks freed), RoPE neox.

Call parse() first (it sets OMP_NUM_THREADS before numpy and mha load)."""

import argparse
import os
import time


def parse(doc, extra=None):
    """The common options (and extra(ap) for a script's own); sets
    OMP_NUM_THREADS to --threads unless it is set."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--embed-dim", type=int, default=768)
    ap.add_argument("--num-heads", type=int, default=12)
    ap.add_argument("--num-kv-heads", type=int, default=0, help="0: as many as --num-heads")
    ap.add_argument("--block-size", type=int, default=16, help="mha's paged cache block")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    if extra:
        extra(ap)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    return args


class Workload:
    """The shapes, the stop lengths and the float inputs (prompt (P, E),
    one (N, E) array per step), from args.seed; the same draws, in the same
    order, as serve_torch.py has always made."""

    def __init__(self, args):
        import numpy as np

        self.N, self.P, self.G = args.sequences, args.prompt, args.gen
        self.E, self.H = args.embed_dim, args.num_heads
        self.Hkv = args.num_kv_heads or self.H
        self.d = self.E // self.H
        self.block_size = args.block_size
        self.rng = np.random.default_rng(args.seed)
        self.stops = self.rng.integers(self.G // 4, self.G + 1, size=self.N)

    def make_inputs(self):
        """The float inputs: after the module is made (as serve_torch.py did)."""
        import numpy as np

        self.prompt = self.rng.standard_normal((self.P, self.E), dtype=np.float32)
        self.steps_x = [self.rng.standard_normal((self.N, self.E), dtype=np.float32)
                        for _ in range(self.G)]

    def batch_sizes(self):
        """The number of sequences running at each step: what either side
        must have decoded per step."""
        return [int((self.stops > s).sum()) for s in range(self.G) if (self.stops > s).any()]

    def describe(self, threads):
        return (f"{self.N} sequences sharing a {self.P}-token prompt, up to {self.G} new tokens "
                f"each (stops in [{self.G // 4}, {self.G}]), E {self.E}, {self.H} heads, "
                f"{self.Hkv} KV heads (d {self.d}), {threads} threads")


class MhaRun:
    """Results of run_mha: times in seconds."""
    prefill_s = decode_s = 0.0
    tokens = peak_blocks = block_bytes = 0
    first = None  # the first step's outputs (N, E)
    batch_sizes = ()

    @property
    def mem_bytes(self):
        return self.peak_blocks * self.block_bytes


def run_mha(m, w, kv_dtype="f32"):
    """The workload through m.forward_paged over a PagedKVCache of blocks
    of w.block_size tokens stored as kv_dtype."""
    import numpy as np

    N, P, G, bs = w.N, w.P, w.G, w.block_size
    r = MhaRun()
    cache = m.make_paged_cache(num_blocks=(P + 15) // 16 * 16 // bs + N * (G // bs + 3) + 8,
                               block_size=bs, dtype=kv_dtype)
    t0 = time.perf_counter()
    root = cache.add_sequence()
    for p0 in range(0, P, 512):
        m.forward_paged(cache, [root], [w.prompt[p0:p0 + 512]], rope="neox")
    r.prefill_s = time.perf_counter() - t0
    ids = [root] + [cache.fork(root) for _ in range(N - 1)]
    live = list(range(N))
    peak, sizes = cache.blocks_in_use(), []
    t0 = time.perf_counter()
    for s in range(G):
        if not live:
            break
        outs = m.forward_paged(cache, [ids[i] for i in live], [w.steps_x[s][i:i + 1] for i in live],
                               rope="neox")
        if s == 0:
            r.first = np.concatenate(outs)
        sizes.append(len(live))
        peak = max(peak, cache.blocks_in_use())
        keep = []
        for i in live:
            if s + 1 >= w.stops[i]:
                cache.free(ids[i])
            else:
                keep.append(i)
        live = keep
    r.decode_s = time.perf_counter() - t0
    r.tokens, r.batch_sizes = sum(sizes), sizes
    r.peak_blocks, r.block_bytes = peak, cache.block_bytes
    return r

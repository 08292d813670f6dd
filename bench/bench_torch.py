#!/usr/bin/python3
"""bench_torch.py: the PyTorch peer of `mha bench`, on the same shapes.

Times torch.nn.MultiheadAttention (batch_first, eval, no_grad; with
--backward, forward + backward through autograd) or, with --core, the
attention core alone on projected (B*H, L, d) tensors (torch's
scaled_dot_product_attention when it exists, else bmm / softmax / bmm as in
torch 1.13's MultiheadAttention). Prints one JSON object per line with the
keys of `mha bench --json` (median_ms, gflops, peak_fraction, ...), under the
same dense FLOP count (causal counted as dense; backward = 2x forward).

The peak is not measured here (Python cannot time an FMA kernel): pass
--peak-gflops (e.g. from `mha bench --json`'s peak_gflops) to get
peak_fraction; otherwise it is null.

Run it with Debian's interpreter, /usr/bin/python3 (python3-torch). The
thread count must be fixed before torch is imported: OMP_NUM_THREADS and
OPENBLAS_NUM_THREADS (and OMP_WAIT_POLICY=PASSIVE with more than one
thread, else torch's OpenMP pool spins against OpenBLAS's threads), then
torch.set_num_threads().
"""
import argparse
import json
import math
import os
import resource
import statistics
import sys
import time


def positive(s):
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError("needs a positive integer, got %r" % s)
    if v < 1:
        raise argparse.ArgumentTypeError("needs a positive integer, got %r" % s)
    return v


def default_threads():
    """OMP_NUM_THREADS when it is a positive integer, else every core."""
    env = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return os.cpu_count() or 1


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        sys.stderr.write("bench_torch.py: %s (see --help)\n" % message)
        sys.exit(2)


def fail(msg, code=2):
    sys.stderr.write("bench_torch.py: %s\n" % msg)
    sys.exit(code)


def blas_in_use():
    """The BLAS library this process has mapped (torch's CPU GEMMs go
    through it): "openblas (<path>)", "netlib reference (<path>)", ..."""
    libs = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                base = os.path.basename(path)
                if "blas" in base or "mkl" in base or "blis" in base:
                    libs.add(os.path.realpath(path))
    except OSError:
        return "unknown"
    if not libs:
        return "none mapped"
    out = []
    for p in sorted(libs):
        if "openblas" in p:
            kind = "openblas"
        elif "mkl" in p:
            kind = "mkl"
        elif "blis" in p:
            kind = "blis"
        elif "/blas/libblas" in p:
            kind = "netlib reference"
        else:
            kind = "other"
        out.append("%s (%s)" % (kind, p))
    return ", ".join(out)


def parse():
    p = OneLineParser(description=__doc__.split("\n\n")[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=positive, default=1)
    p.add_argument("--seq", type=positive, required=True)
    p.add_argument("--kv-seq", type=positive, default=None)
    p.add_argument("--embed-dim", type=positive, required=True)
    p.add_argument("--num-heads", type=positive, required=True)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--window", type=positive, default=None,
                   help="not implemented (rejected, as in mha bench)")
    p.add_argument("--backward", action="store_true")
    p.add_argument("--core", action="store_true")
    p.add_argument("--threads", type=positive,
                   default=default_threads(),
                   help="default: OMP_NUM_THREADS, else every core (as mha)")
    p.add_argument("--repeat", type=positive, default=5)
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first")
    p.add_argument("--isa", default=None, help="mha bench only (ignored)")
    p.add_argument("--workspace", action="store_true",
                   help="mha bench only (ignored)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peak-gflops", type=float, default=None,
                   help="the machine's fp32 FMA peak, for peak_fraction")
    p.add_argument("--json", action="store_true",
                   help="accepted for symmetry with mha bench: output is "
                        "always JSON lines")
    a = p.parse_args()
    if a.kv_seq is None:
        a.kv_seq = a.seq
    if a.embed_dim % a.num_heads:
        fail("--embed-dim %d is not divisible by --num-heads %d"
             % (a.embed_dim, a.num_heads))
    if a.window is not None:
        fail("--window: sliding-window attention is not implemented (neither "
             "in libmha nor here)")
    if a.warmup < 0:
        fail("--warmup needs a non-negative integer")
    if a.core and a.backward:
        fail("--core --backward: not timed (mha_sdpa has no backward to "
             "compare with)")
    return a


def main():
    a = parse()
    # Threads: before importing torch.
    n = str(a.threads)
    os.environ["OMP_NUM_THREADS"] = n
    os.environ["OPENBLAS_NUM_THREADS"] = n
    os.environ["MKL_NUM_THREADS"] = n
    if a.threads > 1:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(a.threads)

    B, L, S, E, H = a.batch, a.seq, a.kv_seq, a.embed_dim, a.num_heads
    d = E // H
    torch.manual_seed(a.seed)
    g = torch.Generator().manual_seed(a.seed)

    def uniform(*shape):
        return torch.rand(*shape, generator=g) * 2 - 1

    # Boolean causal mask, True = not allowed (top-left aligned as mha).
    mask = torch.ones(L, S, dtype=torch.bool).triu(1) if a.causal else None
    has_sdpa = hasattr(F, "scaled_dot_product_attention")

    if a.core:
        q, k, v = uniform(B * H, L, d), uniform(B * H, S, d), uniform(B * H, S, d)
        scale = 1.0 / math.sqrt(d)
        if has_sdpa:
            impl = "torch-sdpa"
            q4, k4, v4 = (t.view(B, H, -1, d) for t in (q, k, v))
            fmask = None if mask is None else ~mask

            def run():
                with torch.no_grad():
                    return F.scaled_dot_product_attention(q4, k4, v4,
                                                          attn_mask=fmask)
        else:
            impl = "torch-bmm-softmax"
            fmask = None
            if mask is not None:
                fmask = torch.zeros(L, S).masked_fill(mask, float("-inf"))

            def run():
                with torch.no_grad():
                    s = torch.bmm(q * scale, k.transpose(1, 2))
                    if fmask is not None:
                        s += fmask
                    return torch.bmm(torch.softmax(s, dim=-1), v)
        flops = 4.0 * B * L * S * E
        path = impl
    else:
        m = torch.nn.MultiheadAttention(E, H, batch_first=True)
        x = uniform(B, L, E)
        self_attn = S == L
        if self_attn:
            kk = vv = x
        else:
            kk, vv = uniform(B, S, E), uniform(B, S, E)
        impl = "torch-nn.MultiheadAttention"
        if a.backward:
            m.train()  # dropout is 0: train() only turns the fast path off
            x.requires_grad_(True)
            if not self_attn:
                kk.requires_grad_(True)
                vv.requires_grad_(True)
            gout = uniform(B, L, E)
            path = "autograd"

            def run():
                for t in [x, kk, vv] + list(m.parameters()):
                    t.grad = None
                out, _ = m(x, kk, vv, need_weights=False, attn_mask=mask)
                out.backward(gout)
                return out
        else:
            m.eval()
            fast = self_attn and mask is None and H % 2 == 0
            path = "fast (native MHA)" if fast else "python (attn_mask or non-self)"

            def run():
                with torch.no_grad():
                    return m(x, kk, vv, need_weights=False, attn_mask=mask)[0]
        flops = 4.0 * B * L * E * E + 4.0 * B * S * E * E + 4.0 * B * L * S * E
        if a.backward:
            flops *= 3
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0

    for _ in range(a.warmup):
        run()
    times = []
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) * 1e3)
    med = statistics.median(times)
    gflops = flops / (med * 1e-3) * 1e-9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0

    blas = blas_in_use()
    if blas.startswith("netlib"):
        sys.stderr.write(
            "bench_torch.py: warning: torch's GEMMs run on the %s BLAS, "
            "10-30x slower than OpenBLAS: install libopenblas0-pthread or put "
            "its libblas.so.3 first in LD_LIBRARY_PATH\n" % blas)
    cap = "unknown"
    for line in torch.__config__.show().splitlines():
        if "CPU capability usage" in line:
            cap = line.split(":", 1)[1].strip().lower()
    if a.core:
        note = "core dense 4BLSE (QK^T + PV)"
    else:
        note = ("module forward dense 4BLE^2 + 4BSE^2 + 4BLSE (projections + "
                "QK^T + PV)")
        if a.backward:
            note += (", x3 for forward + backward (backward = 2x forward)")
    if a.causal:
        note += "; causal counted as dense"
    peak = a.peak_gflops
    print(json.dumps({
        "what": "torch", "impl": impl, "impl_ran": path,
        "backward_impl": "autograd" if a.backward else "none",
        "isa": cap, "threads": torch.get_num_threads(), "batch": B, "seq": L,
        "kv_seq": S, "embed_dim": E, "num_heads": H, "causal": a.causal,
        "backward": a.backward, "core": a.core, "repeat": a.repeat, "warmup": a.warmup,
        "median_ms": round(med, 4), "min_ms": round(min(times), 4),
        "max_ms": round(max(times), 4), "flop_count": flops,
        "gflops": round(gflops, 3), "peak_gflops": peak,
        "peak_fraction": round(gflops / peak, 4) if peak else None,
        "max_rss_mib": round(rss, 1), "rss_before_mib": round(rss_before, 1),
        "flop_count_note": note, "torch_version": torch.__version__,
        "blas": blas, "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
    }))
    sys.stdout.flush()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""bench_python.py: mha.torch.MultiheadAttention against torch.nn.MultiheadAttention.

Times both modules in one process, on the same weights (torch's module's
state_dict loaded into mha's) and inputs: E 768, h 12, batch_first,
self-attention m(x, x, x, need_weights=False), for the shapes B8*L512,
B1*L2048, B1*L4096 and causal B1*L2048 (torch: the float causal attn_mask,
plus is_causal=True where its MultiheadAttention takes it (2.x); mha:
is_causal=True alone). Per shape: the forward (eval, torch.no_grad()) and
forward + backward (train mode, dropout 0, x.requires_grad_(),
out.backward(g) with a fixed random g: the gradients of x and of every
parameter). After --warmup untimed runs of each, the two run interleaved
(torch, mha, torch, mha, ...) --repeat times; the table gives the medians
and torch/mha (> 1: mha is faster), and the largest output / input-gradient
difference between the two as a check that both computed the same thing.

The binding's own cost per call is measured on a tiny shape (E 16, h 2,
B 1, L 4, where the arithmetic is ~10 kFLOP): the median per-call time of
torch's module, mha.torch's module, mha's numpy API (mha.MultiheadAttention)
and of the C library alone (`mha bench --json` of the installed mha
command, the same shape and threads), forward and forward + backward; the
difference to the C time is the Python layer's overhead.

--json FILE writes every measurement; --shapes picks shapes by name
(b8l512, l2048, l4096, l2048c; tiny for the overhead table), --quick runs
small shapes for a smoke test. Runs under PyTorch 1.13 (Debian's
python3-torch, with Debian's OpenBLAS: set OPENBLAS_CORETYPE=SkylakeX on
the Intel Xeon, which OpenBLAS 0.3.21 does not know) and 2.x. The thread
count is fixed before torch is imported (--threads, default
OMP_NUM_THREADS else 2; OMP_WAIT_POLICY=PASSIVE with more than one) and
given to torch.set_num_threads; mha's OpenMP reads OMP_NUM_THREADS.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

# name: (B, L, E, H, causal)
SHAPES = {
    "b8l512": (8, 512, 768, 12, False),
    "l2048": (1, 2048, 768, 12, False),
    "l4096": (1, 4096, 768, 12, False),
    "l2048c": (1, 2048, 768, 12, True),
}
QUICK = {
    "q-b2l128": (2, 128, 256, 4, False),
    "q-l256": (1, 256, 256, 4, False),
    "q-l256c": (1, 256, 256, 4, True),
}
TINY = (1, 4, 16, 2)  # B, L, E, H


def default_threads():
    env = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(env) if env.isdigit() and int(env) > 0 else 2


def flops(B, L, E):
    """Dense module forward: projections 8BLE^2 + QK^T and PV 4BL^2E (as mha bench)."""
    return 8.0 * B * L * E * E + 4.0 * B * L * L * E


def blas_in_use():
    libs = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6:
                    base = os.path.basename(parts[-1])
                    if "blas" in base or "mkl" in base:
                        libs.add(os.path.realpath(parts[-1]))
    except OSError:
        return "unknown"
    return ", ".join(sorted(libs)) or "none mapped"


class Pair:
    """torch's module and mha's with the same weights, one input, one grad."""

    def __init__(self, torch, mt, B, L, E, H, causal, seed):
        self.torch = torch
        torch.manual_seed(seed)
        g = torch.Generator().manual_seed(seed + 1)
        self.ref = torch.nn.MultiheadAttention(E, H, batch_first=True)
        self.ours = mt.MultiheadAttention(E, H, batch_first=True)
        self.ours.load_state_dict(self.ref.state_dict())
        self.x = torch.rand(B, L, E, generator=g) * 2 - 1
        self.gout = torch.rand(B, L, E, generator=g) * 2 - 1
        self.causal = causal
        self.tkw, self.okw = {}, {}
        if causal:
            self.tkw["attn_mask"] = torch.full((L, L), float("-inf")).triu(1)
            if torch_takes_is_causal(torch):
                self.tkw["is_causal"] = True
            self.okw["is_causal"] = True

    def module(self, which):
        return (self.ref, self.tkw) if which == "torch" else (self.ours, self.okw)

    def forward(self, which):
        m, kw = self.module(which)
        m.eval()
        with self.torch.no_grad():
            return m(self.x, self.x, self.x, need_weights=False, **kw)[0]

    def fwd_bwd(self, which):
        m, kw = self.module(which)
        m.train()  # dropout is 0
        x = self.x.detach().requires_grad_()
        for p in m.parameters():
            p.grad = None
        out = m(x, x, x, need_weights=False, **kw)[0]
        out.backward(self.gout)
        return out.detach(), x.grad


def torch_takes_is_causal(torch):
    import inspect
    try:
        return "is_causal" in inspect.signature(torch.nn.MultiheadAttention.forward).parameters
    except (TypeError, ValueError):
        return False


def timed(f):
    t0 = time.perf_counter()
    f()
    return (time.perf_counter() - t0) * 1e3


def max_diff(a, b):
    return float((a - b).abs().max())


def bench_shape(torch, mt, name, shape, mode, repeat, warmup, seed):
    B, L, E, H, causal = shape
    pair = Pair(torch, mt, B, L, E, H, causal, seed)
    run = pair.forward if mode == "forward" else pair.fwd_bwd
    check = {}
    for _ in range(warmup):
        rt, ro = run("torch"), run("mha")
    if mode == "forward":
        check["max_out_diff"] = max_diff(rt, ro)
    else:
        check["max_out_diff"] = max_diff(rt[0], ro[0])
        check["max_dx_diff"] = max_diff(rt[1], ro[1])
        check["max_dparam_diff"] = max(
            max_diff(p.grad, q.grad) for p, q in zip(pair.ref.parameters(),
                                                     pair.ours.parameters()))
    del rt, ro
    times = {"torch": [], "mha": []}
    for _ in range(repeat):
        for which in ("torch", "mha"):
            times[which].append(timed(lambda: run(which)))
    tmed, omed = statistics.median(times["torch"]), statistics.median(times["mha"])
    fl = flops(B, L, E) * (3 if mode == "fwd+bwd" else 1)
    return dict(shape=name, batch=B, seq=L, embed_dim=E, num_heads=H, causal=causal,
                mode=mode, torch_ms=tmed, mha_ms=omed, ratio=tmed / omed,
                torch_gflops=fl / tmed * 1e-6, mha_gflops=fl / omed * 1e-6,
                torch_times_ms=times["torch"], mha_times_ms=times["mha"],
                torch_kwargs=sorted(pair.tkw), flop_count=fl, **check)


def per_call_us(f, calls, rounds):
    """Median over rounds of the mean time of `calls` calls, in µs."""
    res = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        res.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(res)


def c_level_us(threads, backward, save=True):
    """`mha bench` (the installed command) on the tiny shape: median µs."""
    import mha
    cli = mha._cli()
    if cli is None:
        return None, "the mha command is not installed with the package"
    B, L, E, H = TINY
    cmd = [cli, "bench", "--batch", str(B), "--seq", str(L), "--embed-dim", str(E),
           "--num-heads", str(H), "--repeat", "4001", "--warmup", "200", "--threads",
           str(threads), "--json"]
    if backward:
        cmd.append("--backward")
        if not save:
            cmd.append("--no-save")
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        row = json.loads(r.stdout.strip().splitlines()[-1])
        return row["median_ms"] * 1e3, " ".join(cmd[1:])
    except (OSError, ValueError, IndexError, KeyError, subprocess.SubprocessError) as e:
        return None, "mha bench failed: %s" % e


def bench_tiny(torch, mt, threads, calls, rounds, seed):
    import numpy as np
    import mha
    B, L, E, H = TINY
    pair = Pair(torch, mt, B, L, E, H, False, seed)
    npm = mha.MultiheadAttention(E, H, batch_first=True)
    npm.load_state_dict(pair.ref.state_dict())
    npm.eval()
    xn = pair.x.numpy()
    gn = pair.gout.numpy()

    def np_fwd():
        return npm(xn, need_weights=False)

    def np_fwd_bwd():
        npm(xn, need_weights=False)
        return npm.backward(gn, xn)  # re-runs the forward (the numpy API keeps no state)

    assert np.abs(np_fwd()[0] - pair.forward("torch").numpy()).max() < 1e-5
    rows = []
    for mode, fns in (("forward", (lambda: pair.forward("torch"), lambda: pair.forward("mha"),
                                   np_fwd)),
                      ("fwd+bwd", (lambda: pair.fwd_bwd("torch"), lambda: pair.fwd_bwd("mha"),
                                   np_fwd_bwd))):
        for f in fns:
            for _ in range(200):
                f()
        res = {"torch": [], "mha.torch": [], "mha numpy": []}
        for _ in range(rounds):  # interleaved rounds
            for k, f in zip(res, fns):
                res[k].append(per_call_us(f, calls, 1))
        row = {k: statistics.median(v) for k, v in res.items()}
        c, how = c_level_us(threads, mode == "fwd+bwd")
        row["C (mha bench)"] = c
        if mode == "fwd+bwd":
            c2, _ = c_level_us(threads, True, save=False)
            row["C, forward re-run (--no-save)"] = c2
        rows.append(dict(mode=mode, per_call_us=row, c_command=how,
                         batch=B, seq=L, embed_dim=E, num_heads=H))
    return rows


def markdown(rows, tiny, info):
    out = ["torch %s, numpy %s, mha %s (%s), %d threads, Python %s; BLAS: %s; "
           "OPENBLAS_CORETYPE=%s; repeat %d (medians, interleaved); load average %.1f -> %.1f"
           % (info["torch"], info["numpy"], info["mha"], info["mha_isa"], info["threads"],
              info["python"], info["blas"], info["openblas_coretype"], info["repeat"],
              info["loadavg_start"], info["loadavg_end"]), ""]
    if rows:
        out.append("| shape | mode | torch ms | mha ms | torch/mha | torch GFLOP/s | "
                   "mha GFLOP/s | max out diff | max dx diff |")
        out.append("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            out.append("| B%d·L%d%s | %s | %.1f | %.1f | **%.2f** | %.0f | %.0f | %.1e | %s |" % (
                r["batch"], r["seq"], " causal" if r["causal"] else "", r["mode"],
                r["torch_ms"], r["mha_ms"], r["ratio"], r["torch_gflops"], r["mha_gflops"],
                r["max_out_diff"],
                "%.1e" % r["max_dx_diff"] if "max_dx_diff" in r else "—"))
        out.append("")
    if tiny:
        B, L, E, H = TINY
        out.append("Per-call time, tiny shape (B %d, L %d, E %d, h %d), µs (median):" % (B, L, E, H))
        out.append("")
        keys = list(tiny[-1]["per_call_us"])
        out.append("| mode | " + " | ".join(keys) + " |")
        out.append("|---|" + "---:|" * len(keys))
        for t in tiny:
            out.append("| %s | " % t["mode"] + " | ".join(
                "—" if t["per_call_us"].get(k) is None else "%.1f" % t["per_call_us"][k]
                for k in keys) + " |")
        out.append("")
        out.append("(numpy fwd+bwd: a forward call and backward(), which re-runs the forward; "
                   "the C columns come from a separate `mha bench` process.)")
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=None,
                   help="comma-separated names: %s, tiny (default: all of them)"
                        % ", ".join(SHAPES))
    p.add_argument("--modes", default="forward,fwd+bwd", help="forward, fwd+bwd or both")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=default_threads())
    p.add_argument("--quick", action="store_true",
                   help="small shapes (%s) and a short tiny run: a smoke test"
                        % ", ".join(QUICK))
    p.add_argument("--tiny-calls", type=int, default=None,
                   help="calls per round of the tiny shape (default 500; --quick 50)")
    p.add_argument("--tiny-rounds", type=int, default=None, help="default 7; --quick 3")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="FILE")
    a = p.parse_args()
    table = dict(QUICK) if a.quick else dict(SHAPES)
    names = list(table) + ["tiny"]
    if a.shapes:
        names = [s.strip() for s in a.shapes.split(",") if s.strip()]
        table = dict(SHAPES, **QUICK)
        bad = [s for s in names if s not in table and s != "tiny"]
        if bad:
            p.error("unknown shape(s) %s; known: %s, tiny"
                    % (", ".join(bad), ", ".join(list(SHAPES) + list(QUICK))))
    modes = [m.strip() for m in a.modes.split(",")]
    if any(m not in ("forward", "fwd+bwd") for m in modes):
        p.error("--modes: forward and/or fwd+bwd")
    if a.repeat < 1 or a.warmup < 0 or a.threads < 1:
        p.error("--repeat and --threads must be positive, --warmup non-negative")
    calls = a.tiny_calls or (50 if a.quick else 500)
    rounds = a.tiny_rounds or (3 if a.quick else 7)

    n = str(a.threads)
    for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[k] = n
    if a.threads > 1:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import numpy
    import torch
    torch.set_num_threads(a.threads)
    import mha
    import mha.torch as mt

    info = {"torch": torch.__version__, "numpy": numpy.__version__, "mha": mha.__version__,
            "mha_isa": mha.isa(), "threads": torch.get_num_threads(),
            "python": platform.python_version(), "blas": blas_in_use(),
            "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "repeat": a.repeat,
            "warmup": a.warmup, "torch_mha_takes_is_causal": torch_takes_is_causal(torch),
            "loadavg_start": os.getloadavg()[0]}
    rows = []
    for name in names:
        if name == "tiny":
            continue
        for mode in modes:
            r = bench_shape(torch, mt, name, table[name], mode, a.repeat, a.warmup, a.seed)
            rows.append(r)
            sys.stderr.write("%-8s %-8s torch %8.1f ms  mha %8.1f ms  torch/mha %.2f\n"
                             % (name, mode, r["torch_ms"], r["mha_ms"], r["ratio"]))
    tiny = bench_tiny(torch, mt, a.threads, calls, rounds, a.seed) if "tiny" in names else []
    info["loadavg_end"] = os.getloadavg()[0]
    print(markdown(rows, tiny, info))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"info": info, "shapes": rows, "tiny": tiny}, f, indent=1)


if __name__ == "__main__":
    main()

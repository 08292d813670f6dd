#!/usr/bin/env python3
"""run.py: mha against its attention peers, side by side, in one table.

    bench/peers/setup.sh            # once: the pinned virtual environments
    python3 bench/peers/run.py      # the full run (see README.md)
    python3 bench/peers/run.py --quick

For each peer (torch, ort, openvino, ggml) it starts one process in that
peer's virtual environment (bench/peers/peer.py), with mha's Python package
on PYTHONPATH, and hands it the list of cases; that process times mha and
the peer's operators in alternation on the same inputs (so each row's ratio
comes from one process and one stretch of time) and checks that their
outputs agree. The fp32 FMA peak and the read bandwidth the last columns
are held against are measured by `mha bench` (the C CLI, build/mha) in its
own process on the same thread count, before the peers run; so is the GEMM
reference (torch.matmul on 2048^3 float32 and bfloat16 matrices, in the
torch2 venv) each row's attention rate is also given as a fraction of.
--dtype picks float32 cases, bfloat16 cases or both (the default).

Prints a markdown table on stdout (progress on stderr); --json FILE also
writes every result. Standard library only: any python3 runs it.
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PEERS = ["torch", "ort", "openvino", "ggml"]
# virtual environment of each peer, under the venvs directory
VENV = {"torch": "torch2", "ort": "peers-ort", "openvino": "peers-openvino",
        "ggml": "peers-ggml"}


DTYPES = ("f32", "bf16")
# max abs diff above which a row is flagged '(!)': the inputs are O(1); bf16
# (8 significant bits: a rounding of an O(1) value is up to 2^-8) gets more
# room than float32
DIFF_FLAG = {"f32": 1e-3, "bf16": 6e-2}


def case(kind, B, L, S, H, Hkv, d, causal=False, backward=False, dtype="f32"):
    c = {"kind": kind, "B": B, "L": L, "S": S, "H": H, "Hkv": Hkv, "d": d,
         "causal": causal, "backward": backward, "dtype": dtype}
    c["id"] = label(c)
    return c


def label(c):
    if c["kind"] == "decode":
        s = "decode B%d 1 query over %d cached" % (c["B"], c["S"])
    else:
        s = "%s B%d L%d" % (c["kind"], c["B"], c["L"])
    if c["Hkv"] != c["H"]:
        s += " h%d/kv%d d%d" % (c["H"], c["Hkv"], c["d"])
    else:
        s += " E%d h%d" % (c["H"] * c["d"], c["H"])
    if c["causal"]:
        s += " causal"
    if c["backward"]:
        s += " fwd+bwd"
    if c["dtype"] != "f32":  # the float32 labels are the ones of before
        s += " " + c["dtype"]
    return s


def cases(quick, dtypes=DTYPES):
    """The shapes of the table: module forward (projections + attention)
    and attention core at E 768 h 12 (B 8 L 512, B 1 L 2048, B 1 L 4096),
    dense and causal, forward and forward + backward; the core with GQA (32
    query / 8 KV heads, d 128) at L 4096; decode (one query over 32k and
    256k cached tokens, both head layouts). Each shape once per dtype of
    dtypes, side by side (f32 then bf16)."""
    return [dict(c, dtype=dt, id=label(dict(c, dtype=dt)))
            for c in shapes(quick) for dt in DTYPES if dt in dtypes]


def shapes(quick):
    out = []
    if quick:
        mh = [(2, 32)]
        E, H = 64, 4
        gqa = (1, 32, 8, 2, 16)
        dec = [256]
    else:
        mh = [(8, 512), (1, 2048), (1, 4096)]
        E, H = 768, 12
        gqa = (1, 4096, 32, 8, 128)
        dec = [32768, 262144]
    for kind in ("module", "core"):
        for bwd in (False, True):
            for B, L in mh:
                for causal in (False, True):
                    out.append(case(kind, B, L, L, H, H, E // H, causal, bwd))
    B, L, Hq, Hkv, d = gqa
    for bwd in (False, True):
        for causal in (False, True):
            out.append(case("core", B, L, L, Hq, Hkv, d, causal, bwd))
    for S in dec:
        out.append(case("decode", 1, 1, S, H, H, E // H))
        out.append(case("decode", 1, 1, S, Hq, Hkv, d))
    return out


def flops(c):
    """The work: module 2BLE^2 + 2BS(2E)E + 2BLE^2 + 4BLSE, core 4BLSE
    (E = H d); causal: the attention's visible (query, key) pairs only
    (S = L: L (L + 1) / 2 of the L S), so that no rate exceeds the peak
    it is held against; backward 2x the forward."""
    B, L, S, H, d = c["B"], c["L"], c["S"], c["H"], c["d"]
    E = H * d
    f = 4 * B * L * S * E
    if c["causal"]:  # query i sees keys j <= i + S - L
        f = 4 * B * E * sum(min(i + 1 + S - L, S) for i in range(L))
    if c["kind"] == "module":
        f += 2 * B * L * E * E + 4 * B * S * E * E + 2 * B * L * E * E
    return f * (3 if c["backward"] else 1)


def kv_bytes(c):
    """The K and V bytes one decode step reads from mha's cache (bf16
    cases: a cache storing bf16)."""
    return 2 * c["B"] * c["Hkv"] * c["S"] * c["d"] * (2 if c["dtype"] == "bf16" else 4)


def mha_cli_json(mha, args, threads):
    cmd = [mha, "bench", "--json", "--threads", str(threads)] + args
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError("%s: %s" % (" ".join(cmd), p.stderr.strip()))
    return json.loads(p.stdout.strip().splitlines()[-1])


def measure_peaks(mha, threads):
    """fp32 FMA peak (GFLOP/s) and read bandwidth (GB/s), as `mha bench`
    measures them on `threads` threads (tiny problems: the measurement is
    the point)."""
    core = mha_cli_json(mha, ["--core", "--batch", "1", "--seq", "16", "--embed-dim", "16",
                              "--num-heads", "1", "--repeat", "1"], threads)
    dec = mha_cli_json(mha, ["--decode", "--kv-len", "16", "--embed-dim", "16",
                             "--num-heads", "1", "--repeat", "1", "--warmup", "0"], threads)
    return core["peak_gflops"], core["peak_isa"], dec["read_bandwidth_gbps"]


def measure_gemm(python, threads, timeout=300):
    """torch.matmul 2048^3 GFLOP/s in float32 and bfloat16 on `threads`
    threads (peer.py gemm, in the torch2 venv): {'f32': {...}, 'bf16': {...}}."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               OMP_WAIT_POLICY="PASSIVE")
    p = subprocess.run([python, os.path.join(HERE, "peer.py"), "gemm", "--threads",
                        str(threads)], capture_output=True, text=True, timeout=timeout, env=env)
    if p.returncode != 0:
        raise RuntimeError("peer.py gemm: %s" % p.stderr.strip()[-300:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def cpu_info():
    """The CPU's model name and its bf16-relevant flags (from /proc/cpuinfo)."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and name == (platform.processor() or
                                                              platform.machine()):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return name, {f: f in flags for f in ("avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16")}


def run_peer(peer, python, mha_lib, threads, todo, timeout):
    """Runs peer.py in `python`; yields its JSON lines as they come."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                "OPENBLAS_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE",
                "PYTHONPATH": mha_lib + (os.pathsep + env["PYTHONPATH"]
                                         if env.get("PYTHONPATH") else ""),
                "PYTHONUNBUFFERED": "1"})
    p = subprocess.Popen([python, os.path.join(HERE, "peer.py"), peer, "--threads",
                          str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         env=env, text=True)
    p.stdin.write(json.dumps(todo))
    p.stdin.close()
    t0 = time.time()
    for line in p.stdout:
        line = line.strip()
        if line:
            yield json.loads(line)
        if timeout and time.time() - t0 > timeout:
            p.kill()
            yield {"peer": peer, "error": "timed out after %d s" % timeout}
            break
    rc = p.wait()
    if rc:
        yield {"peer": peer, "error": "peer.py exited with status %d" % rc}


def fmt_ms(x):
    if x is None:
        return "-"
    return "%.3f" % x if x < 10 else "%.1f" % x if x < 1000 else "%.0f" % x


def fmt_diff(d, dtype="f32", vs_f32=False):
    """The differences; '(!)' after one over DIFF_FLAG[dtype] (all inputs
    are O(1): such a peer computed something else); vs_f32: held against
    mha's float32 answer (mha has no such bf16 operator yet)."""
    if isinstance(d, str):
        return d
    out = " / ".join("%.1e" % x if isinstance(x, float) else str(x) for x in d)
    if any(not isinstance(x, float) or x > DIFF_FLAG[dtype] for x in d):
        out += " (!)"
    return out + (" vs mha f32" if vs_f32 else "")


def table(results, by_id, peaks, gemm=None):
    """The markdown table: the GEMM reference rows (when measured), then
    the measured rows; and the list of what did not run (peer, operator,
    reason: the cases)."""
    peak, _, bw = peaks
    lines = ["| case | peer | peer operator | peer ms | mha ms | peer / mha "
             "| mha % of peak | peer / mha % of GEMM | max abs diff |",
             "|---|---|---|---:|---:|---:|---:|---:|---|"]
    gemm = gemm or {}
    for dt in DTYPES:
        if dt in gemm:
            lines.append("| GEMM %d x %d x %d %s (reference) | torch %s | torch.matmul "
                         "(%.0f GFLOP/s) | %s | - | - | - | 100%% | - |"
                         % (gemm["n"], gemm["n"], gemm["n"], dt, dt, gemm[dt]["gflops"],
                            fmt_ms(gemm[dt]["ms"])))
    pct = lambda ms, c: ("%.0f%%" % (100 * flops(c) / (ms * 1e-3) * 1e-9
                                     / gemm[c["dtype"]]["gflops"]) if ms else "-")
    skipped = {}
    for cid, rows in results:
        c = by_id[cid]
        for r in rows:
            peer = "%s %s" % (r["peer"], r["prec"]) if r.get("prec") else r["peer"]
            if "ms" not in r:
                key = (peer, r["op"], r.get("skip", "?"))
                skipped.setdefault(key, []).append(cid)
                continue
            mms = r.get("mha_ms")
            if mms is None:
                frac, ratio, mcol = "-", "-", r.get("mha_na") or "n/a"
            else:
                mcol, ratio = fmt_ms(mms), "%.2f" % (r["ms"] / mms)
                if peak is None:
                    frac = "-"
                elif c["kind"] == "decode":
                    frac = "%.0f%% bw" % (100 * kv_bytes(c) / (mms * 1e-3) * 1e-9 / bw)
                elif c["dtype"] != "f32":  # the FMA peak is float32's: see GEMM
                    frac = "-"
                else:
                    frac = "%.1f%%" % (100 * flops(c) / (mms * 1e-3) * 1e-9 / peak)
            if c["kind"] == "decode" or c["dtype"] not in gemm:
                g = "-"
            else:
                g = "%s / %s" % (pct(r["ms"], c), pct(mms, c))
            lines.append("| %s | %s | %s | %s | %s | %s | %s | %s | %s |"
                         % (cid, peer, r["op"], fmt_ms(r["ms"]), mcol, ratio, frac, g,
                            fmt_diff(r["max_abs_diff"], c["dtype"], mms is None)))
    notes = []
    for (peer, op, why), ids in skipped.items():
        notes.append("- %s, %s: %s (%d case%s: %s)" % (peer, op, why, len(ids),
                                                       "" if len(ids) == 1 else "s",
                                                       "; ".join(ids)))
    return "\n".join(lines), notes


def main():
    venvs = os.environ.get("MHA_PEERS_VENVS", "/opt/mha-venvs")
    ap = argparse.ArgumentParser(description="mha against its attention peers (README.md)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny shapes (seconds): checks that every peer runs end to end")
    ap.add_argument("--peers", default=",".join(PEERS),
                    help="comma-separated subset of %s" % ",".join(PEERS))
    ap.add_argument("--only", default="",
                    help="only the cases whose label contains this text (e.g. 'decode'); "
                         "several texts comma-separated: a label containing any of them")
    ap.add_argument("--dtype", default="both", choices=["f32", "bf16", "both"],
                    help="the cases in float32, in bfloat16 (labels ending ' bf16') or both, "
                         "side by side (default both)")
    ap.add_argument("--venvs", default=venvs,
                    help="directory of the virtual environments (default $MHA_PEERS_VENVS "
                         "or /opt/mha-venvs)")
    ap.add_argument("--mha-lib", default=None,
                    help="mha's Python package, put on PYTHONPATH (default VENVS/peers-mha)")
    ap.add_argument("--mha", default=os.path.join(ROOT, "build", "mha"),
                    help="the mha CLI that measures the peak (default build/mha)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    ap.add_argument("--repeat", type=int, default=None,
                    help="least timed rounds per case (default 5; --quick 3)")
    ap.add_argument("--max-repeat", type=int, default=None,
                    help="most timed rounds per case (default 30; --quick 5)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds of rounds per case after the least (default 2; --quick 0)")
    ap.add_argument("--timeout", type=float, default=0,
                    help="seconds one peer's process may take (default: no limit)")
    ap.add_argument("--json", default=None, help="also write all results to this file")
    ap.add_argument("--list", action="store_true", help="print the cases and exit")
    a = ap.parse_args()
    q = a.quick
    rep = a.repeat or (3 if q else 5)
    mrep = a.max_repeat or (5 if q else 30)
    budget = a.budget if a.budget is not None else (0.0 if q else 2.0)
    if a.threads < 1 or rep < 1 or mrep < rep or a.warmup < 0:
        ap.error("needs --threads >= 1, --repeat >= 1, --max-repeat >= --repeat, --warmup >= 0")
    only = [t for t in a.only.split(",") if t] or [""]
    todo = [c for c in cases(q, DTYPES if a.dtype == "both" else (a.dtype,))
            if any(t in c["id"] for t in only)]
    for c in todo:
        c.update({"warmup": a.warmup, "min_repeat": rep, "max_repeat": mrep, "budget_s": budget})
    if a.list:
        for c in todo:
            print("%-50s %.3g GFLOP" % (c["id"], flops(c) * 1e-9))
        return 0
    peers = [p for p in a.peers.split(",") if p]
    bad = [p for p in peers if p not in PEERS]
    if bad:
        ap.error("unknown peer %s (known: %s)" % (",".join(bad), ",".join(PEERS)))
    mha_lib = a.mha_lib or os.path.join(a.venvs, "peers-mha")
    if not os.path.isdir(os.path.join(mha_lib, "mha")):
        sys.exit("run.py: no mha package in %s: run bench/peers/setup.sh" % mha_lib)
    peaks = (None, None, None)
    if os.access(a.mha, os.X_OK):
        peaks = measure_peaks(a.mha, a.threads)
        sys.stderr.write("peak %.1f GFLOP/s (%s), read bandwidth %.1f GB/s, %d threads\n"
                         % (peaks[0], peaks[1], peaks[2], a.threads))
    else:
        sys.stderr.write("run.py: %s not found (build it: make): no peak column\n" % a.mha)
    gemm, gemm_err = None, None
    torch_py = os.path.join(a.venvs, VENV["torch"], "bin", "python")
    if todo and os.access(torch_py, os.X_OK):
        try:
            gemm = measure_gemm(torch_py, a.threads)
            sys.stderr.write("GEMM %d^3 (torch.matmul): f32 %.1f GFLOP/s, bf16 %.1f GFLOP/s\n"
                             % (gemm["n"], gemm["f32"]["gflops"], gemm["bf16"]["gflops"]))
        except (RuntimeError, subprocess.SubprocessError, ValueError, KeyError) as exc:
            gemm_err = "GEMM reference: %s" % exc
            sys.stderr.write("run.py: %s\n" % gemm_err)
    else:
        gemm_err = "GEMM reference: no torch2 venv at %s" % os.path.dirname(
            os.path.dirname(torch_py))
    by_id = {c["id"]: c for c in todo}
    per_case = {c["id"]: [] for c in todo}
    headers, errors, raw = [], [], []
    t_all = time.time()
    for peer in peers:
        py = os.path.join(a.venvs, VENV[peer], "bin", "python")
        if not os.access(py, os.X_OK):
            errors.append("%s: no virtual environment at %s (run bench/peers/setup.sh)"
                          % (peer, os.path.dirname(os.path.dirname(py))))
            continue
        t0 = time.time()
        for r in run_peer(peer, py, mha_lib, a.threads, todo, a.timeout):
            raw.append(r)
            if "id" not in r:
                (errors if "error" in r else headers).append(r)
                if "error" in r:
                    sys.stderr.write("%s: %s\n" % (peer, r["error"]))
                continue
            if "error" in r:
                errors.append("%s, %s: %s" % (peer, r["id"], r["error"]))
                sys.stderr.write("%s, %s: %s\n" % (peer, r["id"], r["error"]))
                continue
            for o in r["ops"]:
                row = dict(o, peer=peer)
                if "ms" in o:
                    row["mha_ms"] = r["mha_ms"]
                per_case[r["id"]].append(row)
            sys.stderr.write("%7.1fs %-9s %s\n" % (time.time() - t0, peer, r["id"]))
    results = [(c["id"], per_case[c["id"]]) for c in todo]
    print("## mha and its attention peers (%s)\n" % ("quick shapes" if q else "full run"))
    cpu, flags = cpu_info()
    print("%s UTC, %s, %d threads each; %s; median of >= %d rounds after %d warm-up "
          "round(s); total %.0f s." % (datetime.datetime.now(datetime.timezone.utc)
                                       .strftime("%Y-%m-%d %H:%M"), cpu, a.threads,
                                       {"both": "fp32 and bf16"}.get(a.dtype, a.dtype), rep,
                                       a.warmup, time.time() - t_all))
    print("CPU flags for bf16: %s." % ", ".join("%s %s" % (f, "yes" if v else "no")
                                               for f, v in flags.items()))
    if peaks[0] is not None:
        print("Peak (`mha bench`, same threads): fp32 FMA %.1f GFLOP/s (%s), read bandwidth "
              "%.1f GB/s." % peaks)
    if gemm:
        print("GEMM reference (torch %s, torch.matmul %d x %d x %d, same threads, same run): "
              "f32 %.1f GFLOP/s, bf16 %.1f GFLOP/s." % (gemm["torch"], gemm["n"], gemm["n"],
                                                       gemm["n"], gemm["f32"]["gflops"],
                                                       gemm["bf16"]["gflops"]))
    for h in headers:
        print("- %s: %s; mha %s (%s) in the same process"
              % (h["peer"], h["version"], h["mha"], h["mha_isa"]))
    print()
    # the GEMM reference rows of the dtypes this run has
    shown = gemm and {k: v for k, v in gemm.items()
                      if k not in DTYPES or any(c["dtype"] == k for c in todo)}
    tab, notes = table(results, by_id, peaks, shown)
    print(tab)
    print("\npeer / mha > 1: mha is faster. peer: the library and what it computes in (f32; "
          "bf16: bf16 tensors or model; autocast bf16: float32 tensors and module under "
          "torch.autocast; openvino default: the CPU plugin's own choice; ggml f16 / bf16: "
          "the K/V type). Cases ending in bf16: inputs rounded to bf16 values, mha in bf16 "
          "(mha ms 'n/a' or a reason: a case mha cannot run). mha %% of peak: mha's GFLOP/s (causal "
          "rows: the visible pairs only, backward = 2x forward) over the fp32 FMA peak (f32 "
          "rows); decode rows: K and V bytes read per second over the read bandwidth (over "
          "100%% when the cache fits in the CPU caches). peer / mha %% of GEMM: the same "
          "GFLOP/s of the peer and of mha over torch.matmul's in the row's dtype. max abs "
          "diff: largest |peer - mha| of the output (fwd+bwd: output / query gradient; "
          "'vs mha f32': against mha's float32 answer; (!): over %g (f32) or %g (bf16), "
          "the two disagree: one of them computed something else)."
          % (DIFF_FLAG["f32"], DIFF_FLAG["bf16"]))
    if notes:
        print("\nNot run:")
        print("\n".join(notes))
    if gemm_err:
        errors.append(gemm_err)
    if errors:
        print("\nErrors:")
        for e in errors:
            print("- %s" % (e if isinstance(e, str) else "%s: %s" % (e["peer"], e["error"])))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"peaks": peaks, "cases": todo, "results": raw}, f, indent=1)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

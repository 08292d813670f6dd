#!/bin/sh
# prune.sh: what head pruning saves. For K pruned heads of H, the module's
# forward should lose about K/H of the attention core's time (the pruned
# heads' scores, softmax and PV are skipped; the projections still run).
#
# Each round times, in one go: the attention core alone (`mha bench --core`)
# and the module forward with K = 0, H/4, H/2, 3H/4 and H heads pruned
# (`mha bench --prune-heads K`). Rounds are repeated (--rounds) and the
# medians taken, so machine noise hits every K alike. Prints, per K: the
# forward's median time, the saving against K = 0, and the expected saving
# K/H x core with their ratio (1.0: pruning saves exactly its share of the
# core), for the core timed alone and for the core as the forward runs it
# (forward with no head pruned minus forward with all pruned: its head
# views are strided rows of the packed QKV buffer, not contiguous tensors).
#
# Run from the repository root after `make`:
#   bench/prune.sh [--seq L] [--embed-dim E] [--num-heads H] [--threads T]
#                  [--rounds R] [--repeat N] [--causal] [--mha PATH]
set -eu
mha=build/mha seq=2048 E=768 H=12 threads=2 rounds=3 repeat=3 causal=""
while [ $# -gt 0 ]; do
    case "$1" in
    --seq) seq=$2; shift 2 ;;
    --embed-dim) E=$2; shift 2 ;;
    --num-heads) H=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --repeat) repeat=$2; shift 2 ;;
    --causal) causal=--causal; shift ;;
    --mha) mha=$2; shift 2 ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "prune.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
ks="0 $((H / 4)) $((H / 2)) $((3 * H / 4)) $H"
common="--seq $seq --embed-dim $E --num-heads $H --threads $threads --repeat $repeat $causal --json"
r=0
while [ $r -lt "$rounds" ]; do
    # shellcheck disable=SC2086
    "$mha" bench --core $common | sed 's/^/core /' >> "$tmp"
    for k in $ks; do
        # shellcheck disable=SC2086
        "$mha" bench --prune-heads "$k" $common | sed "s/^/k$k /" >> "$tmp"
    done
    r=$((r + 1))
done
/usr/bin/python3 - "$tmp" "$H" "$ks" <<'PY'
import json, statistics, sys
path, H, ks = sys.argv[1], int(sys.argv[2]), [int(k) for k in sys.argv[3].split()]
runs = {}
for line in open(path):
    tag, js = line.split(" ", 1)
    runs.setdefault(tag, []).append(json.loads(js)["median_ms"])
med = {t: statistics.median(v) for t, v in runs.items()}
core, base = med["core"], med["k0"]
inmod = base - med["k%d" % H]  # the forward's own attention: all heads pruned vs none
print("attention core alone (mha bench --core): %.2f ms; forward with no head pruned: "
      "%.2f ms, with all %d pruned: %.2f ms, so the core inside the forward is %.2f ms "
      "(medians of %d rounds)" % (core, base, H, med["k%d" % H], inmod, len(runs["core"])))
print("%8s %11s %10s %14s %6s %16s %6s" % ("pruned", "forward ms", "saving ms",
      "K/H x core", "ratio", "K/H x in-fwd", "ratio"))
for k in ks:
    t = med["k%d" % k]
    e1, e2 = k / H * core, k / H * inmod
    f = lambda e: "%.2f" % ((base - t) / e) if k else "-"
    print("%5d/%-2d %11.2f %10.2f %14.2f %6s %16.2f %6s" % (k, H, t, base - t, e1, f(e1), e2,
                                                          f(e2)))
PY

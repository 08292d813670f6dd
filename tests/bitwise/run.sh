#!/bin/sh
# tests/bitwise/run.sh BUILD OUT: the bit-for-bit fingerprint of a build,
# for behaviour-preserving changes (a refactor must not change one bit).
#
# Writes OUT, one line per output: the hashes of tests/bitwise/outputs.c
# (the library's entry points on a fixed set of random configurations)
# for every SIMD kernel set the CPU has and 1 or 2 OpenMP threads, then
# the sha256 of the files a fixed set of CLI runs writes (init, forward,
# backward, cached decoding, diagnostics, a short training, the demo's
# walk-through, and MPI runs with 2 ranks when MPI is there).
#
# Use: run it on the tree before the change and after, on the same
# machine, and compare: cmp before.txt after.txt (the hashes depend on the
# CPU's kernels, so they are not committed).
set -eu
build=$(cd "$1" && pwd)
out=$2
src=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mha=$build/mha
cc -O2 -std=c11 -D_POSIX_C_SOURCE=200809L "$src/tests/bitwise/outputs.c" \
    -I"$src/include" "$build/libmha.a" $(pkg-config --libs libcjson) \
    $(pkg-config --libs lapacke 2>/dev/null || true) -fopenmp -lm -o "$tmp/outputs"
: > "$out"
for isa in scalar avx2 avx512; do
    for t in 1 2; do
        MHA_ISA=$isa OMP_NUM_THREADS=$t "$tmp/outputs" --cases 400 |
            sed "s/^/api isa=$isa threads=$t /" >> "$out"
    done
done

# CLI runs: each writes files whose sha256 goes to OUT.
d=$tmp/cli
mkdir -p "$d"
"$tmp/outputs" --write-inputs "$d"
run() {  # run NAME COMMAND...: runs it, records the hashes of $d/NAME*
    name=$1
    shift
    if "$@" > "$d/$name.stdout" 2> "$d/$name.stderr"; then rc=0; else rc=$?; fi
    echo "cli $name rc $rc" >> "$out"
    for f in "$d/$name".*; do
        case "$f" in *.stderr) continue ;; esac
        [ -f "$f" ] || continue
        echo "cli $name $(basename "$f") $(norm "$f" | sha256sum | cut -c1-16)" >> "$out"
    done
}
# What a run prints or writes minus what varies between identical runs:
# the temporary directory, times and throughputs (train's CSV: its last
# column, tokens per second).
norm() {
    case "$1" in
    *.csv) cut -d, -f1-4 "$1" ;;
    *) sed -e "s#$d#DIR#g" -e 's/[0-9.]*k* *tok\(en\)*s\/s//g' \
           -e 's/[0-9.]* s (/ s (/g' -e 's/ETA [0-9:]*//g' "$1" ;;
    esac
}
run w "$mha" init --embed-dim 24 --num-heads 4 --seed 3 --out "$d/w.safetensors"
run wg "$mha" init --embed-dim 24 --num-heads 4 --num-kv-heads 2 --seed 4 \
    --head-gate dynamic --out "$d/wg.safetensors"
run wkv "$mha" init --embed-dim 24 --num-heads 6 --add-bias-kv --seed 5 --out "$d/wkv.safetensors"
run wbf "$mha" init --embed-dim 24 --num-heads 4 --weight-dtype bf16 --seed 6 \
    --out "$d/wbf.safetensors"
for impl in reference fused; do
    run "fwd-$impl" "$mha" forward --weights "$d/w.safetensors" --inputs "$d/x.safetensors" \
        --out "$d/fwd-$impl.y" --impl $impl --need-weights
    run "fwd-causal-$impl" "$mha" forward --weights "$d/wg.safetensors" \
        --inputs "$d/self.safetensors" --out "$d/fwd-causal-$impl.y" --impl $impl --causal \
        --rope neox --softcap 3 --need-weights --no-average-weights
    run "fwd-drop-$impl" "$mha" forward --weights "$d/wkv.safetensors" \
        --inputs "$d/x.safetensors" --out "$d/fwd-drop-$impl.y" --impl $impl --train \
        --dropout 0.2 --out-dropout 0.1 --seed 7 --add-zero-attn --alibi
    run "fwd-win-$impl" "$mha" forward --weights "$d/w.safetensors" --inputs "$d/x.safetensors" \
        --out "$d/fwd-win-$impl.y" --impl $impl --window-left 3 --window-right 2 \
        --need-weights --weights-heads 1:3 --weights-rows 2:9
    run "bwd-$impl" "$mha" backward --weights "$d/w.safetensors" --inputs "$d/x.safetensors" \
        --grad-output "$d/g.safetensors" --out "$d/bwd-$impl.y" --impl $impl
    run "bwd-gqa-$impl" "$mha" backward --weights "$d/wg.safetensors" \
        --inputs "$d/self.safetensors" --grad-output "$d/g.safetensors" \
        --out "$d/bwd-gqa-$impl.y" --impl $impl --causal --rope interleaved
    run "bwd-drop-$impl" "$mha" backward --weights "$d/wkv.safetensors" \
        --inputs "$d/x.safetensors" --grad-output "$d/g.safetensors" \
        --out "$d/bwd-drop-$impl.y" --impl $impl --train --dropout 0.3 --seed 9
done
run fwd-bf16 "$mha" forward --weights "$d/wbf.safetensors" --inputs "$d/x.safetensors" \
    --out "$d/fwd-bf16.y" --dtype bf16
for kv in f32 bf16 int8; do
    run "cached-$kv" "$mha" forward --weights "$d/wg.safetensors" --inputs "$d/self.safetensors" \
        --out "$d/cached-$kv.y" --incremental --chunk 5 --kv-dtype $kv --rope neox
done
run inspect "$mha" inspect --weights "$d/w.safetensors" --inputs "$d/x.safetensors" \
    --out "$d/inspect.dir"
for f in "$d"/inspect.dir/*.json; do
    echo "cli inspect $(basename "$f") $(sha256sum < "$f" | cut -c1-16)" >> "$out"
done
run train "$mha" train --task recall --heads 4 --steps 40 --csv "$d/train.csv"
run demo "$mha" demo --no-bert
if [ -n "$(command -v mpiexec)" ] && "$mha" forward --help | grep -q -- --parallel; then
    for p in heads heads-fast ulysses ring; do
        run "mpi-fwd-$p" mpiexec -n 2 --allow-run-as-root --oversubscribe --bind-to none \
            -x OMP_NUM_THREADS=1 "$mha" forward --weights "$d/wg.safetensors" \
            --inputs "$d/self.safetensors" --out "$d/mpi-fwd-$p.y" --parallel $p --causal
        run "mpi-bwd-$p" mpiexec -n 2 --allow-run-as-root --oversubscribe --bind-to none \
            -x OMP_NUM_THREADS=1 "$mha" backward --weights "$d/wg.safetensors" \
            --inputs "$d/self.safetensors" --grad-output "$d/g.safetensors" \
            --out "$d/mpi-bwd-$p.y" --parallel $p --causal
    done
fi
echo "$(wc -l < "$out") lines in $out"

#!/bin/sh
# tests/fuzz/run.sh [SECONDS] [TARGET...]: builds the libFuzzer targets and
# runs each for SECONDS (default 60) on a copy of its seed corpus.
#
# Build: the library with clang, -O1 -g, AddressSanitizer +
# UndefinedBehaviorSanitizer (every report fatal) and libFuzzer's coverage
# instrumentation, OpenMP off, into build-fuzz/ through the project's own
# CMake (so the source list and per-file ISA flags are the library's); then
# each tests/fuzz/fuzz_<target>.c is linked against it. Needs clang and
# libFuzzer (Debian 12: `scripts/install-deps.sh --test` installs clang and
# libclang-rt-dev).
#
# Targets: every tests/fuzz/fuzz_<target>.c (safetensors: the reader on
# arbitrary bytes; checkpoint: config.json and the index of a Hugging Face
# checkpoint; forward: weights + inputs files to mha_forward), or those
# named. Each must have a committed, non-empty seed corpus in
# tests/fuzz/corpus/<target> (regenerate them with tests/fuzz/make_corpus.py):
# a missing or empty one fails the run (exit 2) before anything is built.
#
# Run: each target on build-fuzz/corpus/<target> (a fresh copy of
# tests/fuzz/corpus/<target>, so the committed seeds and regressions are
# replayed first and new units never touch the tree), with
# -max_total_time=SECONDS -rss_limit_mb=$FUZZ_RSS_MB (2048)
# -timeout=$FUZZ_TIMEOUT (10 s) -max_len=8192 and the dictionary
# tests/fuzz/safetensors.dict; artifacts go to build-fuzz/artifacts/<target>/,
# the log to build-fuzz/<target>.log.
#
# Findings: a crash or leak artifact (crash-*, leak-*, or any other kind)
# fails the run, as does a fuzzer that exits non-zero without an artifact.
# A timeout-*, oom-* or slow-unit-* artifact may be the machine's noise (a
# loaded machine, another process's memory), so it is reported by kind and
# file and rerun alone (the fuzz binary on that file, the same -timeout and
# -rss_limit_mb, log build-fuzz/<target>.rerun.log) up to twice: it fails
# the run only when both reruns fail too ("timeout reproduced"); a rerun that
# passes reports "timeout did not reproduce (machine noise)" and does not
# fail.
#
# Prints per target: executions, time, exec/s, cov/ft (libFuzzer's last
# status line), new units, and the verdict. Exit status 1 if any target
# found something that counts (or failed to run), 2 on a usage, corpus or
# build error, else 0.
set -eu
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
SECS=${1:-60}
if [ $# -gt 0 ]; then shift; fi
if [ $# -gt 0 ]; then
    TARGETS=$*
else
    TARGETS=""
    for f in "$ROOT"/tests/fuzz/fuzz_*.c; do
        n=${f##*/fuzz_}
        TARGETS="$TARGETS${TARGETS:+ }${n%.c}"
    done
fi
TIMEOUT=${FUZZ_TIMEOUT:-10}
RSS_MB=${FUZZ_RSS_MB:-2048}
for v in "SECONDS=$SECS" "FUZZ_TIMEOUT=$TIMEOUT" "FUZZ_RSS_MB=$RSS_MB"; do
    case "${v#*=}" in
        '' | *[!0-9]* | 0) echo "run.sh: ${v%%=*} must be a positive whole number, got '${v#*=}'" >&2
            exit 2 ;;
    esac
done
# Every target's source and committed seed corpus, before building anything.
for t in $TARGETS; do
    [ -f "$ROOT/tests/fuzz/fuzz_$t.c" ] || { echo "run.sh: no target tests/fuzz/fuzz_$t.c" >&2; exit 2; }
    c=$ROOT/tests/fuzz/corpus/$t
    if [ ! -d "$c" ] || [ -z "$(find "$c" -type f | head -n 1)" ]; then
        echo "run.sh: fuzz_$t has no seed corpus: tests/fuzz/corpus/$t is missing or empty" \
            "(commit one; tests/fuzz/make_corpus.py makes the seeds)" >&2
        exit 2
    fi
done
CC=${FUZZ_CC:-clang}
B=$ROOT/build-fuzz
JOBS=$(nproc 2>/dev/null || echo 2)

if ! command -v "$CC" >/dev/null 2>&1; then
    echo "run.sh: $CC not found (Debian: scripts/install-deps.sh --test)" >&2
    exit 2
fi
SAN="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"

echo "== building the fuzz targets into build-fuzz/ ($CC, -O1 -g, ASan+UBSan)"
t0=$(date +%s)
mkdir -p "$B"
cmake -S "$ROOT" -B "$B" -DCMAKE_C_COMPILER="$CC" -DCMAKE_BUILD_TYPE=Debug \
    -DCMAKE_C_FLAGS_DEBUG="-O1 -g" \
    -DCMAKE_C_FLAGS="$SAN -fsanitize=fuzzer-no-link" \
    -DMHA_OPENMP=OFF -DMHA_BUILD_TESTS=OFF -DMHA_BUILD_SHARED=OFF >"$B/cmake.log" 2>&1 ||
    { cat "$B/cmake.log" >&2; echo "run.sh: cmake configure failed" >&2; exit 2; }
cmake --build "$B" --target mha_static -j "$JOBS" >"$B/build.log" 2>&1 ||
    { tail -n 50 "$B/build.log" >&2; echo "run.sh: library build failed" >&2; exit 2; }
LIBS=$(pkg-config --libs libcjson lapacke)
for t in $TARGETS; do
    src=$ROOT/tests/fuzz/fuzz_$t.c
    # shellcheck disable=SC2086
    "$CC" -std=c11 -O1 -g $SAN -fsanitize=fuzzer -Wall -Wextra -D_POSIX_C_SOURCE=200809L \
        -I"$ROOT/include" "$src" "$B/libmha.a" $LIBS -lm -o "$B/fuzz_$t"
done
echo "   built in $(($(date +%s) - t0)) s"

export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0:symbolize=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
unset MHA_IMPL MHA_ISA 2>/dev/null || true

# rerun_alone TARGET FILE: the fuzz binary on FILE alone, with the run's
# -timeout and -rss_limit_mb, up to twice; stops at the first pass. Sets
# rr_fails (failed reruns) and rr_last (the last rerun's outcome, in words).
rerun_alone() {
    rr_fails=0
    for _ in 1 2; do
        rr=0
        "$B/fuzz_$1" -timeout="$TIMEOUT" -rss_limit_mb="$RSS_MB" "$2" \
            >"$B/$1.rerun1.log" 2>&1 || rr=$?
        cat "$B/$1.rerun1.log" >>"$B/$1.rerun.log"
        if [ "$rr" -eq 0 ]; then
            ms=$(sed -n 's/^Executed .* in \([0-9]*\) ms$/\1/p' "$B/$1.rerun1.log" | tail -n 1)
            rr_last="passed alone in ${ms:-?} ms"
            rm -f "$B/$1.rerun1.log"
            return
        fi
        rr_fails=$((rr_fails + 1))
        why=$(grep -E -m 1 "ERROR: libFuzzer: |ERROR: AddressSanitizer|runtime error" \
            "$B/$1.rerun1.log" | sed 's/^==[0-9]*== *//' || true)
        rr_last="failed alone (exit $rr: ${why:-see build-fuzz/$1.rerun.log})"
    done
    rm -f "$B/$1.rerun1.log"
}

found=0
summary=""
for t in $TARGETS; do
    corpus=$B/corpus/$t
    art=$B/artifacts/$t
    log=$B/$t.log
    rm -rf "$corpus" "$art"
    mkdir -p "$corpus" "$art"
    cp "$ROOT/tests/fuzz/corpus/$t"/* "$corpus"/
    seeds=$(find "$corpus" -type f | wc -l)
    echo "== fuzz_$t: $SECS s on $seeds seed files (log: build-fuzz/$t.log)"
    t1=$(date +%s)
    rc=0
    "$B/fuzz_$t" -max_total_time="$SECS" -rss_limit_mb="$RSS_MB" -timeout="$TIMEOUT" -max_len=8192 \
        -dict="$ROOT/tests/fuzz/safetensors.dict" -print_final_stats=1 \
        -artifact_prefix="$art/" "$corpus" >"$log" 2>&1 || rc=$?
    el=$(($(date +%s) - t1))
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
    eps=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)
    newu=$(sed -n 's/^stat::new_units_added: *//p' "$log" | tail -n 1)
    rss=$(sed -n 's/^stat::peak_rss_mb: *//p' "$log" | tail -n 1)
    last=$(grep -E '^#[0-9]+' "$log" | tail -n 1 || true)
    cov=$(echo "$last" | sed -n 's/.* cov: \([0-9]*\).*/\1/p')
    ft=$(echo "$last" | sed -n 's/.* ft: \([0-9]*\).*/\1/p')
    corp=$(echo "$last" | sed -n 's/.* corp: \([^ ]*\).*/\1/p')
    # Each artifact by kind: crashes and leaks count; timeouts, out-of-memory
    # and slow units count only when they reproduce alone.
    rm -f "$B/$t.rerun.log"
    hard=0
    notes=""
    for a in $(find "$art" -type f | sort); do
        f=build-fuzz/artifacts/$t/${a##*/}
        case "${a##*/}" in
            timeout-*) kind=timeout ;;
            oom-*) kind=out-of-memory ;;
            slow-unit-*) kind=slow-unit ;;
            crash-*) kind=crash ;;
            leak-*) kind=leak ;;
            *) kind=other ;;
        esac
        case $kind in
            timeout | out-of-memory | slow-unit)
                rerun_alone "$t" "$a"
                if [ "$rr_fails" -ge 2 ]; then
                    note="$kind reproduced: $f $rr_last, 2 of 2 reruns (-timeout=$TIMEOUT -rss_limit_mb=$RSS_MB)"
                    hard=1
                elif [ "$kind" = slow-unit ] && [ "$rr_fails" -eq 0 ]; then
                    note="slow-unit within the timeout: $f $rr_last (-timeout=$TIMEOUT), not counted"
                else
                    note="$kind did not reproduce (machine noise): $f $rr_last"
                    [ "$rr_fails" -eq 0 ] || note="$note after 1 failed rerun"
                fi ;;
            *)
                note="$kind: $f"
                hard=1 ;;
        esac
        echo "   fuzz_$t: $note"
        notes="$notes${notes:+; }$note"
    done
    if [ "$hard" -ne 0 ] || { [ "$rc" -ne 0 ] && [ -z "$notes" ]; }; then
        verdict="FOUND SOMETHING (exit $rc${notes:+; $notes}; see build-fuzz/$t.log and build-fuzz/artifacts/$t/)"
        found=1
        grep -E "ERROR: |runtime error|invariant broken|SUMMARY" "$log" | head -n 5 || true
    elif [ -n "$notes" ]; then
        verdict="nothing that reproduces ($notes)"
    else
        verdict="nothing found"
    fi
    line=$(printf 'fuzz_%s: %s execs in %s s, %s exec/s, cov %s ft %s, corpus %s (%s new), peak rss %s MB: %s' \
        "$t" "${execs:-?}" "$el" "${eps:-?}" "${cov:-?}" "${ft:-?}" "${corp:-?}" "${newu:-?}" \
        "${rss:-?}" "$verdict")
    echo "$line"
    summary="$summary$line
"
done
echo "== fuzz summary"
printf '%s' "$summary"
exit $found

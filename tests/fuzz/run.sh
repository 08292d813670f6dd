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
# Run: each target on build-fuzz/corpus/<target> (a fresh copy of
# tests/fuzz/corpus/<target>, so the committed seeds and regressions are
# replayed first and new units never touch the tree), with
# -max_total_time=SECONDS -rss_limit_mb=2048 -timeout=10 -max_len=8192 and
# the dictionary tests/fuzz/safetensors.dict;
# crash, leak, timeout and out-of-memory inputs go to
# build-fuzz/artifacts/<target>/, the log to build-fuzz/<target>.log.
# Prints per target: executions, time, exec/s, cov/ft (libFuzzer's last
# status line), new units, and whether it found anything. Exit status 1 if
# any target found something (or failed to run), else 0.
#
# Targets: safetensors (the reader on arbitrary bytes), checkpoint
# (config.json and the index of a Hugging Face checkpoint), forward (weights +
# inputs files to mha_forward). Regenerate the seeds with
# tests/fuzz/make_corpus.py.
set -eu
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
SECS=${1:-60}
if [ $# -gt 0 ]; then shift; fi
TARGETS=${*:-"safetensors forward checkpoint"}
case "$SECS" in
    '' | *[!0-9]* | 0) echo "run.sh: SECONDS must be a positive whole number, got '$SECS'" >&2
        exit 2 ;;
esac
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
    [ -f "$src" ] || { echo "run.sh: no target $src" >&2; exit 2; }
    # shellcheck disable=SC2086
    "$CC" -std=c11 -O1 -g $SAN -fsanitize=fuzzer -Wall -Wextra -D_POSIX_C_SOURCE=200809L \
        -I"$ROOT/include" "$src" "$B/libmha.a" $LIBS -lm -o "$B/fuzz_$t"
done
echo "   built in $(($(date +%s) - t0)) s"

export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0:symbolize=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
unset MHA_IMPL MHA_ISA 2>/dev/null || true

found=0
summary=""
for t in $TARGETS; do
    corpus=$B/corpus/$t
    art=$B/artifacts/$t
    log=$B/$t.log
    rm -rf "$corpus" "$art"
    mkdir -p "$corpus" "$art"
    if [ -d "$ROOT/tests/fuzz/corpus/$t" ]; then
        cp "$ROOT/tests/fuzz/corpus/$t"/* "$corpus"/ 2>/dev/null || true
    fi
    seeds=$(find "$corpus" -type f | wc -l)
    echo "== fuzz_$t: $SECS s on $seeds seed files (log: build-fuzz/$t.log)"
    t1=$(date +%s)
    rc=0
    "$B/fuzz_$t" -max_total_time="$SECS" -rss_limit_mb=2048 -timeout=10 -max_len=8192 \
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
    arts=$(find "$art" -type f ! -name 'slow-unit-*' | wc -l)
    if [ "$rc" -ne 0 ] || [ "$arts" -ne 0 ]; then
        verdict="FOUND SOMETHING (exit $rc; see build-fuzz/$t.log and build-fuzz/artifacts/$t/)"
        found=1
        grep -E "ERROR: |runtime error|invariant broken|SUMMARY" "$log" | head -n 5 || true
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

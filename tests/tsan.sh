#!/bin/sh
# tsan.sh: the concurrency stress (tests/test_concurrency.c: many threads on
# one shared module) under ThreadSanitizer. The build has no OpenMP
# (-DMHA_OPENMP=OFF): libgomp is not instrumented, so TSan cannot see its
# synchronisation and would report its barriers as races; the calls still
# run on the test's own threads concurrently. Any report fails the run
# (halt_on_error), and so does a result that differs from the serial one.
# Run from the repository root: tests/tsan.sh [BUILD_DIR] (default build-tsan).
set -eu
dir=${1:-build-tsan}
mkdir -p "$dir"
log="$dir/tsan-build.log"
cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Debug -DMHA_OPENMP=OFF -DMHA_BUILD_SHARED=OFF \
    -DCMAKE_C_FLAGS="-fsanitize=thread -fno-omit-frame-pointer -O1 -g" > "$log" 2>&1 ||
    { cat "$log"; exit 1; }
cmake --build "$dir" --target test_concurrency -j "$(nproc 2>/dev/null || echo 2)" \
    >> "$log" 2>&1 || { cat "$log"; exit 1; }
export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1"
"$dir/tests/test_concurrency"
echo "tsan: test_concurrency clean (no ThreadSanitizer report)"

#!/bin/sh
# The allocation-failure sweep: builds build-fault/ (the library with
# -DMHA_FAULT_INJECTION=ON, AddressSanitizer + UndefinedBehaviorSanitizer,
# LeakSanitizer on), runs tests/alloc/test_alloc_fail single-threaded, and
# prints, per scenario, the allocations and allocation sites swept (each
# made to fail alone, then with every later one), a total, and which of the
# library's allocation sites (the mha__malloc/calloc/realloc/alloc calls in
# src/) the sweep reached. Exits non-zero on any failed check, leak,
# sanitizer report, or an allocation in src/ that bypasses the wrappers.
# Usage: tests/alloc/run.sh [BUILD_DIR]   (default build-fault)
set -eu
cd "$(dirname "$0")/../.."
build=${1:-build-fault}
jobs=$(nproc 2>/dev/null || echo 2)

# Every allocation of the library goes through the wrappers of error.c.
raw=$(grep -nE '(^|[^_[:alnum:]])(malloc|calloc|realloc|strdup|strndup|aligned_alloc|posix_memalign)\(' \
      src/*.c src/kernels/*.c | grep -v '^src/error\.c:' || true)
if [ -n "$raw" ]; then
    echo "allocations that bypass mha__malloc/calloc/realloc/alloc:"
    echo "$raw"
    exit 1
fi

mkdir -p "$build"
flags="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all"
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Debug -DMHA_FAULT_INJECTION=ON \
      -DMHA_BUILD_SHARED=OFF -DCMAKE_C_FLAGS="$flags" > "$build/cmake.log" 2>&1 ||
    { cat "$build/cmake.log"; exit 1; }
cmake --build "$build" --target test_alloc_fail -j "$jobs" > "$build/build.log" 2>&1 ||
    { cat "$build/build.log"; exit 1; }

exe="$build/tests/alloc/test_alloc_fail"
sites="$build/tests/alloc/sites.txt"
status=0
OMP_NUM_THREADS=1 MHA_TEST_TMPDIR="$build/tests/alloc" MHA_ALLOC_SITES="$sites" \
    ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:exitcode=23 \
    UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    "$exe" || status=$?

# The library's allocation sites (file:line of each wrapper call) against
# those the sweep reached (return addresses mapped by addr2line).
all=$(grep -nE 'mha__(malloc|calloc|realloc|alloc)\(' src/*.c src/kernels/*.c |
      grep -v '^src/error\.c:' | cut -d: -f1,2 | sort -u)
reached=""
if [ -s "$sites" ] && command -v addr2line > /dev/null; then
    # a return address points after the call: look up the byte before it;
    # -i lists inlined frames innermost first, keep the line inside src/
    reached=$(cut -d' ' -f1 "$sites" | sort -u |
              while read -r a; do printf '0x%x\n' $((a - 1)); done |
              addr2line -i -e "$exe" 2>/dev/null | sed 's/ (discriminator [0-9]*)//' |
              grep -o 'src/[^:]*\.c:[0-9]*' | sort -u)
fi
nall=$(echo "$all" | grep -c . || true)
nreached=$(echo "$all" | while read -r s; do
    echo "$reached" | grep -qx "$s" && echo "$s"; done | grep -c . || true)
echo "allocation sites in src/: $nall, reached by the sweep: $nreached"
echo "$all" | while read -r s; do
    echo "$reached" | grep -qx "$s" || echo "  not reached: $s: $(sed -n "${s#*:}p" "${s%%:*}" | sed 's/^ *//')"
done
if [ "$status" -ne 0 ]; then
    echo "test_alloc_fail FAILED (exit status $status)"
    exit "$status"
fi
echo "test_alloc_fail: every allocation failure gave MHA_ERR_NOMEM, no leak, no crash"

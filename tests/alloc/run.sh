#!/bin/sh
# The allocation-failure sweep: builds build-fault/ (the library with
# -DMHA_FAULT_INJECTION=ON, AddressSanitizer + UndefinedBehaviorSanitizer,
# LeakSanitizer on), runs tests/alloc/test_alloc_fail single-threaded and,
# when MPI is there, the MPI layer's sweep (mpiexec -n 2
# test_alloc_fail_mpi --mpi: each allocation failing on one rank at a time,
# every rank must fail cleanly), and prints, per scenario, the allocations
# and allocation sites swept (each made to fail alone, then with every later
# one), a total, and which of the library's allocation sites (the
# mha__malloc/calloc/realloc/alloc calls in src/, src/kernels/, src/mpi/)
# the sweeps reached. Exits non-zero on any failed check, leak, sanitizer
# report, hang (timeout), or an allocation in src/ that bypasses the wrappers.
# Usage: tests/alloc/run.sh [BUILD_DIR]   (default build-fault)
set -eu
cd "$(dirname "$0")/../.."
build=${1:-build-fault}
jobs=$(nproc 2>/dev/null || echo 2)

# Every allocation of the library goes through the wrappers of error.c.
raw=$(grep -nE '(^|[^_[:alnum:]])(malloc|calloc|realloc|strdup|strndup|aligned_alloc|posix_memalign)\(' \
      src/*.c src/kernels/*.c src/mpi/*.c | grep -v '^src/error\.c:' || true)
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
# the MPI sweep's executable exists when CMake built libmha_mpi
mpi_target=""
if cmake --build "$build" --target help 2>/dev/null | grep -q test_alloc_fail_mpi &&
   command -v mpiexec > /dev/null; then
    mpi_target=test_alloc_fail_mpi
fi
cmake --build "$build" --target test_alloc_fail $mpi_target -j "$jobs" > "$build/build.log" 2>&1 ||
    { cat "$build/build.log"; exit 1; }

exe="$build/tests/alloc/test_alloc_fail"
sites="$build/tests/alloc/sites.txt"
status=0
OMP_NUM_THREADS=1 MHA_TEST_TMPDIR="$build/tests/alloc" MHA_ALLOC_SITES="$sites" \
    ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:exitcode=23 \
    UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    "$exe" || status=$?

# The MPI layer: 2 ranks (Open MPI's own memory suppressed for LeakSanitizer,
# with whole stacks so that only its allocations match; a timeout: a rank
# left waiting fails the sweep instead of hanging it).
exe_mpi="$build/tests/alloc/test_alloc_fail_mpi"
sites_mpi="$build/tests/alloc/sites_mpi.txt"
rm -f "$sites_mpi".*
mpi_status=0
if [ -n "$mpi_target" ]; then
    echo "MPI layer, 2 ranks:"
    OMP_NUM_THREADS=1 MHA_TEST_TMPDIR="$build/tests/alloc" MHA_ALLOC_SITES="$sites_mpi" \
        ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:exitcode=23:fast_unwind_on_malloc=0 \
        LSAN_OPTIONS=suppressions=$PWD/tests/alloc/openmpi.supp:print_suppressions=0 \
        UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
        timeout 900 mpiexec -n 2 --allow-run-as-root --oversubscribe --bind-to none \
        "$exe_mpi" --mpi || mpi_status=$?
else
    echo "MPI layer: not swept (no libmha_mpi in this build, or no mpiexec)"
fi

# The library's allocation sites (file:line of each wrapper call) against
# those the sweep reached (return addresses mapped by addr2line).
all=$(grep -nE 'mha__(malloc|calloc|realloc|alloc)\(' src/*.c src/kernels/*.c src/mpi/*.c |
      grep -v '^src/error\.c:' | cut -d: -f1,2 | sort -u)
# source lines of the sites an executable's sites files name
lines_of() {  # lines_of EXE FILE...
    e=$1
    shift
    # a return address points after the call: look up the byte before it;
    # -i lists inlined frames innermost first, keep the line inside src/
    cat "$@" | cut -d' ' -f1 | sort -u |
        while read -r a; do printf '0x%x\n' $((a - 1)); done |
        addr2line -i -e "$e" 2>/dev/null | sed 's/ (discriminator [0-9]*)//' |
        grep -o 'src/[^:]*\.c:[0-9]*' | sort -u
}
reached=""
if command -v addr2line > /dev/null; then
    [ -s "$sites" ] && reached=$(lines_of "$exe" "$sites")
    if ls "$sites_mpi".* > /dev/null 2>&1; then
        reached=$(printf '%s\n%s\n' "$reached" "$(lines_of "$exe_mpi" "$sites_mpi".*)" |
                  grep . | sort -u)
    fi
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
if [ "$mpi_status" -ne 0 ]; then
    why=""
    [ "$mpi_status" -eq 124 ] && why=": timed out, a rank left waiting?"
    echo "test_alloc_fail_mpi --mpi FAILED (exit status $mpi_status$why)"
    exit "$mpi_status"
fi
echo "test_alloc_fail: every allocation failure gave MHA_ERR_NOMEM, no leak, no crash" \
     "${mpi_target:+(the MPI layer's on every rank)}"

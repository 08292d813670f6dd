#!/bin/sh
# The allocation-failure sweep: builds build-fault/ (the library with
# -DMHA_FAULT_INJECTION=ON, AddressSanitizer + UndefinedBehaviorSanitizer,
# LeakSanitizer on), runs tests/alloc/test_alloc_fail single-threaded and,
# when MPI is there, the MPI layer's sweep (mpiexec -n 2
# test_alloc_fail_mpi --mpi: each allocation failing on one rank at a time,
# every rank must fail cleanly), and prints, per scenario, the allocations
# and allocation sites swept (each made to fail alone, then with every later
# one), a total, which of the library's allocation sites (the
# mha__malloc/calloc/realloc/alloc calls in src/, src/kernels/, src/mpi/)
# the sweeps reached, and each stage's time.
# Exits non-zero (a last line "tests/alloc/run.sh: FAILED: ...") on any
# failed check, leak, sanitizer report, hang (timeout), an allocation in
# src/ that bypasses the wrappers, and on any allocation site the sweeps
# did not reach (each named: file:line and the line's text; add a scenario
# to test_alloc_fail.c that reaches it). Also when it cannot tell which
# sites were reached: addr2line missing, a sites file missing or empty, no
# address mapped to a source line, no site found in src/; and when the MPI
# layer cannot be swept (no libmha_mpi or no mpiexec) unless
# MHA_ALLOC_NO_MPI=1 excuses src/mpi/'s sites (reported as not swept).
# MHA_ALLOC_PLANT="FILE:LINE ..." adds fake sites to the library's list (a
# check of this script: the run must fail naming them).
# Usage: tests/alloc/run.sh [BUILD_DIR]   (default build-fault)
set -eu
cd "$(dirname "$0")/../.."
build=${1:-build-fault}
jobs=$(nproc 2>/dev/null || echo 2)
t_start=$(date +%s)

# fail WHY: the last line, and a non-zero exit
fail() {
    echo "tests/alloc/run.sh: FAILED: $*"
    exit 1
}

# Every allocation of the library goes through the wrappers of error.c.
raw=$(grep -nE '(^|[^_[:alnum:]])(malloc|calloc|realloc|strdup|strndup|aligned_alloc|posix_memalign)\(' \
      src/*.c src/kernels/*.c src/mpi/*.c | grep -v '^src/error\.c:' || true)
if [ -n "$raw" ]; then
    echo "allocations that bypass mha__malloc/calloc/realloc/alloc:"
    echo "$raw"
    fail "allocations in src/ that bypass the wrappers (listed above)"
fi

# The library's allocation sites (file:line of each wrapper call), and any
# planted for a check of this script.
all=$(grep -nE 'mha__(malloc|calloc|realloc|alloc|scratch_alloc)\(' src/*.c src/kernels/*.c src/mpi/*.c |
      grep -v '^src/error\.c:' | cut -d: -f1,2 | sort -u)
[ -n "$all" ] || fail "no allocation site found in src/ (grep for mha__malloc/calloc/realloc/alloc)"
plant=${MHA_ALLOC_PLANT:-}
if [ -n "$plant" ]; then
    for s in $plant; do
        case $s in
            *?:[0-9]*) ;;
            *) fail "MHA_ALLOC_PLANT: '$s' is not FILE:LINE" ;;
        esac
        echo "planted allocation site (MHA_ALLOC_PLANT): $s"
    done
    # (word splitting intended: a list of FILE:LINE)
    # shellcheck disable=SC2086
    all=$(printf '%s\n' "$all" $plant | sort -u)
fi
# Without addr2line no site can be mapped: fail now, not at "0 reached".
command -v addr2line > /dev/null ||
    fail "addr2line not found (binutils): the sites the sweep reached cannot be mapped to source lines"

mkdir -p "$build"
flags="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all"
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Debug -DMHA_FAULT_INJECTION=ON \
      -DMHA_BUILD_SHARED=OFF -DCMAKE_C_FLAGS="$flags" > "$build/cmake.log" 2>&1 ||
    { cat "$build/cmake.log"; fail "cmake (log above)"; }
# the MPI sweep's executable exists when CMake built libmha_mpi
mpi_target=""
if cmake --build "$build" --target help 2>/dev/null | grep -q test_alloc_fail_mpi &&
   command -v mpiexec > /dev/null; then
    mpi_target=test_alloc_fail_mpi
fi
cmake --build "$build" --target test_alloc_fail $mpi_target -j "$jobs" > "$build/build.log" 2>&1 ||
    { cat "$build/build.log"; fail "build (log above)"; }
t_built=$(date +%s)

exe="$build/tests/alloc/test_alloc_fail"
sites="$build/tests/alloc/sites.txt"
rm -f "$sites" 2> /dev/null || true
status=0
OMP_NUM_THREADS=1 MHA_TEST_TMPDIR="$build/tests/alloc" MHA_ALLOC_SITES="$sites" \
    ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:exitcode=23 \
    UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    "$exe" || status=$?
t_swept=$(date +%s)

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
t_mpi=$(date +%s)

# Which sites the sweeps reached: the return addresses of the sites files
# mapped to source lines by addr2line. Every failure is collected here and
# reported at the end (the unreached sites last, before the FAILED line).
problems=""
problem() {
    problems="$problems${problems:+; }$*"
}
# source lines of the sites an executable's sites files name
lines_of() {  # lines_of EXE FILE...
    e=$1
    shift
    # a return address points after the call: look up the byte before it;
    # -i lists inlined frames innermost first, keep the line inside src/
    cat "$@" | cut -d' ' -f1 | sort -u |
        while read -r a; do printf '0x%x\n' $((a - 1)); done |
        addr2line -i -e "$e" | sed 's/ (discriminator [0-9]*)//' |
        grep -o 'src/[^:]*\.c:[0-9]*' | sort -u || true
}
reached=""
if [ -f "$sites" ] && [ -s "$sites" ]; then
    reached=$(lines_of "$exe" "$sites")
    [ -n "$reached" ] ||
        problem "addr2line mapped none of $sites's addresses to a line of src/ (no debug info?)"
else
    problem "the sweep wrote no sites ($sites missing or empty)"
fi
mpi_excused=""
if [ -n "$mpi_target" ]; then
    for r in 0 1; do
        { [ -f "$sites_mpi.$r" ] && [ -s "$sites_mpi.$r" ]; } ||
            problem "the MPI sweep wrote no sites for rank $r ($sites_mpi.$r missing or empty)"
    done
    if ls "$sites_mpi".* > /dev/null 2>&1; then
        reached_mpi=$(lines_of "$exe_mpi" "$sites_mpi".*)
        [ -n "$reached_mpi" ] ||
            problem "addr2line mapped none of $sites_mpi.*'s addresses to a line of src/"
        reached=$(printf '%s\n%s\n' "$reached" "$reached_mpi" | grep . | sort -u)
    fi
elif [ "${MHA_ALLOC_NO_MPI:-0}" = 1 ]; then
    mpi_excused=$(echo "$all" | grep '^src/mpi/' || true)
else
    problem "the MPI layer was not swept (install Open MPI, or MHA_ALLOC_NO_MPI=1 to excuse src/mpi/'s sites)"
fi
nall=$(echo "$all" | grep -c . || true)
unreached=$(echo "$all" | while read -r s; do
    echo "$reached" | grep -qxF "$s" || echo "$mpi_excused" | grep -qxF "$s" || echo "$s"
done)
nunreached=$(echo "$unreached" | grep -c . || true)
nexcused=$(echo "$mpi_excused" | grep -c . || true)
echo "allocation sites in src/: $nall, reached by the sweep: $((nall - nunreached - nexcused))${mpi_excused:+ (the $nexcused of src/mpi/ not swept, excused by MHA_ALLOC_NO_MPI=1)}"
echo "times: build $((t_built - t_start)) s, sweep $((t_swept - t_built)) s," \
     "MPI sweep $((t_mpi - t_swept)) s"

if [ "$status" -ne 0 ]; then
    echo "test_alloc_fail FAILED (exit status $status)"
    problem "test_alloc_fail (exit status $status)"
fi
if [ "$mpi_status" -ne 0 ]; then
    why=""
    [ "$mpi_status" -eq 124 ] && why=": timed out, a rank left waiting?"
    echo "test_alloc_fail_mpi --mpi FAILED (exit status $mpi_status$why)"
    problem "test_alloc_fail_mpi --mpi (exit status $mpi_status$why)"
fi
if [ "$nunreached" -gt 0 ]; then
    echo "allocation sites the sweep did not reach (add a scenario to tests/alloc/test_alloc_fail.c):"
    echo "$unreached" | while read -r s; do
        f=${s%:*} l=${s##*:}
        text=$( (sed -n "${l}p" "$f" 2> /dev/null || true) | sed 's/^ *//')
        echo "  not reached: $s: ${text:-(no such line: planted?)}"
    done
    problem "$nunreached of $nall allocation sites not reached (listed above)"
fi
if [ -n "$problems" ]; then
    echo "tests/alloc/run.sh: FAILED: $problems"
    [ "$status" -ne 0 ] && exit "$status"
    [ "$mpi_status" -ne 0 ] && exit "$mpi_status"
    exit 1
fi
if [ -n "$mpi_excused" ]; then
    swept="all $((nall - nexcused)) allocation sites outside src/mpi/ reached (MPI layer excused)"
else
    swept="all $nall allocation sites reached"
fi
echo "test_alloc_fail: every allocation failure gave MHA_ERR_NOMEM, no leak, no crash" \
     "${mpi_target:+(the MPI layer on every rank) }- $swept"

#!/bin/sh
# compare.sh: libmha against PyTorch on the same shapes, in the same run.
#
# For each shape it runs `build/mha bench --json` and then
# bench/bench_torch.py (Debian's python3-torch) with the same options, one
# after the other, and prints a table: shape, mha ms, torch ms, the ratio
# torch/mha (> 1: mha is faster), mha GFLOP/s and both sides' fraction of
# the fp32 FMA peak that `mha bench` measures in its own process (the
# fraction for torch uses the peak measured by the mha run just before it).
# Peak memory is each process's max RSS (torch's includes ~230 MiB of
# import).
#
# Run from the repository root after `make`:
#   bench/compare.sh                    the default shapes (~5 min or less)
#   bench/compare.sh --impl reference   another libmha implementation
#   bench/compare.sh --shape "--batch 1 --seq 512 --embed-dim 768 --num-heads 12"
#   bench/compare.sh --long             adds the core at L=32768, causal,
#                                       for libmha only (peak memory)
# Options:
#   --impl NAME     libmha implementation: fused (default), reference, auto
#   --threads T     threads for both (default 2)
#   --repeat N      timed runs per shape (default: 5, or 3 for big shapes)
#   --shape ARGS    `mha bench` shape options; repeatable; replaces the
#                   default list (--repeat inside ARGS is allowed)
#   --long          also the long core shape (mha only; torch would need
#                   tens of GiB for the scores)
#   --no-torch      libmha only
#   --mha PATH      the mha executable (default build/mha)
#   --python PATH   the interpreter with torch (default /usr/bin/python3)
#   --jsonl FILE    also append every JSON line to FILE
#   --list          print the default shapes and exit
# torch's GEMMs go through whatever libblas.so.3 the loader finds (the
# footer names it). Debian's default without libopenblas0 is the netlib
# reference BLAS, 10-30x slower; OpenBLAS 0.3.21 may also misdetect a newer
# CPU (it falls back to "Prescott" kernels): then set OPENBLAS_CORETYPE
# (e.g. SkylakeX or Haswell). Both pass through the environment:
#   LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu/openblas-pthread \
#   OPENBLAS_CORETYPE=SkylakeX bench/compare.sh
# The default shapes are the issue's targets (E 768, 12 heads): module
# forward at L 2048 and 4096, causal at L 2048, forward + backward at L 2048,
# and batch 8 at L 512.
set -u

impl=fused
threads=2
repeat=
long=0
torch=1
mha=build/mha
py=/usr/bin/python3
jsonl=
shapes=
list=0

die() { echo "compare.sh: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
    case "$1" in
    --impl) [ $# -ge 2 ] || die "--impl needs a value"; impl=$2; shift 2 ;;
    --threads) [ $# -ge 2 ] || die "--threads needs a value"; threads=$2; shift 2 ;;
    --repeat) [ $# -ge 2 ] || die "--repeat needs a value"; repeat=$2; shift 2 ;;
    --shape) [ $# -ge 2 ] || die "--shape needs a value"
             shapes="${shapes}${2}
"; shift 2 ;;
    --long) long=1; shift ;;
    --no-torch) torch=0; shift ;;
    --mha) [ $# -ge 2 ] || die "--mha needs a value"; mha=$2; shift 2 ;;
    --python) [ $# -ge 2 ] || die "--python needs a value"; py=$2; shift 2 ;;
    --jsonl) [ $# -ge 2 ] || die "--jsonl needs a value"; jsonl=$2; shift 2 ;;
    --list) list=1; shift ;;
    -h|--help) sed -n '2,/^set -u/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
    esac
done
case "$threads" in ''|*[!0-9]*|0) die "--threads needs a positive integer" ;; esac
case "$repeat" in *[!0-9]*|0) die "--repeat needs a positive integer" ;; esac
case "$impl" in fused|reference|ref|auto) ;; *) die "unknown --impl $impl (fused, reference, auto)" ;; esac

# One shape per line: `mha bench` options. "--repeat 3" on big shapes keeps
# the default run short; --repeat on the command line overrides it.
E="--embed-dim 768 --num-heads 12"
if [ -z "$shapes" ]; then
    shapes="--batch 1 --seq 2048 $E --repeat 3
--batch 1 --seq 4096 $E --repeat 3
--batch 1 --seq 2048 $E --causal --repeat 3
--batch 1 --seq 2048 $E --backward --repeat 3
--batch 8 --seq 512 $E --repeat 3
"
fi
if [ "$long" = 1 ]; then
    shapes="${shapes}--batch 1 --seq 32768 $E --core --causal --repeat 1 --warmup 0 --mha-only
"
fi
if [ "$list" = 1 ]; then printf '%s' "$shapes"; exit 0; fi

[ -x "$mha" ] || die "$mha not found: run make first (or pass --mha PATH)"
here=$(dirname "$0")
if [ "$torch" = 1 ] && ! "$py" -c "import torch" 2>/dev/null; then
    die "$py cannot import torch (Debian: apt-get install python3-torch), or use --no-torch"
fi

# Value of a numeric (or string) key in a one-line JSON object.
num() { printf '%s\n' "$1" | sed -n "s/.*\"$2\": *\([-0-9.eE+]*\).*/\1/p"; }
str() { printf '%s\n' "$1" | sed -n "s/.*\"$2\": *\"\([^\"]*\)\".*/\1/p"; }

# A short label for a shape's options.
label() {
    # shellcheck disable=SC2086
    set -- $1
    b=1 l='?' s='' e='?' h='?' extra=
    while [ $# -gt 0 ]; do
        case "$1" in
        --batch) b=$2; shift ;;
        --seq) l=$2; shift ;;
        --kv-seq) s=$2; shift ;;
        --embed-dim) e=$2; shift ;;
        --num-heads) h=$2; shift ;;
        --causal) extra="$extra causal" ;;
        --backward) extra="$extra fwd+bwd" ;;
        --core) extra="$extra core" ;;
        --repeat|--warmup|--seed|--isa) shift ;;
        esac
        shift
    done
    [ -n "$s" ] && [ "$s" != "$l" ] && l="$l S$s"
    printf 'B%s L%s E%s H%s%s' "$b" "$l" "$e" "$h" "$extra"
}

echo "compare.sh: libmha --impl $impl vs PyTorch, $threads thread(s), $(date '+%Y-%m-%d %H:%M'), load: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)"
fmt='%-34s %10s %10s %8s %9s %7s %7s %9s %9s\n'
# shellcheck disable=SC2059
table=$(printf "$fmt" "shape" "mha ms" "torch ms" "t/mha" "mha GF/s" "mha %pk" "t %pk" "mha MiB" "t MiB")
failed=0
peak_seen=
isa_seen=
ran_seen=
torch_blas=
while IFS= read -r args; do
    [ -n "$args" ] || continue
    only=0
    case "$args" in *--mha-only*) only=1; args=$(printf '%s' "$args" | sed 's/ *--mha-only//') ;; esac
    if [ -n "$repeat" ]; then
        args=$(printf '%s' "$args" | sed 's/ *--repeat [0-9]*//')
        args="$args --repeat $repeat"
    fi
    name=$(label "$args")
    echo "  running $name ..." >&2
    # shellcheck disable=SC2086
    mj=$("$mha" bench $args --impl "$impl" --threads "$threads" --json </dev/null 2>/tmp/compare_mha_err.$$)
    if [ -z "$mj" ]; then
        echo "  mha: $(cat /tmp/compare_mha_err.$$)" >&2
        failed=$((failed + 1))
        mms=error mg=- mp=- mr=- peak=
    else
        [ -n "$jsonl" ] && printf '%s\n' "$mj" >>"$jsonl"
        mms=$(num "$mj" median_ms) mg=$(num "$mj" gflops) mr=$(num "$mj" max_rss_mib)
        mms=$(awk -v x="$mms" 'BEGIN { printf "%.2f", x }')
        mg=$(awk -v x="$mg" 'BEGIN { printf "%.1f", x }')
        mp=$(awk -v f="$(num "$mj" peak_fraction)" 'BEGIN { printf "%.1f", 100 * f }')
        peak=$(num "$mj" peak_gflops)
        peak_seen="$peak_seen $peak"
        isa_seen=$(str "$mj" isa)
        ran=$(str "$mj" impl_ran); bran=$(str "$mj" backward_impl)
        case "$args" in *--backward*) ran="$ran, backward $bran" ;; esac
        case " $ran_seen " in *" $name: $ran;"*) ;; *) ran_seen="$ran_seen $name: $ran;" ;; esac
    fi
    tms=- tp=- tr=- ratio=-
    if [ "$torch" = 1 ] && [ "$only" = 0 ]; then
        pk=
        [ -n "$peak" ] && pk="--peak-gflops $peak"
        # shellcheck disable=SC2086
        tj=$("$py" "$here/bench_torch.py" $args --threads "$threads" $pk </dev/null 2>/tmp/compare_torch_err.$$)
        if [ -z "$tj" ]; then
            echo "  torch: $(tail -n 1 /tmp/compare_torch_err.$$)" >&2
            failed=$((failed + 1))
            tms=error
        else
            [ -n "$jsonl" ] && printf '%s\n' "$tj" >>"$jsonl"
            tms=$(num "$tj" median_ms) tr=$(num "$tj" max_rss_mib)
            torch_blas="$(str "$tj" torch_version), BLAS: $(str "$tj" blas)"
            ct=$(str "$tj" openblas_coretype)
            [ -n "$ct" ] && torch_blas="$torch_blas, OPENBLAS_CORETYPE=$ct"
            tms=$(awk -v x="$tms" 'BEGIN { printf "%.2f", x }')
            tf=$(num "$tj" peak_fraction)
            [ -n "$tf" ] && tp=$(awk -v f="$tf" 'BEGIN { printf "%.1f", 100 * f }')
            if [ "$mms" != error ]; then
                ratio=$(awk -v t="$tms" -v m="$mms" 'BEGIN { printf "%.2f", t / m }')
            fi
        fi
    fi
    # shellcheck disable=SC2059
    row=$(printf "$fmt" "$name" "$mms" "$tms" "$ratio" "$mg" "$mp" "$tp" "$mr" "$tr")
    table="$table
$row"
done <<EOF
$shapes
EOF
rm -f /tmp/compare_mha_err.$$ /tmp/compare_torch_err.$$

echo "$table"
echo "t/mha = torch ms / mha ms (> 1: mha faster). %pk: of the fp32 FMA peak measured by mha bench"
echo "(GFLOP/s each mha run measured, $isa_seen fused kernels:$peak_seen). FLOPs: dense count"
echo "(causal counted as dense; fwd+bwd = 3x forward). MiB: process max RSS."
echo "Implementations that ran (mha):$ran_seen"
[ -n "$torch_blas" ] && echo "torch $torch_blas"
[ "$failed" = 0 ] || { echo "compare.sh: $failed run(s) failed" >&2; exit 1; }

#!/bin/sh
# tests/run-suite.sh NAME SKIPS [--py WHICH] [--isa ISA MHA] -- COMMAND...
#
# How ctest runs a suite that may skip (exit 77): COMMAND runs with its
# output streamed; then
#   - exit 77 under CI=true (CI sets it) is a failure: every dependency of
#     a skippable suite is one the project's own install step provides
#     (scripts/install-deps.sh --test, scripts/python-venvs.sh --optional),
#     so a skip there means the install is broken; the message names what
#     was missing (the suite's last line that mentions a skip);
#   - exit 77 otherwise stays a skip, and the reason is written to
#     SKIPS/NAME.txt, which `make check` prints as one line at its end
#     (scripts/skipped.sh).
# --py WHICH finds the interpreter when the suite runs, not when CMake
# configured (so the README's order, `make` then `install-deps.sh --test &&
# make check`, runs every suite) and puts it before COMMAND:
#   debian   $MHA_PYTHON3 if set, else /usr/bin/python3 (Debian's, with
#            python3-torch), else python3 on PATH
#   VENV     a virtual environment's directory (a path with a /):
#            VENV/bin/python
# A missing interpreter is a skip (under CI=true a failure), naming it.
# --isa ISA MHA runs COMMAND with MHA_ISA=ISA when `MHA info --isas` lists
# ISA, and is a skip otherwise, also under CI=true: no install gives a CPU
# an instruction set (the CI summary lists the ISAs the CPU lacks).
set -u
name=$1 skips=$2
shift 2
py= isa= mha=
while [ $# -gt 0 ]; do
    case $1 in
        --py) py=$2; shift 2 ;;
        --isa) isa=$2 mha=$3; shift 3 ;;
        --) shift; break ;;
        *) echo "run-suite.sh: unknown option $1" >&2; exit 2 ;;
    esac
done

# skip WHY [ci-ok]: records the skip (or, under CI=true and without
# ci-ok, fails naming it)
skip() {
    if [ "${CI:-}" = true ] && [ "${2:-}" != ci-ok ]; then
        echo "$name: FAILED: skipped under CI=true, where the install provides it: $1"
        exit 1
    fi
    mkdir -p "$skips"
    echo "$1" > "$skips/$name.txt"
    echo "$name: skipped: $1"
    exit 77
}
rm -f "$skips/$name.txt"

if [ -n "$isa" ]; then
    have=$("$mha" info --isas 2>&1) || { echo "$name: $mha info --isas failed: $have"; exit 1; }
    case " $have " in
        *" $isa "*) MHA_ISA=$isa; export MHA_ISA ;;
        *) skip "this CPU or build lacks $isa (it runs: $have)" ci-ok ;;
    esac
fi

if [ -n "$py" ]; then
    case $py in
        debian)
            if [ -n "${MHA_PYTHON3:-}" ]; then interp=$MHA_PYTHON3
            elif [ -x /usr/bin/python3 ]; then interp=/usr/bin/python3
            else interp=$(command -v python3 || true)
            fi
            [ -n "$interp" ] && [ -x "$interp" ] ||
                skip "no python3 (scripts/install-deps.sh --test installs Debian's)" ;;
        */*)
            interp=$py/bin/python
            [ -x "$interp" ] ||
                skip "no virtual environment $interp (scripts/python-venvs.sh makes it)" ;;
        *) echo "run-suite.sh: unknown --py $py" >&2; exit 2 ;;
    esac
    set -- "$interp" "$@"
fi

out=$(mktemp "${TMPDIR:-/tmp}/mha-suite.XXXXXX")
rcf=$out.rc
{ "$@" 2>&1; echo $? > "$rcf"; } | tee "$out"
rc=$(cat "$rcf" 2>/dev/null || echo 1)
why=$(grep -i 'skip' "$out" | tail -n 1)
rm -f "$out" "$rcf"
if [ "$rc" = 77 ]; then
    skip "${why:-exit status 77, no reason printed}"
fi
exit "$rc"

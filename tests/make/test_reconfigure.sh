#!/bin/sh
# tests/make/test_reconfigure.sh SRC TMP: the top-level Makefile configures
# again when a configure failed or was interrupted (CMakeCache.txt there,
# the generated build/Makefile not), and only then. `make -n` plans the
# commands without running them: nothing is configured or built here.
set -eu
src=$1 tmp=$2
rm -rf "$tmp"
mkdir -p "$tmp/b"
fail=0
# what `make` would run in $src for the build directory $tmp/b
# (an outer make's MAKEFLAGS, as under make check, left out)
plan() { env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL make -n -C "$src" BUILD="$tmp/b" JOBS=1 all 2>&1; }
expect() {  # expect NAME yes|no: whether the plan has a configure
    out=$(plan)
    if printf '%s\n' "$out" | grep -q -- "cmake -S . -B $tmp/b"; then has=yes; else has=no; fi
    if [ "$has" = "$2" ]; then
        echo "ok    $1"
    else
        echo "FAIL  $1: configure planned: $has, expected $2; make -n printed:"
        printf '%s\n' "$out" | sed 's/^/        /'
        fail=1
    fi
}
expect "an empty build directory: configure" yes
: > "$tmp/b/CMakeCache.txt"
expect "CMakeCache.txt without Makefile (a failed configure): configure again" yes
: > "$tmp/b/Makefile"
expect "CMakeCache.txt and Makefile: no configure" no
rm -rf "$tmp"
exit $fail

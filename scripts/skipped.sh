#!/bin/sh
# scripts/skipped.sh BUILD_DIR: one line naming every suite the last ctest
# run in BUILD_DIR skipped and why (tests/run-suite.sh writes
# BUILD_DIR/Testing/skips/NAME.txt), or that none was.
dir=${1:-build}/Testing/skips
line=""
n=0
for f in "$dir"/*.txt; do
    [ -f "$f" ] || continue
    n=$((n + 1))
    line="$line${line:+; }$(basename "$f" .txt) ($(head -n 1 "$f"))"
done
if [ $n -eq 0 ]; then
    echo "skipped suites: none"
else
    echo "skipped suites ($n): $line"
fi

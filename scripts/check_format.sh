#!/bin/sh
# scripts/check_format.sh [ROOT]: src/ and include/ are formatted as
# .clang-format says (clang-format --dry-run --Werror). The layout depends on
# clang-format's major version: the tree is kept with Debian 12's
# clang-format 14; another version skips (exit 77) rather than fail.
set -eu
root=${1:-$(dirname "$0")/..}
cd "$root"
cf=$(command -v clang-format-14 || command -v clang-format || true)
if [ -z "$cf" ]; then
    echo "clang-format not found: skipped (apt-get install clang-format)"
    exit 77
fi
major=$("$cf" --version | sed -n 's/.*version \([0-9]*\)\..*/\1/p')
if [ "$major" != 14 ]; then
    echo "clang-format $major, the tree is kept with 14: skipped"
    exit 77
fi
files=$(ls src/*.c src/*.h src/kernels/*.c src/kernels/*.h src/mpi/*.c src/mpi/*.h include/*.h python/src/*.c python/src/*.h examples/embed/*.c examples/embed/*.h tools/cmd_embed.c 2>/dev/null)
"$cf" --dry-run --Werror $files
echo "format: ok ($(echo $files | wc -w) files)"

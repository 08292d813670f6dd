#!/bin/sh
# Installs libmha into a temporary prefix, then builds the README example
# against it twice: with pkg-config, and with CMake's find_package(mha).
# Usage: [CFLAGS=...] test_install.sh SOURCE_DIR BUILD_DIR WORK_DIR
# CFLAGS: the library build's flags (a sanitizer build needs its consumers
# built with the same runtime).
set -eu
CFLAGS=${CFLAGS:-}
src=$1 build=$2 work=$3
rm -rf "$work" && mkdir -p "$work"
cmake --install "$build" --prefix "$work/prefix" > "$work/install.log"
libdir=$(ls -d "$work"/prefix/lib*/pkgconfig | head -n 1 | xargs dirname)
export PKG_CONFIG_PATH="$libdir/pkgconfig"
cc -std=c11 $CFLAGS "$src/examples/hello.c" -o "$work/hello_pc" \
   $(pkg-config --cflags --libs mha) -Wl,-rpath,"$libdir"
"$work/hello_pc" > "$work/pc.out"
grep -q "token 3" "$work/pc.out"
cmake -S "$src/tests/install/consumer" -B "$work/consumer" \
   -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_C_FLAGS="$CFLAGS" -DEXAMPLE_SOURCE="$src/examples/hello.c" \
   > "$work/consumer.log"
cmake --build "$work/consumer" > "$work/consumer-build.log"
"$work/consumer/hello" > "$work/cmake.out"
cmp "$work/pc.out" "$work/cmake.out"
cat "$work/pc.out"
echo "install: pkg-config and find_package(mha) consumers built and ran"

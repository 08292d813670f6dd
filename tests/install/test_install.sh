#!/bin/sh
# Installs libmha into a temporary prefix, then builds the README example
# against it twice: with pkg-config, and with CMake's find_package(mha).
# The package must ask for lapacke exactly when the library uses it
# (CMake MHA_LAPACKE). When the build has libmha_mpi and mpiexec is there,
# tests/install/hello_mpi.c too, against mha_mpi.pc and against
# find_package(mha COMPONENTS mpi) (mha::mha_mpi), each run with 2 ranks.
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
# lapacke: asked for by mha.pc and mhaConfig.cmake iff libmha.a calls LAPACKE
uses=no pc=no cfg=no
nm "$libdir/libmha.a" 2> /dev/null | grep -q ' U LAPACKE_' && uses=yes
pkg-config --print-requires-private mha | grep -q '^lapacke' && pc=yes
grep -q 'set(MHA_HAVE_LAPACKE ON)' "$libdir/cmake/mha/mhaConfig.cmake" && cfg=yes
[ $uses = $pc ] && [ $pc = $cfg ] ||
    { echo "install: libmha.a uses LAPACKE: $uses; mha.pc asks for it: $pc;" \
           "mhaConfig.cmake: $cfg"; exit 1; }
cc -std=c11 $CFLAGS "$src/examples/hello.c" -o "$work/hello_pc" \
   $(pkg-config --cflags --libs mha) -Wl,-rpath,"$libdir"
"$work/hello_pc" > "$work/pc.out"
grep -q "token 3" "$work/pc.out"
# the MPI consumer, when there is libmha_mpi and mpiexec (Open MPI's own
# memory at exit is not freed: no leak report for it under ASan)
mpi=""
if [ -f "$libdir/libmha_mpi.a" ] && command -v mpiexec > /dev/null; then
    mpi=yes
    cc -std=c11 $CFLAGS "$src/tests/install/hello_mpi.c" -o "$work/hello_mpi_pc" \
       $(pkg-config --cflags --libs mha_mpi) -Wl,-rpath,"$libdir"
fi
mpirun2() {
    ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0} OMP_NUM_THREADS=1 \
        timeout 120 mpiexec -n 2 --allow-run-as-root --oversubscribe --bind-to none "$@"
}
[ -n "$mpi" ] && mpirun2 "$work/hello_mpi_pc" > "$work/pc_mpi.out"
cmake -S "$src/tests/install/consumer" -B "$work/consumer" \
   -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_C_FLAGS="$CFLAGS" -DEXAMPLE_SOURCE="$src/examples/hello.c" \
   ${mpi:+-DMPI_EXAMPLE_SOURCE="$src/tests/install/hello_mpi.c"} \
   > "$work/consumer.log"
cmake --build "$work/consumer" > "$work/consumer-build.log"
"$work/consumer/hello" > "$work/cmake.out"
cmp "$work/pc.out" "$work/cmake.out"
cat "$work/pc.out"
echo "install: pkg-config and find_package(mha) consumers built and ran"
if [ -n "$mpi" ]; then
    mpirun2 "$work/consumer/hello_mpi" > "$work/cmake_mpi.out"
    cmp "$work/pc_mpi.out" "$work/cmake_mpi.out"
    grep -q "bit-identical" "$work/pc_mpi.out"
    cat "$work/pc_mpi.out"
    echo "install: MPI consumers (mha_mpi.pc, find_package(mha COMPONENTS mpi)) built and ran on 2 ranks"
else
    echo "install: no libmha_mpi or no mpiexec: the MPI consumer is not built"
fi

#!/bin/sh
# bench/peers/setup.sh: the virtual environments of bench/peers, at pinned
# versions, from PyPI, under ${MHA_PEERS_VENVS:-${MHA_VENVS:-/opt/mha-venvs}}:
#   torch2          PyTorch (scripts/python-venvs.sh makes it; reused as is,
#                   created by that script when missing)
#   peers-ort       ONNX Runtime + onnx (graphs built with onnx.helper)
#   peers-openvino  OpenVINO
#   peers-ggml      ggml-python, built here from its PyPI sdist (it vendors
#                   ggml's source; GGML_NATIVE=ON, i.e. -march=native, the
#                   CPU backend only; about a minute on 2 cores)
#   peers-mha       this tree's mha Python package (pip install --target),
#                   put on PYTHONPATH in every peer's process by run.py;
#                   rebuilt on every run of this script (incremental, in
#                   peers-mha-build) so that it measures the current tree
# A venv is rebuilt only when missing or when its pins changed (a stamp
# file records them): running this again is cheap. Nothing downloads model
# weights. Needs python3 (3.10+, the one on PATH; every venv must use the
# same interpreter, since the one mha build goes into all of them), a C/C++
# compiler, cmake >= 3.21 and OpenMP.
set -eu
root=${MHA_PEERS_VENVS:-${MHA_VENVS:-/opt/mha-venvs}}
src=$(cd "$(dirname "$0")/../.." && pwd)
py=$(command -v python3)
PIP="-m pip install -q --disable-pip-version-check"
NUMPY="numpy==2.4.6"
PIN_ORT="onnxruntime==1.32.0 onnx==1.23.2 $NUMPY protobuf==7.36.2 flatbuffers==25.12.19
ml_dtypes==0.7.0 packaging==26.4 typing_extensions==4.16.0"
PIN_OV="openvino==2026.4.1 openvino-telemetry==2025.2.0 $NUMPY"
# the ggml build's own tools, pinned too (no build isolation)
PIN_GGML_BUILD="scikit-build-core==0.10.7 packaging==26.4 pathspec==1.1.1"
PIN_GGML="ggml-python==0.0.45 $NUMPY typing_extensions==4.16.0"

# make NAME PACKAGES [PIP OPTIONS]
make_venv() {
    dir=$root/$1 pkgs=$(echo $2) opts=${3:-}
    stamp="$py $pkgs $opts"
    if [ -x "$dir/bin/python" ] && [ "$(cat "$dir/.mha-pins" 2>/dev/null)" = "$stamp" ]; then
        echo "peers venv $dir: up to date"
        return 0
    fi
    echo "peers venv $dir: creating ($pkgs)"
    rm -rf "$dir"
    mkdir -p "$root"
    "$py" -m venv "$dir"
    if [ "$1" = peers-ggml ]; then
        "$dir/bin/python" $PIP $PIN_GGML_BUILD
        # built from the sdist for this CPU: -march=native, CPU backend
        CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
            "$dir/bin/python" $PIP --no-build-isolation --no-binary ggml-python \
            --config-settings=cmake.define.GGML_NATIVE=ON \
            --config-settings=cmake.define.GGML_OPENMP=ON $pkgs
    else
        "$dir/bin/python" $PIP $pkgs
    fi
    echo "$stamp" > "$dir/.mha-pins"
}

if [ ! -x "$root/torch2/bin/python" ]; then
    echo "peers: no $root/torch2: making it with scripts/python-venvs.sh"
    MHA_VENVS=$root "$src/scripts/python-venvs.sh" || true
    [ -x "$root/torch2/bin/python" ] || { echo "peers: could not make $root/torch2" >&2; exit 1; }
fi
make_venv peers-ort "$PIN_ORT"
make_venv peers-openvino "$PIN_OV"
make_venv peers-ggml "$PIN_GGML"

# mha: one wheel of this tree, installed into peers-mha (run.py puts it on
# PYTHONPATH); built with the ggml venv's pinned scikit-build-core
echo "peers: building mha's Python package from $src"
wheels=$root/peers-mha-wheel
rm -rf "$wheels" "$root/peers-mha"
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
    "$root/peers-ggml/bin/python" -m pip wheel -q --disable-pip-version-check \
    --no-build-isolation --no-deps --config-settings=build-dir="$root/peers-mha-build" \
    -w "$wheels" "$src"
"$root/peers-ggml/bin/python" $PIP --no-deps --target "$root/peers-mha" "$wheels"/mha-*.whl

for v in torch2 peers-ort peers-openvino peers-ggml; do
    PYTHONPATH=$root/peers-mha OMP_NUM_THREADS=1 "$root/$v/bin/python" -c "
import importlib.metadata as md, mha, sys
want = {'torch2': ['torch', 'numpy'], 'peers-ort': ['onnxruntime', 'onnx', 'numpy'],
        'peers-openvino': ['openvino', 'numpy'], 'peers-ggml': ['ggml-python', 'numpy']}['$v']
mod = {'torch2': 'torch', 'peers-ort': 'onnxruntime', 'peers-openvino': 'openvino',
       'peers-ggml': 'ggml'}['$v']
__import__(mod)
print('$v:', ', '.join('%s %s' % (p, md.version(p)) for p in want), '| mha', mha.__version__, mha.isa())
"
done

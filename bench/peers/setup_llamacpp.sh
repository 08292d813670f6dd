#!/bin/sh
# bench/peers/setup_llamacpp.sh: the virtual environment of
# bench/serve_llamacpp.py, at pinned versions, from PyPI, at
# ${MHA_PEERS_VENVS:-${MHA_VENVS:-/opt/mha-venvs}}/llamacpp:
#   llama-cpp-python  built here from its PyPI sdist (it vendors llama.cpp
#                     and ggml; CPU backend only, GGML_NATIVE=ON, i.e.
#                     -march=native: the venv is built for the machine it
#                     runs on; OpenMP; several minutes on 2 cores)
#   gguf              writes the random-weight model (GGUFWriter)
#   numpy
#   mha               this tree's Python package, installed into the same
#                     venv (pip install --no-build-isolation, built in
#                     llamacpp-mha-build next to the venv, incrementally);
#                     rebuilt on every run of this script so that the
#                     benchmark measures the current tree
# The venv is rebuilt only when missing or when its pins changed (a stamp
# file records them): running this again is cheap. Nothing downloads model
# weights. Needs python3 (3.10+), a C/C++ compiler, cmake >= 3.21, OpenMP.
# Run the benchmark with
#   /opt/mha-venvs/llamacpp/bin/python bench/serve_llamacpp.py
set -eu
root=${MHA_PEERS_VENVS:-${MHA_VENVS:-/opt/mha-venvs}}
dir=$root/llamacpp
src=$(cd "$(dirname "$0")/../.." && pwd)
py=$(command -v python3)
PIP="-m pip install -q --disable-pip-version-check"
# the builds' own tools (no build isolation: pinned too); scikit-build-core
# at mha's pin (pyproject.toml)
PIN_BUILD="scikit-build-core==0.10.7 packaging==26.4 pathspec==1.1.1"
PIN="llama-cpp-python==0.3.36 gguf==0.19.0 numpy==2.4.6 typing_extensions==4.16.0
diskcache==5.6.3 jinja2==3.1.6 MarkupSafe==3.0.4 pyyaml==6.0.3 tqdm==4.70.1
requests==2.34.2 certifi==2026.10.19.post1 charset-normalizer==3.5.3 idna==3.20 urllib3==2.8.0"
CMAKE_DEFS="-DGGML_NATIVE=ON -DGGML_OPENMP=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF
-DGGML_BLAS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
pins=$(echo $PIN_BUILD $PIN)
defs=$(echo $CMAKE_DEFS)
stamp="$py $pins $defs"
if [ -x "$dir/bin/python" ] && [ "$(cat "$dir/.mha-pins" 2>/dev/null)" = "$stamp" ]; then
    echo "llamacpp venv $dir: up to date"
else
    echo "llamacpp venv $dir: creating ($pins)"
    rm -rf "$dir"
    mkdir -p "$root"
    "$py" -m venv "$dir"
    "$dir/bin/python" $PIP $PIN_BUILD
    # llama-cpp-python's build reads CMAKE_ARGS; its sdist, never a wheel
    CMAKE_ARGS="$defs" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
        "$dir/bin/python" $PIP --no-build-isolation --no-binary llama-cpp-python $(echo $PIN)
    echo "$stamp" > "$dir/.mha-pins"
fi

echo "llamacpp: building mha's Python package from $src"
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
    "$dir/bin/python" $PIP --no-build-isolation --no-deps \
    --config-settings=build-dir="$root/llamacpp-mha-build" "$src"
OMP_NUM_THREADS=1 "$dir/bin/python" -c "
import importlib.metadata as md, llama_cpp, gguf, mha
print('llamacpp:', ', '.join('%s %s' % (p, md.version(p))
      for p in ['llama-cpp-python', 'gguf', 'numpy']), '| mha', mha.__version__, mha.isa())
"

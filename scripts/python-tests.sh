#!/bin/sh
# scripts/python-tests.sh VENV [BUILD_DIR [PYTEST ARGS]]: installs this tree's Python
# package into the virtual environment VENV (pip install ., the extension
# built by scikit-build-core into BUILD_DIR/python-<venv name> so that
# reruns are incremental) and runs the Python suite (tests/python) there.
# Exit status 77 (skipped) when VENV does not exist: create it with
# scripts/python-venvs.sh (scripts/install-deps.sh --test does). Under
# CI=true a skipped test that is not skipped by design fails the run
# (tests/pytest/ci_skips.py).
set -eu
venv=$1
shift
src=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$src/build}
[ $# -gt 0 ] && shift
if [ ! -x "$venv/bin/python" ]; then
    echo "python tests: no virtual environment at $venv (run scripts/python-venvs.sh): skipped"
    exit 77
fi
name=$(basename "$venv")
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-build-isolation \
    --no-deps --config-settings=build-dir="$build/python-$name" "$src"
cd "$src/tests/python"
"$venv/bin/python" -c "import torch, numpy, mha, mha.torch; print('torch', torch.__version__, 'numpy', numpy.__version__, 'mha', mha.__version__, mha.isa())"
# (tests/pytest/ci_skips.py: under CI=true a skip that is not by design fails)
PYTHONPATH=$src/tests/pytest${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH
exec "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider -p ci_skips "$@" 2>&1

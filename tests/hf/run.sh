#!/bin/sh
# tests/hf/run.sh VENV MHA [--cli-only]: the Hugging Face conformance of
# checkpoint loading (tests/hf/test_hf_attention.py) under VENV's python
# with the mha executable MHA. Exit 77 (skipped; under CI=true
# tests/run-suite.sh makes it a failure) when VENV has no torch,
# transformers, safetensors or pytest.
#
# Each build tests itself: the Python API is this tree's (python/mha) with
# the extension scripts/python-tests.sh built next to MHA (MHA's
# dir/python-<venv name>), never the venv's installed package (another
# build's). Without that extension:
#   --cli-only (a build without the Python suite, MHA_PYTHON_TESTS=OFF:
#              the sanitizer and scalar builds) runs the tests that go
#              through MHA alone and says which were left out and why;
#   otherwise  it fails, naming the missing extension (ctest runs
#              python_torch2 first, which builds it).
set -eu
VENV=$1
MHA=$2
cli_only=${3:-}
PY=$VENV/bin/python
if [ ! -x "$PY" ]; then
    echo "tests/hf: no virtual environment $VENV (scripts/python-venvs.sh): skipped"
    exit 77
fi
if ! err=$("$PY" -c "import torch, transformers, safetensors, pytest" 2>&1); then
    echo "tests/hf: $VENV lacks torch, transformers, safetensors or pytest" \
         "($(echo "$err" | tail -n 1)): skipped"
    exit 77
fi
case $MHA in /*) ;; *) MHA=$(pwd)/$MHA ;; esac  # (relative to the caller's directory)
here=$(cd "$(dirname "$0")" && pwd)
ext=$(dirname "$MHA")/python-$(basename "$VENV")
so=$(ls "$ext"/_mha.*.so 2>/dev/null | head -n 1 || true)
pkg=
select=
if [ -n "$so" ]; then
    pkg=$(mktemp -d "${TMPDIR:-/tmp}/mha-hf-pkg.XXXXXX")
    mkdir "$pkg/mha"
    cp "$here/../../python/mha/"*.py "$so" "$pkg/mha/"
    echo "tests/hf: mha from python/mha with $so"
elif [ "$cli_only" = --cli-only ]; then
    # an empty package directory first on the path: `import mha` fails
    # rather than finding the venv's installed package
    pkg=$(mktemp -d "${TMPDIR:-/tmp}/mha-hf-pkg.XXXXXX")
    mkdir "$pkg/mha"
    echo "raise ImportError('tests/hf --cli-only: no Python extension of this build')" \
        > "$pkg/mha/__init__.py"
    select="test_layer or test_real_minilm"
    echo "tests/hf: this build ($(dirname "$MHA")) has no Python extension of its own" \
         "(MHA_PYTHON_TESTS=OFF): the tests through mha forward --checkpoint run," \
         "test_cached and test_backward (the Python API) are left out of it"
else
    echo "tests/hf: FAILED: no extension of this build at $ext (python_torch2 builds it:" \
         "ctest -R 'python_torch2|hf_checkpoints'); the venv's installed mha would be" \
         "another build's"
    exit 1
fi
# (tests/pytest/ci_skips.py: under CI=true a skip that is not by design
# fails: the MiniLM weights package missing, say)
PYTHONPATH=$pkg:$here/../pytest${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH
cd "$here"
rc=0
if [ -n "$select" ]; then
    "$PY" -m pytest -q -rxfs -p no:cacheprovider -p ci_skips . --mha "$MHA" -k "$select" || rc=$?
else
    "$PY" -m pytest -q -rxfs -p no:cacheprovider -p ci_skips . --mha "$MHA" || rc=$?
fi
rm -rf "$pkg"
exit $rc

#!/bin/sh
# tests/hf/run.sh VENV MHA: the Hugging Face conformance of checkpoint
# loading (tests/hf/test_hf_attention.py) under VENV's python with mha
# executable MHA. Exit 77 (skipped) when VENV has no torch, transformers,
# safetensors or pytest. The Python API is this tree's (python/mha) with
# the extension scripts/python-tests.sh built next to MHA
# (MHA's dir/python-<venv name>) when there is one, so that another
# tree's install into the shared venv does not stand in for it; else the
# venv's installed mha package.
set -eu
VENV=$1
MHA=$2
PY=$VENV/bin/python
if [ ! -x "$PY" ] || ! "$PY" -c "import torch, transformers, safetensors, pytest" 2>/dev/null; then
    echo "tests/hf: $VENV lacks torch, transformers, safetensors or pytest: skipped"
    exit 77
fi
case $MHA in /*) ;; *) MHA=$(pwd)/$MHA ;; esac  # (relative to the caller's directory)
here=$(cd "$(dirname "$0")" && pwd)
so=$(ls "$(dirname "$MHA")/python-$(basename "$VENV")"/_mha.*.so 2>/dev/null | head -n 1 || true)
pkg=
if [ -n "$so" ]; then
    pkg=$(mktemp -d "${TMPDIR:-/tmp}/mha-hf-pkg.XXXXXX")
    mkdir "$pkg/mha"
    cp "$here/../../python/mha/"*.py "$so" "$pkg/mha/"
    PYTHONPATH=$pkg${PYTHONPATH:+:$PYTHONPATH}
    export PYTHONPATH
    echo "tests/hf: mha from python/mha with $so"
fi
cd "$here"
rc=0
"$PY" -m pytest -q -rxf -p no:cacheprovider . --mha "$MHA" || rc=$?
[ -z "$pkg" ] || rm -rf "$pkg"
exit $rc

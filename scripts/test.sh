#!/usr/bin/env bash
# Set up (with test dependencies) and run the whole test suite. CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
exec .venv/bin/python -m pytest "$@"

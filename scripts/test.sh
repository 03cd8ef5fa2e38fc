#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite; exits with pytest's code.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/setup.sh
exec .venv/bin/python -m pytest tests -p no:cacheprovider -ra "$@"

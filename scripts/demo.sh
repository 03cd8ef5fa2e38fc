#!/usr/bin/env bash
# Set up everything (idempotent) and run the text-to-video workflow through a real ComfyUI on the tiny model.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/setup.sh
exec .venv/bin/python scripts/demo.py "$@"

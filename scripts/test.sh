#!/usr/bin/env bash
# The test command of the README (and of CI): set up, then run every test.
# GPU tests (marked gpu) skip visibly on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -rs "$@"

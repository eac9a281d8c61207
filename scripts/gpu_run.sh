#!/usr/bin/env bash
# The one entry point on the GPU machine: runs the battery of device blocks
# (tests/gpu/battery.py, a test harness) from the repo root.
#   bash scripts/gpu_run.sh --smoke --out "$OUT" [--only ceiling weight_stream ...]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec python3 -m gpu.battery "$@"

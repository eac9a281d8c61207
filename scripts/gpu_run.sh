#!/usr/bin/env bash
# The one entry point on the GPU machine: runs the battery from the repo root.
#   bash scripts/gpu_run.sh --smoke --out "$OUT" [--only ceiling weight_stream ...]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec python3 -m megac.gpu.battery "$@"

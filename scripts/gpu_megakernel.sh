#!/usr/bin/env bash
# On the GPU machine: the megakernel checks, after scripts/gpu_env.sh's setup:
#   bash scripts/gpu_megakernel.sh --run tiny hang smollm2 --out "$OUT"
# Profiling one step with Nsight Compute:
#   source scripts/gpu_env.sh && ncu -k megakernel -c 1 python3 -m gpu.one_step north-mini-code
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
exec python3 -m gpu.megakernel_check "$@"

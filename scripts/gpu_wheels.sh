#!/usr/bin/env bash
# Here (not on the GPU machine): the wheels the GPU machine lacks, into
# .whl (git-ignored; carried to the device, installed there by gpu_env.sh):
# the server's stack, the GGUF reader, pytest and the openai client the GPU
# serving checks drive. Python 3.12 x86_64 wheels from the configured index.
# Also .smoltok: SmolLM2's tokenizer saved as a directory (3.4 MB), so North
# Mini Code can be served there with a real tokenizer without carrying the
# 94 MB GGUF (MEGAC_NMC_TOKENIZER=$PWD/.smoltok for gpu.serve_bench).
set -euo pipefail
cd "$(dirname "$0")/.."
pip=.venv/bin/pip
[ -x "$pip" ] || pip="python3 -m pip"
mkdir -p .whl
$pip download -q --no-deps -d .whl --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 \
  fastapi starlette uvicorn h11 anyio idna sniffio pydantic pydantic-core typing-inspection annotated-types \
  annotated-doc opentelemetry-api gguf pytest pluggy iniconfig \
  openai httpx httpcore httpx2 httpcore2 truststore jiter distro tqdm certifi
du -sh .whl
if [ ! -f .smoltok/tokenizer.json ]; then
  .venv/bin/python -c "
from megac.loading import load_hf_tokenizer
from megac.weights.gguf import smollm2_gguf_path
p = smollm2_gguf_path()
load_hf_tokenizer(str(p.parent), gguf_file=p.name).save_pretrained('.smoltok')"
fi
du -sh .smoltok

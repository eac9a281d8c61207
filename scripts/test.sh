#!/usr/bin/env bash
# The test command of the README (and of CI): set up, then run every test.
# GPU tests (marked gpu) skip visibly on a machine without a GPU.
# Two pytest-xdist workers where there are two cores (MEGAC_TEST_WORKERS
# overrides; 0 runs in this process): the suite takes about half the time
# on the 2-core CI machine. Tests whose peak memory would add up share a
# worker (xdist_group "big-memory", --dist loadgroup).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cores=$(nproc 2>/dev/null || echo 1)
workers=${MEGAC_TEST_WORKERS:-$([ "$cores" -ge 2 ] && echo 2 || echo 0)}
exec .venv/bin/python -m pytest -q -rs -n "$workers" --dist loadgroup "$@"

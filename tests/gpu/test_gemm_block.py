"""GPU: the tiny-M GEMM tile and its epilogues (megac/gpu/blocks/gemm.py).

Runs the block's quick battery in a subprocess (a device fault or a
watchdog abort cannot take the test session down) and requires every
correctness check to pass: all decode GEMM shapes of North Mini Code and
SmolLM2-135M at M = 1, 2, 4, 8, against torch, NaN-poisoned outputs fully
written, relaunches bit-identical. Bandwidth is reported, not asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
def test_gemm_block(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    out = tmp_path / "gemm.json"
    proc = subprocess.run(
        [sys.executable, "-m", "megac.gpu.blocks.gemm", "--quick", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.exists(), f"block wrote no result (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    res = json.loads(out.read_text())
    checks = res["checks"]
    assert checks, "no checks ran"
    failed = [f"{c['name']}: {c['detail']}" for c in checks if not c["ok"]]
    assert not failed, "\n".join(failed)

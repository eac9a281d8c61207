"""GPU: the moe_routing battery block (quick mode) passes every check.

Runs in a subprocess so a device fault or watchdog abort cannot take the
test session down with it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
def test_moe_routing_block_quick(tmp_path):
    out = tmp_path / "moe_routing.json"
    proc = subprocess.run(
        [sys.executable, "-m", "megac.gpu.blocks.moe_routing", "--quick", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.is_file(), f"no result (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    res = json.loads(out.read_text())
    failed = [c for c in res["checks"] if not c["ok"]]
    assert res["checks"], "the block ran no checks"
    assert not failed, json.dumps(failed, indent=1)[:6000]

"""Run every GPU battery block (tests/gpu/blocks/*.py) in a subprocess, quick
sizes, and require all of its checks to pass. Skipped without a GPU."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpu import battery

BLOCKS = battery.discover()


@pytest.mark.gpu
@pytest.mark.parametrize("block", BLOCKS)
def test_block_checks_pass(block: str, tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(battery.REPO), str(battery.REPO / "tests")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    res = battery.run_block(block, True, tmp_path, battery.TIMEOUT_QUICK_S, env)
    failed = [c for c in res["checks"] if not c["ok"]]
    assert res["checks"], f"{block} reported no checks"
    assert not failed, f"{block}: " + json.dumps(failed, indent=1)[:4000]

"""The GEMM rings' stage cursor (opcodes/gemm_tc.cuh WalkPos, the
MEGAC_TC_WALK_POS walk) visits the stages Walk::stage computes, from any
starting stage, for every tile shape and warp count: the device structs are
__host__ __device__, so tests/codegen/walk_pos_test.cu runs them on the CPU."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

OPCODES = Path(__file__).resolve().parents[2] / "opcodes"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
@pytest.mark.parametrize("pow2_div", [0, 1])
def test_the_stage_cursor_walks_the_stages_walk_stage_computes(tmp_path, pow2_div):
    """With the walk's divisions, and with its shifts and masks for powers of
    two (MEGAC_TC_POW2_DIV): the same fields, quotients and stages as plain
    integer division gives."""
    exe = tmp_path / "walk_pos_test"
    build = subprocess.run(
        ["nvcc", "-std=c++17", f"-I{OPCODES}", f"-DMEGAC_TC_POW2_DIV={pow2_div}", "-o", str(exe),
         str(Path(__file__).with_name("walk_pos_test.cu"))],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:]
    kind, cases = run.stdout.split()
    # every tile shape of 16..1024 features by 32..4096 columns, 1-8 warps
    assert kind == "ok" and int(cases) > 1_000_000

"""megac bench's streaming-read ceiling (megac.gpu.ceiling): what it reports
on the CPU machine, and on a GPU that the read kernel's sum is the data's and
the ceiling is the fastest read measured."""

from __future__ import annotations

import pytest

from megac import decode_bench as db
from megac.gpu import ceiling


def test_no_ceiling_on_the_cpu() -> None:
    assert db.measure_ceiling("cpu") is None


def test_line_names_the_best_read_and_the_others() -> None:
    c = ceiling.Ceiling(bps=4.6e12, method=ceiling.SHAPES[1][0],
                        reads={ceiling.SHAPES[0][0]: 4.59e12, ceiling.SHAPES[1][0]: 4.6e12, ceiling.TORCH_SUM: 4.28e12},
                        skipped={})
    line = c.line()
    assert line.startswith("streaming-read ceiling: 4.600 TB/s (16 B nc loads, 1 CTA x 1024")
    assert "torch.sum (float32) 4.280" in line and "4 CTAs x 512 threads per SM 4.590" in line
    assert "not used" not in line
    rec = c.record()
    assert rec["bps"] == 4.6e12 and rec["reads_bps"][ceiling.TORCH_SUM] == 4.28e12


def test_line_says_why_a_read_was_not_used() -> None:
    c = ceiling.Ceiling(bps=4.28e12, method=ceiling.TORCH_SUM, reads={ceiling.TORCH_SUM: 4.28e12},
                        skipped={"read kernel": "not built or loaded (nvcc is not on PATH)"})
    assert c.line().splitlines()[1] == "  not used: read kernel: not built or loaded (nvcc is not on PATH)"


def test_the_kernel_source_ships_with_the_package() -> None:
    # setup.py copies opcodes/ into the wheel; the source must sit there, not under tests/
    assert ceiling.SOURCE.is_file() and ceiling.SOURCE.parent.name == "opcodes"
    assert f"void __launch_bounds__(1024) {ceiling.KERNEL}(" in ceiling.SOURCE.read_text()


@pytest.mark.gpu
def test_kernel_reads_every_byte_and_the_best_read_is_the_ceiling() -> None:
    import torch

    got = ceiling.measure(nbytes=1 << 30, repeats=5, warmup_s=0.2)
    # on a GPU with nvcc or the carried cubin, both launch shapes' sums equal the data's
    assert not got.skipped, got.skipped
    assert set(got.reads) == {s[0] for s in ceiling.SHAPES} | {ceiling.TORCH_SUM}
    assert got.bps == max(got.reads.values()) and got.reads[got.method] == got.bps
    # and the buffer is given back
    assert torch.cuda.memory_allocated() < (1 << 30)

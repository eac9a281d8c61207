"""How big the KV pool is and how long a context it serves: an asked budget
as given, the GPU's free memory after the weights otherwise, and on the GPU
the longest context one request can hold in that pool (checked against the
block count computed here from the layer windows, not by the code under
test's own helper)."""

from __future__ import annotations

import pytest

from megac.engine.build import (DEFAULT_CPU_KV_GB, GPU_HEADROOM_BYTES, fit_max_model_len,
                                kv_budget_bytes)
from megac.errors import MegacError
from models import variant

GiB = 2 ** 30


def test_budget_asked_wins_then_gpu_then_cpu_default():
    assert kv_budget_bytes(2.5, 80 * GiB, 0.9) == int(2.5 * GiB)
    assert kv_budget_bytes(None, 80 * GiB, 0.9) == int(80 * GiB * 0.9) - GPU_HEADROOM_BYTES
    assert kv_budget_bytes(None, 80 * GiB, 0.5) == 40 * GiB - GPU_HEADROOM_BYTES
    assert kv_budget_bytes(None, None, 0.9) == int(DEFAULT_CPU_KV_GB * GiB)
    assert kv_budget_bytes(None, GiB // 2, 0.9) == 0  # nothing left after the headroom
    with pytest.raises(MegacError, match="gpu-memory-utilization"):
        kv_budget_bytes(None, 80 * GiB, 1.5)


def blocks_held(windows, tokens, bs):
    """Blocks one row holds at ``tokens`` cached: all of a full layer's, a
    sliding layer's from the block holding its window's first key."""
    total = 0
    for w in windows:
        first_key = 0 if w is None else max(0, tokens - w)
        total += (tokens - 1) // bs - first_key // bs + 1
    return total


def blocks_needed(windows, tokens, bs):
    """Blocks a pool must have for one row to grow to ``tokens``: the most it
    holds at any length on the way (a short window frees a block as it
    passes a block boundary, so the count at the end can be the smaller)."""
    return max(blocks_held(windows, t, bs) for t in range(1, tokens + 1))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-moe"])
def test_fitted_length_is_the_longest_that_fits(name):
    spec = variant(name)
    bs = spec.target.kv_block_size
    windows = [l.window for l in spec.layers]
    for budget in (blocks_needed(windows, 100, bs), blocks_needed(windows, 1000, bs) + 3, 10 ** 9):
        got = fit_max_model_len(spec, None, budget, bs)
        assert got <= spec.max_context
        assert blocks_needed(windows, got, bs) <= budget
        assert got == spec.max_context or blocks_needed(windows, got + 1, bs) > budget
    # an asked length that fits is kept; one that does not is a one-line error
    assert fit_max_model_len(spec, 64, blocks_needed(windows, 64, bs), bs) == 64
    with pytest.raises(MegacError, match="--max-model-len 512: one request needs"):
        fit_max_model_len(spec, 512, blocks_needed(windows, 512, bs) - 1, bs)
    with pytest.raises(MegacError, match="less than one request"):
        fit_max_model_len(spec, None, 0, bs)

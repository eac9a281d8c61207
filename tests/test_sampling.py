"""The sampler: greedy, temperature, top-k, top-p, min-p, penalties, bias,
seeds (same seed -> same tokens, independent of other rows)."""

from __future__ import annotations

import torch

import numpy as np
import pytest

from megac import abi
from megac.runtime.step import greedy_from_records
from megac.sampling import RowSampling, SamplingParams, filtered_probs, make_stream, sample, sample_row, sample_rows


def _logits(v=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(v, generator=g) * 3


def test_greedy_is_argmax_and_lowest_id_on_ties():
    x = _logits()
    assert sample_row(x, SamplingParams(temperature=0.0), None) == int(torch.argmax(x))
    tie = torch.zeros(10)
    tie[3] = tie[7] = 5.0
    assert sample_row(tie, SamplingParams(temperature=0.0), None) == 3


def test_same_seed_same_tokens_different_seed_differs():
    x = _logits()
    p = SamplingParams(temperature=1.0, seed=1234)

    def run(seed):
        g = make_stream(seed)
        return [sample_row(x, p, g) for _ in range(40)]

    assert run(1234) == run(1234)
    assert run(1234) != run(4321)


def test_rows_are_independent_of_each_other():
    x = torch.stack([_logits(seed=i) for i in range(4)])
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i) for i in range(4)]
    gens = [make_stream(i) for i in range(4)]
    batched = [sample(x, params, gens) for _ in range(10)]
    for i in range(4):
        g = make_stream(i)
        alone = [sample_row(x[i], params[i], g) for _ in range(10)]
        assert alone == [b[i] for b in batched]


def test_top_k_one_is_greedy():
    x = _logits()
    g = make_stream(0)
    p = SamplingParams(temperature=1.5, top_k=1)
    assert {sample_row(x, p, g) for _ in range(20)} == {int(torch.argmax(x))}


def test_top_k_keeps_k_tokens():
    x = _logits()
    probs = filtered_probs(x, SamplingParams(temperature=1.0, top_k=5))
    assert int((probs > 0).sum()) == 5
    assert set(torch.nonzero(probs).flatten().tolist()) == set(torch.topk(x, 5).indices.tolist())


def test_top_p_keeps_the_smallest_nucleus():
    x = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = filtered_probs(x, SamplingParams(temperature=1.0, top_p=0.8))
    assert (probs > 0).tolist() == [True, True, False, False]
    probs = filtered_probs(x, SamplingParams(temperature=1.0, top_p=0.81))
    assert (probs > 0).tolist() == [True, True, True, False]
    probs = filtered_probs(x, SamplingParams(temperature=1.0, top_p=0.01))
    assert (probs > 0).tolist() == [True, False, False, False]


def test_min_p():
    x = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = filtered_probs(x, SamplingParams(temperature=1.0, min_p=0.2))
    assert (probs > 0).tolist() == [True, True, True, False]


def test_sampling_follows_the_distribution():
    x = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    g = make_stream(7)
    p = SamplingParams(temperature=1.0)
    counts = torch.bincount(torch.tensor([sample_row(x, p, g) for _ in range(3000)]), minlength=3).float() / 3000
    assert torch.allclose(counts, torch.tensor([0.7, 0.2, 0.1]), atol=0.04)


def test_logit_bias_penalties_and_min_tokens():
    x = torch.zeros(10)
    x[4] = 1.0
    assert sample_row(x, SamplingParams(temperature=0.0, logit_bias={6: 5.0}), None) == 6
    # frequency penalty pushes an already generated token down
    p = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    assert sample_row(x, p, None, output_ids=[4]) != 4
    p = SamplingParams(temperature=0.0, presence_penalty=2.0)
    assert sample_row(x, p, None, output_ids=[4, 4]) != 4
    # EOS is masked until min_tokens tokens were generated
    x[2] = 10.0
    p = SamplingParams(temperature=0.0, min_tokens=2)
    assert sample_row(x, p, None, output_ids=[5], eos_ids={2}) == 4
    assert sample_row(x, p, None, output_ids=[5, 5], eos_ids={2}) == 2


def test_random_stream_does_not_depend_on_filters():
    """Each step draws vocab exponentials from (seed, step): after one step
    under different filters both streams draw the same next noise."""
    x = _logits()
    g1, g2 = make_stream(5), make_stream(5)
    sample_row(x, SamplingParams(temperature=1.0, top_k=3), g1)
    sample_row(x, SamplingParams(temperature=1.0, top_p=0.5), g2)
    assert torch.equal(g1.exponentials(64, "cpu"), g2.exponentials(64, "cpu"))


def test_noise_is_exponential_and_independent_across_steps():
    """Mean and variance of Exp(1) are 1; P(E > 1) = e^-1; consecutive steps
    are uncorrelated. 2^17 draws: the standard errors are ~0.003 (mean),
    ~0.008 (variance), ~0.0013 (tail), ~0.003 (correlation); the bounds
    are 4-5 of them."""
    s = make_stream(123)
    a, b = s.exponentials(1 << 17, "cpu").double(), s.exponentials(1 << 17, "cpu").double()
    assert bool(torch.all(torch.isfinite(a))) and float(a.min()) > 0
    assert abs(float(a.mean()) - 1.0) < 0.015
    assert abs(float(a.var()) - 1.0) < 0.04
    assert abs(float((a > 1).double().mean()) - np.exp(-1)) < 0.007
    assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.015


def test_stream_resumes_from_its_step():
    """A request's stream after k draws continues exactly where a fresh
    stream of the same seed would after k draws (preemption keeps it)."""
    s1, s2 = make_stream(9), make_stream(9)
    for _ in range(3):
        s1.exponentials(10, "cpu")
    s2.step = 3
    assert torch.equal(s1.exponentials(10, "cpu"), s2.exponentials(10, "cpu"))


def test_sample_rows_equals_row_by_row_and_skips_none():
    x = torch.stack([_logits(seed=i) for i in range(5)])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_k=7, seed=1), None,
              SamplingParams(temperature=0.0, logit_bias={3: 100.0}), SamplingParams(temperature=1.2, seed=2)]
    rows = [RowSampling(p, make_stream(p.seed), [1, 2]) if p else None for p in params]
    got = sample_rows(x, rows)
    want = [sample_row(x[i], p, make_stream(p.seed), [1, 2]) if p else None for i, p in enumerate(params)]
    assert got == want
    assert got[2] is None and got[3] == 3 and got[0] == int(torch.argmax(x[0]))


def test_sample_rows_takes_plain_greedy_rows_from_the_given_tokens():
    """``greedy=`` (the argmax records' tokens) serves rows that need no
    logits; a row with a logit bias still reads the logits."""
    x = torch.stack([_logits(seed=i) for i in range(3)])
    rows = [RowSampling(SamplingParams(temperature=0.0), None),
            RowSampling(SamplingParams(temperature=0.0, logit_bias={0: 1e3}), None),
            RowSampling(SamplingParams(temperature=0.0), None)]
    got = sample_rows(x, rows, greedy=torch.tensor([11, 12, 13]))
    assert got == [11, 0, 13]
    # every row plain greedy (the common decode step): exactly the given tokens, as ints
    plain = [rows[0], rows[2], rows[0]]
    got = sample_rows(x, plain, greedy=torch.tensor([7, 8, 9]))
    assert got == [7, 8, 9] and all(type(t) is int for t in got)


def _records(values: np.ndarray, tile: int) -> np.ndarray:
    """Argmax records of logits [n, vocab] per tile, by a plain loop (first
    maximal index; NaN above all, the first NaN wins)."""
    n, v = values.shape
    tiles = -(-v // tile)
    rec = np.zeros((n, tiles, 2), dtype=np.int32)
    for r in range(n):
        for t in range(tiles):
            seg = values[r, t * tile:(t + 1) * tile]
            nan = np.flatnonzero(np.isnan(seg))
            j = int(nan[0]) if len(nan) else int(np.argmax(seg))
            rec[r, t, 0] = np.float32(seg[j]).view(np.int32)
            rec[r, t, 1] = t * tile + j
    return rec


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_from_records_follows_the_abi_rule(seed):
    """Against the ABI's host reduction and a plain argmax of the logits:
    random rows, rows with ties across tiles (lowest index wins), +inf, and a
    NaN (the lowest-index NaN wins)."""
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((6, 1000)).astype(np.float32)
    v = np.round(v * 4) / 4  # many equal values: ties inside and across tiles
    v[1, 130] = v[1, 870] = 9.0
    v[2, 500] = np.inf
    v[3, 700] = np.nan
    v[3, 20] = 50.0
    v[4, 990] = np.nan
    v[4, 10] = np.nan
    rec = _records(v, 128)
    got = greedy_from_records(torch.from_numpy(rec)).numpy()
    want, _ = abi.argmax_reduce(rec)
    assert got.tolist() == want.tolist()
    assert got[1] == 130 and got[2] == 500 and got[3] == 700 and got[4] == 10
    for r in (0, 5):
        assert got[r] == int(np.argmax(v[r]))

"""The sampler: greedy, temperature, top-k, top-p, min-p, penalties, bias,
seeds (same seed -> same tokens, independent of other rows)."""

from __future__ import annotations

import torch

from megac.sampling import SamplingParams, filtered_probs, make_generator, sample, sample_row


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
        g = make_generator(seed)
        return [sample_row(x, p, g) for _ in range(40)]

    assert run(1234) == run(1234)
    assert run(1234) != run(4321)


def test_rows_are_independent_of_each_other():
    x = torch.stack([_logits(seed=i) for i in range(4)])
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i) for i in range(4)]
    gens = [make_generator(i) for i in range(4)]
    batched = [sample(x, params, gens) for _ in range(10)]
    for i in range(4):
        g = make_generator(i)
        alone = [sample_row(x[i], params[i], g) for _ in range(10)]
        assert alone == [b[i] for b in batched]


def test_top_k_one_is_greedy():
    x = _logits()
    g = make_generator(0)
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
    g = make_generator(7)
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
    """Each step draws vocab exponentials, so the generator advances alike."""
    x = _logits()
    g1, g2 = make_generator(5), make_generator(5)
    sample_row(x, SamplingParams(temperature=1.0, top_k=3), g1)
    sample_row(x, SamplingParams(temperature=1.0, top_p=0.5), g2)
    assert torch.equal(torch.rand(4, generator=g1), torch.rand(4, generator=g2))

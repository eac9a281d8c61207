"""The one sampler: fp32 logits of a row -> the next token.

Every backend returns fp32 logits ``[n, vocab]`` with ``logit_scale`` already
applied; the engine hands them here, one row at a time, with that row's
:class:`SamplingParams` and its own ``torch.Generator``. Processing order:

1. ``logit_bias`` (added), ``presence_penalty`` / ``frequency_penalty``
   (subtracted for tokens already generated), EOS / stop tokens masked while
   fewer than ``min_tokens`` were generated;
2. greedy (``temperature < 1e-5``): ``argmax``, the lowest id among ties;
3. otherwise ``logits / temperature``, ``top_k`` (keep the k largest; ties at
   the k-th value are kept), ``top_p`` (the smallest set of most probable
   tokens whose mass reaches ``top_p``; the first is always kept), ``min_p``
   (drop tokens below ``min_p * p_max``), then one draw by the exponential
   race ``argmax(p / E)`` with ``E ~ Exp(1)`` drawn from the row's generator
   (exactly sampling from ``p``).

Each step draws exactly ``vocab`` exponentials from the row's generator,
whatever the filters, so the random stream only depends on the step count:
the same seed gives the same tokens alone, batched, in any order and after a
preemption (the generator lives with the request).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """Per-request sampling and stopping parameters (validated by the API)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


def make_generator(seed: int | None) -> torch.Generator:
    """The row's generator: seeded from ``seed``, or from the OS when None."""
    g = torch.Generator(device="cpu")
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1)
    g.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return g


def process_logits(logits: torch.Tensor, p: SamplingParams, output_ids: list[int],
                   eos_ids: set[int]) -> torch.Tensor:
    """Step 1 of the module docstring on a copy of one row's fp32 logits."""
    x = logits.float().clone()
    vocab = x.shape[-1]
    if p.logit_bias:
        for t, b in p.logit_bias.items():
            if 0 <= t < vocab:
                x[t] += b
    if output_ids and (p.presence_penalty or p.frequency_penalty):
        ids = torch.tensor(output_ids, dtype=torch.int64)
        counts = torch.bincount(ids[(ids >= 0) & (ids < vocab)], minlength=vocab).to(x.dtype)
        x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype)
    if len(output_ids) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else eos_ids):
            if 0 <= t < vocab:
                x[t] = float("-inf")
    return x


def filtered_probs(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p (zeros elsewhere)."""
    x = x / p.temperature
    vocab = x.shape[-1]
    if 0 < p.top_k < vocab:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        sp, si = torch.sort(probs, descending=True, stable=True)
        before = torch.cumsum(sp, dim=-1) - sp  # mass of the strictly better tokens
        drop = before >= p.top_p
        drop[0] = False
        probs = probs.clone()
        probs[si[drop]] = 0.0
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs


def sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None,
               output_ids: list[int] | None = None, eos_ids: set[int] | frozenset = frozenset()) -> int:
    """The next token of one row (see the module docstring)."""
    x = process_logits(logits, p, output_ids or [], set(eos_ids))
    if p.greedy:
        return int(torch.argmax(x))
    probs = filtered_probs(x, p)
    if generator is None:
        generator = make_generator(None)
    e = torch.empty_like(probs).exponential_(generator=generator)
    return int(torch.argmax(probs / e))


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           outputs: list[list[int]] | None = None, eos_ids: set[int] | frozenset = frozenset()) -> list[int]:
    """``sample_row`` for each row of ``logits`` ``[n, vocab]``."""
    outputs = outputs if outputs is not None else [[] for _ in params]
    return [sample_row(logits[i], params[i], generators[i], outputs[i], eos_ids) for i in range(len(params))]


__all__ = ["GREEDY_EPS", "SamplingParams", "filtered_probs", "make_generator", "process_logits", "sample",
           "sample_row"]

"""The one sampler: fp32 logits of a row -> the next token.

Every backend returns fp32 logits ``[n, vocab]`` with ``logit_scale`` already
applied; the engine hands them here, one row at a time, with that row's
:class:`SamplingParams` and its own :class:`NoiseStream`. Processing order:

1. ``logit_bias`` (added), ``presence_penalty`` / ``frequency_penalty``
   (subtracted for tokens already generated), EOS / stop tokens masked while
   fewer than ``min_tokens`` were generated; then, for a row held to a
   grammar (structured output, :mod:`megac.grammar`), every token the
   grammar forbids at ``-inf``;
2. greedy (``temperature < 1e-5``): ``argmax``, the lowest id among ties;
3. otherwise ``logits / temperature``, ``top_k`` (keep the k largest; ties at
   the k-th value are kept), ``top_p`` (the smallest set of most probable
   tokens whose mass reaches ``top_p``; the first is always kept), ``min_p``
   (drop tokens below ``min_p * p_max``), then one draw by the exponential
   race ``argmax(p / E)`` with ``E ~ Exp(1)`` from the row's
   :class:`NoiseStream` (exactly sampling from ``p``).

The noise is counter-based (:mod:`megac.rng`): step ``s`` of a row seeded
``seed`` draws ``vocab`` exponentials from the counters of ``(seed, s)``,
whatever the filters, on whatever device holds the logits. So the tokens
depend only on the seed, the step and the logits: the same alone, batched, in
any order, after a preemption (the stream lives with the request), and the
same on the CPU and on a GPU given the same logits (up to a last-ulp
difference of ``log`` between devices deciding a race, ~1e-7 per step).

:func:`sample_rows` samples a batch where its logits live: greedy rows in one
batched argmax, the others row by row, and only the token ids come back to
the host (one synchronisation per step). The CUDA backend reads its greedy
rows from the LM head's argmax records instead (:func:`needs_logits` says
which rows may; never a row held to a grammar).

A grammar row's matcher is advanced here too, right after its token is
drawn (:func:`sample_row`, :func:`sample_rows`): computing the next mask and
accepting the token stay a pair, whoever calls the sampler.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from megac.rng import hash24, stream_key

if TYPE_CHECKING:
    from megac.grammar import GrammarMatcher

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


class NoiseStream:
    """A row's sampling noise: ``exponentials`` of step ``s`` come from the
    counters of ``(seed, s)``; ``step`` counts the draws (one per sampled
    token), so a request resumes its stream after a preemption."""

    def __init__(self, seed: int | None) -> None:
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        self.seed = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
        self.step = 0

    def exponentials(self, n: int, device) -> torch.Tensor:
        """fp32 [n] ~ Exp(1) for the current step, then the next step.
        ``u = (h + 0.5) 2^-24`` lies strictly inside (0, 1), so ``-log u``
        is finite and positive."""
        key = stream_key("noise", self.seed, self.step)
        self.step += 1
        u = hash24(0, n, key, device).to(torch.float32).add_(0.5).mul_(2.0 ** -24)
        return u.log_().neg_()


def make_stream(seed: int | None) -> NoiseStream:
    """The row's noise stream: seeded from ``seed``, or from the OS when None."""
    return NoiseStream(seed)


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
        ids = torch.tensor(output_ids, dtype=torch.int64, device=x.device)
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


def has_processing(p: SamplingParams, output_ids: Sequence[int]) -> bool:
    """Whether step 1 of the module docstring changes any logit."""
    return bool(p.logit_bias or (output_ids and (p.presence_penalty or p.frequency_penalty))
                or len(output_ids) < p.min_tokens)


def needs_logits(p: SamplingParams, output_ids: Sequence[int], grammar: "GrammarMatcher | None" = None) -> bool:
    """False when the token is the plain greedy argmax of the logits (what
    the LM head's argmax records give without reading the logits)."""
    return grammar is not None or not p.greedy or has_processing(p, output_ids)


def _sample_tensor(logits: torch.Tensor, p: SamplingParams, stream: NoiseStream | None,
                   output_ids: Sequence[int], eos_ids, grammar: "GrammarMatcher | None" = None) -> torch.Tensor:
    """The next token of one row as a 0-d int64 tensor on the logits' device
    (the grammar, if any, is not advanced here)."""
    x = process_logits(logits, p, list(output_ids), set(eos_ids)) if has_processing(p, output_ids) else logits
    if grammar is not None:
        x = grammar.constrain(x, logits)
    if p.greedy:
        return torch.argmax(x)
    probs = filtered_probs(x.float(), p)
    if stream is None:
        stream = make_stream(None)
    return torch.argmax(probs / stream.exponentials(probs.shape[-1], probs.device))


def sample_row(logits: torch.Tensor, p: SamplingParams, stream: NoiseStream | None,
               output_ids: Sequence[int] | None = None, eos_ids=frozenset(),
               grammar: "GrammarMatcher | None" = None) -> int:
    """The next token of one row (see the module docstring); ``grammar``
    constrains it and accepts it."""
    tok = int(_sample_tensor(logits, p, stream, output_ids or [], eos_ids, grammar))
    if grammar is not None:
        grammar.accept(tok)
    return tok


@dataclass
class RowSampling:
    """What sampling one row needs (the engine builds one per sampled row)."""

    params: SamplingParams
    stream: NoiseStream | None
    output_ids: Sequence[int] = ()
    eos_ids: frozenset = frozenset()
    #: structured output: the row's matcher (constrains the row, then accepts its token)
    grammar: "GrammarMatcher | None" = None


def sample_rows(logits: torch.Tensor, rows: Sequence[RowSampling | None], *,
                greedy: torch.Tensor | None = None) -> list[int | None]:
    """The next token of every row of ``logits`` ``[n, vocab]`` (any device)
    whose entry in ``rows`` is not None; None for the others. ``greedy``
    (int64 [n], same device): tokens to take for rows that do not
    :func:`needs_logits` (the argmax records' reduction); else a batched
    argmax of the logits. One host synchronisation for the whole batch."""
    n = len(rows)
    if n == 0:
        return []
    plain = [i for i, r in enumerate(rows) if r is not None and not needs_logits(r.params, r.output_ids, r.grammar)]
    if greedy is not None and len(plain) == n:
        return greedy[:n].tolist()  # every row plain greedy: the records' tokens, one copy
    plain_set = set(plain)
    out = torch.full((n,), -1, dtype=torch.int64, device=logits.device if greedy is None else greedy.device)
    if plain:
        src = greedy if greedy is not None else torch.argmax(logits[:n], dim=-1)
        ix = torch.tensor(plain, device=out.device)
        out[ix] = src[ix].to(out.device)
    for i, r in enumerate(rows):
        if r is not None and i not in plain_set:
            out[i] = _sample_tensor(logits[i], r.params, r.stream, r.output_ids, r.eos_ids, r.grammar).to(out.device)
    tokens = [t if r is not None else None for t, r in zip(out.tolist(), rows)]
    for t, r in zip(tokens, rows):
        if r is not None and r.grammar is not None:
            r.grammar.accept(t)
    return tokens


def sample(logits: torch.Tensor, params: list[SamplingParams], streams: list[NoiseStream | None],
           outputs: list[list[int]] | None = None, eos_ids=frozenset()) -> list[int]:
    """``sample_row`` for each row of ``logits`` ``[n, vocab]``."""
    outputs = outputs if outputs is not None else [[] for _ in params]
    return [sample_row(logits[i], params[i], streams[i], outputs[i], eos_ids) for i in range(len(params))]


__all__ = ["GREEDY_EPS", "NoiseStream", "RowSampling", "SamplingParams", "filtered_probs", "has_processing",
           "make_stream", "needs_logits", "process_logits", "sample", "sample_row", "sample_rows"]

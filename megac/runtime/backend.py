"""The backend interface the engine drives: one decode step over a shared
paged KV cache, plus the PyTorch prefill into the same cache.

A backend owns nothing but compute. The engine owns the
:class:`~megac.kv.paged.PagedKVCache` (rows, blocks, prefix sharing) and
hands the same object to the backend at construction; the backend reads and
writes K/V through it (``append_slot`` / ``write`` / ``gather`` / ``advance``).

Protocol (:class:`Backend`)::

    name: str                 # "vm", "reference", later "cuda"
    max_batch_size: int       # most rows one decode() may carry
    spec, weights, kv         # what it was built over
    decode(rows, token_ids) -> torch.Tensor   # fp32 [len(rows), vocab]
    prefill(row, token_ids) -> torch.Tensor   # fp32 [vocab], last token
    # optional: sample where the logits live, hand back token ids only
    decode_sample(rows, token_ids, samples, keep_logits=False) -> (tokens, logits | None)

``decode``: ``token_ids[i]`` is the current token of KV row ``rows[i]``; its
K/V is appended at the row's ``seq_pos``, which advances by one. The engine
has already reserved that slot (``kv.append_slot(row)``, idempotent), so a
backend never runs out of blocks mid-step. Logits carry ``logit_scale``.

``prefill``: appends ``token_ids`` to ``row`` (which may already hold tokens:
chunked prefill, prefix-cache hits); may raise
:class:`~megac.kv.paged.KVOutOfBlocks` *before changing anything* (the engine
evicts or preempts and retries). The default is :func:`megac.prefill.prefill_row`
(plain PyTorch), which every backend shares.

``decode_sample``: a backend on a device samples there (the CUDA backend:
greedy rows from the LM head's argmax records, the others through
:func:`megac.sampling.sample_rows` on the GPU), so only token ids cross to
the host; :func:`decode_and_sample` falls back to ``decode`` + ``sample_rows``
for the others. ``samples[i]`` is None for a row whose logits are dropped
(a replayed token after a preemption).

Determinism contract: a row's logits depend only on that row's tokens and on
the shapes of the calls that produced its cache (the engine keeps those
identical; see :mod:`megac.engine.scheduler`), never on other rows.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

import torch

from megac.errors import MegacError
from megac.runtime.kinds import BACKEND_KINDS  # re-exported: the kinds live where --help reads them

if TYPE_CHECKING:
    from megac.kv.paged import PagedKVCache
    from megac.spec.model import ModelSpec
    from megac.weights.canonical import ModelWeights


@runtime_checkable
class Backend(Protocol):
    name: str
    max_batch_size: int
    spec: "ModelSpec"
    weights: "ModelWeights"
    kv: "PagedKVCache"

    def decode(self, rows: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor: ...

    def prefill(self, row: int, token_ids: Sequence[int]) -> torch.Tensor: ...


def decode_and_sample(backend, rows: Sequence[int], token_ids: Sequence[int], samples, *,
                      keep_logits: bool = False):
    """One decode step and the next token of each row whose ``samples`` entry
    is not None: ``(tokens, logits)``, logits fp32 on the CPU when
    ``keep_logits`` else None."""
    fn = getattr(backend, "decode_sample", None)
    if fn is not None:
        return fn(rows, token_ids, samples, keep_logits=keep_logits)
    from megac.sampling import sample_rows

    logits = backend.decode(rows, token_ids)
    return sample_rows(logits, samples), (logits.float().cpu() if keep_logits else None)


def run_greedy_steps(backend, rows: Sequence[int], token_ids: Sequence[int], steps: int, progress=None):
    """``steps`` greedy decode steps of the fixed ``rows`` one after the
    other, each step's tokens the next one's input: ``(tokens per step, wall
    ms per step)``."""
    from megac.sampling import RowSampling, SamplingParams

    greedy = [RowSampling(SamplingParams(temperature=0.0), None)] * len(rows)
    out: list[list[int]] = []
    walls: list[float] = []
    tokens = list(token_ids)
    for i in range(steps):
        t0 = time.perf_counter()
        tokens, _ = decode_and_sample(backend, rows, tokens, greedy)
        walls.append((time.perf_counter() - t0) * 1e3)
        out.append([int(t) for t in tokens])
        if progress is not None:
            progress(i + 1, out[-1])
    return out, walls


def run_greedy(backend, rows: Sequence[int], token_ids: Sequence[int], steps: int, progress=None):
    """:func:`run_greedy_steps`, pipelined where the backend can
    (``decode_greedy_run``: the CUDA backend queues step i+1 before the host
    reads step i's tokens, which reach step i+1 on the device). The walls
    are then the time between consecutive steps' tokens reaching the host:
    a steady decoder's time per step. ``progress(i, tokens)`` once step i's
    tokens reached the host."""
    fn = getattr(backend, "decode_greedy_run", None)
    if fn is not None:
        return fn(rows, token_ids, steps, progress)
    return run_greedy_steps(backend, rows, token_ids, steps, progress)


class TorchPrefillMixin:
    """``prefill`` through :func:`megac.prefill.prefill_row` (the shared path)."""

    spec: "ModelSpec"
    weights: "ModelWeights"
    kv: "PagedKVCache"

    @torch.no_grad()
    def prefill(self, row: int, token_ids: Sequence[int]) -> torch.Tensor:
        from megac.prefill import prefill_row

        if self.weights is None:
            raise MegacError("prefill: this backend gave its canonical weights back (a decode-only `megac bench` "
                             "engine); build another engine to prefill")
        return prefill_row(self.weights, self.spec, self.kv, row, list(token_ids))


class ReferenceBackend(TorchPrefillMixin):
    """:func:`megac.reference.decode_step`: plain PyTorch, one row at a time
    (batch invariant by construction). Works on any spec, CPU only here."""

    name = "reference"

    def __init__(self, spec: "ModelSpec", weights: "ModelWeights", kv: "PagedKVCache", *,
                 max_batch_size: int = 64) -> None:
        self.spec, self.weights, self.kv = spec, weights, kv
        self.max_batch_size = max_batch_size

    @torch.no_grad()
    def decode(self, rows: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor:
        from megac.reference import decode_step

        return decode_step(self.weights, self.spec, self.kv, list(token_ids), list(rows))


__all__ = ["BACKEND_KINDS", "Backend", "ReferenceBackend", "TorchPrefillMixin", "decode_and_sample", "run_greedy",
           "run_greedy_steps"]

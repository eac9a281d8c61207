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

``decode``: ``token_ids[i]`` is the current token of KV row ``rows[i]``; its
K/V is appended at the row's ``seq_pos``, which advances by one. The engine
has already reserved that slot (``kv.append_slot(row)``, idempotent), so a
backend never runs out of blocks mid-step. Logits carry ``logit_scale``.

``prefill``: appends ``token_ids`` to ``row`` (which may already hold tokens:
chunked prefill, prefix-cache hits); may raise
:class:`~megac.kv.paged.KVOutOfBlocks` *before changing anything* (the engine
evicts or preempts and retries). The default is :func:`megac.prefill.prefill_row`
(plain PyTorch), which every backend shares.

Determinism contract: a row's logits depend only on that row's tokens and on
the shapes of the calls that produced its cache (the engine keeps those
identical; see :mod:`megac.engine.scheduler`), never on other rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

import torch

if TYPE_CHECKING:
    from megac.kv.paged import PagedKVCache
    from megac.spec.model import ModelSpec
    from megac.weights.canonical import ModelWeights

BACKEND_KINDS = ("cpu", "cuda", "auto", "reference")


@runtime_checkable
class Backend(Protocol):
    name: str
    max_batch_size: int
    spec: "ModelSpec"
    weights: "ModelWeights"
    kv: "PagedKVCache"

    def decode(self, rows: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor: ...

    def prefill(self, row: int, token_ids: Sequence[int]) -> torch.Tensor: ...


class TorchPrefillMixin:
    """``prefill`` through :func:`megac.prefill.prefill_row` (the shared path)."""

    spec: "ModelSpec"
    weights: "ModelWeights"
    kv: "PagedKVCache"

    @torch.no_grad()
    def prefill(self, row: int, token_ids: Sequence[int]) -> torch.Tensor:
        from megac.prefill import prefill_row

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


__all__ = ["BACKEND_KINDS", "Backend", "ReferenceBackend", "TorchPrefillMixin"]

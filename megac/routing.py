"""MoE routing math: the one CPU definition of ROUTER_TOPK, ROUTE_FINALIZE and
MOE_COMBINE.

The CPU VM (``megac/vm/ops.py``) executes the opcodes through these functions
and the GPU battery (``tests/gpu/blocks/moe_routing.py``) checks the device
block (``opcodes/moe_routing.cuh``) against them, so the device has exactly
one reference to agree with.

* ``sum_splits``: router logits = the split-K partials added in split order (fp32).
* ``topk``: the k largest logits, descending, ties to the lower expert id
  (a stable descending sort; NaN sorts first, as in ``torch.sort``). Weights:
  sigmoid(logit), or a softmax over the k SELECTED logits
  (``exp(sel - sel[0])`` summed in k order); fp64, rounded once to fp32.
  ``renormalize``: divide by the fp64 sum, in k order, of the rounded weights
  and round once more.
* ``finalize``: per-expert counts, exclusive offsets, and the slots: expert
  e's entries take ``offsets[e] + 0, 1, ...`` in (row, k) order.
* ``queue_records``: one ``Queue.MOE_UP``/``MOE_DOWN`` record
  ``{expert, n_tile, slot0, rows}`` per (active expert ascending, tile
  ascending), ``rows`` = every entry routed to the expert.
* ``combine``: ``out = w0*y0``, then ``out = out + wj*yj`` for j in order, fp32
  (each product and each sum rounded: no fused multiply-add).

Imports only numpy, torch and megac.abi: the GPU machine imports it too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megac.abi import QUEUE_RECORD_WORDS, QUEUE_RECORDS, Queue, record_index


def sum_splits(parts: torch.Tensor) -> torch.Tensor:
    """Router logits from split-K partials ``[S, ..., E]`` (fp32, split order)."""
    logit = parts[0]
    for s in range(1, parts.shape[0]):
        logit = logit + parts[s]
    return logit


def _ordered_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension, index order (the device's order)."""
    tot = x[..., 0]
    for j in range(1, x.shape[-1]):
        tot = tot + x[..., j]
    return tot


def topk(logits: torch.Tensor, k: int, *, softmax: bool, renormalize: bool,
         scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids int64 [..., k], weights fp32 [..., k])`` of fp32 ``logits [..., E]``.
    ``scale`` (fp32 ``[...]``, positive): the logits are unnormalised (a
    router that folds the MoE combine, Flag.COMBINE_IN); the ids are ranked
    from them as given (a positive scale keeps their order, and the up
    claimers rank the same unscaled sums), the weights from the selected
    logits times ``scale`` (one fp32 rounding)."""
    srt = torch.sort(logits, dim=-1, descending=True, stable=True)
    ids = srt.indices[..., :k]
    sel = srt.values[..., :k]
    if scale is not None:
        sel = sel * scale.to(torch.float32)[..., None]
    sel = sel.to(torch.float64)
    if softmax:
        e = torch.exp(sel - sel[..., :1])
        w = (e / _ordered_sum(e)[..., None]).to(torch.float32)
    else:
        w = torch.sigmoid(sel).to(torch.float32)
    if renormalize:
        w64 = w.to(torch.float64)
        w = (w64 / _ordered_sum(w64)[..., None]).to(torch.float32)
    return ids, w


@dataclass(frozen=True)
class Route:
    """ROUTE_FINALIZE's result for ``ids [rows, k]`` (int64 arrays)."""

    counts: np.ndarray  # [E] entries routed to each expert
    offsets: np.ndarray  # [E] first slot of each expert (exclusive scan of counts)
    slot: np.ndarray  # [rows, k] slot of entry (row, j)


def finalize(ids: np.ndarray, experts: int) -> Route:
    """Counts, offsets and slots of the routed entries ``ids [rows, k]``."""
    flat = ids.reshape(-1).astype(np.int64)
    counts = np.bincount(flat, minlength=experts)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
    order = np.argsort(flat, kind="stable")  # by expert, (row, k) order within one
    slot = np.empty(len(flat), dtype=np.int64)
    slot[order] = np.arange(len(flat))
    return Route(counts, offsets, slot.reshape(ids.shape))


# One builder serves both expert queues: their records share one layout.
assert [f for f, _ in QUEUE_RECORDS[Queue.MOE_UP]] == [f for f, _ in QUEUE_RECORDS[Queue.MOE_DOWN]]


def queue_records(route: Route, tiles: int) -> np.ndarray:
    """int64 ``[active * tiles, 4]`` records of an expert queue, in queue order."""
    active = np.flatnonzero(route.counts)
    e = np.repeat(active, tiles)
    recs = np.empty((len(e), QUEUE_RECORD_WORDS), dtype=np.int64)
    recs[:, record_index(Queue.MOE_UP, "EXPERT")] = e
    recs[:, record_index(Queue.MOE_UP, "N_TILE")] = np.tile(np.arange(tiles), len(active))
    recs[:, record_index(Queue.MOE_UP, "SLOT0")] = route.offsets[e]
    recs[:, record_index(Queue.MOE_UP, "ROWS")] = route.counts[e]
    return recs


def queue_capacity(experts: int, entries: int, tiles: int) -> int:
    """Worst-case records of a queue: every entry on its own expert."""
    return min(experts, entries) * tiles


def combine(w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """fp32 ``[m, D]`` = sum over j in order of ``w [m, k]`` times ``y [m, k, D]``."""
    acc = w[:, 0, None] * y[:, 0]
    for j in range(1, w.shape[1]):
        acc = acc + w[:, j, None] * y[:, j]
    return acc


__all__ = ["Route", "combine", "finalize", "queue_capacity", "queue_records", "sum_splits", "topk"]

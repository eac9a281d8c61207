"""The host side of one decode step, the same for every backend.

Row ``i`` of a schedule runs the current token ``tokens[i]`` of KV-cache row
``kv_rows[i]``; schedule rows past ``len(kv_rows)`` are inactive
(``row_active = 0``: they compute on a zero residual and write nothing
visible). Around the kernel, each step:

1. :func:`load_rows`: reserve each row's slot in the paged cache
   (``append_slot``: maps the block of the new position, releases
   sliding-window blocks) and copy the page tables / positions into the
   step's tables (``page_table``, ``seq_pos`` = position of the current
   token, ``row_active``); the CUDA backend runs its two halves apart and
   sizes the page-table rows to the step (:func:`page_rows`) in between;
2. :func:`seed_rows`: the embedding gather into ``x_resid`` (fp32) and the
   first RMSNorm into ``x_norm[0]``;
3. the per-step reset of every buffer in ``plan.reset`` (counters, queue
   heads; the backend zeroes its own copies);
4. :func:`host_words`: per row the full-attention split count
   ``attn_splits(seq_len)`` and the sliding one ``attn_splits(min(seq_len,
   max window))`` (each from the row's own span: batch invariance), one
   record ``{row, kv_head, split, num_splits}`` per full-attention split,
   shared by every full layer, and its length;
5. the kernel;
6. :func:`finish_rows`: the logits (times ``logit_scale``) go to the sampler,
   each row's ``seq_pos`` advances.

The functions fill numpy / torch arrays the backend owns (the VM's device
state, the CUDA backend's host staging buffers), so no backend repeats them.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from megac import abi
from megac.errors import MegacError
from megac.ops.norm import rms_norm


def reserve_rows(kv, kv_rows: Sequence[int], geo) -> list[int]:
    """Reserve the current slot of every row (``append_slot``); returns each
    row's position (the current token's)."""
    n = len(kv_rows)
    if n > geo.rows:
        raise MegacError(f"step: {n} rows for a schedule of {geo.rows}")
    positions = [int(kv.append_slot(int(r))) for r in kv_rows]
    for r, p in zip(kv_rows, positions):
        if p + 1 > geo.context:
            raise MegacError(f"step: row {r} reaches {p + 1} tokens, beyond the schedule's context bucket "
                             f"({geo.context})")
    return positions


def page_rows(positions: Sequence[int], block_size: int, cap: int, floor: int = 16) -> int:
    """Page-table row length for a step whose rows sit at ``positions``: the
    pages the longest row reaches (its current token's included), rounded up
    to a power of two (few distinct lengths, so few descriptors), at least
    ``floor``, at most ``cap`` (the schedule's context bucket). One schedule
    serves every context from 4K to 256K for North Mini Code, so its own
    row length (4096 pages) made every step fill and send 6.4 MB of page
    tables."""
    need = max((int(p) // block_size + 1 for p in positions), default=1)
    return min(max(floor, 1 << (need - 1).bit_length()), cap)


def fill_tables(kv, kv_rows: Sequence[int], positions: Sequence[int], page_table: np.ndarray, seq_pos: np.ndarray,
                row_active: np.ndarray) -> None:
    """The step's KV tables: each row's first ``page_table.shape[2]`` pages
    (-1 past them and for rows past ``kv_rows``), positions and activity."""
    n = len(kv_rows)
    page_table[...] = -1
    mb = min(page_table.shape[2], kv.max_blocks_per_seq)
    if n:
        page_table[:, :n, :mb] = kv.page_table[:, np.asarray(kv_rows, dtype=np.int64), :mb]
    fill_positions(positions, seq_pos, row_active)


def fill_positions(positions: Sequence[int], seq_pos: np.ndarray, row_active: np.ndarray) -> None:
    """The step's positions and activity (rows past ``len(positions)`` off)."""
    n = len(positions)
    seq_pos[...] = 0
    row_active[...] = 0
    seq_pos[:n] = positions
    row_active[:n] = 1


def load_rows(kv, kv_rows: Sequence[int], geo, page_table: np.ndarray, seq_pos: np.ndarray,
              row_active: np.ndarray) -> list[int]:
    """:func:`reserve_rows` then :func:`fill_tables`; returns each row's
    position (the current token's)."""
    positions = reserve_rows(kv, kv_rows, geo)
    fill_tables(kv, kv_rows, positions, page_table, seq_pos, row_active)
    return positions


def check_tokens(tokens: Sequence[int], vocab: int) -> torch.Tensor:
    ids = torch.as_tensor([int(t) for t in tokens], dtype=torch.int64)
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise MegacError(f"step: token id outside the vocabulary (0..{vocab - 1})")
    return ids


def seed_rows(tokens: Sequence[int], geo, w_embed: torch.Tensor, w_norm0: torch.Tensor, eps: float,
              act: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_resid [rows, hidden] fp32, x_norm0 [rows, hidden] act)``: the
    embedding rows of ``tokens`` (zero for inactive rows) and their first
    RMSNorm with gamma ``w_norm0``."""
    return seed_ids(check_tokens(tokens, geo.vocab).to(w_embed.device), geo, w_embed, w_norm0, eps, act)


def seed_ids(ids: torch.Tensor, geo, w_embed: torch.Tensor, w_norm0: torch.Tensor, eps: float,
             act: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`seed_rows` of checked int64 ids already on ``w_embed``'s device
    (the CUDA backend's step graph reads them from the step's upload)."""
    n = len(ids)
    x = torch.zeros((geo.rows, geo.hidden), dtype=torch.float32, device=w_embed.device)
    if n:
        x[:n] = w_embed[ids].to(torch.float32)
    return x, rms_norm(x, w_norm0, eps, act)


_ATTN_COLS = tuple(abi.record_index(abi.Queue.ATTN, f) for f in ("ROW", "KV_HEAD", "SPLIT", "NUM_SPLITS"))


def host_words(geo, positions: Sequence[int], targets: np.ndarray, attn_queue: np.ndarray) -> int:
    """Per-row split counts and the attention queue into the host region of
    ``targets`` and into ``attn_queue``; returns the queue length. Records
    run row by row, then split, then kv head: the kv heads of a split read
    the same KV pages (heads interleaved in a block) and are claimed one
    after another. Measured (H200, North Mini Code, check queue_order, two
    runs, same bits) against row / kv head / split: batch 8 at 8K -0.6 and
    -0.4 %, at 32K -1.2 and -1.1 %, batch 4 at 32K -0.6 and -0.4 %. Built
    with numpy: at batch 8 and 8K, 512 records written one field at a time
    cost ~1.5 ms a step."""
    tw = geo.target_words
    targets[: tw.host_words] = 0
    seq = [int(positions[i]) + 1 if i < len(positions) else 1 for i in range(geo.rows)]
    full = [geo.attn_splits(n) for n in seq]
    for i, n in enumerate(seq):
        targets[tw.attn_splits_full(i)] = full[i]
        targets[tw.attn_splits_sliding(i)] = geo.attn_splits(min(n, geo.max_window)) if geo.max_window else 0
    n = 0
    if geo.full_layers and not geo.full_static:  # static full-layer splits read no queue
        heads = geo.kv_heads
        n = heads * sum(full)
        if n > attn_queue.shape[0]:
            raise MegacError("step: attention queue over capacity")
        per_row = np.asarray(full, dtype=np.int64) * heads
        c_row, c_head, c_split, c_num = _ATTN_COLS
        attn_queue[:n, c_row] = np.repeat(np.arange(geo.rows), per_row)
        attn_queue[:n, c_split] = np.concatenate([np.repeat(np.arange(f), heads) for f in full])
        attn_queue[:n, c_head] = np.concatenate([np.tile(np.arange(heads), f) for f in full])
        attn_queue[:n, c_num] = np.repeat(np.asarray(full, dtype=np.int64), per_row)
    targets[tw.attn_queue_len] = n
    return n


def finish_rows(kv, kv_rows: Sequence[int], logits: torch.Tensor, logit_scale: float) -> torch.Tensor:
    """The step wrote each row's token: advance the rows; the logits of the
    live rows times ``logit_scale`` (what the sampler reads)."""
    out = logits[: len(kv_rows)].clone()
    if logit_scale != 1.0:
        out = out * logit_scale
    for r in kv_rows:
        kv.advance(int(r), 1)
    return out


def greedy_from_records(records: torch.Tensor) -> torch.Tensor:
    """int64 [n]: each row's greedy token from its LM-head argmax records
    (int32 ``[n, lm_tiles, ARGMAX_RECORD_WORDS]``), by the ABI's greedy rule
    (:func:`megac.abi.argmax_select`: largest value, lowest index among equal
    values, a NaN above everything), on the records' device: only the token
    ids need to leave it."""
    vals = records[..., 0].contiguous().view(torch.float32)
    idx = records[..., 1].to(torch.int64)
    nan = torch.isnan(vals)
    top = torch.where(nan, torch.full_like(vals, float("-inf")), vals).amax(dim=-1, keepdim=True)
    cand = torch.where(nan.any(dim=-1, keepdim=True), nan, vals == top)
    big = torch.iinfo(torch.int64).max
    return torch.where(cand, idx, torch.full_like(idx, big)).amin(dim=-1)


__all__ = ["check_tokens", "fill_positions", "fill_tables", "finish_rows", "greedy_from_records", "host_words", "load_rows", "page_rows",
           "reserve_rows", "seed_ids", "seed_rows"]

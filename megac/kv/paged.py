"""The paged KV cache (layout: ``megac.abi.KV_LAYOUT``).

Storage
    ``k_pool``, ``v_pool``: torch ``[num_blocks, block_size, kv_heads,
    head_dim]`` (one pool for all layers; default bf16; ``head_major``: a
    view of storage ``[num_blocks, kv_heads, block_size, head_dim]``, one KV
    head's keys of a block contiguous, as the GPU backends keep it where the
    model's ``kv_head_major`` tile asks: opcodes/kv_pool.cuh), ``page_table``: numpy
    int32 ``[num_layers, max_rows, max_blocks_per_seq]`` (``-1``: unmapped or
    released), ``seq_pos``: numpy int32 ``[max_rows]`` (tokens cached = the
    position of the current token), ``row_active``: numpy int32
    ``[max_rows]``. Token ``p`` of row ``r`` in layer ``l`` lives in block
    ``page_table[l, r, p // block_size]`` at offset ``p % block_size``
    (``torch.from_numpy`` gives zero-copy views for a device upload).

One step of a row
    1. ``pos = append_slot(row)`` (or ``reserve(row, n)`` for ``n`` tokens at
       once, e.g. a prefill): maps the blocks of positions ``seq_pos ..
       seq_pos+n-1`` in every layer (a new block on a block boundary; a shared
       block is copied first: copy-on-write), and releases sliding-window
       blocks that the current token no longer sees. ``seq_pos`` does not
       move; reserving again before ``advance`` is idempotent.
    2. the step writes K/V (``write``) at those positions and attends.
    3. ``advance(row, n)``: ``seq_pos += n``.

Sliding windows
    A sliding layer's query at position ``q`` sees keys ``q-window < j <= q``
    (the window counts the current token). When positions up to ``q`` are
    reserved, every block whose tokens are all ``<= q-window`` is released
    back to the pool (page-table entry ``-1``); the first position still held
    is :meth:`first_held` (block aligned). The same rule decides which blocks
    a long prefill maps at all: positions no later query can see are not
    stored (``write`` skips them).

Blocks are reference counted so rows can share a prefix (``fork_row``; later
prefix caching); a row only ever writes positions ``>= seq_pos``, and a
shared block it must write is copied first, so shared blocks are never
written. Running out raises :class:`KVOutOfBlocks` *before* anything
changes (the server preempts a row and retries).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np
import torch

from megac.errors import MegacError

if TYPE_CHECKING:
    from megac.spec.model import ModelSpec


class KVOutOfBlocks(MegacError):
    """The block pool cannot satisfy a reservation (nothing was changed)."""

    def __init__(self, row: int, needed: int, free: int) -> None:
        super().__init__(f"KV cache out of blocks: row {row} needs {needed} more, {free} free")
        self.row, self.needed, self.free = row, needed, free


class BlockAllocator:
    """Free list + reference counts over ``num_blocks`` blocks. ``alloc``
    hands out the lowest free ids first (deterministic)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise MegacError(f"KV cache: num_blocks must be >= 1 (got {num_blocks})")
        self.num_blocks = num_blocks
        self.refcount = np.zeros(num_blocks, dtype=np.int32)
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() gives the lowest id

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise KVOutOfBlocks(-1, 1, 0)
        b = self._free.pop()
        assert self.refcount[b] == 0
        self.refcount[b] = 1
        return b

    def incref(self, b: int) -> None:
        if self.refcount[b] < 1:
            raise MegacError(f"KV cache: incref of free block {b}")
        self.refcount[b] += 1

    def decref(self, b: int) -> bool:
        """Drop one reference; True when the block went back to the pool."""
        if self.refcount[b] < 1:
            raise MegacError(f"KV cache: decref of free block {b}")
        self.refcount[b] -= 1
        if self.refcount[b] == 0:
            self._free.append(b)
            return True
        return False


def blocks_for_tokens(spec: "ModelSpec", tokens: int, block_size: int | None = None) -> int:
    """Blocks (all layers together) one row holds after reserving ``tokens``
    positions: ``ceil(tokens/bs)`` per full layer, fewer for sliding ones."""
    bs = block_size or spec.target.kv_block_size
    n = 0
    for layer in spec.layers:
        last_block = (tokens - 1) // bs if tokens > 0 else -1
        first = 0
        if layer.window is not None and tokens > 0:
            first = max(0, tokens - layer.window) // bs
        n += last_block - first + 1
    return n


@functools.lru_cache(maxsize=4096)
def _sliding_peak(window: int, bs: int, tokens: int) -> int:
    """The most blocks a sliding layer of ``window`` keys holds while a row
    grows to ``tokens`` positions (``tokens`` past ``window + bs`` changes
    nothing: past the window the count repeats with period ``bs``)."""
    best = (min(tokens, window) - 1) // bs + 1
    for t in range(window + 1, min(tokens, window + bs) + 1):
        best = max(best, (t - 1) // bs - (t - window) // bs + 1)
    return best


def peak_blocks_for_tokens(spec: "ModelSpec", tokens: int, block_size: int | None = None) -> int:
    """The most blocks (all layers together) one row holds on its way to
    ``tokens`` positions: what a pool must hold for the row to get there.
    :func:`blocks_for_tokens` is not monotone where a window is short next to
    a block: a window of 8 keys on blocks of 16 holds 2 blocks at 17-23
    tokens and 1 at 24, so a pool sized for a row's final length could
    never let it grow through the middle (the engine waited forever)."""
    bs = block_size or spec.target.kv_block_size
    if tokens <= 0:
        return 0
    n = 0
    for layer in spec.layers:
        if layer.window is None:
            n += (tokens - 1) // bs + 1
        else:
            n += _sliding_peak(int(layer.window), bs, min(tokens, int(layer.window) + bs))
    return n


class PagedKVCache:
    """Paged K/V pools + per-layer page tables for ``max_rows`` rows."""

    #: decode appends (n == 1) take vectorised / no-op fast paths (tests turn
    #: this off to compare them with the general reservation code)
    _fast_paths = True

    def __init__(self, spec: "ModelSpec", *, max_rows: int, num_blocks: int,
                 max_context: int | None = None, dtype: torch.dtype = torch.bfloat16,
                 device: str | torch.device = "cpu", block_size: int | None = None,
                 head_major: bool = False) -> None:
        self.num_layers = spec.num_layers
        self.kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.block_size = block_size or spec.target.kv_block_size
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise MegacError(f"KV cache: block_size must be a power of two (got {self.block_size})")
        self.max_context = max_context or spec.max_context
        self.max_rows = max_rows
        self.max_blocks_per_seq = -(-self.max_context // self.block_size)
        #: window in keys per layer (0: full attention)
        self.windows = np.array([l.window or 0 for l in spec.layers], dtype=np.int64)
        self.dtype = dtype

        self.head_major = bool(head_major)
        if self.head_major:  # stored head-major, seen token-major: every index below works on the view
            stored = (num_blocks, self.kv_heads, self.block_size, self.head_dim)
            self.k_pool = torch.zeros(stored, dtype=dtype, device=device).transpose(1, 2)
            self.v_pool = torch.zeros(stored, dtype=dtype, device=device).transpose(1, 2)
        else:
            shape = (num_blocks, self.block_size, self.kv_heads, self.head_dim)
            self.k_pool = torch.zeros(shape, dtype=dtype, device=device)
            self.v_pool = torch.zeros(shape, dtype=dtype, device=device)
        self.page_table = np.full((self.num_layers, max_rows, self.max_blocks_per_seq), -1, dtype=np.int32)
        #: bumped by every change of ``page_table``: a GPU backend re-sends a
        #: step's page tables only when they changed (at 128K they are MBs)
        self.version = 0
        self.seq_pos = np.zeros(max_rows, dtype=np.int32)
        self.row_active = np.zeros(max_rows, dtype=np.int32)
        self.allocator = BlockAllocator(num_blocks)
        #: end (exclusive) of the positions reserved per row (>= seq_pos)
        self._reserved = np.zeros(max_rows, dtype=np.int64)
        #: first position still held per (layer, row) (block aligned; 0 for full layers)
        self._floor = np.zeros((self.num_layers, max_rows), dtype=np.int64)
        #: rows that may hold shared blocks (fork_row): their appends check copy-on-write
        self._may_share = np.zeros(max_rows, dtype=bool)
        self._sliding_windows = sorted({int(w) for w in self.windows if w > 0})

    # ------------------------------------------------------------------ info

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by a row or held by someone else (``hold``)."""
        return self.allocator.num_used

    # ------------------------------------------------------------------ shared blocks

    def hold(self, blocks: np.ndarray) -> None:
        """One more reference on each of ``blocks`` (a prefix cache keeping
        them alive beyond the row that filled them); -1 entries (a sliding
        layer's released block) are skipped."""
        for b in np.asarray(blocks).ravel().tolist():
            if b >= 0:
                self.allocator.incref(int(b))

    def release(self, blocks: np.ndarray) -> int:
        """Drop one reference on each of ``blocks`` (-1 entries skipped);
        returns how many went back to the pool."""
        return sum(bool(self.allocator.decref(int(b))) for b in np.asarray(blocks).ravel().tolist() if b >= 0)

    def refcounts(self, blocks: np.ndarray) -> np.ndarray:
        """Reference counts of ``blocks`` (same shape)."""
        return self.allocator.refcount[np.asarray(blocks)]

    def attachable(self, blocks: np.ndarray) -> bool:
        """Whether ``blocks`` (``[num_layers, n]``, -1 = released) hold every
        key the row's next token (position ``n * block_size``) sees: all of
        a full layer's, a sliding layer's from its window's first block on."""
        n = blocks.shape[1]
        for layer in range(self.num_layers):
            first = self.window_start(layer, n * self.block_size) // self.block_size
            if (blocks[layer, first:] < 0).any():
                return False
        return True

    def attach_shared(self, row: int, blocks: np.ndarray) -> None:
        """Map ``blocks`` (``int32 [num_layers, n]``: block ``j`` of every
        layer) as the first ``n`` blocks of the fresh, empty ``row`` (one
        reference each) and start the row at ``n * block_size`` tokens. A
        sliding layer's blocks before its window may be -1 (released: the
        row never reads them again). The row may only write positions after
        them; a shared block it must write is copied first (copy-on-write)."""
        if not self.row_active[row] or self.seq_pos[row] != 0 or self.reserved_end(row) != 0:
            raise MegacError(f"KV cache: row {row} must be freshly allocated to attach shared blocks")
        if blocks.ndim != 2 or blocks.shape[0] != self.num_layers:
            raise MegacError(f"KV cache: shared blocks must be [num_layers, n] (got {blocks.shape})")
        n = blocks.shape[1]
        if n == 0:
            return
        if not self.attachable(blocks):
            raise MegacError("KV cache: cannot attach an unmapped block a layer still reads")
        self.hold(blocks)
        self.page_table[:, row, :n] = blocks
        self.version += 1
        # a sliding layer holds from its first mapped block on (what the
        # row's own window moves released before it)
        mapped = blocks >= 0
        self._floor[:, row] = np.where(mapped.any(axis=1), mapped.argmax(axis=1), n) * self.block_size
        tokens = n * self.block_size
        self.seq_pos[row] = tokens
        self._reserved[row] = tokens
        self._may_share[row] = True

    def reserved_end(self, row: int) -> int:
        return int(self._reserved[row])

    def first_held(self, layer: int, row: int) -> int:
        """First position of ``row`` still stored in ``layer`` (0 for full
        layers; block aligned)."""
        return int(self._floor[layer, row])

    def window_start(self, layer: int, pos: int) -> int:
        """First key position a query at ``pos`` sees in ``layer``."""
        w = int(self.windows[layer])
        return 0 if w == 0 else max(0, pos - w + 1)

    def blocks_of_row(self, row: int) -> set[int]:
        t = self.page_table[:, row, :]
        return set(int(b) for b in t[t >= 0])

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.max_rows:
            raise MegacError(f"KV cache: row {row} out of range 0..{self.max_rows - 1}")
        if not self.row_active[row]:
            raise MegacError(f"KV cache: row {row} is not allocated")

    # ------------------------------------------------------------------ rows

    def allocate_row(self, row: int | None = None) -> int:
        """Claim a free row (the lowest, or ``row``): empty, seq_pos 0."""
        if row is None:
            free = np.flatnonzero(self.row_active == 0)
            if free.size == 0:
                raise MegacError(f"KV cache: all {self.max_rows} rows are in use")
            row = int(free[0])
        elif not 0 <= row < self.max_rows:
            raise MegacError(f"KV cache: row {row} out of range 0..{self.max_rows - 1}")
        elif self.row_active[row]:
            raise MegacError(f"KV cache: row {row} is already allocated")
        self.row_active[row] = 1
        self.seq_pos[row] = 0
        self._reserved[row] = 0
        self._floor[:, row] = 0
        self._may_share[row] = False
        self.page_table[:, row, :] = -1
        self.version += 1
        return row

    def free_row(self, row: int) -> None:
        """Release every block of ``row`` and mark it inactive."""
        self._check_row(row)
        t = self.page_table[:, row, :]
        for b in t[t >= 0].tolist():
            self.allocator.decref(b)
        t[:] = -1
        self.version += 1
        self.row_active[row] = 0
        self.seq_pos[row] = 0
        self._reserved[row] = 0
        self._floor[:, row] = 0
        self._may_share[row] = False

    def fork_row(self, src: int) -> int:
        """A new row sharing all of ``src``'s cached tokens (blocks are
        reference counted; either row copies a shared block before writing)."""
        self._check_row(src)
        dst = self.allocate_row()
        self.page_table[:, dst, :] = self.page_table[:, src, :]
        self.version += 1
        t = self.page_table[:, dst, :]
        for b in t[t >= 0].tolist():
            self.allocator.incref(b)
        self.seq_pos[dst] = self.seq_pos[src]
        self._reserved[dst] = self.seq_pos[src]
        self._floor[:, dst] = self._floor[:, src]
        self._may_share[src] = self._may_share[dst] = True
        return dst

    # ------------------------------------------------------------------ slots

    def reserve(self, row: int, n: int, *, stepwise: bool = False) -> int:
        """Map positions ``seq_pos .. seq_pos+n-1`` of ``row`` in every layer
        (see the module docstring); returns ``seq_pos``. Raises
        :class:`KVOutOfBlocks` without changing anything when the pool is short.

        ``stepwise``: the ``n`` positions are decoded one step at a time (a
        decode burst reserving its slots ahead), so each is a query that
        still sees its own window: sliding blocks are released only below
        the first position's window (a prefill chunk, which reads the cached
        history before it reserves, releases below the last one's). The
        blocks the later steps no longer see go at a later reservation."""
        self._check_row(row)
        if n < 1:
            raise MegacError(f"KV cache: reserve needs n >= 1 (got {n})")
        p0 = int(self.seq_pos[row])
        end = p0 + n
        if end <= self._reserved[row]:
            # already reserved (a retried step): nothing changes, unless a
            # longer reservation released what this one's tokens still see
            lo = np.where(self.windows > 0, np.maximum(0, end - self.windows), 0)
            bad = np.flatnonzero((lo // self.block_size) * self.block_size < self._floor[:, row])
            if len(bad):
                raise MegacError(
                    f"KV cache: row {row} layer {int(bad[0])}: position {int(lo[bad[0]])} was already "
                    f"released (a reservation cannot move back)")
            return p0
        if end > self.max_context:
            raise MegacError(f"KV cache: row {row} would reach {end} tokens > max_context ({self.max_context})")
        if n == 1 and self._fast_paths:
            if p0 % self.block_size and not self._may_share[row] and not any(
                    p0 - w + 1 > 0 and (p0 - w + 1) % self.block_size == 0 for w in self._sliding_windows):
                # no block boundary, no window start crossing one, nothing shared
                self._reserved[row] = end
                return p0
            return self._reserve_one(row, p0)
        bs = self.block_size
        cur = end - 1  # the position of the step's last (current) token
        releases: list[tuple[int, int]] = []  # (layer, block index)
        allocs: list[tuple[int, int]] = []  # (layer, block index)
        cows: list[tuple[int, int]] = []  # (layer, block index)
        new_floor = self._floor[:, row].copy()
        rc = self.allocator.refcount
        for layer in range(self.num_layers):
            lo = self.window_start(layer, p0 if stepwise else cur)
            floor_blk = lo // bs
            if floor_blk * bs < self._floor[layer, row]:
                raise MegacError(
                    f"KV cache: row {row} layer {layer}: position {lo} was already released "
                    f"(a reservation cannot move back)")
            table = self.page_table[layer, row]
            old_floor_blk = int(self._floor[layer, row]) // bs
            for b in range(old_floor_blk, floor_blk):
                if table[b] >= 0:
                    releases.append((layer, b))
            new_floor[layer] = max(new_floor[layer], floor_blk * bs)
            first_write = max(lo, p0)
            for b in range(first_write // bs, cur // bs + 1):
                if table[b] < 0:
                    allocs.append((layer, b))
                elif rc[table[b]] > 1:
                    cows.append((layer, b))
        freed = sum(1 for layer, b in releases if rc[self.page_table[layer, row, b]] == 1)
        needed = len(allocs) + len(cows)
        if needed > self.allocator.num_free + freed:
            raise KVOutOfBlocks(row, needed, self.allocator.num_free + freed)
        for layer, b in releases:
            self.allocator.decref(int(self.page_table[layer, row, b]))
            self.page_table[layer, row, b] = -1
        for layer, b in allocs:
            self.page_table[layer, row, b] = self.allocator.alloc()
        for layer, b in cows:
            old = int(self.page_table[layer, row, b])
            new = self.allocator.alloc()
            self.k_pool[new].copy_(self.k_pool[old])
            self.v_pool[new].copy_(self.v_pool[old])
            self.allocator.decref(old)
            self.page_table[layer, row, b] = new
        if releases or allocs or cows:
            self.version += 1
        self._floor[:, row] = new_floor
        self._reserved[row] = max(int(self._reserved[row]), end)
        return p0

    def _reserve_one(self, row: int, p: int) -> int:
        """``reserve(row, 1)`` vectorised over layers (the per-step decode
        path: a few numpy ops, a Python loop only over layers that change)."""
        bs = self.block_size
        b = p // bs
        table = self.page_table[:, row, :]
        rc = self.allocator.refcount
        cur = table[:, b]
        alloc_layers = np.flatnonzero(cur < 0)
        cow_layers = np.flatnonzero((cur >= 0) & (rc[np.maximum(cur, 0)] > 1))
        lo = np.where(self.windows > 0, np.maximum(0, p - self.windows + 1), 0)
        new_floor = (lo // bs) * bs
        floor = self._floor[:, row]
        moved = np.flatnonzero(new_floor > floor)
        releases: list[tuple[int, int]] = []
        for layer in moved.tolist():
            for blk in range(int(floor[layer]) // bs, int(new_floor[layer]) // bs):
                if table[layer, blk] >= 0:
                    releases.append((layer, blk))
        needed = len(alloc_layers) + len(cow_layers)
        if needed:
            freed = sum(1 for layer, blk in releases if rc[table[layer, blk]] == 1)
            if needed > self.allocator.num_free + freed:
                raise KVOutOfBlocks(row, needed, self.allocator.num_free + freed)
        for layer, blk in releases:
            self.allocator.decref(int(table[layer, blk]))
            table[layer, blk] = -1
        for layer in alloc_layers.tolist():
            table[layer, b] = self.allocator.alloc()
        for layer in cow_layers.tolist():
            old = int(table[layer, b])
            new = self.allocator.alloc()
            self.k_pool[new].copy_(self.k_pool[old])
            self.v_pool[new].copy_(self.v_pool[old])
            self.allocator.decref(old)
            table[layer, b] = new
        if releases or len(alloc_layers) or len(cow_layers):
            self.version += 1
        if len(moved):
            floor[moved] = new_floor[moved]
        self._reserved[row] = p + 1
        return p

    def append_slot(self, row: int) -> int:
        """Reserve the slot of the row's next token in every layer (a block on
        a boundary, sliding releases); returns its position (= ``seq_pos``)."""
        return self.reserve(row, 1)

    def advance(self, row: int, n: int = 1) -> None:
        """The step wrote its ``n`` tokens: ``seq_pos += n``."""
        self._check_row(row)
        if self.seq_pos[row] + n > self._reserved[row]:
            raise MegacError(f"KV cache: row {row}: advance past the reserved positions "
                             f"({int(self.seq_pos[row])} + {n} > {int(self._reserved[row])})")
        self.seq_pos[row] += n

    # ------------------------------------------------------------------ data

    def write_skip(self, layer: int, row: int, start: int, n: int) -> int:
        """How many of ``n`` positions from ``start`` ``layer`` does not store
        (below :meth:`first_held`: out of every future window)."""
        return max(0, min(n, int(self._floor[layer, row]) - start))

    def slots(self, row: int, spans, *, write: bool = False) -> list[torch.Tensor]:
        """Flat pool slots (``block * block_size + offset``, int64 on the
        pool's device) of each ``(layer, start, end)`` span of ``row``, in
        token order, uploaded in one copy: an upload from NumPy waits for the
        GPU's queue, and a prefill chunk used to make two per layer and pass.
        Reads must lie between :meth:`first_held` and the reservation; writes
        (``write``) also at or past ``seq_pos``."""
        self._check_row(row)
        bs, parts = self.block_size, []
        for layer, start, end in spans:
            if write and (start < self.seq_pos[row] or end > self._reserved[row]):
                raise MegacError(f"KV cache: row {row}: write of positions {start}..{end - 1} outside the "
                                 f"reservation {int(self.seq_pos[row])}..{int(self._reserved[row]) - 1}")
            if start < self._floor[layer, row]:
                raise MegacError(f"KV cache: row {row} layer {layer}: position {start} was released "
                                 f"(first held: {self.first_held(layer, row)})")
            if end > self._reserved[row] or start > end:
                raise MegacError(f"KV cache: row {row}: gather {start}..{end - 1} outside "
                                 f"0..{int(self._reserved[row]) - 1}")
            pos = np.arange(start, end)
            blocks = self.page_table[layer, row, pos // bs].astype(np.int64)
            if (blocks < 0).any():  # pragma: no cover - reserve maps everything >= floor
                raise MegacError(f"KV cache: row {row} layer {layer}: unmapped reserved position")
            parts.append(blocks * bs + pos % bs)
        sizes = [len(x) for x in parts]
        flat = torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.int64)).to(self.k_pool.device)
        return list(torch.split(flat, sizes)) if parts else []

    def read_slots(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[len(slots), kv_heads, head_dim]`` at pool ``slots``
        (``block * block_size + offset``; indexed by the pair, since the
        head-major view cannot flatten its first two dims without a copy)."""
        b, o = slots // self.block_size, slots % self.block_size
        return self.k_pool[b, o], self.v_pool[b, o]

    def write_slots(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ``[len(slots), kv_heads, head_dim]`` at pool ``slots``."""
        b, o = slots // self.block_size, slots % self.block_size
        self.k_pool[b, o] = k.to(self.k_pool.dtype)
        self.v_pool[b, o] = v.to(self.v_pool.dtype)

    def write(self, layer: int, row: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ``[n, kv_heads, head_dim]`` at positions
        ``start .. start+n-1`` (reserved, ``>= seq_pos``); positions below
        :meth:`first_held` (out of every future window) are skipped."""
        self._check_row(row)
        n = k.shape[0]
        if start < self.seq_pos[row] or start + n > self._reserved[row]:
            raise MegacError(f"KV cache: row {row}: write of positions {start}..{start + n - 1} outside the "
                             f"reservation {int(self.seq_pos[row])}..{int(self._reserved[row]) - 1}")
        skip = self.write_skip(layer, row, start, n)
        if skip < n:
            (where,) = self.slots(row, [(layer, start + skip, start + n)], write=True)
            self.write_slots(where, k[skip:], v[skip:])

    def gather(self, layer: int, row: int, start: int | None = None,
               end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[end-start, kv_heads, head_dim]`` of ``row`` in token order
        (default: from :meth:`first_held` to ``seq_pos``; ``end`` may reach
        into the reservation)."""
        self._check_row(row)
        start = self.first_held(layer, row) if start is None else start
        end = int(self.seq_pos[row]) if end is None else end
        (where,) = self.slots(row, [(layer, start, end)])
        return self.read_slots(where)

    # ------------------------------------------------------------------ checks

    def check(self, held: np.ndarray | None = None) -> None:
        """Invariants (tests): every refcount equals the number of page-table
        entries naming the block (plus ``held``: references taken with
        ``hold``, per block); free blocks are named by none."""
        counts = np.bincount(self.page_table[self.page_table >= 0].ravel(), minlength=self.num_blocks)
        if held is not None:
            counts = counts + held
        if not np.array_equal(counts, self.allocator.refcount):
            bad = int(np.flatnonzero(counts != self.allocator.refcount)[0])
            raise MegacError(f"KV cache: block {bad} has refcount {int(self.allocator.refcount[bad])} "
                             f"but {int(counts[bad])} page-table references")
        free = set(self.allocator._free)
        if len(free) != len(self.allocator._free) or any(self.allocator.refcount[b] for b in free):
            raise MegacError("KV cache: free list corrupt")
        if len(free) + int((self.allocator.refcount > 0).sum()) != self.num_blocks:
            raise MegacError("KV cache: blocks lost (neither free nor referenced)")
        inactive = self.row_active == 0
        if (self.page_table[:, inactive, :] >= 0).any():
            raise MegacError("KV cache: an inactive row still maps blocks")


__all__ = ["BlockAllocator", "KVOutOfBlocks", "PagedKVCache", "blocks_for_tokens"]

"""Prefix caching over the paged KV cache: a hash chain over full prefill
chunks, shared blocks held by reference counts.

Granularity is the engine's **prefill chunk** (``chunk_tokens``, a multiple
of the KV block size), not the single block: the engine prefills every prompt
in chunks aligned to absolute multiples of ``chunk_tokens``, and only a chunk
computed whole (all ``chunk_tokens`` tokens in one prefill call) is
registered. A request that reuses cached chunks therefore computes exactly the
same remaining chunks (same shapes, same inputs) as without the cache, so its
output does not depend on what other requests left in the cache. (CPU GEMM
results depend on the row count, so block-granular reuse inside a chunk would
change bits.)

Keys: ``h_j = blake2b(h_{j-1} || tokens of chunk j as int64 LE)`` with
``h_{-1}`` a fixed seed. An entry maps ``h_j`` to the physical blocks of that
chunk in every layer (``int32 [num_layers, chunk_tokens / block_size]``) and
holds one reference on each (``BlockAllocator.incref``), so the blocks survive
the row that computed them. A new row attaches the longest cached chain: its
page-table entries point at the shared blocks (one more reference each) and
its ``seq_pos`` starts after them. Rows only ever write positions at or after
their ``seq_pos``, so shared blocks are never written (the cache's
copy-on-write covers any slip).

Eviction is LRU over entries whose blocks only the cache still references
(refcount 1); among entries used at the same time, the deepest of a chain
goes first, so the head of a shared prefix survives longest.

Sliding-window layers (North Mini Code's): an entry keeps, per layer, the
chunk's blocks that were still mapped when the chunk was registered (right
after its prefill); a sliding layer's blocks that its own window had
already released (a window shorter than a chunk) are -1. A chain of ``n``
chunks is handed out only when every layer holds every key the next token
(position ``n * chunk_tokens``) sees (``PagedKVCache.attachable``), else the
longest shorter chain that does: a sliding layer needs only its window's
blocks, which were registered live. The row then releases the older
sliding blocks as its window moves, as any row does; the cache's own
references keep them for other matches until evicted.

Only the cache's public API is used: ``PagedKVCache.hold`` / ``release`` /
``refcounts`` for the entries' references, ``attach_shared`` to map a cached
chain into a fresh row, ``check(held=...)`` for the invariants.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from megac.errors import MegacError

if TYPE_CHECKING:
    from megac.kv.paged import PagedKVCache

_SEED = hashlib.blake2b(b"megac-prefix-v1", digest_size=16).digest()


def chain_hashes(tokens: Sequence[int], chunk_tokens: int, n_chunks: int | None = None) -> list[bytes]:
    """Chain hashes of the first ``n_chunks`` full chunks of ``tokens``."""
    full = len(tokens) // chunk_tokens
    n = full if n_chunks is None else min(full, n_chunks)
    out: list[bytes] = []
    h = _SEED
    arr = np.asarray(tokens[: n * chunk_tokens], dtype="<i8")
    for j in range(n):
        h = hashlib.blake2b(h + arr[j * chunk_tokens:(j + 1) * chunk_tokens].tobytes(), digest_size=16).digest()
        out.append(h)
    return out


@dataclass
class _Entry:
    blocks: np.ndarray  # int32 [num_layers, blocks_per_chunk]
    depth: int  # chunk index in its chain
    last_used: int


class PrefixCache:
    """Hash chain over full prefill chunks (see the module docstring)."""

    def __init__(self, kv: "PagedKVCache", chunk_tokens: int, *, enabled: bool = True) -> None:
        if chunk_tokens % kv.block_size:
            raise MegacError(f"prefix cache: chunk of {chunk_tokens} tokens is not a multiple of the "
                             f"KV block size {kv.block_size}")
        self.kv = kv
        self.chunk_tokens = chunk_tokens
        self.blocks_per_chunk = chunk_tokens // kv.block_size
        self.enabled = enabled
        self._entries: dict[bytes, _Entry] = {}
        self._clock = 0
        #: prompt tokens looked up / found (Prometheus prefix_cache_queries / _hits)
        self.queries = 0
        self.hits = 0

    # ------------------------------------------------------------------ info

    def __len__(self) -> int:
        return len(self._entries)

    def _evictable(self, e: _Entry) -> bool:
        """Every block of ``e`` is the cache's alone."""
        return bool(np.array_equal(self._only_cached(e), e.blocks >= 0))

    @property
    def num_blocks_held(self) -> int:
        """Blocks the cache references (shared with rows or not)."""
        return sum(int((e.blocks >= 0).sum()) for e in list(self._entries.values()))

    def _only_cached(self, e: _Entry) -> np.ndarray:
        """Mask of ``e``'s blocks that only the cache references."""
        m = e.blocks >= 0
        m[m] = self.kv.refcounts(e.blocks[m]) == 1
        return m

    def num_evictable_blocks(self) -> int:
        """Blocks that only the cache references (free after eviction: whole
        entries, or the sliding-layer blocks of entries a row shares)."""
        return sum(int(self._only_cached(e).sum()) for e in list(self._entries.values()))

    # ------------------------------------------------------------------ use

    def match(self, tokens: Sequence[int], max_chunks: int) -> tuple[list[bytes], np.ndarray]:
        """Longest cached chain over the first ``max_chunks`` chunks of
        ``tokens``: ``(hashes, blocks [num_layers, n_blocks])``."""
        if not self.enabled or max_chunks <= 0:
            return [], np.zeros((self.kv.num_layers, 0), dtype=np.int32)
        self._clock += 1
        found: list[bytes] = []
        parts: list[np.ndarray] = []
        for h in chain_hashes(tokens, self.chunk_tokens, max_chunks):
            e = self._entries.get(h)
            if e is None:
                break
            e.last_used = self._clock
            found.append(h)
            parts.append(e.blocks)
        blocks = np.concatenate(parts, axis=1) if parts else np.zeros((self.kv.num_layers, 0), dtype=np.int32)
        # the longest chain whose end every layer can attend from (sliding
        # layers: their window's blocks mapped)
        while found and not self.kv.attachable(blocks[:, : len(found) * self.blocks_per_chunk]):
            found.pop()
        out = blocks[:, : len(found) * self.blocks_per_chunk].copy()
        # a sliding layer's blocks before its window at the hit's end are
        # never read again: handed out they would be held by the row for
        # nothing (North Mini Code's sliding layers: most of a long prefix),
        # and in a small pool the row could hold every block and never get
        # one to write (a request alone re-admitted and preempted forever)
        pos = out.shape[1] * self.kv.block_size
        for layer in np.flatnonzero(self.kv.windows > 0):
            out[layer, : self.kv.window_start(int(layer), pos) // self.kv.block_size] = -1
        return found, out

    def register(self, row: int, tokens: Sequence[int], chunk: int) -> bool:
        """Cache chunk ``chunk`` of ``row`` (its tokens ``tokens[:(chunk+1)*C]``
        are in the row's blocks, computed as one whole chunk). False when it
        was already cached or caching is off."""
        if not self.enabled:
            return False
        h = chain_hashes(tokens, self.chunk_tokens, chunk + 1)
        if len(h) != chunk + 1:
            raise MegacError(f"prefix cache: chunk {chunk} is not full")
        key = h[-1]
        self._clock += 1
        if key in self._entries:
            self._entries[key].last_used = self._clock
            return False
        b0 = chunk * self.blocks_per_chunk
        blocks = self.kv.page_table[:, row, b0:b0 + self.blocks_per_chunk].copy()
        # a full layer holds every block; a sliding one may have released the
        # chunk's first blocks already (a window shorter than the chunk)
        full = self.kv.windows == 0
        if (blocks[full] < 0).any():
            raise MegacError(f"prefix cache: chunk {chunk} of row {row} is not mapped")
        self.kv.hold(blocks)
        self._entries[key] = _Entry(blocks, chunk, self._clock)
        return True

    def evict(self, blocks_needed: int) -> int:
        """Drop least recently used evictable entries until at least
        ``blocks_needed`` blocks went back to the pool; then, if still short,
        the blocks only the cache holds in entries a row shares (their
        sliding-layer blocks, which the row did not take: ``match`` gives a
        row only its window's); returns the number freed.

        An entry without some of its sliding blocks still serves chains that
        go past it (their windows start later); ``match`` cuts a chain that
        would end where a window's blocks are gone (``attachable``)."""
        freed = 0
        if blocks_needed <= 0 or not self._entries:
            return 0
        order = sorted(self._entries.items(), key=lambda kv_: (kv_[1].last_used, -kv_[1].depth))
        for key, e in order:
            if freed >= blocks_needed:
                break
            if not self._evictable(e):
                continue
            freed += self.kv.release(e.blocks)
            del self._entries[key]
        for key, e in order:
            if freed >= blocks_needed:
                break
            if key not in self._entries:
                continue
            m = self._only_cached(e)
            if not m.any():
                continue
            freed += self.kv.release(e.blocks[m])
            e.blocks[m] = -1
        return freed

    def check(self) -> None:
        """Invariants (tests): every block's refcount equals its page-table
        references plus the cache's own; the free list holds exactly the
        unreferenced blocks (``PagedKVCache.check`` with the cache counted)."""
        kv = self.kv
        held = np.zeros(kv.num_blocks, dtype=np.int64)
        for e in self._entries.values():
            held += np.bincount(e.blocks[e.blocks >= 0], minlength=kv.num_blocks)
        kv.check(held=held)

    def clear(self) -> int:
        """Drop every entry (blocks still used by rows stay with the rows)."""
        n = sum(self.kv.release(e.blocks) for e in self._entries.values())
        self._entries.clear()
        return n


__all__ = ["PrefixCache", "chain_hashes"]

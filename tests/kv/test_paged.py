"""Paged KV cache: allocation cycles, sliding-window release, sharing, exhaustion."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megac.errors import MegacError
from megac.kv import BlockAllocator, KVOutOfBlocks, PagedKVCache, blocks_for_tokens
from megac.spec import load_spec
from models import variant

BS = 16  # tiny-moe / tiny-llama kv_block_size
WINDOW = 8  # tiny-moe sliding window


@pytest.fixture
def moe():
    return load_spec("tiny-moe")


def _cache(spec, rows=4, blocks=256, **kw):
    return PagedKVCache(spec, max_rows=rows, num_blocks=blocks, dtype=torch.float32, **kw)


def _rand_kv(spec, n, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (n, spec.num_kv_heads, spec.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _held_blocks(kv, layer, row):
    t = kv.page_table[layer, row]
    return {int(b) for b in np.flatnonzero(t >= 0)}


def test_layout_shapes(moe):
    kv = _cache(moe, rows=3, blocks=10, max_context=100)
    assert kv.k_pool.shape == (10, BS, moe.num_kv_heads, moe.head_dim)
    assert kv.v_pool.shape == kv.k_pool.shape
    assert kv.page_table.shape == (moe.num_layers, 3, 7) and kv.page_table.dtype == np.int32
    assert kv.seq_pos.dtype == np.int32 and kv.row_active.dtype == np.int32
    assert (kv.page_table == -1).all()
    assert PagedKVCache(moe, max_rows=1, num_blocks=1).k_pool.dtype == torch.bfloat16


def test_allocator():
    a = BlockAllocator(3)
    assert [a.alloc(), a.alloc()] == [0, 1]
    a.incref(0)
    assert not a.decref(0) and a.decref(0)
    assert a.alloc() == 0  # lowest free first
    a.alloc()
    with pytest.raises(KVOutOfBlocks):
        a.alloc()
    with pytest.raises(MegacError):
        BlockAllocator(3).decref(1)


def test_append_free_cycles(moe):
    spec = load_spec("tiny-llama")
    kv = _cache(spec, rows=3, blocks=64)
    total = kv.num_free_blocks
    for cycle in range(3):
        rows = [kv.allocate_row() for _ in range(3)]
        assert rows == [0, 1, 2]
        with pytest.raises(MegacError, match="rows are in use"):
            kv.allocate_row()
        for step in range(40):
            for r in rows[: 1 + (step % 3)]:
                pos = kv.append_slot(r)
                assert pos == kv.seq_pos[r]
                assert kv.append_slot(r) == pos  # idempotent before advance
                kv.advance(r)
            kv.check()
        for r in rows:
            n = int(kv.seq_pos[r])
            # one block per started block of tokens, in every layer
            assert len(kv.blocks_of_row(r)) == spec.num_layers * -(-n // BS)
            assert len(kv.blocks_of_row(r)) == blocks_for_tokens(spec, n)
        # a block is allocated exactly on a boundary
        r = rows[0]
        before = kv.num_free_blocks
        while kv.seq_pos[r] % BS:
            kv.append_slot(r)
            kv.advance(r)
        assert kv.num_free_blocks == before
        kv.append_slot(r)
        assert kv.num_free_blocks == before - spec.num_layers
        kv.advance(r)
        for r in rows:
            kv.free_row(r)
        kv.check()
        assert kv.num_free_blocks == total
        assert not kv.row_active.any() and (kv.page_table == -1).all()


def test_no_block_shared_unintentionally(moe):
    kv = _cache(moe, rows=4)
    for r in range(4):
        kv.allocate_row()
    for step in range(50):
        for r in range(4):
            if step < 10 * (r + 1):
                kv.append_slot(r)
                kv.advance(r)
    kv.check()
    t = kv.page_table[kv.page_table >= 0]
    assert len(t) == len(np.unique(t))  # every block named once
    assert (kv.allocator.refcount <= 1).all()


def test_sliding_release_exact(moe):
    """After reserving position p, a sliding layer holds exactly the blocks
    with a token in the window (p-WINDOW, p] (window counts the current
    token); full layers hold every block."""
    kv = _cache(moe, rows=2)
    row = kv.allocate_row()
    other = kv.allocate_row()
    freed_total = 0
    for p in range(100):
        before = kv.num_free_blocks
        assert kv.append_slot(row) == p
        kv.append_slot(other)
        kv.advance(other)
        lo = max(0, p - WINDOW + 1)
        for layer, ls in enumerate(moe.layers):
            held = _held_blocks(kv, layer, row)
            if ls.attention == "sliding":
                assert held == set(range(lo // BS, p // BS + 1)), (p, layer)
                assert kv.first_held(layer, row) == (lo // BS) * BS
            else:
                assert held == set(range(p // BS + 1))
        kv.advance(row)
        kv.check()
        # both rows move in lockstep: blocks taken at a boundary, released
        # when the window start crosses one
        alloc = moe.num_layers if p % BS == 0 else 0
        released = len(moe.sliding_layers) if p - WINDOW + 1 > 0 and (p - WINDOW + 1) % BS == 0 else 0
        assert before - kv.num_free_blocks == 2 * (alloc - released), p
        freed_total += released
    assert freed_total > 0
    assert blocks_for_tokens(moe, 100) == len(kv.blocks_of_row(row))


def test_release_returns_blocks_to_pool(moe):
    spec = variant(moe, layers=[{"attention": "sliding", "window": WINDOW, "rope": True, "ffn": "moe"}] * 2,
                   dense_intermediate_size=None)
    kv = _cache(spec, rows=1, blocks=4)
    kv.allocate_row()
    # a sliding-only model runs forever in a pool of 2 blocks per layer: after
    # position p each layer holds exactly the blocks of positions
    # [p - WINDOW + 1, p]; every other block is back in the pool
    for p in range(200):
        kv.append_slot(0)
        kv.advance(0)
        lo = max(0, p - WINDOW + 1)
        want = set(range(lo // BS, p // BS + 1))
        for layer in range(2):
            held = kv.page_table[layer, 0]
            assert set(np.flatnonzero(held >= 0).tolist()) == want, (p, layer)
        assert kv.num_used_blocks == 2 * len(want) and kv.num_free_blocks == 4 - 2 * len(want), p
        kv.check()
    assert kv.num_free_blocks == 2  # position 199: only block 12 of each layer is in the window


def test_exhaustion_raises_and_changes_nothing(moe):
    spec = load_spec("tiny-llama")  # 2 layers
    kv = _cache(spec, rows=2, blocks=5)
    a, b = kv.allocate_row(), kv.allocate_row()
    kv.reserve(a, 2 * BS)  # 4 blocks
    kv.advance(a, 2 * BS)
    snapshot = (kv.page_table.copy(), kv.seq_pos.copy(), kv.allocator.refcount.copy(), kv.num_free_blocks)
    with pytest.raises(KVOutOfBlocks) as err:
        kv.append_slot(b)  # needs 2 (one per layer), 1 free
    assert "out of blocks" in str(err.value)
    assert isinstance(err.value, MegacError)
    assert np.array_equal(kv.page_table, snapshot[0]) and np.array_equal(kv.seq_pos, snapshot[1])
    assert np.array_equal(kv.allocator.refcount, snapshot[2]) and kv.num_free_blocks == snapshot[3]
    # preempt a: b proceeds
    kv.free_row(a)
    assert kv.append_slot(b) == 0
    kv.check()


def test_exhaustion_partial_layers_rolls_nothing(moe):
    kv = _cache(moe, rows=1, blocks=moe.num_layers - 1)
    kv.allocate_row()
    with pytest.raises(KVOutOfBlocks):
        kv.append_slot(0)
    assert kv.num_free_blocks == moe.num_layers - 1 and (kv.page_table == -1).all()


def _storage_is_head_major(kv):
    """The pools' memory is [blocks, kv_heads, block_size, head_dim] and
    holds what the token-major view reads."""
    for pool in (kv.k_pool, kv.v_pool):
        storage = pool.transpose(1, 2)
        assert storage.is_contiguous() and not pool.is_contiguous()
        flat = torch.as_strided(pool, (pool.numel(),), (1,))  # the memory in address order
        assert torch.equal(flat, storage.reshape(-1))


@pytest.mark.parametrize("head_major", [False, True])
def test_write_gather_round_trip(moe, head_major):
    """Also with head-major pools (the GPU backends' under the model's
    kv_head_major tile): every write and read goes through the view."""
    kv = _cache(moe, rows=2, head_major=head_major)
    r0, r1 = kv.allocate_row(), kv.allocate_row()
    k, v = _rand_kv(moe, 40, 0)
    k1, v1 = _rand_kv(moe, 40, 1)
    for p in range(40):
        for r, (kk, vv) in ((r0, (k, v)), (r1, (k1, v1))):
            kv.append_slot(r)
            for layer in range(moe.num_layers):
                kv.write(layer, r, p, kk[p:p + 1] + layer, vv[p:p + 1] - layer)
            kv.advance(r)
    for layer, ls in enumerate(moe.layers):
        start = kv.first_held(layer, r0)
        gk, gv = kv.gather(layer, r0)
        assert torch.equal(gk, k[start:] + layer) and torch.equal(gv, v[start:] - layer)
        gk1, _ = kv.gather(layer, r1, 35, 40)
        assert torch.equal(gk1, k1[35:] + layer)
        if ls.attention == "sliding":
            assert start == 32
            with pytest.raises(MegacError, match="released"):
                kv.gather(layer, r0, 0, 40)
        else:
            assert start == 0
    if head_major:
        _storage_is_head_major(kv)
        assert int(kv.k_pool.transpose(1, 2).ne(0).sum()) > 0  # the writes landed in the storage


def test_write_outside_reservation(moe):
    kv = _cache(moe, rows=1)
    kv.allocate_row()
    k, v = _rand_kv(moe, 2, 0)
    with pytest.raises(MegacError, match="outside the reservation"):
        kv.write(0, 0, 0, k[:1], v[:1])
    kv.append_slot(0)
    with pytest.raises(MegacError, match="outside the reservation"):
        kv.write(0, 0, 0, k, v)
    kv.write(0, 0, 0, k[:1], v[:1])
    kv.advance(0)
    with pytest.raises(MegacError, match="outside the reservation"):
        kv.write(0, 0, 0, k[:1], v[:1])  # committed tokens are never rewritten
    with pytest.raises(MegacError, match="advance past"):
        kv.advance(0)
    kv.free_row(0)
    with pytest.raises(MegacError, match="not allocated"):
        kv.append_slot(0)


def test_long_reserve_maps_only_the_window(moe):
    """A prefill of 100 tokens maps sliding layers' last blocks only, and
    writes to released positions are skipped."""
    kv = _cache(moe, rows=1)
    kv.allocate_row()
    assert kv.reserve(0, 100) == 0
    k, v = _rand_kv(moe, 100, 0)
    for layer, ls in enumerate(moe.layers):
        kv.write(layer, 0, 0, k, v)
        held = _held_blocks(kv, layer, 0)
        if ls.attention == "sliding":
            assert held == {5, 6}  # window of position 99: 92..99
        else:
            assert held == set(range(7))
    kv.advance(0, 100)
    kv.check()
    assert len(kv.blocks_of_row(0)) == blocks_for_tokens(moe, 100)
    for layer in range(moe.num_layers):
        start = kv.first_held(layer, 0)
        gk, gv = kv.gather(layer, 0)
        assert torch.equal(gk, k[start:]) and torch.equal(gv, v[start:])


@pytest.mark.parametrize("head_major", [False, True])
def test_fork_copy_on_write(moe, head_major):
    spec = load_spec("tiny-llama")
    kv = _cache(spec, rows=3, blocks=32, head_major=head_major)
    src = kv.allocate_row()
    n = BS + 5
    kv.reserve(src, n)
    k, v = _rand_kv(spec, n, 0)
    for layer in range(spec.num_layers):
        kv.write(layer, src, 0, k, v)
    kv.advance(src, n)
    used = kv.allocator.num_used
    dst = kv.fork_row(src)
    assert kv.allocator.num_used == used  # nothing copied yet
    assert kv.blocks_of_row(dst) == kv.blocks_of_row(src)
    kv.check()
    # dst appends into the shared partial block: copied first
    pos = kv.append_slot(dst)
    assert pos == n
    knew, vnew = _rand_kv(spec, 1, 9)
    for layer in range(spec.num_layers):
        kv.write(layer, dst, pos, knew, vnew)
    kv.advance(dst)
    kv.check()
    for layer in range(spec.num_layers):
        assert kv.page_table[layer, dst, 0] == kv.page_table[layer, src, 0]  # full prefix block still shared
        assert kv.page_table[layer, dst, 1] != kv.page_table[layer, src, 1]
        gk, _ = kv.gather(layer, dst)
        assert torch.equal(gk, torch.cat([k, knew]))
        gk_src, _ = kv.gather(layer, src)
        assert torch.equal(gk_src, k)  # the source is untouched
    # src appends too: its block is no longer shared, no copy
    before = kv.allocator.num_used
    kv.append_slot(src)
    assert kv.allocator.num_used == before
    kv.free_row(src)
    kv.check()
    kv.free_row(dst)
    kv.check()
    assert kv.allocator.num_used == 0
    if head_major:
        _storage_is_head_major(kv)


def test_reservation_cannot_move_back(moe):
    kv = _cache(moe, rows=1)
    kv.allocate_row()
    kv.reserve(0, 60)
    with pytest.raises(MegacError, match="already released"):
        kv.reserve(0, 10)


def test_max_context(moe):
    kv = _cache(moe, rows=1, max_context=20)
    kv.allocate_row()
    with pytest.raises(MegacError, match="max_context"):
        kv.reserve(0, 21)


def test_fast_append_path_equals_general_path(moe):
    """Random allocate / append / chunked reserve / fork / free sequences give
    identical page tables with and without the decode fast paths."""
    import random

    spec = variant(moe, layers=[l.model_dump() for l in moe.layers]
                   + [{"attention": "sliding", "window": 8, "rope": True, "ffn": "moe"}])
    caches = [_cache(spec, rows=4, blocks=400), _cache(spec, rows=4, blocks=400)]
    caches[1]._fast_paths = False
    rng = random.Random(0)
    for it in range(600):
        op = rng.random()
        active = [r for r in range(4) if caches[0].row_active[r]]
        if not active or (op < 0.05 and len(active) < 4):
            for kv in caches:
                kv.allocate_row()
        elif op < 0.08 and len(active) < 4:
            src = rng.choice(active)
            for kv in caches:
                kv.fork_row(src)
        elif op < 0.11:
            r = rng.choice(active)
            for kv in caches:
                kv.free_row(r)
        else:
            r = rng.choice(active)
            n = 1 if op < 0.9 else rng.randint(2, 40)
            if caches[0].seq_pos[r] + n > caches[0].max_context:
                continue
            for kv in caches:
                kv.reserve(r, n)
                if rng.random() < 0.1:
                    kv.reserve(r, n)  # retried step: idempotent
                kv.advance(r, n)
        for kv in caches:
            kv.check()
        assert np.array_equal(caches[0].page_table, caches[1].page_table), it
        assert np.array_equal(caches[0].seq_pos, caches[1].seq_pos)
        assert np.array_equal(caches[0]._floor, caches[1]._floor)


@pytest.mark.parametrize("window, bs", [(WINDOW, BS), (4096, 64), (5, 16), (16, 16), (17, 16), (40, 8), (1, 4)])
def test_peak_blocks_is_the_most_a_growing_row_holds(moe, window, bs):
    """With a window short next to a block the blocks a row holds are not
    monotone in its length (window 8, blocks of 16: 2 blocks per sliding
    layer at 17-23 tokens, 1 at 24); the peak is the running maximum, counted
    here by a row that actually grows one token at a time."""
    from megac.kv import peak_blocks_for_tokens

    layers = [l.model_dump() for l in moe.layers]
    for l in layers:
        if l["window"] is not None:
            l["window"] = window
    spec = variant(moe, f"peak-{window}-{bs}", layers=layers,
                   target={**moe.target.model_dump(), "kv_block_size": bs})
    kv = _cache(spec, rows=1, blocks=4096, max_context=window + 4 * bs + 8)
    row = kv.allocate_row()
    most = 0
    for t in range(1, window + 4 * bs + 3):
        kv.append_slot(row)
        kv.advance(row, 1)
        held = sum(len(_held_blocks(kv, layer, row)) for layer in range(len(spec.layers)))
        assert held == blocks_for_tokens(spec, t, bs), t
        most = max(most, held)
        assert peak_blocks_for_tokens(spec, t, bs) == most, t


def test_a_pool_sized_for_a_short_window_lets_a_row_grow_through_it():
    """tiny-moe (windows of 8 keys, blocks of 16) with room for one request of
    24 tokens: the pool must hold the 12 blocks the row needs at 17-23
    tokens, not the 8 it holds at 24 (sized by the end, a 19-token prompt
    waited for blocks forever and the engine never became idle)."""
    from engines import run
    from megac.passes.pipeline import compile_schedules
    from megac.weights import random_weights

    spec = load_spec("tiny-moe")
    sch = compile_schedules(spec, batch_sizes=[1], buckets=[1024])
    w = random_weights(spec, seed=3)
    for n in (18, 19, 21):
        out = run(spec, w, sch, [list(range(3, 3 + n))], max_tokens=5, eos_token_ids=[])
        assert len(out[0].tokens) == 5, n

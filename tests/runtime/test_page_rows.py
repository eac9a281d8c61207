"""The step's page-table rows sized to the step (runtime.step.page_rows,
fill_tables): every page a row's attention or KV write can touch is in the
packed table, whatever the schedule's bucket."""

import numpy as np
import pytest

from megac.geometry import Geometry
from megac.kv.paged import PagedKVCache
from megac.runtime import step
from megac.spec import load_spec


@pytest.mark.parametrize("positions, expect", [
    ([0], 16),            # the floor
    ([15 * 64 + 63], 16),  # page 15 is the 16th
    ([16 * 64], 32),      # page 16 needs 17 -> 32
    ([5, 3000, 40], 64),  # the longest row decides: page 46 -> 47 -> 64
    ([10 ** 6], 256),     # clamped to the schedule's bucket
    ([], 16),
])
def test_page_rows_is_the_power_of_two_covering_the_longest_row(positions, expect):
    assert step.page_rows(positions, 64, 256) == expect


def test_packed_tables_hold_every_page_the_kernel_reads():
    spec = load_spec("tiny-moe")  # a full and a sliding layer
    kv = PagedKVCache(spec, max_rows=4, num_blocks=512, max_context=4096, block_size=16)
    geo = Geometry.from_spec(spec, 4, 4096)
    lengths = [1, 37, 300, 1100]
    rows = [kv.allocate_row() for _ in lengths]
    for r, n in zip(rows, lengths):
        if n > 1:
            kv.reserve(r, n - 1)
            kv.advance(r, n - 1)
    pos = step.reserve_rows(kv, rows, geo)
    assert pos == [n - 1 for n in lengths]
    mb = step.page_rows(pos, kv.block_size, kv.max_blocks_per_seq, floor=4)
    assert mb == 128  # 1100 tokens -> page 68 -> 69 pages -> 128
    L = spec.num_layers
    packed = np.zeros((L, 4, mb), np.int32)
    seq, act = np.zeros(4, np.int32), np.zeros(4, np.int32)
    step.fill_tables(kv, rows, pos, packed, seq, act)
    for i, r in enumerate(rows):
        for layer in range(L):
            w = kv.windows[layer]
            lo = max(0, pos[i] + 1 - w) if w else 0
            for p in range(lo, pos[i] + 1):  # the keys it attends to, its own slot included
                b = p // kv.block_size
                assert packed[layer, i, b] == kv.page_table[layer, r, b] >= 0
    assert seq.tolist() == pos and act.tolist() == [1, 1, 1, 1]
    # the same first columns as the whole table would carry
    full = np.zeros((L, 4, kv.max_blocks_per_seq), np.int32)
    step.fill_tables(kv, rows, pos, full, seq, act)
    assert np.array_equal(full[:, :, :mb], packed)


def test_every_page_table_change_bumps_the_version():
    """A GPU backend re-sends a step's page tables only when (rows, row
    length, kv.version) changed: so no change of ``page_table`` may leave
    the version as it was. Random decode, prefill, fork, attach and free
    operations on a sliding + full model; and decoding inside a block (the
    common step) must leave it alone, or nothing would be saved."""
    rng = np.random.default_rng(7)
    spec = load_spec("tiny-moe")  # sliding window 8, blocks of 4 here: releases every few steps
    kv = PagedKVCache(spec, max_rows=4, num_blocks=400, max_context=512, block_size=4)
    rows: list[int] = []
    seen_unchanged = 0
    for _ in range(600):
        before, v0 = kv.page_table.copy(), kv.version
        op = rng.integers(0, 10)
        if (op == 0 or not rows) and len(rows) < 4:
            rows.append(kv.allocate_row())
        elif op == 1 and len(rows) > 1:
            kv.free_row(rows.pop(int(rng.integers(0, len(rows)))))
        elif op == 2 and len(rows) < 4:
            rows.append(kv.fork_row(rows[int(rng.integers(0, len(rows)))]))
        elif op == 3 and len(rows) < 4:
            src = rows[int(rng.integers(0, len(rows)))]
            n = int(kv.seq_pos[src]) // kv.block_size
            if n and kv.attachable(kv.page_table[:, src, :n]):
                r = kv.allocate_row()
                v0 = kv.version  # the allocation itself counts
                before = kv.page_table.copy()
                kv.attach_shared(r, kv.page_table[:, src, :n].copy())
                rows.append(r)
        elif op == 4:
            r = rows[int(rng.integers(0, len(rows)))]
            n = int(rng.integers(1, 9))
            if kv.seq_pos[r] + n < kv.max_context:
                kv.reserve(r, n, stepwise=bool(rng.integers(0, 2)))
                kv.advance(r, n)
        else:
            r = rows[int(rng.integers(0, len(rows)))]
            if kv.seq_pos[r] + 1 < kv.max_context:
                kv.append_slot(r)
                kv.advance(r, 1)
        if not np.array_equal(before, kv.page_table):
            assert kv.version != v0, f"page_table changed by op {op} without a version bump"
        elif op >= 5:
            seen_unchanged += kv.version == v0
    assert seen_unchanged > 50  # most single steps stay inside their blocks

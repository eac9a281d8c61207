"""megac/routing.py against a straightforward fp64 computation in plain
Python loops: ids, slots and queue records exactly, weights within 1 ulp
(Python's exp and torch's may differ in the last fp64 bit, which can move
the fp32 rounding by one ulp), combine and split sums exactly (both sides
round every fp32 product and sum once, in the same order)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megac import routing
from megac.abi import Queue, record_index

MODES = [(False, False), (False, True), (True, False), (True, True)]  # (softmax, renormalize)


# --------------------------------------------------------------------------- references
def _key(v: float, e: int) -> tuple:
    """Descending value, NaN above every number, ties to the lower id."""
    return (0, 0.0, e) if math.isnan(v) else (1, -v, e)


def ref_topk(row, k: int, softmax: bool, renormalize: bool) -> tuple[list[int], list[np.float32]]:
    vals = [float(v) for v in row]
    ids = sorted(range(len(vals)), key=lambda e: _key(vals[e], e))[:k]
    sel = [vals[e] for e in ids]
    if softmax:
        ex = [math.exp(s - sel[0]) for s in sel]
        tot = 0.0
        for x in ex:
            tot += x
        w = [np.float32(x / tot) for x in ex]
    else:
        w = [np.float32(1.0 / (1.0 + math.exp(-s))) for s in sel]
    if renormalize:
        tot = 0.0
        for x in w:
            tot += float(x)
        w = [np.float32(float(x) / tot) for x in w]
    return ids, w


def ref_finalize(ids, experts: int, tiles: int) -> tuple[list[int], list[int], list[list[int]], list[tuple]]:
    flat = [int(e) for row in ids for e in row]
    counts = [0] * experts
    for e in flat:
        counts[e] += 1
    offsets, run = [], 0
    for c in counts:
        offsets.append(run)
        run += c
    seen = [0] * experts
    slots = []
    for e in flat:
        slots.append(offsets[e] + seen[e])
        seen[e] += 1
    k = len(ids[0]) if len(ids) else 0
    slot_rows = [slots[r * k:(r + 1) * k] for r in range(len(ids))]
    records = [(e, t, offsets[e], counts[e]) for e in range(experts) if counts[e] for t in range(tiles)]
    return counts, offsets, slot_rows, records


def ulps(a: np.ndarray, b: np.ndarray) -> int:
    ai = np.asarray(a, np.float32).view(np.int32).astype(np.int64)
    bi = np.asarray(b, np.float32).view(np.int32).astype(np.int64)
    return int(np.abs(ai - bi).max())


def check_topk(logits: np.ndarray, k: int, softmax: bool, renormalize: bool) -> None:
    ids, w = routing.topk(torch.from_numpy(logits), k, softmax=softmax, renormalize=renormalize)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    for r in range(logits.shape[0]):
        want_ids, want_w = ref_topk(logits[r], k, softmax, renormalize)
        assert ids[r].tolist() == want_ids, r
        assert ulps(w[r].numpy(), np.array(want_w, np.float32)) <= 1, r


def check_finalize(ids: np.ndarray, experts: int, tiles: int) -> routing.Route:
    route = routing.finalize(ids, experts)
    counts, offsets, slots, records = ref_finalize(ids.tolist(), experts, tiles)
    assert route.counts.tolist() == counts
    assert route.offsets.tolist() == offsets
    assert route.slot.tolist() == slots
    assert [tuple(r) for r in routing.queue_records(route, tiles).tolist()] == records
    return route


# --------------------------------------------------------------------------- top-k and weights
@pytest.mark.parametrize("softmax,renormalize", MODES)
@pytest.mark.parametrize("rows,E,k", [(1, 128, 8), (8, 128, 8), (64, 128, 8), (16, 32, 8), (8, 8, 8), (8, 128, 1)])
def test_topk_random(rows, E, k, softmax, renormalize):
    rng = np.random.default_rng(1000 + rows * E + k)
    logits = (rng.standard_normal((rows, E)) * rng.uniform(0.1, 4.0)).astype(np.float32)
    check_topk(logits, k, softmax, renormalize)


@pytest.mark.parametrize("softmax,renormalize", MODES)
def test_topk_ties_go_to_the_lower_id(softmax, renormalize):
    rng = np.random.default_rng(7)
    logits = (np.round(rng.standard_normal((32, 128)) * 2) / 2).astype(np.float32)
    logits[0] = 0.5  # one big tie: experts 0..k-1
    logits[1, :] = -1.0
    logits[1, [100, 3, 64, 77]] = 2.0  # tied winners, listed in id order
    logits[2, ::2] = -0.0  # -0 and +0 are equal
    logits[2, 1::2] = 0.0
    check_topk(logits, 8, softmax, renormalize)
    ids, _ = routing.topk(torch.from_numpy(logits), 8, softmax=softmax, renormalize=renormalize)
    assert ids[0].tolist() == list(range(8))
    assert ids[1, :4].tolist() == [3, 64, 77, 100]
    assert ids[2].tolist() == list(range(8))


def test_topk_nan_sorts_first():
    logits = np.arange(16, dtype=np.float32)[None, :].repeat(2, 0)
    logits[0, [9, 2]] = np.nan
    ids, w = routing.topk(torch.from_numpy(logits), 4, softmax=False, renormalize=False)
    assert ids[0].tolist() == [2, 9, 15, 14]
    assert torch.isnan(w[0, :2]).all() and not torch.isnan(w[0, 2:]).any()
    assert ids[1].tolist() == [15, 14, 13, 12]


def test_topk_rows_are_independent():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((8, 128)).astype(np.float32)
    for softmax, renormalize in MODES:
        ids, w = routing.topk(torch.from_numpy(logits), 8, softmax=softmax, renormalize=renormalize)
        for r in range(8):
            i1, w1 = routing.topk(torch.from_numpy(logits[r:r + 1]), 8, softmax=softmax, renormalize=renormalize)
            assert torch.equal(i1[0], ids[r]) and torch.equal(w1[0].view(torch.int32), w[r].view(torch.int32))


def test_softmax_weights_cover_only_the_selected_logits():
    logits = np.array([[3.0, 1.0, 2.0, 0.0]], np.float32)
    _, w = routing.topk(torch.from_numpy(logits), 2, softmax=True, renormalize=False)
    e = math.exp(2.0 - 3.0)
    assert w[0].tolist() == [np.float32(1 / (1 + e)), np.float32(e / (1 + e))]


def test_sum_splits_adds_in_split_order():
    rng = np.random.default_rng(5)
    parts = (rng.standard_normal((4, 3, 16)) * 10.0 ** rng.integers(-3, 4, (4, 3, 16))).astype(np.float32)
    got = routing.sum_splits(torch.from_numpy(parts)).numpy()
    want = parts[0].copy()
    for s in range(1, 4):
        for i in np.ndindex(want.shape):
            want[i] = np.float32(want[i] + parts[s][i])
    assert np.array_equal(got.view(np.int32), want.view(np.int32))


# --------------------------------------------------------------------------- finalize and queues
@pytest.mark.parametrize("rows,E,k,tiles", [(1, 128, 8, 12), (8, 128, 8, 16), (64, 128, 8, 3), (64, 8, 4, 2)])
def test_finalize_random(rows, E, k, tiles):
    rng = np.random.default_rng(rows * 31 + E + k)
    ids = np.stack([rng.choice(E, size=k, replace=False) for _ in range(rows)])
    check_finalize(ids, E, tiles)


def test_finalize_every_row_to_the_same_experts():
    ids = np.tile(np.array([[90, 4, 17, 5, 127, 0, 63, 64]]), (64, 1))
    route = check_finalize(ids, 128, 12)
    recs = routing.queue_records(route, 12)
    assert len(recs) == 8 * 12
    assert set(recs[:, record_index(Queue.MOE_UP, "ROWS")].tolist()) == {64}  # no row tiling


def test_finalize_all_experts_hit_fills_the_worst_case_capacity():
    rng = np.random.default_rng(11)
    E, k, tiles = 128, 8, 16
    for rows in (1, 4, 16, 64):
        perm = rng.permutation(E)
        ids = np.stack([perm[(k * r + np.arange(k)) % E] for r in range(rows)])
        route = check_finalize(ids, E, tiles)
        # every entry on an expert of its own (rows*k <= E) or every expert hit
        assert len(routing.queue_records(route, tiles)) == routing.queue_capacity(E, rows * k, tiles)


def test_finalize_one_expert_and_no_rows():
    check_finalize(np.full((16, 1), 5), 128, 4)
    route = check_finalize(np.zeros((0, 8), np.int64), 128, 4)
    assert route.slot.shape == (0, 8) and len(routing.queue_records(route, 4)) == 0


def test_queue_records_follow_the_abi_layout():
    route = routing.finalize(np.array([[2, 0], [2, 1]]), 4)
    recs = routing.queue_records(route, 2)
    for q in (Queue.MOE_UP, Queue.MOE_DOWN):
        assert recs[:, record_index(q, "EXPERT")].tolist() == [0, 0, 1, 1, 2, 2]
        assert recs[:, record_index(q, "N_TILE")].tolist() == [0, 1, 0, 1, 0, 1]
        assert recs[:, record_index(q, "SLOT0")].tolist() == [0, 0, 1, 1, 2, 2]
        assert recs[:, record_index(q, "ROWS")].tolist() == [1, 1, 1, 1, 2, 2]


# --------------------------------------------------------------------------- combine
@pytest.mark.parametrize("k", [1, 3, 8])
def test_combine_is_the_ordered_fp32_sum(k):
    rng = np.random.default_rng(k)
    m, D = 5, 24
    w = rng.random((m, k)).astype(np.float32)
    y = (rng.standard_normal((m, k, D)) * 10.0 ** rng.integers(-4, 5, (m, k, D))).astype(np.float32)
    got = routing.combine(torch.from_numpy(w), torch.from_numpy(y)).numpy()
    want = np.empty((m, D), np.float32)
    for r in range(m):
        for d in range(D):
            acc = np.float32(w[r, 0] * y[r, 0, d])
            for j in range(1, k):
                acc = np.float32(acc + np.float32(w[r, j] * y[r, j, d]))
            want[r, d] = acc
    assert got.dtype == np.float32
    assert np.array_equal(got.view(np.int32), want.view(np.int32))


@pytest.mark.parametrize("softmax,renormalize", MODES)
def test_a_scale_weighs_the_selected_logits_and_keeps_the_ranking(softmax, renormalize):
    """``scale`` (COMBINE_IN's 1 / rms of unnormalised logits): the ids are
    the unscaled logits' ranking, the weights those of the selected logits
    times the row's scale, rounded once to fp32 (the reference scales in
    numpy fp32, then weighs in fp64)."""
    rng = np.random.default_rng(11)
    raw = (rng.standard_normal((6, 64)) * 30.0).astype(np.float32)  # unnormalised: large
    scale = rng.uniform(0.01, 0.2, 6).astype(np.float32)
    ids, w = routing.topk(torch.from_numpy(raw), 8, softmax=softmax, renormalize=renormalize,
                          scale=torch.from_numpy(scale))
    for r in range(6):
        want_ids, _ = ref_topk(raw[r], 8, softmax, renormalize)
        assert ids[r].tolist() == want_ids
        sel = raw[r][want_ids] * scale[r]  # fp32 products
        _, want_w = ref_topk(np.concatenate([sel, np.full(64 - 8, -np.inf, np.float32)]), 8, softmax, renormalize)
        got = w[r].numpy()
        assert np.allclose(got, want_w, rtol=2 ** -23, atol=0), (r, got, want_w)
    # without the scale the weights differ: the scale is applied, not ignored
    _, w0 = routing.topk(torch.from_numpy(raw), 8, softmax=softmax, renormalize=renormalize)
    assert not torch.equal(w0, w)

"""The MoE family: ROUTER_TOPK, ROUTE_FINALIZE, MOE_GATHER, the expert
claimers MOE_UPGATE_DRAIN and MOE_DOWN_DRAIN, and MOE_COMBINE (ROUTER_GEMM
is a GEMM: :mod:`megac.ops.gemm`).

The routing math is :mod:`megac.routing` (the one CPU definition the device
block is checked against): top-k by logit (ties: lower expert id); sigmoid
weights (fp64, rounded once), optionally renormalised; softmax weights over
the k selected logits; ROUTE_FINALIZE assigns slots in (row, k) order and
writes one queue record ``{expert, n_tile, slot0, rows}`` per active expert
(ascending) and tile, and the queue lengths into its target words.

MoE buffers are indexed logically ``[L, expert, row, k, feature]`` in the
access model: the physical slot of (row, k) is a device-chosen permutation,
and the expert dimension lets per-expert counters fall out of region overlap.

Device: ``opcodes/moe_routing.cuh`` (top-k, finalize, gather, combine) and
the GEMM tile for the expert tiles.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from megac import abi, routing
from megac.abi import Flag, H, Op, Queue
from megac.errors import BadTaskError, QueueOverflowError
from megac.ops.base import BF16, BIG, FP32, QUEUE_BUFFER, ClaimerOp, OpDef, SubTasks, at, field, last_of, span
from megac.ops.cpu import idx
from megac.ops.norm import experts_access, norm_in_input, norm_in_of, norm_in_rules
from megac.ops.routed import routed_slots
from megac.sol_bytes import expected_distinct_experts
from megac.weights.layout import tile_gate_up_rows


@lru_cache(maxsize=4096)
def _tile_rows(width: int, chunk: int, n0: int, n1: int):
    """tile_gate_up_rows, once per tile shape (a step claims the same tiles)."""
    return tile_gate_up_rows(width, chunk, n0, n1)


def _ek(geo) -> tuple[int, int]:
    return max(geo.num_experts, 1), max(geo.top_k, 1)


def _queue_buffer(q: int) -> str:
    try:
        return QUEUE_BUFFER[Queue(int(q))]
    except ValueError:
        raise BadTaskError(f"unknown queue id {q}") from None


def expected_active_experts(geo, params) -> int:
    """Experts with at least one routed row per MoE layer: ``params.active_experts``;
    else the expected value over ``rows`` independent rows, ``sum_e 1 - (1 - p_e) ** rows``
    with ``p_e`` the chance a row routes to expert ``e``: ``params.expert_probs``
    when given (skewed routing), else uniform routing's ``k/E`` for every expert,
    ``E * (1 - (1 - k/E) ** rows)``."""
    if params.active_experts is not None:
        return int(params.active_experts)
    E, k, R = geo.num_experts, geo.top_k, geo.rows
    if not E:
        return 0
    touched = expected_distinct_experts(E, k, R, params.expert_probs)
    return max(min(k, E), int(round(touched)))


class RouterTopk(OpDef):
    """Per row: sum the router split-K partials in split order, top-k experts
    and their weights."""

    op = Op.ROUTER_TOPK
    node_kinds = ("topk",)
    ffn_kind = "moe"
    header = "moe_routing.cuh"
    device_fn = "router_topk"

    def flags(self, nt, geo):
        # router_combine: unnormalised logits, the weights scaled here (as ROUTE_FINALIZE's)
        return _router_flags(geo) | (int(Flag.COMBINE_IN) if geo.router_combine else 0)

    def field_rules(self, lim):
        return [("ROW", 0, lim.geo.rows, False), ("NUM_SPLITS", 1, BIG, False),
                ("RESID_SLOT", 0, lim.geo.norm_slots, False)]

    def access(self, acc, w, ix, layer, geo):
        row = field(w, self.op, "ROW")
        E, K = _ek(geo)
        acc.add("router_part", False, ix, at(layer), (0, field(w, self.op, "NUM_SPLITS")), at(row), span(E))
        c = (w[:, H.FLAGS].astype(np.int64) & Flag.COMBINE_IN) != 0  # the weights' 1 / rms
        acc.add("x_resid", False, ix[c], at(field(w[c], self.op, "RESID_SLOT")), at(row[c]), span(geo.hidden))
        for buf in ("topk_ids", "topk_w"):
            acc.add(buf, True, ix, at(layer), at(row), span(K))

    def task_bytes(self, w, geo, params):
        E, K = _ek(geo)
        return field(w, self.op, "NUM_SPLITS") * E * FP32 + 3 * K * FP32

    def run(self, vm, words):
        op = self.op
        vm.require_ffn(words, self)
        for (layer, nsp, slot, flags), ti in vm.groups(words, op, ("NUM_SPLITS", "RESID_SLOT"), flags=True):
            _rank_rows(vm, "ROUTER_TOPK", layer, field(words[ti], op, "ROW"), nsp, flags, resid_slot=slot)


def _router_flags(geo) -> int:
    return int((Flag.SOFTMAX_ROUTER if geo.router_softmax else 0)
               | (Flag.RENORMALIZE if geo.router_renormalize else 0))


def _inv_rms(vm, slot: int, rows: np.ndarray) -> torch.Tensor:
    """1 / rms of ``rows`` of x_resid slot ``slot`` (fp32 ``[len(rows)]``):
    the scale a COMBINE_IN finalize gives the unnormalised logits (the norm
    task's residual, the norm's statistics: rms_norm's mean of squares)."""
    x = vm.st["x_resid"][slot][idx(rows)]
    for r in rows:
        vm.tr.read("x_resid", (slot, int(r), slice(None)))
    return torch.rsqrt(x.pow(2).mean(-1) + vm.eps)


def _rank_rows(vm, who: str, layer: int, rows: np.ndarray, nsp: int, flags: int,
               write_ids: bool = True, write_weights: bool = True, resid_slot: int = 0) -> np.ndarray:
    """``topk_ids`` / ``topk_w`` of ``rows``: their router logits (the first
    ``nsp`` split-K partials summed in split order) ranked (megac.routing).
    ROUTER_TOPK per row; or ROUTE_FINALIZE for every row with fused_topk,
    which keeps the ids to itself (``write_ids=False``: nothing after it reads
    them); or a routed up claimer, which writes nothing (``write_weights=False``
    too). Flagged COMBINE_IN, the partials are unnormalised: the weights
    take 1 / rms of x_resid slot ``resid_slot``'s rows (``_inv_rms``).
    Returns the ids ``[len(rows), K]`` (int64)."""
    st, K = vm.st, vm.geo.top_k
    if not 1 <= nsp <= st["router_part"].shape[1]:
        raise BadTaskError(f"{who}: NUM_SPLITS outside router_part", layer=layer)
    rt = idx(rows)
    for r in rows:
        vm.tr.read("router_part", (layer, slice(0, nsp), int(r), slice(None)))
    logit = routing.sum_splits(st["router_part"][layer, :nsp][:, rt])
    scale = None
    if flags & Flag.COMBINE_IN:
        if not 0 <= resid_slot < vm.geo.norm_slots:
            raise BadTaskError(f"{who}: RESID_SLOT outside the norm slots", layer=layer)
        scale = _inv_rms(vm, resid_slot, rows)
    ids, wts = routing.topk(logit, K, softmax=bool(flags & Flag.SOFTMAX_ROUTER),
                            renormalize=bool(flags & Flag.RENORMALIZE), scale=scale)
    for r in rows:
        if write_ids:
            vm.tr.write("topk_ids", (layer, int(r), slice(None)))
        if write_weights:
            vm.tr.write("topk_w", (layer, int(r), slice(None)))
    if write_ids:
        st["topk_ids"][layer, rt] = ids.to(torch.int32)
    if write_weights:
        st["topk_w"][layer, rt] = wts
    return ids.numpy().astype(np.int64)


class RouteFinalize(OpDef):
    """Per layer, on the device: per-expert counts -> offsets -> slot map ->
    the MoE up/down queues and their lengths (target words; no up queue with
    UP_COUNT_WORD -1: routed claims derive it themselves). With
    TOPK_SPLITS > 0 (the target's fused_topk) it first ranks every row's
    experts from the router partials, as ROUTER_TOPK would; with X_SLOT >= 0
    (fused_gather) it then copies the rows to their slots, as MOE_GATHER
    would."""

    op = Op.ROUTE_FINALIZE
    node_kinds = ("route_finalize",)
    ffn_kind = "moe"
    header = "moe_routing.cuh"
    device_fn = "route_finalize"

    def flags(self, nt, geo):
        if not geo.fused_topk:
            return 0
        # router_combine: unnormalised logits, the weights scaled here
        return _router_flags(geo) | (int(Flag.COMBINE_IN) if geo.router_combine else 0)

    def field_rules(self, lim):
        g, tw = lim.geo, lim.tw
        if not g.num_experts:
            return None

        def word_of(fn):
            def lo(sub):
                return np.array([fn(int(l)) for l in sub[:, H.LAYER]], dtype=np.int64)

            return lo

        up_w, down_w = word_of((lambda l: -1) if g.routed_claims else tw.moe_up_count), word_of(tw.moe_down_count)
        return [
            # the device emits UP_TILES records per active expert: the count
            # the claimed tasks' waiters expect (geometry.up_tiles)
            ("UP_TILES", g.up_tiles, g.up_tiles + 1, False),
            # split_down: the count is of the up claims (they write moe_out), no down queue
            ("DOWN_TILES", *((g.up_tiles, g.up_tiles + 1) if g.split_down else (g.down_tiles, g.down_tiles + 1)),
             False),
            ("UP_COUNT_WORD", up_w, lambda sub: up_w(sub) + 1, False),
            ("DOWN_COUNT_WORD", down_w, lambda sub: down_w(sub) + 1, False),
            ("UP_QUEUE", int(Queue.MOE_UP), int(Queue.MOE_UP) + 1, False),
            ("DOWN_QUEUE", *((-1, 0) if g.split_down else (int(Queue.MOE_DOWN), int(Queue.MOE_DOWN) + 1)), False),
            ("NUM_ROWS", 1, g.rows + 1, False),
            ("TOPK_SPLITS", g.finalize_topk_splits, g.finalize_topk_splits + 1, False),
            ("RESID_SLOT", 0, g.norm_slots, False),
        ]

    def access(self, acc, w, ix, layer, geo):
        E, K = _ek(geo)
        n = field(w, self.op, "NUM_ROWS")
        if geo.fused_topk:  # ranks the rows first (TOPK_SPLITS: the router's split count)
            acc.add("router_part", False, ix, at(layer), (0, field(w, self.op, "TOPK_SPLITS")), (0, n), span(E))
            acc.add("topk_w", True, ix, at(layer), (0, n), span(K))  # the ids stay in the task
            c = (w[:, H.FLAGS].astype(np.int64) & Flag.COMBINE_IN) != 0  # the weights' 1 / rms
            acc.add("x_resid", False, ix[c], at(field(w[c], self.op, "RESID_SLOT")), (0, n[c]), span(geo.hidden))
        else:  # the top-k tasks' output
            acc.add("topk_ids", False, ix, at(layer), (0, n), span(K))
        if geo.fused_gather:  # then copies the rows to their slots (as MOE_GATHER)
            acc.add("x_norm", False, ix, at(field(w, self.op, "X_SLOT")), (0, n), span(geo.hidden))
            acc.add("moe_x", True, ix, at(layer), span(E), (0, n), span(K), span(geo.hidden))
        acc.add("route_slot", True, ix, at(layer), (0, n), span(K))
        up = field(w, self.op, "UP_COUNT_WORD") >= 0  # else routed claims: no up queue
        acc.add("moe_up_queue", True, ix[up], at(layer[up]))
        down = field(w, self.op, "DOWN_QUEUE") >= 0  # else split_down: the count alone
        acc.add("moe_down_queue", True, ix[down], at(layer[down]))
        acc.add("target_word", True, ix[up], at(field(w, self.op, "UP_COUNT_WORD")[up]))
        acc.add("target_word", True, ix, at(field(w, self.op, "DOWN_COUNT_WORD")))

    def task_bytes(self, w, geo, params):
        E, K = _ek(geo)
        ranked = geo.rows * (field(w, self.op, "TOPK_SPLITS") * E * FP32 + K * FP32)
        if geo.fused_gather:
            ranked = ranked + geo.rows * geo.hidden * BF16 * (1 + K)
        return ranked + np.full(len(w), geo.rows * K * 3 * FP32 + 2 * abi.QUEUE_RECORD_WORDS * 4 * geo.moe_queue_cap,
                                dtype=np.float64)

    def run(self, vm, words):
        op, st, geo = self.op, vm.st, vm.geo
        vm.require_ffn(words, self)
        E, K = geo.num_experts, geo.top_k
        for i in range(len(words)):
            w = words[i: i + 1]
            layer = int(w[0, H.LAYER])
            n = int(field(w, op, "NUM_ROWS")[0])
            up_t, down_t = int(field(w, op, "UP_TILES")[0]), int(field(w, op, "DOWN_TILES")[0])
            dq_id = int(field(w, op, "DOWN_QUEUE")[0])
            uq, dq = _queue_buffer(field(w, op, "UP_QUEUE")[0]), (_queue_buffer(dq_id) if dq_id >= 0 else None)
            uw, dw = int(field(w, op, "UP_COUNT_WORD")[0]), int(field(w, op, "DOWN_COUNT_WORD")[0])
            if not 0 <= n <= vm.R:
                raise BadTaskError("ROUTE_FINALIZE: NUM_ROWS outside the batch", layer=layer)
            nsp = int(field(w, op, "TOPK_SPLITS")[0])
            ranked = None
            if nsp:
                ranked = _rank_rows(vm, "ROUTE_FINALIZE", layer, np.arange(n), nsp, int(w[0, H.FLAGS]),
                                    write_ids=False, resid_slot=int(field(w, op, "RESID_SLOT")[0]))
            for word in ((uw, dw) if uw >= 0 else (dw,)):  # uw -1: routed claims, no up queue
                if not st.tw.host_words <= word < len(vm.targets):
                    raise BadTaskError(f"ROUTE_FINALIZE: count word {word} outside the device target words",
                                       layer=layer)
            if ranked is None:
                vm.tr.read("topk_ids", (layer, slice(0, n), slice(None)))
                flat = st.np["topk_ids"][layer, :n].reshape(-1).astype(np.int64)
            else:
                flat = ranked.reshape(-1)
            if ((flat < 0) | (flat >= E)).any():
                raise BadTaskError("ROUTE_FINALIZE: expert id out of range", layer=layer, buffer="topk_ids")
            route = routing.finalize(flat.reshape(n, K), E)
            vm.tr.write("route_slot", (layer, slice(0, n), slice(None)))
            st.np["route_slot"][layer, :n] = route.slot
            xs = int(field(w, op, "X_SLOT")[0])
            if xs >= 0:
                _gather_rows(vm, self, layer, vm.x_slot(op, xs, layer), np.arange(n), read_slots=False)
            for qname, tiles, word in ((uq, up_t, uw), (dq, down_t, dw))[0 if uw >= 0 else 1:]:
                recs = routing.queue_records(route, tiles)
                if qname is not None:  # None: split_down's count alone
                    qb = st.np[qname]
                    if len(recs) > qb.shape[1]:
                        raise QueueOverflowError(f"ROUTE_FINALIZE layer {layer}: {len(recs)} records for "
                                                 f"{qname} (capacity {qb.shape[1]})", layer=layer, buffer=qname)
                    vm.tr.write(qname, (layer, slice(0, len(recs))))
                    qb[layer, : len(recs)] = recs
                vm.tr.write("targets", (word,))
                vm.targets[word] = len(recs)


class MoeGather(OpDef):
    """Copy a row's normed activations to its routed slots of ``moe_x``."""

    op = Op.MOE_GATHER
    node_kinds = ("moe_gather",)
    ffn_kind = "moe"
    header = "moe_routing.cuh"
    device_fn = "moe_gather"

    def field_rules(self, lim):
        return [("ROW", 0, lim.geo.rows, False)]

    def access(self, acc, w, ix, layer, geo):
        row = field(w, self.op, "ROW")
        E, K = _ek(geo)
        acc.add("x_norm", False, ix, at(field(w, self.op, "X_SLOT")), at(row), span(geo.hidden))
        acc.add("route_slot", False, ix, at(layer), at(row), span(K))
        acc.add("moe_x", True, ix, at(layer), span(E), at(row), span(K), span(geo.hidden))

    def task_bytes(self, w, geo, params):
        return np.full(len(w), geo.hidden * BF16 * (1 + max(geo.top_k, 1)), dtype=np.float64)

    def run(self, vm, words):
        op = self.op
        vm.require_ffn(words, self)
        for (layer, xs), ti in vm.groups(words, op, ("X_SLOT",)):
            _gather_rows(vm, self, layer, vm.x_slot(op, xs, layer), field(words[ti], op, "ROW"))


def _gather_rows(vm, d: OpDef, layer: int, xs: int, rows: np.ndarray, read_slots: bool = True) -> None:
    """``moe_x[slot] = x_norm[xs, row]`` for each routed slot of ``rows``:
    MOE_GATHER per row, or ROUTE_FINALIZE for every row with fused_gather
    (which wrote the slots itself: ``read_slots=False``)."""
    st = vm.st
    for r in rows:
        if read_slots:
            vm.tr.read("route_slot", (layer, int(r), slice(None)))
        vm.tr.read("x_norm", (xs, int(r), slice(None)))
    slots = routed_slots(vm, d, layer, rows, "moe_x")  # [m, K]
    for j in range(len(rows)):
        vm.tr.write("moe_x", (layer, slots[j], slice(None)))
    x = st["x_norm"][xs, idx(rows)]  # [m, D]
    st["moe_x"][layer, idx(slots.reshape(-1))] = x.repeat_interleave(slots.shape[1], dim=0)


class MoeCombine(OpDef):
    """Per row, features ``[COL0, COL0 + COLS)``: the score-weighted sum of
    its experts' outputs in k order (fp32) into ``ffn_part[layer, 0]``.
    Flagged SPLIT_DOWN (geometry ``split_down``): each expert output is first
    the sum of its ``moe_out_tiles`` split-K partials, in tile order, and a
    row's features are spread over ``combine_splits`` tasks."""

    op = Op.MOE_COMBINE
    node_kinds = ("moe_combine",)
    ffn_kind = "moe"
    header = "moe_routing.cuh"
    device_fn = "moe_combine"

    def field_rules(self, lim):
        D = lim.geo.hidden
        return [("ROW", 0, lim.geo.rows, False), ("COL0", 0, D, False),
                ("COLS", 1, lambda sub: D - field(sub, self.op, "COL0") + 1, False)]

    def flags(self, nt, geo):
        return int(Flag.SPLIT_DOWN) if geo.split_down else 0

    def access(self, acc, w, ix, layer, geo):
        row = field(w, self.op, "ROW")
        E, K = _ek(geo)
        D = geo.hidden
        c0 = field(w, self.op, "COL0")
        c1 = c0 + field(w, self.op, "COLS")
        # every tile's run of the columns: one box over the tiles (each claim writes whole rows)
        T = _combined_tiles(geo)
        acc.add("moe_out", False, ix, at(layer), span(E), at(row), span(K), (c0, (T - 1) * D + c1))
        acc.add("topk_w", False, ix, at(layer), at(row), span(K))
        acc.add("route_slot", False, ix, at(layer), at(row), span(K))
        acc.add("ffn_part", True, ix, at(layer), at(0), at(row), (c0, c1))

    def task_bytes(self, w, geo, params):
        T = _combined_tiles(geo)
        cols = field(w, self.op, "COLS").astype(np.float64)
        return max(geo.top_k, 1) * T * cols * FP32 + cols * FP32

    def run(self, vm, words):
        op, st = self.op, vm.st
        vm.require_ffn(words, self)
        D = vm.geo.hidden
        for (layer, c0, cols, flags), ti in vm.groups(words, op, ("COL0", "COLS"), flags=True):
            split = bool(flags & Flag.SPLIT_DOWN)
            if split and not vm.geo.split_down:
                raise BadTaskError("MOE_COMBINE: SPLIT_DOWN in a schedule whose up claims write no split-K "
                                   "partials", layer=layer)
            if c0 < 0 or cols < 1 or c0 + cols > D or c0 % 4 or cols % 4:
                raise BadTaskError(f"MOE_COMBINE: columns [{c0}, {c0 + cols}) outside the hidden size {D} "
                                   f"or not in 4s", layer=layer)
            T = vm.geo.moe_out_tiles if split else 1
            rows = field(words[ti], op, "ROW")
            for r in rows:
                vm.tr.read("route_slot", (layer, int(r), slice(None)))
                vm.tr.read("topk_w", (layer, int(r), slice(None)))
            slots = routed_slots(vm, self, layer, rows, "moe_out")
            for j in range(len(rows)):
                for t in range(T):
                    vm.tr.read("moe_out", (layer, slots[j], slice(t * D + c0, t * D + c0 + cols)))
            wts = st["topk_w"][layer, idx(rows)]  # [m, K]
            y = sum_tiles(st["moe_out"][layer][idx(slots)], D, T, c0, cols)  # [m, K, cols]
            acc = routing.combine(wts, y)
            for r in rows:
                vm.tr.write("ffn_part", (layer, 0, int(r), slice(c0, c0 + cols)))
            st["ffn_part"][layer, 0, idx(rows), c0:c0 + cols] = acc


def _combined_tiles(geo) -> int:
    """moe_out tiles a combine sums: every split-K tile where the up claims
    write them (split_down), else the one output."""
    return geo.moe_out_tiles if geo.split_down else 1


def sum_tiles(y, D: int, tiles: int, c0: int = 0, cols: int | None = None):
    """``y [..., >= tiles * D]`` -> the sum over its first ``tiles`` runs of
    ``D`` features of features ``[c0, c0 + cols)`` of each run (all ``D``
    by default), in tile order (fp32, one add at a time, as the device)."""
    cols = D - c0 if cols is None else cols
    out = y[..., c0:c0 + cols]
    for t in range(1, tiles):
        out = out + y[..., t * D + c0:t * D + c0 + cols]
    return out


class _ExpertDrain(ClaimerOp):
    """What the two expert claimers share: records ``{expert, n_tile, slot0,
    rows}`` written by ROUTE_FINALIZE, one per (active expert, tile)."""

    ffn_kind = "moe"
    header = "gemm_tile.cuh"

    def tiles(self, geo) -> int:
        raise NotImplementedError

    def subtasks(self, layer, geo, merged=False):
        tiles = self.tiles(geo)
        e, t = np.meshgrid(np.arange(geo.num_experts), np.arange(1 if merged else tiles), indexing="ij")
        e, t = e.ravel(), t.ravel()
        fields = {"EXPERT": e, "N_TILE": t, "N_TILE_HI": np.full_like(t, tiles) if merged else t + 1}
        woff, soff = self._offsets_of(e, geo)
        return SubTasks(self.queue, layer, fields, wait_offset=woff, signal_offset=soff)

    def _offsets_of(self, experts: np.ndarray, geo) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def offsets(self, records, geo):
        return self._offsets_of(records[:, abi.record_index(self.queue, "EXPERT")].astype(np.int64), geo)

    def records(self, vm, records, layer):
        Q = self.queue
        r = records.astype(np.int64)
        e, t = r[:, abi.record_index(Q, "EXPERT")], r[:, abi.record_index(Q, "N_TILE")]
        s0, nr = r[:, abi.record_index(Q, "SLOT0")], r[:, abi.record_index(Q, "ROWS")]
        cap = vm.st["moe_x"].shape[1]
        if ((e < 0) | (e >= vm.geo.num_experts) | (s0 < 0) | (nr < 0) | (s0 + nr > cap) | (t < 0)).any():
            raise BadTaskError(f"{Q.name} record out of range", layer=layer)
        return e, t, s0, nr


#: MOE_UPGATE_DRAIN's routed-claims fields (abi.py; the device's MEGAC_ROUTED_CLAIMS)
ROUTED_FIELDS = ("ROUTE_SPLITS", "NUM_ROWS", "UP_TILES", "X_SLOT")


class MoeUpgateDrain(_ExpertDrain):
    """Claimer of expert gate+up tiles with SiLU*up into ``moe_act``. A claimed
    task waits ``TASK_WAIT_BASE`` (the gathered rows; none with fused_gather,
    where the finalize task the claimer waits on wrote them) and signals
    ``TASK_SIGNAL_BASE + expert``.

    Routed claims (ROUTE_SPLITS > 0; geometry's ``routed_claims``): the
    claimer waits on the router GEMM, ranks rows 0..NUM_ROWS-1 itself as
    ROUTE_FINALIZE does and claims from the records it derives (the ones
    finalize writes to the up queue: ``routing.queue_records`` with UP_TILES
    tiles per active expert), writing nothing but the tiles; a claimed tile
    reads its rows from x_norm slot X_SLOT (the rows of its slots) and waits
    on nothing (the router's counter orders x_norm: the router read it).

    Flagged NORM_IN and ADD_MOE (the up_combine tile: a routed claimer of
    one row whose router folds the combine, ``Geometry.up_combined``) a
    claimed tile stages the norm that writes X_SLOT itself from its NORM_*
    fields, the experts of NORM_LAYER added (``norm_in_input``: the norm
    task's bits), and still waits on nothing: the router's counter orders
    every plane that norm adds (the router's tiles added them)."""

    op = Op.MOE_UPGATE_DRAIN
    node_kinds = ("moe_upgate",)
    device_fn = "moe_upgate_drain"
    queue = Queue.MOE_UP

    def tiles(self, geo):
        return geo.up_tiles

    def _offsets_of(self, experts, geo):
        # split_down: one counter for the layer's combine (every tile of every expert)
        return np.zeros_like(experts), (np.zeros_like(experts) if geo.split_down else experts.copy())

    def flags(self, nt, geo):
        return ((_router_flags(geo) if geo.routed_claims else 0)
                | (int(Flag.SPLIT_DOWN) if geo.split_down else 0)
                | (int(Flag.NORM_IN | Flag.ADD_MOE) if geo.up_combined(nt.layer) else 0))

    def field_rules(self, lim):
        g, C = lim.geo, lim.num_counters
        if not g.num_experts:
            return None
        if g.routed_claims:
            def x_slot(sub):
                return np.array([g.norm_input_slot(int(l)) for l in sub[:, H.LAYER]], dtype=np.int64)

            routed = [("QUEUE_LEN", 0, 1, False),
                      ("ROUTE_SPLITS", g.router_splits, g.router_splits + 1, False),
                      ("NUM_ROWS", g.rows, g.rows + 1, False),
                      ("UP_TILES", g.up_tiles, g.up_tiles + 1, False),
                      ("X_SLOT", x_slot, lambda sub: x_slot(sub) + 1, False)]
        else:
            routed = [("QUEUE_LEN", 0, BIG, True), *[(name, 0, 1, False) for name in ROUTED_FIELDS]]
        if g.router_combine:  # a combining layer's claims wait on the norm writing their rows (others as below)
            task_wait = [("TASK_WAIT_BASE", -1, C, False), ("TASK_WAIT_TARGET", 0, BIG, True)]
        elif g.fused_gather or g.routed_claims:
            # with the gather inside ROUTE_FINALIZE (fused_gather) the claimer's
            # own wait on the queue length already covers the rows, and a routed
            # claimer's wait on the router covers x_norm: no task wait
            task_wait = [("TASK_WAIT_BASE", -1, 0, False), ("TASK_WAIT_TARGET", 0, 1, False)]
        else:
            task_wait = [("TASK_WAIT_BASE", 0, C, False), ("TASK_WAIT_TARGET", 1, BIG, True)]
        return [
            ("QUEUE", int(Queue.MOE_UP), int(Queue.MOE_UP) + 1, False),
            *routed,
            *task_wait,
            ("TASK_SIGNAL_BASE", 0, C, False),
            (last_of(self.op, "TASK_SIGNAL_BASE", self.signal_span(g)), 0, C, False),
            ("N_LEN", 1, 2 * g.expert_width + 1, False),
            *norm_in_rules(lim),
        ]

    def access(self, acc, w, idx, layer, geo):
        if not geo.routed_claims:
            return super().access(acc, w, idx, layer, geo)
        E, _ = _ek(geo)
        # the ranking's input: every routed row's router partials (no queue)
        acc.add("router_part", False, idx, at(layer), (0, field(w, self.op, "ROUTE_SPLITS")),
                (0, field(w, self.op, "NUM_ROWS")), span(E))
        # where the router folds the norm (NORM_IN) it no longer orders the
        # claims after the norm task that writes their rows: the claimer
        # waits on it itself, a header wait (routed claims have no task wait)
        # (where the router folds the combine (router_combine) the claims wait on the norm
        # themselves, after the ranking: the norm ends after the router there)
        f = np.array([geo.folded(int(l)) and not geo.router_combined(int(l)) for l in layer], dtype=bool)
        if f.any():
            slot = np.array([geo.norm_input_slot(int(l)) for l in layer[f]], dtype=np.int64)
            acc.add("x_norm", False, idx[f], at(slot), span(geo.rows), span(geo.hidden))

    def subtask_access(self, acc, sub, geo):
        m = len(sub)
        t = np.arange(m, dtype=np.int64)
        layer = np.full(m, sub.layer, dtype=np.int64)
        R, K = geo.rows, max(geo.top_k, 1)
        e, n = sub.fields["EXPERT"], sub.fields["N_TILE"]
        n_hi = sub.fields.get("N_TILE_HI", n + 1)
        half = geo.moe_up_bn // 2
        c0 = n * half
        c1 = np.minimum(n_hi * half, geo.expert_width)
        if geo.up_combined(sub.layer):  # the planes of the norm it folds (every row: the scale)
            D, nl = geo.hidden, sub.layer - 1
            acc.add("x_resid", False, t, at(geo.resid_in_slot("norm", nl)), span(R), span(D))
            acc.add("o_part", False, t, at(np.full(m, nl, dtype=np.int64)), (0, geo.kv_heads), span(R), span(D))
            experts_access(acc, t, np.full(m, nl, dtype=np.int64), geo, span(D))
        elif geo.routed_claims:  # the rows where they lie (any of them: the routing picks)
            acc.add("x_norm", False, t, at(geo.norm_input_slot(sub.layer)), span(R), span(geo.hidden))
        else:
            acc.add("moe_x", False, t, at(layer), at(e), span(R), span(K), span(geo.hidden))
        if geo.split_down:  # tile n's split-K partial of the expert's output
            D = geo.hidden
            acc.add("moe_out", True, t, at(layer), at(e), span(R), span(K), (n * D, n_hi * D))
        else:
            acc.add("moe_act", True, t, at(layer), at(e), span(R), span(K), (c0, c1))

    def routed_queue(self, vm, cw):
        """Routed claims: the records claimer ``cw`` derives (int64 ``[m, 4]``),
        as ROUTE_FINALIZE would write them; None for a claimer that reads the
        queue. Keeps each slot's row for the claimed tiles (``vm.routed_rows``)."""
        op = self.op
        nsp = int(cw[abi.field_index(op, "ROUTE_SPLITS")])
        if nsp == 0:
            return None
        layer = int(cw[H.LAYER])
        vm.require_ffn(cw[None, :], self)
        n, tiles = int(cw[abi.field_index(op, "NUM_ROWS")]), int(cw[abi.field_index(op, "UP_TILES")])
        xs = vm.x_slot(op, int(cw[abi.field_index(op, "X_SLOT")]), layer)
        if not 1 <= n <= vm.R or tiles < 1:
            raise BadTaskError(f"MOE_UPGATE_DRAIN: routed NUM_ROWS {n} / UP_TILES {tiles} out of range", layer=layer)
        ids = _rank_rows(vm, op.name, layer, np.arange(n), nsp, int(cw[H.FLAGS]), write_ids=False,
                         write_weights=False)
        route = routing.finalize(ids, vm.geo.num_experts)
        rows_of = np.empty(route.slot.size, dtype=np.int64)
        rows_of[route.slot.reshape(-1)] = np.repeat(np.arange(n, dtype=np.int64), ids.shape[1])
        vm.routed_rows[layer] = (xs, rows_of)
        return routing.queue_records(route, tiles).astype(np.int64)

    def _x_of(self, vm, cw, layer: int) -> str:
        """The buffer a routed claimer's tiles read their rows from (the
        claimer has ranked: ``vm.routed_rows``): x_norm, or flagged NORM_IN
        the folded norm's output for its X_SLOT (``norm_in_input``, its reads
        tracked; with ADD_MOE only, and one row: the device stages the tile's
        rows 0.. of that norm, which are its routed rows only then)."""
        fold = norm_in_of(vm, self.op, cw[None, :])
        if fold is None:
            return "x_norm"
        if not fold[4] or int(cw[abi.field_index(self.op, "NUM_ROWS")]) != 1:
            raise BadTaskError("MOE_UPGATE_DRAIN: NORM_IN on a routed claimer needs ADD_MOE and NUM_ROWS 1",
                               layer=layer)
        return norm_in_input(vm, vm.routed_rows[layer][0], fold, self)

    def signal_span(self, geo):
        return 1 if geo.split_down else max(geo.num_experts, 1)

    def signal_count(self, layer, offset, geo):
        if geo.split_down:  # every claimed tile; ROUTE_FINALIZE counts them (its DOWN_TILES = up_tiles)
            return abi.dyn(geo.target_words.moe_down_count(layer))
        return geo.up_tiles  # per active expert

    def claimed_work(self, geo, params):
        act = expected_active_experts(geo, params)
        rows_per_expert = geo.rows * geo.top_k / max(act, 1)
        b = geo.moe_up_bn * geo.hidden * BF16 + rows_per_expert * (geo.hidden + geo.moe_up_bn // 2) * BF16
        if geo.split_down:  # its features' down columns, the partial written in fp32
            b += geo.moe_up_bn // 2 * geo.hidden * BF16 + rows_per_expert * geo.hidden * FP32
        return act * geo.up_tiles, float(b)

    def run_claimed(self, vm, cw, records):
        layer = int(cw[H.LAYER])
        vm.require_ffn(cw[None, :], self)
        routed = int(cw[abi.field_index(self.op, "ROUTE_SPLITS")]) > 0
        if not routed and int(cw[H.FLAGS]) & Flag.NORM_IN:
            raise BadTaskError("MOE_UPGATE_DRAIN: NORM_IN on a claimer of the queue (only routed claims fold "
                               "the norm)", layer=layer)
        if routed and layer not in vm.routed_rows:
            raise BadTaskError("MOE_UPGATE_DRAIN: a routed record claimed before its claimer ranked the rows",
                               layer=layer)
        nlen = int(cw[abi.field_index(self.op, "N_LEN")])
        st, geo = vm.st, vm.geo
        ew = geo.expert_width
        chunk = st.weights.moe_chunk
        if nlen <= 0 or nlen % (2 * chunk):
            raise BadTaskError(f"MOE_UPGATE_DRAIN: N_LEN {nlen} does not match the expert gate/up interleave "
                               f"(whole chunks of {chunk})", layer=layer)
        W = st.w("w_moe_upgate")[vm.slot(layer)]  # [E, 2ew, D]
        split = bool(int(cw[H.FLAGS]) & Flag.SPLIT_DOWN)
        if split and not geo.split_down:
            raise BadTaskError("MOE_UPGATE_DRAIN: SPLIT_DOWN in a schedule without split-K down partials",
                               layer=layer)
        Wd = st.w("w_moe_down")[vm.slot(layer)] if split else None  # [E, D, ew]
        D, out = geo.hidden, st["moe_out"]
        e, t, s0, nr = self.records(vm, records, layer)
        act = st["moe_act"]
        xbuf = self._x_of(vm, cw, layer) if routed else "moe_x"
        for i in range(len(records)):
            n0 = int(t[i]) * nlen
            n1 = min(n0 + nlen, 2 * ew)
            if n0 >= n1:
                raise BadTaskError(f"MOE_UPGATE_DRAIN: N_TILE {int(t[i])} outside the expert", layer=layer)
            h, c0 = (n1 - n0) // 2, n0 // 2
            pair = _tile_rows(ew, chunk, n0, n1)
            if pair is None:
                raise BadTaskError(f"MOE_UPGATE_DRAIN: tile rows {n0}..{n1} are not whole gate/up chunks of {chunk}",
                                   layer=layer)
            g, u = pair
            slots = range(int(s0[i]), int(s0[i] + nr[i]))
            if routed:  # each slot's row, where it lies in x_norm
                xs, rows_of = vm.routed_rows[layer]
                if int(s0[i] + nr[i]) > len(rows_of):
                    raise BadTaskError("MOE_UPGATE_DRAIN: routed record past the routed slots", layer=layer)
                if xbuf == "x_norm":  # (a folded norm's reads were tracked by _x_of)
                    for s in slots:
                        vm.tr.read("x_norm", (xs, int(rows_of[s]), slice(None)))
            else:
                vm.tr.read("moe_x", (layer, slice(int(s0[i]), int(s0[i] + nr[i])), slice(None)))
            for s in slots:
                if routed:
                    y = vm.slot_product(("moe_up", layer, int(e[i]), s), xbuf, xs, int(rows_of[s]),
                                        W[int(e[i])])
                else:
                    y = vm.slot_product(("moe_up", layer, int(e[i]), s), "moe_x", layer, s, W[int(e[i])])
                yt = y[n0:n1]
                a = (F.silu(yt[g]) * yt[u]).to(act.dtype)
                if split:  # the tile's features times their down columns: its partial of the output
                    ti = int(t[i])
                    if (ti + 1) * D > out.shape[2]:
                        raise BadTaskError(f"MOE_UPGATE_DRAIN: N_TILE {ti} past moe_out's tiles", layer=layer)
                    out[layer, s, ti * D:(ti + 1) * D] = F.linear(a.float()[None], Wd[int(e[i])][:, c0:c0 + h])[0]
                else:
                    act[layer, s, c0:c0 + h] = a
            rs = slice(int(s0[i]), int(s0[i] + nr[i]))
            if split:
                vm.tr.write("moe_out", (layer, rs, slice(int(t[i]) * D, (int(t[i]) + 1) * D)))
            else:
                vm.tr.write("moe_act", (layer, rs, slice(c0, c0 + h)))


class MoeDownDrain(_ExpertDrain):
    """Claimer of expert down tiles into fp32 ``moe_out``. A claimed task waits
    ``TASK_WAIT_BASE + expert`` and signals ``TASK_SIGNAL_BASE``."""

    op = Op.MOE_DOWN_DRAIN
    node_kinds = ("moe_down",)
    device_fn = "moe_down_drain"
    queue = Queue.MOE_DOWN

    def tiles(self, geo):
        return geo.down_tiles

    def _offsets_of(self, experts, geo):
        return experts.copy(), np.zeros_like(experts)

    def field_rules(self, lim):
        g, C = lim.geo, lim.num_counters
        if not g.num_experts:
            return None
        return [
            ("QUEUE", int(Queue.MOE_DOWN), int(Queue.MOE_DOWN) + 1, False),
            ("QUEUE_LEN", 0, BIG, True),
            ("TASK_WAIT_BASE", 0, C, False),
            (last_of(self.op, "TASK_WAIT_BASE", g.num_experts), 0, C, False),
            ("TASK_WAIT_TARGET", 1, BIG, True),
            ("TASK_SIGNAL_BASE", 0, C, False),
            ("N_LEN", 1, g.hidden + 1, False),
        ]

    def subtask_access(self, acc, sub, geo):
        m = len(sub)
        t = np.arange(m, dtype=np.int64)
        layer = np.full(m, sub.layer, dtype=np.int64)
        R, K = geo.rows, max(geo.top_k, 1)
        e, n = sub.fields["EXPERT"], sub.fields["N_TILE"]
        n_hi = sub.fields.get("N_TILE_HI", n + 1)
        c0 = n * geo.moe_down_bn
        c1 = np.minimum(n_hi * geo.moe_down_bn, geo.hidden)
        acc.add("moe_act", False, t, at(layer), at(e), span(R), span(K), span(max(geo.expert_width, 1)))
        acc.add("moe_out", True, t, at(layer), at(e), span(R), span(K), (c0, c1))

    def signal_span(self, geo):
        return 1

    def signal_count(self, layer, offset, geo):
        if geo.fused_combine or ((geo.router_combine or geo.qkv_combine) and geo.rows == 1):
            # one row (fused_combine_at, router_combine, qkv_combine): its top-k experts are the layer's active
            # experts, so the count is known here (a waiter then needs no wait on its writer)
            return min(geo.num_experts, geo.top_k) * geo.down_tiles
        return abi.dyn(geo.target_words.moe_down_count(layer))

    def claimed_work(self, geo, params):
        act = expected_active_experts(geo, params)
        rows_per_expert = geo.rows * geo.top_k / max(act, 1)
        b = geo.moe_down_bn * geo.expert_width * BF16 + rows_per_expert * (geo.expert_width * BF16
                                                                           + geo.moe_down_bn * FP32)
        return act * geo.down_tiles, float(b)

    def run_claimed(self, vm, cw, records):
        layer = int(cw[H.LAYER])
        vm.require_ffn(cw[None, :], self)
        nlen = int(cw[abi.field_index(self.op, "N_LEN")])
        st, geo = vm.st, vm.geo
        W = st.w("w_moe_down")[vm.slot(layer)]  # [E, D, ew]
        e, t, s0, nr = self.records(vm, records, layer)
        out = st["moe_out"]
        for i in range(len(records)):
            n0 = int(t[i]) * nlen
            n1 = min(n0 + nlen, geo.hidden)
            if n0 >= n1:
                raise BadTaskError(f"MOE_DOWN_DRAIN: N_TILE {int(t[i])} outside the hidden size", layer=layer)
            vm.tr.read("moe_act", (layer, slice(int(s0[i]), int(s0[i] + nr[i])), slice(None)))
            for s in range(int(s0[i]), int(s0[i] + nr[i])):
                y = vm.slot_product(("moe_down", layer, int(e[i]), s), "moe_act", layer, s, W[int(e[i])])
                out[layer, s, n0:n1] = y[n0:n1]
            vm.tr.write("moe_out", (layer, slice(int(s0[i]), int(s0[i] + nr[i])), slice(n0, n1)))


MOE_OPS = (RouterTopk(), RouteFinalize(), MoeGather(), MoeUpgateDrain(), MoeDownDrain(), MoeCombine())

__all__ = ["MOE_OPS", "MoeCombine", "MoeDownDrain", "MoeGather", "MoeUpgateDrain", "RouteFinalize", "RouterTopk",
           "expected_active_experts"]

"""Pass ``tile``: op node -> tiles (one future task each).

Each op node becomes a set of tiles with named coordinates (the opcode field
names of ``megac.abi``; ``select`` encodes them) and, for the coverage
check, the box each tile produces in the node's output space.

Tiling (sizes from :class:`~megac.geometry.Geometry`):

=================  =========================================================
qkv                per Q head, K head, V head: head_dim / qkv_bn tiles of
                   qkv_bn columns (N_LEN; one tile per head by default,
                   K = hidden); output space: the fused qkv columns
attn (sliding)     (row, kv head, split) for split < sliding_static_splits
attn (full)        one claimer template (ATTN queue); output = its subtasks
attn_combine       (row, kv head)
o_proj             kv_heads split-K slices (slice s = KV head s's query
                   heads) x o_proj_bn tiles over hidden; with o_proj_merge
                   each merges KV head s's attention splits (no
                   attn_combine node)
ffn_upgate         upgate_bn rows of interleaved gate/up = upgate_bn/2 columns
ffn_down           ffn_splits split-K slices (ffn_split_bounds) x down_bn tiles
router             router_splits split-K slices x router_bn tiles over experts
topk, moe_gather,  one per row
moe_combine, norm,
norm_attn
route_finalize     one per MoE layer (with fused_topk it also ranks every
                   row's experts: no topk node; with fused_gather it also
                   copies the rows to their slots: no moe_gather node;
                   with routed claims it ranks and writes no up queue)
moe_upgate/down    one claimer template each (MOE_UP / MOE_DOWN queue)
lm_head            lm_bn tiles over the vocabulary
=================  =========================================================

Ensures: every node has >= 1 tile; the tiles of a node cover its output
exactly (in bounds, disjoint, complete); claimer queues' worst-case subtasks
cover the claimer node's output exactly.
"""

from __future__ import annotations

import numpy as np

from megac import abi
from megac.abi import Queue
from megac.access import queue_subtasks, subtask_boxes
from megac.geometry import Geometry, _even_bounds
from megac.ops.norm import NORM_IN_FIELDS
from megac.passes import Lowering, NodeTasks, PassError

NAME = "tile"


def _ranges(total: int, bn: int) -> tuple[np.ndarray, np.ndarray]:
    n0 = np.arange(0, total, bn, dtype=np.int64)
    return n0, np.minimum(bn, total - n0)


def _grid(*axes):
    """Cartesian product (first axis slowest) as flat int64 arrays."""
    mesh = np.meshgrid(*[np.asarray(a, dtype=np.int64) for a in axes], indexing="ij")
    return [m.ravel() for m in mesh]


def _boxes(*dims):
    """dims: (lo, hi) per dimension, arrays or scalars, broadcast to n."""
    n = max(np.size(a) for d in dims for a in d)
    lo = np.empty((n, len(dims)), dtype=np.int64)
    hi = np.empty((n, len(dims)), dtype=np.int64)
    for i, (a, b) in enumerate(dims):
        lo[:, i] = a
        hi[:, i] = b
    return lo, hi


def _norm_params(geo: Geometry, kind: str, l: int) -> tuple[int, int, int]:
    """(GAMMA, ATTN_SPLITS, FFN_SPLITS) of the norm node ``kind`` of layer ``l``."""
    L = geo.num_layers
    if kind == "norm_attn":
        return L + l, geo.kv_heads, 0
    moe = geo.ffn[l] == "moe"
    a_splits = 0 if geo.block == "sequential" else geo.kv_heads
    # with fused_combine the norm reads the experts' outputs, no ffn_part
    f_splits = (0 if geo.fused_combine else 1) if moe else geo.ffn_splits
    return (2 * L if l == L - 1 else l + 1), a_splits, f_splits


def _fold_fields(geo: Geometry, l: int, like: np.ndarray, combined: bool = False) -> dict[str, np.ndarray]:
    """The NORM_* fields of layer ``l``'s QKV / router tiles (or up claimer):
    the parameters of the norm that writes their x_norm slot (layer
    ``l - 1``'s "norm", a parallel block) where they fold it
    (Geometry.folded), else zeros. ``combined``: the reader adds layer
    ``l - 1``'s expert outputs itself (the MoE combine folded too: ADD_MOE /
    COMBINE_IN), so no FFN partial (NORM_FFN_SPLITS 0)."""
    vals = (0, 0, 0, 0)
    if geo.folded(l):
        gamma, a_splits, f_splits = _norm_params(geo, "norm", l - 1)
        assert gamma == geo.norm_input_slot(l)
        vals = (l - 1, a_splits, 0 if combined else f_splits, geo.resid_in_slot("norm", l - 1))
    return {n: np.full_like(like, v) for n, v in zip(NORM_IN_FIELDS, vals)}


def _router_fold_fields(geo: Geometry, l: int, like: np.ndarray) -> dict[str, np.ndarray]:
    """A router tile's NORM_* fields: the folded norm's (``_fold_fields``),
    or where it folds the combine instead (Geometry.router_combined) the same
    without the FFN partial: it adds layer ``l - 1``'s expert outputs itself;
    elsewhere in a router_combine model NORM_LAYER -1 and the residual slot
    the norm writing its x_norm slot writes (COMBINE_IN's residual form)."""
    if geo.router_combine and not geo.router_combined(l):  # the norm's residual alone, unnormalised
        return {n: np.full_like(like, v) for n, v in zip(NORM_IN_FIELDS, (-1, 0, 0, geo.norm_input_slot(l)))}
    return _fold_fields(geo, l, like, geo.router_combined(l))


def _up_fold_fields(geo: Geometry, l: int, like: np.ndarray) -> dict[str, np.ndarray]:
    """An up claimer's NORM_* fields: where its claims fold the norm with the
    MoE combine (Geometry.up_combined) the folded norm's without the FFN
    partial (as a qkv_combine QKV tile's), else zeros."""
    if geo.up_combined(l):
        return _fold_fields(geo, l, like, combined=True)
    return {n: np.zeros_like(like) for n in NORM_IN_FIELDS}


def _split_count(geo: Geometry, l: int) -> int:
    """The dynamic target naming row 0's attention split count in layer ``l``
    (the host's sliding or full-layer word; row r's is this + r)."""
    tw = geo.target_words
    return abi.dyn(tw.attn_splits_sliding(0) if geo.sliding[l] else tw.attn_splits_full(0))


def _tile_node(nt: NodeTasks, geo: Geometry) -> None:
    k, l = nt.kind, nt.layer
    R, D, hd = geo.rows, geo.hidden, geo.head_dim
    tw = geo.target_words
    F: dict[str, np.ndarray] = {}
    if k == "qkv":
        nq, nkv = geo.num_heads, geo.kv_heads
        per, bn = hd // geo.qkv_bn, geo.qkv_bn  # tiles per head, columns per tile
        part = np.concatenate([np.zeros(nq), np.ones(nkv), np.full(nkv, 2)]).astype(np.int64)
        head = np.concatenate([np.arange(nq), np.arange(nkv), np.arange(nkv)]).astype(np.int64)
        h, sub = _grid(range(nq + 2 * nkv), range(per))
        n0 = h * hd + sub * bn
        F = dict(N0=n0, N_LEN=np.full_like(n0, bn), K0=np.zeros_like(n0), K_LEN=np.full_like(n0, D),
                 SPLIT=np.zeros_like(n0), PART=part[h], HEAD=head[h], **_fold_fields(geo, l, n0, geo.qkv_combined(l)))
        shape, box = (geo.qkv_width,), _boxes((n0, n0 + bn))
    elif k == "attn" and geo.static_attn(l):
        S = geo.static_splits(l)
        row, kvh, split = _grid(range(R), range(geo.kv_heads), range(S))
        F = dict(ROW=row, KV_HEAD=kvh, SPLIT=split,
                 NUM_SPLITS=_split_count(geo, l) + row,
                 WINDOW=np.full_like(row, geo.window[l]))
        shape, box = (R, geo.kv_heads, S), _boxes((row, row + 1), (kvh, kvh + 1), (split, split + 1))
    elif k in ("attn", "moe_upgate", "moe_down"):
        queue = {"attn": Queue.ATTN, "moe_upgate": Queue.MOE_UP, "moe_down": Queue.MOE_DOWN}[k]
        nt.claimer, nt.queue = True, int(queue)
        if queue == Queue.ATTN:
            qlen, n_len = abi.dyn(tw.attn_queue_len), None
        elif queue == Queue.MOE_UP:
            qlen, n_len = abi.dyn(tw.moe_up_count(l)), geo.moe_up_bn
        else:
            qlen, n_len = abi.dyn(tw.moe_down_count(l)), geo.moe_down_bn
        one = np.ones(1, dtype=np.int64)
        F = dict(QUEUE=one * int(queue), QUEUE_LEN=one * qlen, TASK_WAIT_BASE=-one,
                 TASK_WAIT_TARGET=0 * one, TASK_SIGNAL_BASE=-one)
        if queue == Queue.ATTN:
            F["WINDOW"] = 0 * one  # full attention
        else:
            F["N_LEN"] = one * n_len
        if queue == Queue.MOE_UP and geo.routed_claims:
            # the claimer ranks the rows and derives the queue itself: no queue length to read
            F.update(QUEUE_LEN=0 * one, ROUTE_SPLITS=one * geo.router_splits, NUM_ROWS=one * geo.rows,
                     UP_TILES=one * geo.up_tiles, X_SLOT=one * geo.norm_input_slot(l), **_up_fold_fields(geo, l, one))
        elif queue == Queue.MOE_UP:  # records from the queue ROUTE_FINALIZE writes
            F.update(ROUTE_SPLITS=0 * one, NUM_ROWS=0 * one, UP_TILES=0 * one, X_SLOT=0 * one,
                     **_up_fold_fields(geo, l, one))
        shape, box = (1,), _boxes((0, 1))
    elif k == "attn_combine":
        row, kvh = _grid(range(R), range(geo.kv_heads))
        F = dict(ROW=row, KV_HEAD=kvh, NUM_SPLITS=_split_count(geo, l) + row)
        shape, box = (R, geo.kv_heads), _boxes((row, row + 1), (kvh, kvh + 1))
    elif k == "o_proj":
        kw = geo.heads_per_kv * hd
        nn0, nlen = _ranges(D, geo.o_proj_bn)
        s, t = _grid(range(geo.kv_heads), range(len(nn0)))
        # o_proj_merge: each tile merges its KV head's splits of the one row
        merge = _split_count(geo, l) if geo.o_proj_merge else 0
        F = dict(N0=nn0[t], N_LEN=nlen[t], K0=s * kw, K_LEN=np.full_like(s, kw), SPLIT=s,
                 MERGE_SPLITS=np.full_like(s, merge))
        shape, box = (geo.kv_heads, D), _boxes((s, s + 1), (nn0[t], nn0[t] + nlen[t]))
    elif k == "ffn_upgate":
        half = geo.upgate_bn // 2
        out0, cols = _ranges(geo.dense_width, half)
        F = dict(N0=2 * out0, N_LEN=2 * cols, K0=np.zeros_like(out0), K_LEN=np.full_like(out0, D),
                 SPLIT=np.zeros_like(out0), OUT0=out0, X_SLOT=np.full_like(out0, geo.norm_input_slot(l)))
        shape, box = (geo.dense_width,), _boxes((out0, out0 + cols))
    elif k == "ffn_down":
        b = np.asarray(geo.ffn_split_bounds, dtype=np.int64)
        nn0, nlen = _ranges(D, geo.down_bn)
        s, t = _grid(range(geo.ffn_splits), range(len(nn0)))
        F = dict(N0=nn0[t], N_LEN=nlen[t], K0=b[s], K_LEN=b[s + 1] - b[s], SPLIT=s)
        shape, box = (geo.ffn_splits, D), _boxes((s, s + 1), (nn0[t], nn0[t] + nlen[t]))
    elif k == "router":
        b = np.asarray(geo.router_split_bounds, dtype=np.int64)
        nn0, nlen = _ranges(geo.num_experts, geo.router_bn)
        s, t = _grid(range(geo.router_splits), range(len(nn0)))
        F = dict(N0=nn0[t], N_LEN=nlen[t], K0=b[s], K_LEN=b[s + 1] - b[s], SPLIT=s,
                 X_SLOT=np.full_like(s, geo.norm_input_slot(l)), **_router_fold_fields(geo, l, s))
        shape, box = (geo.router_splits, geo.num_experts), _boxes((s, s + 1), (nn0[t], nn0[t] + nlen[t]))
    elif k == "topk":
        row = np.arange(R, dtype=np.int64)
        F = dict(ROW=row, NUM_SPLITS=np.full_like(row, geo.router_splits),
                 # router_combine: the residual whose 1 / rms scales the weights (the norm's slot)
                 RESID_SLOT=np.full_like(row, geo.norm_input_slot(l) if geo.router_combine else 0))
        shape, box = (R,), _boxes((row, row + 1))
    elif k == "route_finalize":
        one = np.ones(1, dtype=np.int64)
        # split_down: the "down" count is the up claims' (they write moe_out)
        F = dict(UP_TILES=one * geo.up_tiles, DOWN_TILES=one * (geo.up_tiles if geo.split_down else geo.down_tiles),
                 # routed claims derive the up queue themselves: finalize writes none (-1)
                 UP_COUNT_WORD=one * (-1 if geo.routed_claims else tw.moe_up_count(l)),
                 DOWN_COUNT_WORD=one * tw.moe_down_count(l),
                 UP_QUEUE=one * int(Queue.MOE_UP),
                 DOWN_QUEUE=one * (-1 if geo.split_down else int(Queue.MOE_DOWN)), NUM_ROWS=one * R,
                 TOPK_SPLITS=one * geo.finalize_topk_splits, X_SLOT=one * geo.finalize_x_slot(l),
                 # router_combine: the residual whose 1 / rms scales the weights (the norm's slot)
                 RESID_SLOT=one * (geo.norm_input_slot(l) if geo.router_combine else 0))
        shape, box = (1,), _boxes((0, 1))
    elif k == "moe_combine":  # combine_splits feature ranges per row (split_down), else the whole row
        b = np.asarray(_even_bounds(D, geo.combine_splits, 4), dtype=np.int64)
        row, s = _grid(range(R), range(len(b) - 1))
        F = dict(ROW=row, COL0=b[s], COLS=b[s + 1] - b[s])
        shape, box = (R, len(b) - 1), _boxes((row, row + 1), (s, s + 1))
    elif k == "moe_gather":
        row = np.arange(R, dtype=np.int64)
        F = dict(ROW=row, X_SLOT=np.full_like(row, geo.norm_input_slot(l)))
        shape, box = (R,), _boxes((row, row + 1))
    elif k in ("norm", "norm_attn"):
        row = np.arange(R, dtype=np.int64)
        gamma, a_splits, f_splits = _norm_params(geo, k, l)
        F = dict(ROW=row, ATTN_SPLITS=np.full_like(row, a_splits), FFN_SPLITS=np.full_like(row, f_splits),
                 GAMMA=np.full_like(row, gamma), RESID_IN=np.full_like(row, geo.resid_in_slot(k, l)))
        shape, box = (R,), _boxes((row, row + 1))
    elif k == "lm_head":
        n0, nlen = _ranges(geo.vocab, geo.lm_bn)
        F = dict(N0=n0, N_LEN=nlen, K0=np.zeros_like(n0), K_LEN=np.full_like(n0, D), SPLIT=np.zeros_like(n0))
        shape, box = (geo.vocab,), _boxes((n0, n0 + nlen))
    else:
        raise PassError(NAME, f"{nt.name}: no tiling for node kind {k!r}")
    nt.fields = {name: np.asarray(v, dtype=np.int64) for name, v in F.items()}
    nt.out_shape = tuple(int(x) for x in shape)
    nt.out_lo, nt.out_hi = box


def requires(lw: Lowering) -> None:
    g = lw.graph
    if g is None or not g.graph.get("order"):
        raise PassError(NAME, "needs a decode graph (megac.ir.build_graph)")
    if g.graph.get("num_layers") != lw.geo.num_layers:
        raise PassError(NAME, "graph and geometry disagree on num_layers")
    for k in ("fused_topk", "fused_gather", "routed_claims", "fused_combine", "split_down", "o_proj_merge"):
        if bool(g.graph.get(k)) != getattr(lw.geo, k):
            raise PassError(NAME, f"graph and geometry disagree on {k} (routing work inside ROUTE_FINALIZE)")


def run(lw: Lowering) -> str:
    lw.nodes, lw.by_name = [], {}
    for i, name in enumerate(lw.graph.graph["order"]):
        d = lw.graph.nodes[name]
        nt = NodeTasks(name=name, kind=d["kind"], layer=d["layer"], index=i)
        _tile_node(nt, lw.geo)
        lw.add_node(nt)
    n = sum(nt.n for nt in lw.nodes if not nt.claimer)
    c = sum(1 for nt in lw.nodes if nt.claimer)
    return f"{len(lw.nodes)} nodes -> {n} static tiles + {c} claimer nodes"


# ---------------------------------------------------------------------------
# Coverage: tiles of a node are in bounds, disjoint and complete.
# ---------------------------------------------------------------------------
def exact_cover_problem(lo: np.ndarray, hi: np.ndarray, shape: tuple[int, ...]) -> str | None:
    """None if the boxes tile ``shape`` exactly, else what is wrong."""
    lo, hi = np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)
    if len(lo) == 0:
        return "no tiles"
    shp = np.asarray(shape, dtype=np.int64)
    if (lo < 0).any() or (hi > shp).any() or (hi <= lo).any():
        i = int(np.nonzero(((lo < 0) | (hi > shp) | (hi <= lo)).any(axis=1))[0][0])
        return f"tile {i} box {list(zip(lo[i].tolist(), hi[i].tolist()))} is empty or outside {tuple(shape)}"
    vol = np.prod(hi - lo, axis=1).sum()
    total = int(np.prod(shp))
    if vol != total:
        return f"tiles cover {int(vol)} cells of {total} (overlap or gap)"
    # Equal volume + every compressed cell painted exactly once => exact cover.
    cuts = [np.unique(np.concatenate([lo[:, d], hi[:, d], [0, shp[d]]])) for d in range(lo.shape[1])]
    ilo = np.stack([np.searchsorted(cuts[d], lo[:, d]) for d in range(lo.shape[1])], axis=1)
    ihi = np.stack([np.searchsorted(cuts[d], hi[:, d]) for d in range(lo.shape[1])], axis=1)
    gshape = tuple(len(c) for c in cuts)  # one extra slot per dim for the diff array
    diff = np.zeros(gshape, dtype=np.int64)
    d = lo.shape[1]
    for corner in range(1 << d):
        idx = tuple(np.where((corner >> k) & 1, ihi[:, k], ilo[:, k]) for k in range(d))
        sign = (-1) ** bin(corner).count("1")
        np.add.at(diff, idx, sign)
    for k in range(d):
        diff = np.cumsum(diff, axis=k)
    cells = diff[tuple(slice(0, len(c) - 1) for c in cuts)]
    if not (cells == 1).all():
        return "tiles overlap or leave a gap"
    return None


def ensures(lw: Lowering) -> None:
    geo = lw.geo
    checked: set = set()  # layers of one kind tile identically: check each tiling once
    for nt in lw.nodes:
        if nt.n < 1:
            raise PassError(NAME, f"{nt.name} has no tile")
        key = (nt.claimer, nt.queue, nt.out_shape, nt.out_lo.tobytes(), nt.out_hi.tobytes())
        if key in checked:
            continue
        checked.add(key)
        if nt.claimer:
            sub = queue_subtasks(Queue(nt.queue), nt.layer, geo)
            if len(sub) < 1:
                raise PassError(NAME, f"{nt.name}: queue {Queue(nt.queue).name} has no subtask")
            writes = [b for b in subtask_boxes(sub, geo) if b.write]
            lo = np.concatenate([b.lo for b in writes if b.buffer == writes[0].buffer])
            hi = np.concatenate([b.hi for b in writes if b.buffer == writes[0].buffer])
            # ignore the layer dimension and, for MoE, the (row, k) dims the
            # record's rows resolve at run time
            shape = tuple(int(x) for x in (hi.max(axis=0) - lo.min(axis=0)))
            problem = exact_cover_problem(lo - lo.min(axis=0), hi - lo.min(axis=0), shape)
        else:
            problem = exact_cover_problem(nt.out_lo, nt.out_hi, nt.out_shape)
        if problem:
            raise PassError(NAME, f"{nt.name}: {problem}")


__all__ = ["NAME", "ensures", "exact_cover_problem", "requires", "run"]

"""The access model: which buffer regions a task reads and writes.

Shared by ``passes.depend`` (derives counters from region overlap) and
``passes.verify`` (proves every read is ordered after its writers), so the
two cannot disagree silently. Pure functions of the task words and the
:class:`~megac.geometry.Geometry`; no pass state.

Interface (stable)
------------------

``Region(buffer, box)``
    ``box`` is a tuple of half-open ``(lo, hi)`` per dimension of the LOGICAL
    buffer ``buffer`` (shapes: ``logical_shapes(geo)``).

``task_access(words, geo) -> Access(reads: list[Region], writes: list[Region])``
    one task (``words``: int array of 32). For a claimer (ATTN_DRAIN,
    MOE_*_DRAIN) this is the claimer's OWN access (its queue and the target
    word of QUEUE_LEN), not the claimed tasks': see ``group_access``.

``group_access(queue, layer, geo, claimer_words) -> GroupAccess``
    the claimed tasks of one queue for one layer as ONE virtual task:
    ``reads``/``writes`` = per buffer the bounding box of what any claimable
    task may touch (exact: the claimable tasks tile it); ``waits`` = list of
    ``(counter, target)`` the claimed tasks wait on (TASK_WAIT_BASE + offset,
    TASK_WAIT_TARGET; NOT the claimer's header waits, which are in its words);
    ``signals`` = list of ``(counter, count)``: counters the claimed tasks
    signal, with the exact number of signals per step, or ``None`` when that
    number is only known at run time (then every waiter's target is a dynamic
    target word holding it). MoE up counters get exactly ``up_tiles`` signals
    per ACTIVE expert; an expert no row routes to gets none and nobody waits
    on its counter.

``access_boxes(words, geo) -> list[Boxes]``
    the vectorised form of ``task_access`` for an int array ``[n, 32]``:
    ``Boxes(buffer, write, task, lo, hi)`` with ``task`` int64 ``[m]`` (row of
    ``words``), ``lo``/``hi`` int64 ``[m, ndim]``. A task may appear in several
    Boxes of one buffer. ``task_access`` is this function for n = 1.

``queue_subtasks(queue, layer, geo, merged=False) -> SubTasks`` / ``subtask_boxes(sub, geo)``
    every task a queue may hold in a step (worst case), with
    ``wait_offset``/``signal_offset`` per subtask (the ABI's formulas: ATTN
    waits TASK_WAIT_BASE + kv_head and signals TASK_SIGNAL_BASE +
    row*kv_heads + kv_head; MOE_UP waits TASK_WAIT_BASE and signals
    TASK_SIGNAL_BASE + expert; MOE_DOWN waits TASK_WAIT_BASE + expert and
    signals TASK_SIGNAL_BASE) and their boxes (``task`` indexes the subtasks).
    ``merged=True`` folds records with equal offsets into one subtask (a
    split / tile range): same dependencies, far fewer subtasks.

``step_inputs(geo) -> list[Region]``
    regions valid before launch: ``x_resid`` (seeded residual), ``x_norm``
    slot 0 (seeded first norm), the host target words, the attention queue.
    ``STEP_INPUT_BUFFERS`` names the buffers that are read-only inputs and
    are therefore not modelled as regions at all: weights, the old KV cache
    (k_pool/v_pool older tokens, page_table, seq_pos, row_active), rope
    tables.

``dyn_words(words) -> list[int]``
    target words a task reads (dynamic header targets and dynamic fields).

Logical buffers (``logical_shapes``) are the launch-descriptor names plus:

* ``kv_new [L, rows, 2*kv_width]`` the K (``[0, kv_width)``) and V
  (``[kv_width, 2*kv_width)``) of the CURRENT token written by QKV_PROJ
  (older KV is a step input);
* ``moe_x``, ``moe_act``, ``moe_out`` are indexed
  ``[L, expert, row, k, feature]``: the physical slot of (row, k) is a
  device-chosen permutation, so regions name the logical (expert, row, k)
  triple. MOE_GATHER of row r writes ``moe_x[l, :, r, :, :]``; an expert's
  tasks touch ``[l, e, :, :, cols]``; MOE_COMBINE of row r reads
  ``moe_out[l, :, r, :, :]``;
* ``moe_up_queue``/``moe_down_queue [L]``, ``attn_queue [1]``;
* ``target_word [TargetWords.total]``.

``x_resid`` is the only buffer written more than once per step
(``MULTI_WRITTEN``: each ADD_RMSNORM of a row rewrites that row); a read of
it sees the latest writer. Every other region is written at most once per
step. Regions cover buffers written inside the step and the step inputs
above; weights and the old KV cache are not modelled (read-only).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megac import abi
from megac.abi import H, Op, Queue
from megac.geometry import Geometry

#: Buffers written more than once per step (every ADD_RMSNORM of a row rewrites
#: that row of the residual): a read sees the latest writer before it.
MULTI_WRITTEN = ("x_resid",)

#: Read-only inputs of a step, not modelled as regions (weights, old KV, tables).
STEP_INPUT_BUFFERS = (
    "w_embed", "w_lm_head", "w_norm", "w_qkv", "w_o", "w_upgate", "w_down",
    "w_router", "w_moe_upgate", "w_moe_down", "layer_slot", "rope_inv_freq",
    "k_pool", "v_pool", "page_table", "seq_pos", "row_active",
)


@dataclass(frozen=True)
class Region:
    buffer: str
    box: tuple[tuple[int, int], ...]

    def overlaps(self, other: "Region") -> bool:
        return self.buffer == other.buffer and all(
            a0 < b1 and b0 < a1 for (a0, a1), (b0, b1) in zip(self.box, other.box)
        )

    @property
    def volume(self) -> int:
        v = 1
        for lo, hi in self.box:
            v *= max(0, hi - lo)
        return v


@dataclass
class Access:
    reads: list[Region]
    writes: list[Region]


@dataclass
class GroupAccess:
    reads: list[Region]
    writes: list[Region]
    waits: list[tuple[int, int]]
    signals: list[tuple[int, int | None]]


@dataclass
class Boxes:
    buffer: str
    write: bool
    task: np.ndarray  # int64 [m]
    lo: np.ndarray  # int64 [m, ndim]
    hi: np.ndarray  # int64 [m, ndim]

    def __len__(self) -> int:
        return len(self.task)


@dataclass
class SubTasks:
    """Every task a claimer queue may hold for one layer (worst case)."""

    queue: Queue
    layer: int
    fields: dict[str, np.ndarray]  # per-subtask record fields (int64 [m])
    wait_offset: np.ndarray  # int64 [m]: waits TASK_WAIT_BASE + offset
    signal_offset: np.ndarray  # int64 [m]: signals TASK_SIGNAL_BASE + offset

    def __len__(self) -> int:
        return len(self.wait_offset)


# ---------------------------------------------------------------------------
# Logical shapes
# ---------------------------------------------------------------------------
def logical_shapes(geo: Geometry) -> dict[str, tuple[int, ...]]:
    L, R = geo.num_layers, geo.rows
    E, K = max(geo.experts, 1), max(geo.top_k, 1)
    return {
        "x_resid": (R, geo.hidden),
        "x_norm": (geo.norm_slots, R, geo.hidden),
        "q": (L, R, geo.q_width),
        "kv_new": (L, R, 2 * geo.kv_width),
        "attn_o_part": (L, R, geo.num_heads, geo.max_splits, geo.head_dim),
        "attn_lse_part": (L, R, geo.num_heads, geo.max_splits),
        "attn_out": (L, R, geo.q_width),
        "o_part": (L, geo.kv_heads, R, geo.hidden),
        "ffn_act": (L, R, max(geo.dense_width, 1)),
        "ffn_part": (L, max(geo.ffn_splits, 1), R, geo.hidden),
        "router_part": (L, max(geo.router_splits, 1), R, E),
        "topk_ids": (L, R, K),
        "topk_w": (L, R, K),
        "route_slot": (L, R, K),
        "moe_x": (L, E, R, K, geo.hidden),
        "moe_act": (L, E, R, K, max(geo.expert_width, 1)),
        "moe_out": (L, E, R, K, geo.hidden),
        "moe_up_queue": (L,),
        "moe_down_queue": (L,),
        "attn_queue": (1,),
        "target_word": (geo.target_words.total,),
        "logits": (R, geo.vocab),
        "argmax_part": (R, geo.lm_tiles),
    }


def step_inputs(geo: Geometry) -> list[Region]:
    tw = geo.target_words
    return [
        Region("x_resid", ((0, geo.rows), (0, geo.hidden))),
        Region("x_norm", ((0, 1), (0, geo.rows), (0, geo.hidden))),
        Region("target_word", ((0, tw.host_words),)),
        Region("attn_queue", ((0, 1),)),
    ]


# ---------------------------------------------------------------------------
# Box construction helpers
# ---------------------------------------------------------------------------
class _Acc:
    """Collects Boxes; dims given as (lo, hi) pairs of scalars or arrays."""

    def __init__(self) -> None:
        self.out: list[Boxes] = []

    def add(self, buffer: str, write: bool, task: np.ndarray, *dims) -> None:
        m = len(task)
        if m == 0:
            return
        lo = np.empty((m, len(dims)), dtype=np.int64)
        hi = np.empty((m, len(dims)), dtype=np.int64)
        for d, (a, b) in enumerate(dims):
            lo[:, d] = a
            hi[:, d] = b
        self.out.append(Boxes(buffer, write, np.asarray(task, dtype=np.int64), lo, hi))


def _f(words: np.ndarray, op: Op, name: str) -> np.ndarray:
    return words[:, abi.field_index(op, name)].astype(np.int64)


def _all(n: int) -> tuple[int, int]:
    return (0, n)


def _pt(x) -> tuple:
    return (x, x + 1)


def _dyn_mask(v: np.ndarray) -> np.ndarray:
    return (v >= 0) & ((v & abi.DYN_FLAG) != 0)


def _bound(values: np.ndarray, geo: Geometry) -> np.ndarray:
    """Largest value of a count field: itself, or the bound of its target word."""
    out = values.copy()
    dm = _dyn_mask(values)
    if dm.any():
        words = values[dm] & abi.DYN_INDEX_MASK
        uw, inv = np.unique(words, return_inverse=True)
        out[dm] = np.array([geo.dyn_bound(int(w)) for w in uw], dtype=np.int64)[inv.ravel()]
    return out


# ---------------------------------------------------------------------------
# Per-opcode semantics
# ---------------------------------------------------------------------------
def _attn_decode(acc: _Acc, t, layer, row, kvh, split, geo: Geometry, split_hi=None) -> None:
    hpk, hd = geo.heads_per_kv, geo.head_dim
    acc.add("q", False, t, _pt(layer), _pt(row), (kvh * hpk * hd, (kvh + 1) * hpk * hd))
    acc.add("kv_new", False, t, _pt(layer), _pt(row), (kvh * hd, (kvh + 1) * hd))
    acc.add("kv_new", False, t, _pt(layer), _pt(row),
            (geo.kv_width + kvh * hd, geo.kv_width + (kvh + 1) * hd))
    heads = (kvh * hpk, (kvh + 1) * hpk)
    sp = _pt(split) if split_hi is None else (split, split_hi)
    acc.add("attn_o_part", True, t, _pt(layer), _pt(row), heads, sp, _all(hd))
    acc.add("attn_lse_part", True, t, _pt(layer), _pt(row), heads, sp)


def _gemm(words, op):
    return (_f(words, op, "N0"), _f(words, op, "N_LEN"), _f(words, op, "K0"), _f(words, op, "K_LEN"))


def _ops_access(acc: _Acc, words: np.ndarray, idx: np.ndarray, op: Op, geo: Geometry) -> None:
    w = words[idx]
    layer = w[:, H.LAYER].astype(np.int64)
    R, D = geo.rows, geo.hidden
    if op == Op.QKV_PROJ:
        n0, nl, k0, kl = _gemm(w, op)
        acc.add("x_norm", False, idx, _pt(layer), _all(R), (k0, k0 + kl))
        isq = n0 < geo.q_width
        acc.add("q", True, idx[isq], _pt(layer[isq]), _all(R), (n0[isq], n0[isq] + nl[isq]))
        kv = ~isq
        off = n0[kv] - geo.q_width
        acc.add("kv_new", True, idx[kv], _pt(layer[kv]), _all(R), (off, off + nl[kv]))
    elif op == Op.ATTN_DECODE:
        _attn_decode(acc, idx, layer, _f(w, op, "ROW"), _f(w, op, "KV_HEAD"), _f(w, op, "SPLIT"), geo)
    elif op == Op.ATTN_DRAIN:
        acc.add("attn_queue", False, idx, _all(1))
    elif op == Op.ATTN_COMBINE:
        row, kvh = _f(w, op, "ROW"), _f(w, op, "KV_HEAD")
        ns = _bound(_f(w, op, "NUM_SPLITS"), geo)
        hpk, hd = geo.heads_per_kv, geo.head_dim
        heads = (kvh * hpk, (kvh + 1) * hpk)
        acc.add("attn_o_part", False, idx, _pt(layer), _pt(row), heads, (0, ns), _all(hd))
        acc.add("attn_lse_part", False, idx, _pt(layer), _pt(row), heads, (0, ns))
        acc.add("attn_out", True, idx, _pt(layer), _pt(row), (kvh * hpk * hd, (kvh + 1) * hpk * hd))
    elif op == Op.O_PROJ:
        n0, nl, k0, kl = _gemm(w, op)
        acc.add("attn_out", False, idx, _pt(layer), _all(R), (k0, k0 + kl))
        acc.add("o_part", True, idx, _pt(layer), _pt(_f(w, op, "SPLIT")), _all(R), (n0, n0 + nl))
    elif op == Op.FFN_UPGATE_ACT:
        n0, nl, k0, kl = _gemm(w, op)
        out0 = _f(w, op, "OUT0")
        acc.add("x_norm", False, idx, _pt(_f(w, op, "X_SLOT")), _all(R), (k0, k0 + kl))
        acc.add("ffn_act", True, idx, _pt(layer), _all(R), (out0, out0 + nl // 2))
    elif op == Op.FFN_DOWN:
        n0, nl, k0, kl = _gemm(w, op)
        acc.add("ffn_act", False, idx, _pt(layer), _all(R), (k0, k0 + kl))
        acc.add("ffn_part", True, idx, _pt(layer), _pt(_f(w, op, "SPLIT")), _all(R), (n0, n0 + nl))
    elif op == Op.ROUTER_GEMM:
        n0, nl, k0, kl = _gemm(w, op)
        acc.add("x_norm", False, idx, _pt(_f(w, op, "X_SLOT")), _all(R), (k0, k0 + kl))
        acc.add("router_part", True, idx, _pt(layer), _pt(_f(w, op, "SPLIT")), _all(R), (n0, n0 + nl))
    elif op == Op.ROUTER_TOPK:
        row = _f(w, op, "ROW")
        acc.add("router_part", False, idx, _pt(layer), (0, _f(w, op, "NUM_SPLITS")), _pt(row),
                _all(max(geo.experts, 1)))
        for buf in ("topk_ids", "topk_w"):
            acc.add(buf, True, idx, _pt(layer), _pt(row), _all(max(geo.top_k, 1)))
    elif op == Op.ROUTE_FINALIZE:
        K = max(geo.top_k, 1)
        acc.add("topk_ids", False, idx, _pt(layer), (0, _f(w, op, "NUM_ROWS")), _all(K))
        acc.add("route_slot", True, idx, _pt(layer), (0, _f(w, op, "NUM_ROWS")), _all(K))
        acc.add("moe_up_queue", True, idx, _pt(layer))
        acc.add("moe_down_queue", True, idx, _pt(layer))
        acc.add("target_word", True, idx, _pt(_f(w, op, "UP_COUNT_WORD")))
        acc.add("target_word", True, idx, _pt(_f(w, op, "DOWN_COUNT_WORD")))
    elif op == Op.MOE_GATHER:
        row = _f(w, op, "ROW")
        acc.add("x_norm", False, idx, _pt(_f(w, op, "X_SLOT")), _pt(row), _all(D))
        acc.add("route_slot", False, idx, _pt(layer), _pt(row), _all(max(geo.top_k, 1)))
        acc.add("moe_x", True, idx, _pt(layer), _all(max(geo.experts, 1)), _pt(row),
                _all(max(geo.top_k, 1)), _all(D))
    elif op in (Op.MOE_UPGATE_DRAIN, Op.MOE_DOWN_DRAIN):
        buf = "moe_up_queue" if op == Op.MOE_UPGATE_DRAIN else "moe_down_queue"
        acc.add(buf, False, idx, _pt(layer))
    elif op == Op.MOE_COMBINE:
        row = _f(w, op, "ROW")
        E, K = max(geo.experts, 1), max(geo.top_k, 1)
        acc.add("moe_out", False, idx, _pt(layer), _all(E), _pt(row), _all(K), _all(D))
        acc.add("topk_w", False, idx, _pt(layer), _pt(row), _all(K))
        acc.add("route_slot", False, idx, _pt(layer), _pt(row), _all(K))
        acc.add("ffn_part", True, idx, _pt(layer), _pt(0), _pt(row), _all(D))
    elif op == Op.ADD_RMSNORM:
        row = _f(w, op, "ROW")
        flags = w[:, H.FLAGS].astype(np.int64)
        acc.add("x_resid", False, idx, _pt(row), _all(D))
        a = (flags & abi.Flag.ADD_ATTN) != 0
        acc.add("o_part", False, idx[a], _pt(layer[a]), (0, _f(w[a], op, "ATTN_SPLITS")), _pt(row[a]), _all(D))
        f = (flags & abi.Flag.ADD_FFN) != 0
        acc.add("ffn_part", False, idx[f], _pt(layer[f]), (0, _f(w[f], op, "FFN_SPLITS")), _pt(row[f]), _all(D))
        acc.add("x_resid", True, idx, _pt(row), _all(D))
        acc.add("x_norm", True, idx, _pt(_f(w, op, "GAMMA")), _pt(row), _all(D))
    elif op == Op.LM_HEAD:
        n0, nl, k0, kl = _gemm(w, op)
        acc.add("x_norm", False, idx, _pt(geo.final_norm_slot), _all(R), (k0, k0 + kl))
        acc.add("logits", True, idx, _all(R), (n0, n0 + nl))
        t0 = n0 // geo.lm_bn
        acc.add("argmax_part", True, idx, _all(R), (t0, _ceil_div_arr(n0 + nl, geo.lm_bn)))
    elif op == Op.NOP:
        pass
    else:  # pragma: no cover - every Op is handled above
        raise ValueError(f"no access model for {op!r}")


def _ceil_div_arr(a: np.ndarray, b: int) -> np.ndarray:
    return -(-a // b)


def _dyn_fields() -> dict[Op, list[int]]:
    out: dict[Op, list[int]] = {}
    for op, name in abi.DYN_CAPABLE:
        out.setdefault(op, []).append(abi.field_index(op, name))
    return out


_DYN_FIELDS = _dyn_fields()


def _dyn_reads(acc: _Acc, words: np.ndarray) -> None:
    """Every dynamic reference (header targets, dyn-capable fields) reads its word."""
    ops = words[:, H.OPCODE]
    cols = [(None, H.TARGET0), (None, H.TARGET1)]
    for op, idxs in _DYN_FIELDS.items():
        cols += [(op, i) for i in idxs]
    for op, col in cols:
        v = words[:, col].astype(np.int64)
        m = _dyn_mask(v)
        if op is not None:
            m &= ops == int(op)
        if col == H.TARGET1:
            m &= words[:, H.WAIT1] >= 0
        if col == H.TARGET0:
            m &= words[:, H.WAIT0] >= 0
        t = np.nonzero(m)[0]
        if len(t):
            wi = v[t] & abi.DYN_INDEX_MASK
            acc.add("target_word", False, t, (wi, wi + 1))


def access_boxes(words: np.ndarray, geo: Geometry) -> list[Boxes]:
    """Vectorised access of tasks ``words [n, 32]`` (see module docstring)."""
    words = np.asarray(words)
    if words.ndim == 1:
        words = words[None, :]
    acc = _Acc()
    ops = words[:, H.OPCODE]
    for opv in np.unique(ops):
        idx = np.nonzero(ops == opv)[0].astype(np.int64)
        _ops_access(acc, words, idx, Op(int(opv)), geo)
    _dyn_reads(acc, words)
    return acc.out


def _to_regions(boxes: list[Boxes], write: bool) -> list[Region]:
    out = []
    for b in boxes:
        if b.write != write:
            continue
        for i in range(len(b)):
            out.append(Region(b.buffer, tuple((int(lo), int(hi)) for lo, hi in zip(b.lo[i], b.hi[i]))))
    return out


def task_access(words, geo: Geometry) -> Access:
    boxes = access_boxes(np.asarray(words).reshape(1, -1), geo)
    return Access(reads=_to_regions(boxes, False), writes=_to_regions(boxes, True))


def dyn_words(words) -> list[int]:
    acc = _Acc()
    _dyn_reads(acc, np.asarray(words).reshape(1, -1))
    return [int(b.lo[i, 0]) for b in acc.out for i in range(len(b))]


# ---------------------------------------------------------------------------
# Claimer queues
# ---------------------------------------------------------------------------
CLAIMER_QUEUE = {Op.ATTN_DRAIN: Queue.ATTN, Op.MOE_UPGATE_DRAIN: Queue.MOE_UP, Op.MOE_DOWN_DRAIN: Queue.MOE_DOWN}


def queue_subtasks(queue: Queue, layer: int, geo: Geometry, merged: bool = False) -> SubTasks:
    """Every record ``queue`` may hold for ``layer`` in a step (worst case).

    ``merged=True`` folds the records that share both ABI offsets (so they
    wait on and signal the same counters) into one subtask whose split /
    tile range is ``[SPLIT, SPLIT_HI)`` / ``[N_TILE, N_TILE_HI)``: the
    dependency structure is the same, with far fewer subtasks."""
    if queue == Queue.ATTN:
        S = geo.full_max_splits
        r, h, s = np.meshgrid(np.arange(geo.rows), np.arange(geo.kv_heads), np.arange(1 if merged else S),
                              indexing="ij")
        r, h, s = r.ravel(), h.ravel(), s.ravel()
        fields = {"ROW": r, "KV_HEAD": h, "SPLIT": s, "SPLIT_HI": np.full_like(s, S) if merged else s + 1}
        return SubTasks(queue, layer, fields, wait_offset=h.copy(), signal_offset=r * geo.kv_heads + h)
    tiles = geo.up_tiles if queue == Queue.MOE_UP else geo.down_tiles
    e, t = np.meshgrid(np.arange(geo.experts), np.arange(1 if merged else tiles), indexing="ij")
    e, t = e.ravel(), t.ravel()
    fields = {"EXPERT": e, "N_TILE": t, "N_TILE_HI": np.full_like(t, tiles) if merged else t + 1}
    if queue == Queue.MOE_UP:
        return SubTasks(queue, layer, fields, wait_offset=np.zeros_like(e), signal_offset=e.copy())
    return SubTasks(queue, layer, fields, wait_offset=e.copy(), signal_offset=np.zeros_like(e))


def subtask_boxes(sub: SubTasks, geo: Geometry) -> list[Boxes]:
    acc = _Acc()
    m = len(sub)
    t = np.arange(m, dtype=np.int64)
    layer = np.full(m, sub.layer, dtype=np.int64)
    if sub.queue == Queue.ATTN:
        split = sub.fields["SPLIT"]
        _attn_decode(acc, t, layer, sub.fields["ROW"], sub.fields["KV_HEAD"],
                     split, geo, split_hi=sub.fields.get("SPLIT_HI", split + 1))
        return acc.out
    E, R, K = max(geo.experts, 1), geo.rows, max(geo.top_k, 1)
    e, n = sub.fields["EXPERT"], sub.fields["N_TILE"]
    n_hi = sub.fields.get("N_TILE_HI", n + 1)
    if sub.queue == Queue.MOE_UP:
        half = geo.moe_up_bn // 2
        c0 = n * half
        c1 = np.minimum(n_hi * half, geo.expert_width)
        acc.add("moe_x", False, t, _pt(layer), _pt(e), _all(R), _all(K), _all(geo.hidden))
        acc.add("moe_act", True, t, _pt(layer), _pt(e), _all(R), _all(K), (c0, c1))
    else:
        c0 = n * geo.moe_down_bn
        c1 = np.minimum(n_hi * geo.moe_down_bn, geo.hidden)
        acc.add("moe_act", False, t, _pt(layer), _pt(e), _all(R), _all(K), _all(max(geo.expert_width, 1)))
        acc.add("moe_out", True, t, _pt(layer), _pt(e), _all(R), _all(K), (c0, c1))
    return acc.out


def _bounding(boxes: list[Boxes], write: bool) -> list[Region]:
    per: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for b in boxes:
        if b.write != write or not len(b):
            continue
        lo, hi = b.lo.min(axis=0), b.hi.max(axis=0)
        if b.buffer in per:
            plo, phi = per[b.buffer]
            lo, hi = np.minimum(lo, plo), np.maximum(hi, phi)
        per[b.buffer] = (lo, hi)
    return [Region(k, tuple((int(a), int(c)) for a, c in zip(lo, hi))) for k, (lo, hi) in per.items()]


def group_access(queue: Queue, layer: int, geo: Geometry, claimer_words=None) -> GroupAccess:
    """The claimed tasks of ``queue`` for ``layer`` as one virtual task. Counters
    come from the claimer's TASK_* fields (``claimer_words``; without it the
    waits and signals lists are empty)."""
    sub = queue_subtasks(queue, layer, geo, merged=True)
    boxes = subtask_boxes(sub, geo)
    waits: list[tuple[int, int]] = []
    signals: list[tuple[int, int | None]] = []
    if claimer_words is not None:
        w = np.asarray(claimer_words).reshape(-1)
        op = Op(int(w[H.OPCODE]))
        base = int(w[abi.field_index(op, "TASK_WAIT_BASE")])
        target = int(w[abi.field_index(op, "TASK_WAIT_TARGET")])
        if base >= 0:
            waits = [(base + int(o), target) for o in np.unique(sub.wait_offset)]
        sbase = int(w[abi.field_index(op, "TASK_SIGNAL_BASE")])
        if sbase >= 0:
            count = geo.up_tiles if queue == Queue.MOE_UP else None
            signals = [(sbase + int(o), count) for o in np.unique(sub.signal_offset)]
    return GroupAccess(_bounding(boxes, False), _bounding(boxes, True), waits, signals)


def queue_signal_count(queue: Queue, layer: int, offset: int, geo: Geometry) -> int:
    """Exact signals counter TASK_SIGNAL_BASE + ``offset`` of ``queue`` receives
    in a step: a number, or a dynamic target (``abi.dyn(word)``) naming the
    target word that holds it."""
    tw = geo.target_words
    if queue == Queue.ATTN:
        return abi.dyn(tw.attn_splits_full(offset // geo.kv_heads))
    if queue == Queue.MOE_UP:
        return geo.up_tiles  # per active expert
    return abi.dyn(tw.moe_down_count(layer))


__all__ = [
    "Access",
    "Boxes",
    "MULTI_WRITTEN",
    "CLAIMER_QUEUE",
    "GroupAccess",
    "Region",
    "STEP_INPUT_BUFFERS",
    "SubTasks",
    "access_boxes",
    "dyn_words",
    "group_access",
    "logical_shapes",
    "queue_signal_count",
    "queue_subtasks",
    "step_inputs",
    "subtask_boxes",
    "task_access",
]

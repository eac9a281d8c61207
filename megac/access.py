"""The access model: which buffer regions a task reads and writes.

Shared by ``passes.depend`` (derives counters from region overlap) and
``passes.verify`` (proves every read is ordered after its writers), so the
two cannot disagree silently. Pure functions of the task words and the
:class:`~megac.geometry.Geometry`; no pass state. The regions of each opcode
are its definition's (``megac.ops``: ``OpDef.access``, and for claimed tasks
``ClaimerOp.subtask_access``); this module iterates the registry and adds
what is not an opcode's: logical shapes, step inputs, dynamic target-word
reads, claimer groups.

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
  ``moe_out[l, :, r, :, :]``; moe_out's features are ``moe_out_tiles``
  runs of ``hidden`` (tile t of a split-K down partial at ``t * hidden``);
* ``moe_up_queue``/``moe_down_queue [L]``, ``attn_queue [1]``;
* ``target_word [TargetWords.total]``.

Every region is written at most once per step (``MULTI_WRITTEN`` names
buffers that may be rewritten, a read of which sees the latest writer: none
since the residual has a slot per norm). Regions cover buffers written inside the step and the step inputs
above; weights and the old KV cache are not modelled (read-only).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megac import abi
from megac.abi import H, Op, Queue
from megac.buffers import step_buffers
from megac.geometry import Geometry
from megac.ops import CLAIMER_OF_QUEUE, REGISTRY, claimer_for_queue
from megac.ops.base import BoxCollector, Boxes, SubTasks, dyn_mask

#: Buffers written more than once per step (a read sees the latest writer
#: before it): none since each norm writes its own residual slot; the
#: mechanism stays for a buffer that needs it.
MULTI_WRITTEN: tuple[str, ...] = ()

#: Read-only inputs of a step, not modelled as regions (weights, old KV, tables).
STEP_INPUT_BUFFERS = (
    "w_embed", "w_lm_head", "w_norm", "w_qkv", "w_o", "w_upgate", "w_down",
    "w_router", "w_moe_upgate", "w_moe_down", "layer_slot", "rope_inv_freq",
    "k_pool", "v_pool", "page_table", "seq_pos", "row_active",
)

#: claimer opcode -> the queue it drains
CLAIMER_QUEUE = {d.op: q for q, d in CLAIMER_OF_QUEUE.items()}


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


# ---------------------------------------------------------------------------
# Logical shapes
# ---------------------------------------------------------------------------
def logical_shapes(geo: Geometry) -> dict[str, tuple[int, ...]]:
    """The planned shape of every buffer a step writes (``megac.buffers``),
    empty dimensions clamped to 1, plus the logical views: ``kv_new``, the
    MoE buffers by (expert, row, k), the queues and the target words."""
    L, R = geo.num_layers, geo.rows
    E, K = max(geo.num_experts, 1), max(geo.top_k, 1)
    out = {name: tuple(max(int(d), 1) for d in shape) for name, (_, shape, _, _) in step_buffers(geo).items()}
    out.update({
        "kv_new": (L, R, 2 * geo.kv_width),
        "moe_x": (L, E, R, K, geo.hidden),
        "moe_act": (L, E, R, K, max(geo.expert_width, 1)),
        "moe_out": (L, E, R, K, geo.moe_out_tiles * geo.hidden),
        "moe_up_queue": (L,),
        "moe_down_queue": (L,),
        "attn_queue": (1,),
        "target_word": (geo.target_words.total,),
    })
    return out


def step_inputs(geo: Geometry) -> list[Region]:
    tw = geo.target_words
    return [
        Region("x_resid", ((0, 1), (0, geo.rows), (0, geo.hidden))),
        Region("x_norm", ((0, 1), (0, geo.rows), (0, geo.hidden))),
        Region("target_word", ((0, tw.host_words),)),
        Region("attn_queue", ((0, 1),)),
    ]


# ---------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------
def _dyn_fields() -> dict[Op, list[int]]:
    out: dict[Op, list[int]] = {}
    for op, name in abi.DYN_CAPABLE:
        out.setdefault(op, []).append(abi.field_index(op, name))
    return out


_DYN_FIELDS = _dyn_fields()


def _dyn_reads(acc: BoxCollector, words: np.ndarray) -> None:
    """Every dynamic reference (header targets, dyn-capable fields) reads its word."""
    ops = words[:, H.OPCODE]
    cols = [(None, H.TARGET0), (None, H.TARGET1)]
    for op, idxs in _DYN_FIELDS.items():
        cols += [(op, i) for i in idxs]
    for op, col in cols:
        v = words[:, col].astype(np.int64)
        m = dyn_mask(v)
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
    acc = BoxCollector()
    ops = words[:, H.OPCODE]
    for opv in np.unique(ops):
        idx = np.nonzero(ops == opv)[0].astype(np.int64)
        w = words[idx]
        REGISTRY[Op(int(opv))].access(acc, w, idx, w[:, H.LAYER].astype(np.int64), geo)
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
    acc = BoxCollector()
    _dyn_reads(acc, np.asarray(words).reshape(1, -1))
    return [int(b.lo[i, 0]) for b in acc.out for i in range(len(b))]


# ---------------------------------------------------------------------------
# Claimer queues
# ---------------------------------------------------------------------------
def queue_subtasks(queue: Queue, layer: int, geo: Geometry, merged: bool = False) -> SubTasks:
    """Every record ``queue`` may hold for ``layer`` in a step (worst case).

    ``merged=True`` folds the records that share both ABI offsets (so they
    wait on and signal the same counters) into one subtask whose split /
    tile range is ``[SPLIT, SPLIT_HI)`` / ``[N_TILE, N_TILE_HI)``: the
    dependency structure is the same, with far fewer subtasks."""
    return claimer_for_queue(queue).subtasks(layer, geo, merged)


def subtask_boxes(sub: SubTasks, geo: Geometry) -> list[Boxes]:
    acc = BoxCollector()
    claimer_for_queue(sub.queue).subtask_access(acc, sub, geo)
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
            signals = []
            for o in np.unique(sub.signal_offset):
                n = queue_signal_count(queue, layer, int(o), geo)
                signals.append((sbase + int(o), None if abi.is_dyn(n) else n))
    return GroupAccess(_bounding(boxes, False), _bounding(boxes, True), waits, signals)


def queue_signal_count(queue: Queue, layer: int, offset: int, geo: Geometry) -> int:
    """Exact signals counter TASK_SIGNAL_BASE + ``offset`` of ``queue`` receives
    in a step: a number, or a dynamic target (``abi.dyn(word)``) naming the
    target word that holds it."""
    return claimer_for_queue(queue).signal_count(layer, offset, geo)


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

"""A decoded schedule: what the verifier, the cost model and the CPU VM's
checked mode all read.

:class:`Program` flattens the live tasks of ``tasks [num_sms, max_tasks,
32]`` in SM-major order (node ``i`` = live task ``i``) and decodes their
headers. :func:`build_groups` groups the claimers by (queue, layer) and
expands each queue's claimable tasks (``megac.access.queue_subtasks``) into
*parts* (node ``n + j``): claimable tasks with the same waits and signal
merged into one virtual task placed where the claimers are.
:func:`access_tables` lists the regions of every task and part per buffer.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from megac import abi
from megac.abi import DYN_FLAG, DYN_INDEX_MASK, H, Op
from megac.access import CLAIMER_QUEUE
from megac.passes.violations import Sink, Violation, VerifyError

F = abi.field_index


@dataclass
class Group:
    """The claimers of one (queue, layer) and what their claimed tasks do.

    The claimed tasks are merged into *parts*: claimable tasks with the same
    waits and signal form one part (one per (row, kv head) of an attention
    queue, one per expert of a MoE queue), placed where the claimers are.
    ``signals`` are the group's exact per-step totals per counter (an int, or
    ``DYN_FLAG|i``: the value of target word i)."""

    queue: int
    layer: int
    op: int
    claimers: np.ndarray  # live-task indices, SM-major order
    parts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # global part ids
    waits: list[tuple[int, int]] = field(default_factory=list)  # unique (counter, target)
    signals: list[tuple[int, int]] = field(default_factory=list)  # (counter, total count)


@dataclass
class Program:
    """Decoded schedule: live tasks flattened in SM-major order.

    ``geo`` is a :class:`megac.geometry.Geometry`; ``access`` the access model
    module (``access_boxes``, ``queue_subtasks``, ``subtask_boxes``,
    ``queue_signal_count``, ``step_inputs``)."""

    tasks: np.ndarray
    task_counts: np.ndarray
    num_counters: int
    geo: Any
    access: Any = None
    #: optional: counter names for messages, and the counter table to cross-check
    counters: Sequence[Any] | None = None

    def __post_init__(self) -> None:
        if self.access is None:
            from megac import access as _access

            self.access = _access
        self.target_words = self.geo.target_words
        self.tasks = np.asarray(self.tasks, dtype=np.int32)
        self.task_counts = np.asarray(self.task_counts, dtype=np.int64).reshape(-1)
        if self.tasks.ndim != 3 or self.tasks.shape[2] != abi.TASK_WORDS or len(self.task_counts) != self.tasks.shape[0]:
            raise VerifyError([Violation("padding", f"tasks {self.tasks.shape} / task_counts {self.task_counts.shape}: expected [num_sms, max_tasks, {abi.TASK_WORDS}] and [num_sms]")])
        S, T, _ = self.tasks.shape
        self.num_sms = S
        counts = np.clip(self.task_counts, 0, T)
        self.start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        live = np.arange(T)[None, :] < counts[:, None]
        self.words = self.tasks[live]  # [N, 32], SM-major
        self.sm = np.repeat(np.arange(S), counts)
        self.slot = np.arange(len(self.words)) - self.start[self.sm]
        w = self.words
        self.op = w[:, H.OPCODE].astype(np.int64)
        self.layer = w[:, H.LAYER].astype(np.int64)
        self.w0 = w[:, H.WAIT0].astype(np.int64)
        self.t0 = w[:, H.TARGET0].astype(np.int64)
        self.w1 = w[:, H.WAIT1].astype(np.int64)
        self.t1 = w[:, H.TARGET1].astype(np.int64)
        self.sig = w[:, H.SIGNAL].astype(np.int64)
        self.groups: list[Group] = []
        self.claimer_group = np.full(len(w), -1, dtype=np.int64)
        # parts (claimed tasks merged), filled by build_groups
        self.part_group = np.zeros(0, np.int64)
        self.part_waits: list[list[tuple[int, int]]] = []
        self.part_sigs: list[list[int]] = []
        self.part_what: list[tuple] = []  # (SubTasks, index): described on demand
        self.part_size: list[int] = []  # claimable tasks merged into each part
        self.part_boxes: list[Any] = []  # access.Boxes with task = global part id
        self._tables = None  # per-buffer regions, computed once (access_tables)

    @classmethod
    def from_schedule(cls, schedule, access=None) -> "Program":
        return cls(
            tasks=schedule.tasks,
            task_counts=schedule.task_counts,
            num_counters=schedule.num_counters,
            geo=schedule.geometry,
            access=access,
            counters=getattr(schedule, "counters", None),
        )

    @property
    def n(self) -> int:
        return len(self.words)

    @property
    def num_parts(self) -> int:
        return len(self.part_group)

    # ---------------------------------------------------------- messages
    def where(self, i: int) -> str:
        """'SM s slot k OPNAME layer l' for live task i, or a claimed part."""
        i = int(i)
        if i >= self.n:
            j = i - self.n
            g = self.groups[int(self.part_group[j])]
            sub, k = self.part_what[j]
            return f"claimed task ({part_what(g.queue, sub, k)}) of the {opname(g.op)} queue of layer {g.layer}"
        return f"SM {int(self.sm[i])} slot {int(self.slot[i])} {opname(int(self.op[i]))} layer {int(self.layer[i])}"

    def cname(self, c: int) -> str:
        c = int(c)
        if self.counters is not None and 0 <= c < len(self.counters):
            name = getattr(self.counters[c], "name", "")
            if name:
                return f"counter {c} ({name})"
        return f"counter {c}"


def opname(op: int) -> str:
    try:
        return Op(op).name
    except ValueError:
        return f"opcode {op}"


def fmt_target(t: int) -> str:
    t = int(t)
    return f"dyn(word {t & DYN_INDEX_MASK})" if isdyn(t) else str(t)


def isdyn(t: int) -> bool:
    return t >= 0 and bool(t & DYN_FLAG)


def as_i64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.int64)


def build_groups(p: Program, out: Sink) -> None:
    """Group claimer tasks by (queue, layer); expand each group's claimable
    tasks (``access.queue_subtasks``) into parts, merging subtasks that share
    their wait and signal counters (their regions: per buffer the bounding box,
    exact where the subtasks tile it)."""
    is_cl = np.isin(p.op, [int(o) for o in CLAIMER_QUEUE])
    idx = np.flatnonzero(is_cl)
    acc = p.access
    part_group, boxes = [], []
    for key in np.unique(p.op[idx] * 4096 + p.layer[idx]) if len(idx) else []:
        members = idx[p.op[idx] * 4096 + p.layer[idx] == key]
        op_ = Op(int(p.op[members[0]]))
        layer = int(p.layer[members[0]])
        diff = np.flatnonzero((p.words[members, 2:] != p.words[members[0], 2:]).any(axis=1))
        if len(diff):
            j = members[diff[0]]
            col = 2 + int(np.flatnonzero(p.words[j, 2:] != p.words[members[0], 2:])[0])
            out.add("claimer_mismatch", f"{p.where(j)}: word {col} = {p.words[j, col]} but {p.where(members[0])} has {p.words[members[0], col]} (claimers of one queue carry identical words)")
        queue = CLAIMER_QUEUE[op_]
        gi = len(p.groups)
        g = Group(queue=int(queue), layer=layer, op=int(op_), claimers=members)
        p.groups.append(g)
        p.claimer_group[members] = gi
        w = p.words[members[0]].astype(np.int64)
        wb, wt, sb = (int(w[F(op_, n)]) for n in ("TASK_WAIT_BASE", "TASK_WAIT_TARGET", "TASK_SIGNAL_BASE"))
        sub = acc.queue_subtasks(queue, layer, p.geo)
        if not len(sub):
            continue
        key2 = sub.wait_offset * (1 << 32) + sub.signal_offset
        uk, first, inv = np.unique(key2, return_index=True, return_inverse=True)
        base = p.n + len(p.part_waits)
        g.parts = base + np.arange(len(uk))
        woff, soff = sub.wait_offset[first], sub.signal_offset[first]
        p.part_waits += [[(wb + o, wt)] for o in woff.tolist()]
        p.part_sigs += [[sb + o] for o in soff.tolist()]
        p.part_what += [(sub, k) for k in first.tolist()]
        p.part_size += np.bincount(inv.reshape(-1), minlength=len(uk)).tolist()
        part_group.append(np.full(len(uk), gi))
        g.waits = sorted({(wb + int(o), wt) for o in np.unique(woff)})
        g.signals = [(sb + int(o), int(acc.queue_signal_count(queue, layer, int(o), p.geo))) for o in np.unique(soff)]
        for b in acc.subtask_boxes(sub, p.geo):
            if len(b):
                boxes.append(merge_boxes(b, base + inv[b.task]))
    p.part_group = np.concatenate(part_group) if part_group else np.zeros(0, np.int64)
    p.part_boxes = boxes


def part_what(queue, sub, i: int) -> str:
    f = {k: int(v[i]) for k, v in sub.fields.items()}
    if queue == abi.Queue.ATTN:
        return f"row {f['ROW']} kv_head {f['KV_HEAD']}"
    return f"expert {f['EXPERT']}"


def merge_boxes(b, task: np.ndarray):
    """One bounding box per part for a Boxes of the subtasks."""
    o = np.argsort(task, kind="stable")
    t = task[o]
    starts = np.flatnonzero(np.r_[True, t[1:] != t[:-1]])
    lo = np.minimum.reduceat(b.lo[o], starts, axis=0)
    hi = np.maximum.reduceat(b.hi[o], starts, axis=0)
    return type(b)(b.buffer, b.write, t[starts], lo, hi)


def header_waits(p: Program, i: int) -> list[tuple[int, int]]:
    w = p.words[i]
    return [(int(w[c]), int(w[t])) for c, t in ((H.WAIT0, H.TARGET0), (H.WAIT1, H.TARGET1)) if w[c] >= 0]




@dataclass
class AccessTable:
    """Per buffer: node, lo[n, D], hi[n, D], is_write."""

    node: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    write: np.ndarray


def access_tables(p: Program) -> dict[str, AccessTable]:
    """Every region of every task and part, per buffer (computed once)."""
    if p._tables is not None:
        return p._tables
    per: dict[str, list] = defaultdict(list)
    for b in p.access.access_boxes(p.words, p.geo):
        per[b.buffer].append((b.task, b.lo, b.hi, b.write))
    for b in p.part_boxes:
        per[b.buffer].append((b.task, b.lo, b.hi, b.write))
    out = {}
    for buf, items in per.items():
        out[buf] = AccessTable(
            np.concatenate([as_i64(t) for t, _, _, _ in items]),
            np.concatenate([lo for _, lo, _, _ in items]),
            np.concatenate([hi for _, _, hi, _ in items]),
            np.concatenate([np.full(len(t), w) for t, _, _, w in items]),
        )
    p._tables = out
    return out


def box_str(t: AccessTable, e: int) -> str:
    return "[" + ", ".join(f"{lo}:{hi}" for lo, hi in zip(t.lo[e].tolist(), t.hi[e].tolist())) + "]"




__all__ = ["AccessTable", "Group", "Program", "access_tables", "as_i64", "box_str", "build_groups", "fmt_target",
           "header_waits", "isdyn", "opname", "part_what"]

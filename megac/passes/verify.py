"""Pass ``verify``: a static proof that one encoded schedule cannot deadlock or race.

It reads the ENCODED task words (``int32 [num_sms, max_tasks, 32]``), the
schedule's geometry and the access model (``megac.access``); it never looks at
the other passes' internals, so a bug there cannot hide itself here.

Checks, in the order :func:`verify` reports them (the first class with a
violation raises :class:`VerifyError`; :func:`check` returns them all):

1. ``structure`` -- valid opcodes, NOP only as padding, counter indices in
   ``[-1, num_counters)``, static targets >= 1, dynamic references inside the
   target-word layout, descriptor fields in range (ROUTE_FINALIZE's tile
   counts and count words exactly what the geometry and the claimers assume),
   every region inside its buffer's logical shape, claimers of one queue
   carrying identical words.
2. ``targets`` -- every wait target EQUALS the number of signals its counter
   receives in a step. Static tasks signal once; a claimer group signals what
   its claimed tasks signal (``access.queue_signal_count``: a dynamic count
   for attention splits and MoE down tiles, ``up_tiles`` per active expert).
   The schedule's counter table, when it states counts, must agree.
3. ``dynamic`` -- a device-written target word (ROUTE_FINALIZE) is written by
   exactly one task, and that task happens-before every reader through the
   reader's WAIT0 (the device reads TARGET1 and dynamic fields after WAIT0; a
   device word in TARGET0 is read before any wait and is always wrong).
4. ``deadlock`` -- the claimer rule (every input of a claimed task is produced
   before the first claimer of its queue on that producer's SM), then a greedy
   simulation of the in-order SM queues. Counters are monotone, so if one
   greedy run completes, every timing completes; otherwise the stuck SM heads
   are reported with the producer that never arrived.
5. ``hazards`` -- happens-before through counters ONLY (the device overlaps
   consecutive tasks of one SM, so program order orders no data). A wait means
   "every signaller of this counter is done", so W happens-before R iff W's
   signal counter is in the reflexive ancestor closure of R's wait counters.
   Every overlapping (writer, reader) pair must be ordered one way or the other
   (read-after-write / write-after-read), every overlapping pair of writers
   must be ordered, and a read that no writer precedes must be a step input.

Claimer groups (one per (queue, layer)) act as virtual tasks ("parts"): their
waits, signals and regions come from the claimer words (ABI) and the access
model; they are placed where their claimers are.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from megac import abi
from megac.abi import DYN_FLAG, DYN_INDEX_MASK, H, Op
from megac.errors import MegacError

NAME = "verify"

# --------------------------------------------------------------------------
# Violation kinds, grouped by the check class that finds them.
# --------------------------------------------------------------------------
CHECK_ORDER = ("structure", "targets", "dynamic", "deadlock", "hazards")

KINDS: dict[str, str] = {
    # structure
    "opcode": "structure",
    "nop_in_body": "structure",
    "padding": "structure",
    "counter_range": "structure",
    "target_range": "structure",
    "dyn_range": "structure",
    "field_range": "structure",
    "claimer_mismatch": "structure",
    "region_range": "structure",  # a task's region leaves its buffer's logical shape
    "field_mismatch": "structure",  # two fields that must agree do not
    # targets
    "target_high": "targets",  # target > signals: can never be satisfied
    "target_low": "targets",  # target < signals: fires before all producers
    "target_dyn_mismatch": "targets",  # static vs dynamic count disagree
    "counter_table": "targets",  # Schedule.counters disagrees with the words
    # dynamic target words
    "dyn_unwritten": "dynamic",
    "dyn_multi_writer": "dynamic",
    "dyn_order": "dynamic",
    # deadlock
    "claimer_rule": "deadlock",
    "deadlock": "deadlock",
    # hazards
    "raw": "hazards",  # read not ordered after its writer
    "war": "hazards",  # overwrite not ordered after a reader of the old data
    "waw": "hazards",  # two writes of one region unordered
    "unwritten_read": "hazards",  # read of data no task writes, not a step input
    "dead_write": "hazards",  # write nobody reads, not a step output
}

#: Buffers whose final contents leave the step (read by the sampler or the
#: next step's seed), so a write nobody in the step reads is expected there.
STEP_OUTPUTS = ("logits", "argmax_part", "x_resid")

#: Messages kept per kind; the rest are counted (a broken schedule can yield
#: tens of thousands of identical complaints).
MAX_PER_KIND = 20


@dataclass(frozen=True)
class Violation:
    kind: str
    message: str

    @property
    def check(self) -> str:
        return KINDS[self.kind]

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


class VerifyError(MegacError):
    """The schedule is unsafe. ``str(err)`` is one line naming SM, slot,
    opcode, layer and counter of the first violation; ``err.violations``
    holds every violation of that check class."""

    def __init__(self, violations: Sequence[Violation], dropped: int = 0) -> None:
        first = violations[0]
        more = len(violations) - 1 + dropped
        suffix = f" (+{more} more {first.check} violations)" if more else ""
        label = first.check if first.kind == first.check else f"{first.check}: {first.kind}"
        super().__init__(f"verify: {label}: {first.message}{suffix}")
        self.violations = list(violations)
        self.kind = first.kind


@dataclass
class VerifyReport:
    tasks: int = 0
    claimers: int = 0
    groups: int = 0
    counters: int = 0
    counters_used: int = 0
    checked_pairs: int = 0
    sim_rounds: int = 0
    critical_path: int = 0
    elapsed_ms: float = 0.0
    check_ms: dict[str, float] = field(default_factory=dict)

    def summary(self) -> str:
        return (
            f"{self.tasks} tasks ({self.claimers} claimers, {self.groups} queues), "
            f"{self.counters_used}/{self.counters} counters, {self.checked_pairs} region pairs, "
            f"{self.sim_rounds} sim rounds, critical path {self.critical_path} tasks, "
            f"{self.elapsed_ms:.0f} ms"
        )

    def as_dict(self) -> dict:
        return dict(self.__dict__)


# --------------------------------------------------------------------------
# Normalised input: what every check reads.
# --------------------------------------------------------------------------
@dataclass
class Limits:
    """Upper bounds of descriptor fields, from the geometry."""

    rows: int
    num_layers: int
    hidden: int
    num_heads: int
    kv_heads: int
    head_dim: int
    q_width: int
    qkv_width: int
    vocab: int
    max_splits: int
    dense_width: int = 0
    num_experts: int = 0
    expert_width: int = 0
    top_k: int = 0
    up_tiles: int = 0
    down_tiles: int = 0
    #: per layer: True where the FFN is MoE (None: not checked)
    moe_layers: tuple[bool, ...] | None = None

    @classmethod
    def from_geometry(cls, geo) -> "Limits":
        return cls(
            rows=geo.rows,
            num_layers=geo.num_layers,
            hidden=geo.hidden,
            num_heads=geo.num_heads,
            kv_heads=geo.kv_heads,
            head_dim=geo.head_dim,
            q_width=geo.q_width,
            qkv_width=geo.qkv_width,
            vocab=geo.vocab,
            max_splits=geo.max_splits,
            dense_width=geo.dense_width,
            num_experts=geo.experts,
            expert_width=geo.expert_width,
            top_k=geo.top_k,
            up_tiles=geo.up_tiles,
            down_tiles=geo.down_tiles,
            moe_layers=tuple(f == "moe" for f in geo.ffn),
        )


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
        self.limits = Limits.from_geometry(self.geo)
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
        # parts (claimed tasks merged), filled by _build_groups
        self.part_group = np.zeros(0, np.int64)
        self.part_waits: list[list[tuple[int, int]]] = []
        self.part_sigs: list[list[int]] = []
        self.part_what: list[tuple] = []  # (SubTasks, index): described on demand
        self.part_boxes: list[Any] = []  # access.Boxes with task = global part id
        self._tables = None  # per-buffer regions, computed once (_access_tables)

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
            return f"claimed task ({_part_what(g.queue, sub, k)}) of the {_opname(g.op)} queue of layer {g.layer}"
        return f"SM {int(self.sm[i])} slot {int(self.slot[i])} {_opname(int(self.op[i]))} layer {int(self.layer[i])}"

    def cname(self, c: int) -> str:
        c = int(c)
        if self.counters is not None and 0 <= c < len(self.counters):
            name = getattr(self.counters[c], "name", "")
            if name:
                return f"counter {c} ({name})"
        return f"counter {c}"


def _opname(op: int) -> str:
    try:
        return Op(op).name
    except ValueError:
        return f"opcode {op}"


def _fmt_target(t: int) -> str:
    t = int(t)
    return f"dyn(word {t & DYN_INDEX_MASK})" if _isdyn(t) else str(t)


def _isdyn(t: int) -> bool:
    return t >= 0 and bool(t & DYN_FLAG)


def _arr(x) -> np.ndarray:
    return np.asarray(x, dtype=np.int64)


F = abi.field_index


class _Sink:
    """Collects violations, keeping MAX_PER_KIND messages per kind."""

    def __init__(self) -> None:
        self.items: list[Violation] = []
        self.dropped: dict[str, int] = defaultdict(int)
        self._per: dict[str, int] = defaultdict(int)

    def add(self, kind: str, message: str) -> None:
        assert kind in KINDS, kind
        if self._per[kind] >= MAX_PER_KIND:
            self.dropped[kind] += 1
            return
        self._per[kind] += 1
        self.items.append(Violation(kind, message))

    def of(self, check: str) -> list[Violation]:
        return [v for v in self.items if v.check == check]


# ==========================================================================
# 1. structure
# ==========================================================================
def _check_structure(p: Program, out: _Sink) -> None:
    S, T, _ = p.tasks.shape
    C = p.num_counters
    L = p.limits
    if len(p.task_counts) != S or (p.task_counts < 0).any() or (p.task_counts > T).any():
        out.add("padding", f"task_counts {p.task_counts.tolist()[:8]}... does not fit tasks [{S}, {T}, 32]")
    # padding after task_counts[sm] must be all zero (NOP)
    pad = np.arange(T)[None, :] >= p.task_counts[:, None]
    bad = pad & (p.tasks != 0).any(axis=2)
    for s, k in zip(*np.nonzero(bad)):
        out.add("padding", f"SM {s} slot {k}: non-zero words after task_counts[{s}]={p.task_counts[s]} ({_opname(int(p.tasks[s, k, 0]))})")

    op = p.op
    badop = (op < 0) | (op > max(Op))
    for i in np.flatnonzero(badop):
        out.add("opcode", f"SM {p.sm[i]} slot {p.slot[i]}: invalid opcode {op[i]}")
    for i in np.flatnonzero(op == Op.NOP):
        out.add("nop_in_body", f"SM {p.sm[i]} slot {p.slot[i]}: NOP before task_counts[{p.sm[i]}]={p.task_counts[p.sm[i]]} (NOP is padding only)")
    real = ~badop & (op != Op.NOP)

    tw_total = p.target_words.total
    for wname, tname, w, t in (("WAIT0", "TARGET0", p.w0, p.t0), ("WAIT1", "TARGET1", p.w1, p.t1)):
        for i in np.flatnonzero(real & ((w < -1) | (w >= C))):
            out.add("counter_range", f"{p.where(i)}: {wname} counter {w[i]} outside [-1, {C})")
        has = real & (w >= 0) & (w < C)
        dyn = (t & DYN_FLAG) != 0
        for i in np.flatnonzero(has & ~dyn & (t < 1)):
            out.add("target_range", f"{p.where(i)}: {tname} {t[i]} on {p.cname(w[i])} (a static target must be >= 1)")
        for i in np.flatnonzero(has & dyn & (((t & DYN_INDEX_MASK) >= tw_total) | (t < 0))):
            out.add("dyn_range", f"{p.where(i)}: {tname} reads target word {t[i] & DYN_INDEX_MASK} outside the {tw_total} target words")
    for i in np.flatnonzero(real & ((p.sig < -1) | (p.sig >= C))):
        out.add("counter_range", f"{p.where(i)}: SIGNAL counter {p.sig[i]} outside [-1, {C})")

    # layer: < num_layers, LM_HEAD == num_layers
    lm = op == Op.LM_HEAD
    for i in np.flatnonzero(real & ~lm & ((p.layer < 0) | (p.layer >= L.num_layers))):
        out.add("field_range", f"{p.where(i)}: LAYER {p.layer[i]} outside [0, {L.num_layers})")
    for i in np.flatnonzero(lm & (p.layer != L.num_layers)):
        out.add("field_range", f"{p.where(i)}: LM_HEAD LAYER must be num_layers={L.num_layers}")
    if L.moe_layers is not None:
        ml = np.array(L.moe_layers + (False,), dtype=bool)
        lay = np.clip(p.layer, 0, L.num_layers)
        moe_ops = np.isin(op, [Op.ROUTER_GEMM, Op.ROUTER_TOPK, Op.ROUTE_FINALIZE, Op.MOE_GATHER,
                               Op.MOE_UPGATE_DRAIN, Op.MOE_DOWN_DRAIN, Op.MOE_COMBINE])
        dense_ops = np.isin(op, [Op.FFN_UPGATE_ACT, Op.FFN_DOWN])
        for i in np.flatnonzero(real & moe_ops & ~ml[lay]):
            out.add("field_range", f"{p.where(i)}: MoE opcode on a dense layer")
        for i in np.flatnonzero(real & dense_ops & ml[lay]):
            out.add("field_range", f"{p.where(i)}: dense FFN opcode on a MoE layer")

    for op_, rules in _field_rules(p).items():
        idx = np.flatnonzero(real & (op == op_))
        if not len(idx):
            continue
        sub = p.words[idx].astype(np.int64)
        for name, lo, hi, dyn_ok in rules:
            v = sub[:, F(op_, name)] if isinstance(name, str) else name(sub)
            label = name if isinstance(name, str) else getattr(name, "label", "field")
            isdyn = (v >= 0) & ((v & DYN_FLAG) != 0)
            hi_v = hi(sub) if callable(hi) else hi
            lo_v = lo(sub) if callable(lo) else lo
            bad = (v < lo_v) | (v >= hi_v)
            if dyn_ok:
                bad = np.where(isdyn, (v & DYN_INDEX_MASK) >= tw_total, bad)
            for j in np.flatnonzero(bad):
                h = hi_v[j] if isinstance(hi_v, np.ndarray) else hi_v
                lw = lo_v[j] if isinstance(lo_v, np.ndarray) else lo_v
                shown = _fmt_target(int(v[j])) if dyn_ok and isdyn[j] else int(v[j])
                out.add("field_range", f"{p.where(idx[j])}: {label} = {shown} outside [{lw}, {h})")


def _check_field_pairs(p: Program, out: _Sink) -> None:
    """ATTN_COMBINE merges NUM_SPLITS partials after waiting for TARGET0
    split signals: it may merge no more than it waited for (a dynamic count
    counts as the largest value its target word can hold; two dynamic values
    must be the same word). Splits past a row's own count are empty, so
    merging fewer is exact."""
    idx = np.flatnonzero((p.op == Op.ATTN_COMBINE) & (p.w0 >= 0))
    ns = p.words[idx, F(Op.ATTN_COMBINE, "NUM_SPLITS")].astype(np.int64)
    for j, i in enumerate(idx):
        a, t = int(ns[j]), int(p.t0[i])
        if _isdyn(a) and _isdyn(t):
            ok = a == t
        elif _isdyn(t):
            ok = False  # the waited count may be smaller than a static merge
        else:
            ok = (p.geo.dyn_bound(a & DYN_INDEX_MASK) if _isdyn(a) else a) <= t
        if not ok:
            out.add("field_mismatch", f"{p.where(i)}: NUM_SPLITS {_fmt_target(a)} may exceed the {_fmt_target(t)} split signals it waits for on {p.cname(p.w0[i])}")


def _sum_label(a: str, b: str, op_: Op):
    fa, fb = F(op_, a), F(op_, b)

    def fn(sub):
        return sub[:, fa] + sub[:, fb]

    fn.label = f"{a}+{b}"
    return fn


def _field_rules(p: Program) -> dict[int, list]:
    """(field or fn, lo, hi_exclusive, dyn_capable) per opcode."""
    L = p.limits
    C = p.num_counters
    big = 1 << 30

    def gemm(op_, n_total, k_total, splits):
        return [
            ("N0", 0, n_total, False),
            ("N_LEN", 1, n_total + 1, False),
            (_sum_label("N0", "N_LEN", op_), 1, n_total + 1, False),
            ("K0", 0, k_total, False),
            ("K_LEN", 1, k_total + 1, False),
            (_sum_label("K0", "K_LEN", op_), 1, k_total + 1, False),
            ("SPLIT", 0, splits, False),
        ]

    def qkv_head_hi(sub):
        return np.where(sub[:, F(Op.QKV_PROJ, "PART")] == abi.QkvPart.Q, L.num_heads, L.kv_heads)

    def base_plus(op_, fname, span):
        f = F(op_, fname)

        def fn(sub):
            return sub[:, f] + span - 1

        fn.label = f"{fname}+{span - 1}"
        return fn

    rules: dict[int, list] = {
        Op.QKV_PROJ: gemm(Op.QKV_PROJ, L.qkv_width, L.hidden, big)
        + [("PART", 0, 3, False), ("HEAD", 0, qkv_head_hi, False)],
        Op.ATTN_DECODE: [
            ("ROW", 0, L.rows, False),
            ("KV_HEAD", 0, L.kv_heads, False),
            ("SPLIT", 0, L.max_splits, False),
            ("NUM_SPLITS", 1, L.max_splits + 1, True),
            ("WINDOW", 0, big, False),
        ],
        Op.ATTN_DRAIN: [
            ("QUEUE", int(abi.Queue.ATTN), int(abi.Queue.ATTN) + 1, False),
            ("QUEUE_LEN", 0, big, True),
            ("TASK_WAIT_BASE", 0, C, False),
            (base_plus(Op.ATTN_DRAIN, "TASK_WAIT_BASE", L.kv_heads), 0, C, False),
            ("TASK_WAIT_TARGET", 1, big, True),
            ("TASK_SIGNAL_BASE", 0, C, False),
            (base_plus(Op.ATTN_DRAIN, "TASK_SIGNAL_BASE", L.rows * L.kv_heads), 0, C, False),
            ("WINDOW", 0, big, False),
        ],
        Op.ATTN_COMBINE: [
            ("ROW", 0, L.rows, False),
            ("KV_HEAD", 0, L.kv_heads, False),
            ("NUM_SPLITS", 1, L.max_splits + 1, True),
        ],
        Op.O_PROJ: gemm(Op.O_PROJ, L.hidden, L.q_width, max(L.kv_heads, 1)),
        Op.LM_HEAD: gemm(Op.LM_HEAD, L.vocab, L.hidden, big),
        Op.ROUTER_TOPK: [("ROW", 0, L.rows, False), ("NUM_SPLITS", 1, big, False)],
        Op.MOE_GATHER: [("ROW", 0, L.rows, False)],
        Op.MOE_COMBINE: [("ROW", 0, L.rows, False)],
        Op.ADD_RMSNORM: [
            ("ROW", 0, L.rows, False),
            ("ATTN_SPLITS", 0, big, False),
            ("FFN_SPLITS", 0, big, False),
            ("GAMMA", 0, 2 * L.num_layers + 1, False),
        ],
    }
    if L.dense_width:
        rules[Op.FFN_UPGATE_ACT] = gemm(Op.FFN_UPGATE_ACT, 2 * L.dense_width, L.hidden, big) + [
            ("OUT0", 0, L.dense_width, False)
        ]
        rules[Op.FFN_DOWN] = gemm(Op.FFN_DOWN, L.hidden, L.dense_width, big)
    if L.num_experts:
        tw = p.target_words
        rules[Op.ROUTER_GEMM] = gemm(Op.ROUTER_GEMM, L.num_experts, L.hidden, big)

        def word_of(fn):
            def lo(sub):
                return np.array([fn(int(l)) for l in sub[:, H.LAYER]], dtype=np.int64)

            return lo

        up_w, down_w = word_of(tw.moe_up_count), word_of(tw.moe_down_count)
        rules[Op.ROUTE_FINALIZE] = [
            # the device emits UP_TILES records per active expert: the count
            # the claimed tasks' waiters expect (geometry.up_tiles)
            ("UP_TILES", L.up_tiles, L.up_tiles + 1, False),
            ("DOWN_TILES", L.down_tiles, L.down_tiles + 1, False),
            ("UP_COUNT_WORD", up_w, lambda sub: up_w(sub) + 1, False),
            ("DOWN_COUNT_WORD", down_w, lambda sub: down_w(sub) + 1, False),
            ("UP_QUEUE", int(abi.Queue.MOE_UP), int(abi.Queue.MOE_UP) + 1, False),
            ("DOWN_QUEUE", int(abi.Queue.MOE_DOWN), int(abi.Queue.MOE_DOWN) + 1, False),
            ("NUM_ROWS", 1, L.rows + 1, False),
        ]
        rules[Op.MOE_UPGATE_DRAIN] = [
            ("QUEUE", int(abi.Queue.MOE_UP), int(abi.Queue.MOE_UP) + 1, False),
            ("QUEUE_LEN", 0, big, True),
            ("TASK_WAIT_BASE", 0, C, False),
            ("TASK_WAIT_TARGET", 1, big, True),
            ("TASK_SIGNAL_BASE", 0, C, False),
            (base_plus(Op.MOE_UPGATE_DRAIN, "TASK_SIGNAL_BASE", L.num_experts), 0, C, False),
            ("N_LEN", 1, 2 * L.expert_width + 1, False),
        ]
        rules[Op.MOE_DOWN_DRAIN] = [
            ("QUEUE", int(abi.Queue.MOE_DOWN), int(abi.Queue.MOE_DOWN) + 1, False),
            ("QUEUE_LEN", 0, big, True),
            ("TASK_WAIT_BASE", 0, C, False),
            (base_plus(Op.MOE_DOWN_DRAIN, "TASK_WAIT_BASE", L.num_experts), 0, C, False),
            ("TASK_WAIT_TARGET", 1, big, True),
            ("TASK_SIGNAL_BASE", 0, C, False),
            ("N_LEN", 1, L.hidden + 1, False),
        ]
    return rules


# ==========================================================================
# claimer groups: (queue, layer) -> claimed tasks merged into parts
# ==========================================================================
_CLAIMER_QUEUE = {Op.ATTN_DRAIN: abi.Queue.ATTN, Op.MOE_UPGATE_DRAIN: abi.Queue.MOE_UP, Op.MOE_DOWN_DRAIN: abi.Queue.MOE_DOWN}


def _build_groups(p: Program, out: _Sink) -> None:
    """Group claimer tasks by (queue, layer); expand each group's claimable
    tasks (``access.queue_subtasks``) into parts, merging subtasks that share
    their wait and signal counters (their regions: per buffer the bounding box,
    exact where the subtasks tile it)."""
    is_cl = np.isin(p.op, [int(o) for o in _CLAIMER_QUEUE])
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
        queue = _CLAIMER_QUEUE[op_]
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
        part_group.append(np.full(len(uk), gi))
        g.waits = sorted({(wb + int(o), wt) for o in np.unique(woff)})
        g.signals = [(sb + int(o), int(acc.queue_signal_count(queue, layer, int(o), p.geo))) for o in np.unique(soff)]
        for b in acc.subtask_boxes(sub, p.geo):
            if len(b):
                boxes.append(_merge_boxes(b, base + inv[b.task]))
    p.part_group = np.concatenate(part_group) if part_group else np.zeros(0, np.int64)
    p.part_boxes = boxes


def _part_what(queue, sub, i: int) -> str:
    f = {k: int(v[i]) for k, v in sub.fields.items()}
    if queue == abi.Queue.ATTN:
        return f"row {f['ROW']} kv_head {f['KV_HEAD']}"
    return f"expert {f['EXPERT']}"


def _merge_boxes(b, task: np.ndarray):
    """One bounding box per part for a Boxes of the subtasks."""
    o = np.argsort(task, kind="stable")
    t = task[o]
    starts = np.flatnonzero(np.r_[True, t[1:] != t[:-1]])
    lo = np.minimum.reduceat(b.lo[o], starts, axis=0)
    hi = np.maximum.reduceat(b.hi[o], starts, axis=0)
    return type(b)(b.buffer, b.write, t[starts], lo, hi)


def _header_waits(p: Program, i: int) -> list[tuple[int, int]]:
    w = p.words[i]
    return [(int(w[c]), int(w[t])) for c, t in ((H.WAIT0, H.TARGET0), (H.WAIT1, H.TARGET1)) if w[c] >= 0]


# ==========================================================================
# 2. exact targets
# ==========================================================================
def _signal_counts(p: Program):
    """Per counter: the static signal count, and the dynamic words adding to it."""
    C = p.num_counters
    ok = (p.sig >= 0) & (p.sig < C)
    static = np.bincount(p.sig[ok], minlength=C).astype(np.int64)
    dyn: dict[int, list[int]] = defaultdict(list)
    for g in p.groups:
        for c, n in g.signals:
            if not 0 <= c < C:
                continue
            if _isdyn(n):
                dyn[c].append(n)
            else:
                static[c] += n
    return static, dyn


def _all_waits(p: Program):
    """(node, counter, target, which) for every wait: task headers (which 0/1)
    and claimed tasks (which 2, node = the group's first claimer)."""
    C = p.num_counters
    ns, cs, ts, ks = [], [], [], []
    for k, (w, t) in enumerate(((p.w0, p.t0), (p.w1, p.t1))):
        i = np.flatnonzero((w >= 0) & (w < C))
        ns.append(i)
        cs.append(w[i])
        ts.append(t[i])
        ks.append(np.full(len(i), k))
    gn, gc, gt = [], [], []
    for g in p.groups:
        for c, t in g.waits:
            if 0 <= c < C:
                gn.append(int(g.claimers[0]))
                gc.append(c)
                gt.append(t)
    ns.append(_arr(gn))
    cs.append(_arr(gc))
    ts.append(_arr(gt))
    ks.append(np.full(len(gn), 2))
    return tuple(np.concatenate(x) for x in (ns, cs, ts, ks))


_WNAME = np.array(["WAIT0", "WAIT1", "claimed-task wait"])


def _check_targets(p: Program, out: _Sink) -> None:
    static, dyn = _signal_counts(p)
    node, cnt, tgt, which = _all_waits(p)
    isdyn = (tgt >= 0) & ((tgt & DYN_FLAG) != 0)
    has_dyn = np.zeros(p.num_counters, dtype=bool)
    has_dyn[list(dyn)] = True
    # purely static counters with static targets: exact equality, vectorised
    s = ~isdyn & ~has_dyn[cnt]
    exp = static[cnt]
    for i in np.flatnonzero(s & (tgt > exp)):
        c = cnt[i]
        out.add("target_high", f"{p.where(node[i])}: {_WNAME[which[i]]} {p.cname(c)} target {tgt[i]} > the {exp[i]} signals it receives: can never be satisfied (deadlock){_producers_hint(p, c)}")
    for i in np.flatnonzero(s & (tgt < exp)):
        c = cnt[i]
        out.add("target_low", f"{p.where(node[i])}: {_WNAME[which[i]]} {p.cname(c)} target {tgt[i]} < the {exp[i]} signals it receives: fires before all producers{_producers_hint(p, c)}")
    for i in np.flatnonzero(isdyn & ~has_dyn[cnt]):
        c = cnt[i]
        out.add("target_dyn_mismatch", f"{p.where(node[i])}: {_WNAME[which[i]]} {p.cname(c)} has dynamic target {_fmt_target(tgt[i])} but receives a static {static[c]} signals")
    # counters fed by a dynamic group: exactly one dynamic word, nothing else
    for i in np.flatnonzero(has_dyn[cnt]):
        c = int(cnt[i])
        if static[c] != 0 or len(dyn[c]) != 1:
            desc = " + ".join([str(int(static[c]))] * bool(static[c]) + [_fmt_target(x) for x in dyn[c]])
            out.add("target_dyn_mismatch", f"{p.where(node[i])}: {_WNAME[which[i]]} {p.cname(c)} receives {desc} signals, which no single target can equal")
            continue
        want = dyn[c][0]
        if not isdyn[i]:
            out.add("target_dyn_mismatch", f"{p.where(node[i])}: {_WNAME[which[i]]} {p.cname(c)} static target {tgt[i]} but its producers signal {_fmt_target(want)} times")
        elif (tgt[i] & DYN_INDEX_MASK) != (want & DYN_INDEX_MASK):
            out.add("target_dyn_mismatch", f"{p.where(node[i])}: {_WNAME[which[i]]} {p.cname(c)} target {_fmt_target(tgt[i])} but its producers signal {_fmt_target(want)} times")
    _check_counter_table(p, static, dyn, out)


def _check_counter_table(p: Program, static, dyn, out: _Sink) -> None:
    """The schedule's counter table (what diagnostics and the CPU VM read)
    must agree with the signals in the words."""
    if p.counters is None:
        return
    for c, ctr in enumerate(p.counters[: p.num_counters]):
        count = getattr(ctr, "count", None)
        word = getattr(ctr, "count_word", None)
        if count is None and word is None:
            continue  # not stated
        if count is not None:
            if c in dyn or static[c] != count:
                got = _fmt_target(dyn[c][0]) if c in dyn else int(static[c])
                out.add("counter_table", f"{p.cname(c)}: counter table says {count} signals per step, the words give {got}")
        elif word is not None:
            if c not in dyn or len(dyn[c]) != 1 or (dyn[c][0] & DYN_INDEX_MASK) != word or static[c]:
                got = " + ".join([str(int(static[c]))] * bool(static[c]) + [_fmt_target(x) for x in dyn.get(c, [])]) or "0"
                out.add("counter_table", f"{p.cname(c)}: counter table says dyn(word {word}) signals per step, the words give {got}")


def _producers_hint(p: Program, c: int) -> str:
    prod = np.flatnonzero(p.sig == c)
    gs = [g for g in p.groups if any(cc == c for cc, _ in g.signals)]
    if not len(prod) and not gs:
        return "; no task signals it"
    names = [p.where(i) for i in prod[:2]] + [f"the {_opname(g.op)} queue of layer {g.layer}" for g in gs[:1]]
    more = len(prod) + len(gs) - len(names)
    return "; producers: " + ", ".join(names) + (f" and {more} more" if more > 0 else "")


# ==========================================================================
# counter graph: ancestors as bitsets
# ==========================================================================
class _Closure:
    """Reflexive ancestor closure of every counter, as a packed bit matrix:
    bit s of row r is set iff every signaller of s is done once counter r is
    complete (rows >= C: merged wait sets of parts with more than two waits)."""

    def __init__(self, bits: np.ndarray) -> None:
        self.bits = bits

    def test(self, rows: np.ndarray, s: np.ndarray) -> np.ndarray:
        rows = _arr(rows)
        s = _arr(s)
        ok = (rows >= 0) & (s >= 0)
        r = np.where(ok, rows, 0)
        ss = np.where(ok, s, 0)
        return ok & (((self.bits[r, ss >> 3] >> (ss & 7)) & 1) == 1)


def _part_wait_sets(p: Program) -> list[list[int]]:
    """Wait counters of each part: its own plus its claimers' header waits
    (a claimer runs claimed tasks only after its own waits)."""
    C = p.num_counters
    hdr = [[c for c, _ in _header_waits(p, int(g.claimers[0]))] for g in p.groups]
    out = []
    for j in range(p.num_parts):
        cs = [c for c, _ in p.part_waits[j]] + hdr[int(p.part_group[j])]
        out.append(sorted({c for c in cs if 0 <= c < C}))
    return out


def _closure(p: Program, part_waits: list[list[int]]):
    """Topological order of counters, the closure matrix, and the rows each
    part's waits map to."""
    C = p.num_counters
    src, dst = [], []
    for w in (p.w0, p.w1):
        m = (w >= 0) & (w < C) & (p.sig >= 0) & (p.sig < C)
        src.append(w[m])
        dst.append(p.sig[m])
    ps, pd = [], []
    for j in range(p.num_parts):
        for s in p.part_sigs[j]:
            if 0 <= s < C:
                for w in part_waits[j]:
                    ps.append(w)
                    pd.append(s)
    src.append(_arr(ps))
    dst.append(_arr(pd))
    src = np.concatenate(src)
    dst = np.concatenate(dst)
    e = np.unique(src * C + dst) if len(src) else np.zeros(0, dtype=np.int64)
    src, dst = e // C, e % C
    # Kahn order; counters on a cycle come last (the deadlock check reports it)
    indeg = np.bincount(dst, minlength=C).tolist()
    o = np.argsort(src, kind="stable")
    bounds = np.searchsorted(src[o], np.arange(C + 1)).tolist()
    succ = dst[o].tolist()
    od = np.argsort(dst, kind="stable")
    pbounds = np.searchsorted(dst[od], np.arange(C + 1)).tolist()
    pred = src[od].tolist()
    stack = [c for c in range(C) if indeg[c] == 0]
    order = []
    while stack:
        c = stack.pop()
        order.append(c)
        for d in succ[bounds[c]:bounds[c + 1]]:
            indeg[d] -= 1
            if indeg[d] == 0:
                stack.append(d)
    if len(order) < C:
        seen = np.zeros(C, bool)
        seen[order] = True
        order += np.flatnonzero(~seen).tolist()
    refl = [0] * C
    for c in order:
        a = 1 << c
        for q in pred[pbounds[c]:pbounds[c + 1]]:
            a |= refl[q]
        refl[c] = a
    # parts: two wait counters map to their rows; more get a merged row
    rows = list(refl)
    prow = np.full((p.num_parts, 2), -1, dtype=np.int64)
    merged: dict[tuple, int] = {}
    for j, ws in enumerate(part_waits):
        if len(ws) <= 2:
            prow[j, : len(ws)] = ws
        else:
            key = tuple(ws)
            if key not in merged:
                merged[key] = len(rows)
                a = 0
                for c in ws:
                    a |= refl[c]
                rows.append(a)
            prow[j, 0] = merged[key]
    nb = max(1, (C + 7) // 8)
    buf = b"".join(x.to_bytes(nb, "little") for x in rows)
    bits = np.frombuffer(buf, dtype=np.uint8).reshape(len(rows), nb) if rows else np.zeros((0, nb), np.uint8)
    return _Closure(bits), prow, len(e)


class _HB:
    """happens-before between nodes (live tasks 0..n-1, parts n..n+P-1)."""

    def __init__(self, p: Program, cl: _Closure, prow: np.ndarray) -> None:
        self.p, self.cl = p, cl
        C = p.num_counters
        ok = lambda w: np.where((w >= 0) & (w < C), w, -1)  # noqa: E731
        self.row0 = np.concatenate([ok(p.w0), prow[:, 0]])
        self.row1 = np.concatenate([ok(p.w1), prow[:, 1]])
        psig = np.array([s[0] if len(s) == 1 and 0 <= s[0] < C else -1 for s in p.part_sigs], dtype=np.int64)
        self.sig = np.concatenate([ok(p.sig), psig])
        # parts with several signals precede b only when ALL of them do
        self.multi = {p.n + j: _arr([c for c in s if 0 <= c < C]) for j, s in enumerate(p.part_sigs) if len(s) > 1}

    def __call__(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """a happens-before b, elementwise."""
        a, b = _arr(a), _arr(b)
        t = self.cl.test
        res = t(self.row0[b], self.sig[a]) | t(self.row1[b], self.sig[a])
        if self.multi:
            for node in np.unique(a[np.isin(a, list(self.multi))]):
                m = a == node
                bb = b[m]
                okk = np.ones(len(bb), dtype=bool)
                for s in self.multi[int(node)]:
                    ss = np.full(len(bb), s)
                    okk &= t(self.row0[bb], ss) | t(self.row1[bb], ss)
                res[m] = okk
        return res


# ==========================================================================
# 3. dynamic target words
# ==========================================================================
def _check_dynamic(p: Program, hb: _HB, out: _Sink) -> None:
    tw = p.target_words
    writer: dict[int, int] = {}
    for i in np.flatnonzero(p.op == Op.ROUTE_FINALIZE):
        for name in ("UP_COUNT_WORD", "DOWN_COUNT_WORD"):
            wd = int(p.words[i, F(Op.ROUTE_FINALIZE, name)])
            if wd in writer:
                out.add("dyn_multi_writer", f"{p.where(i)}: {name} target word {wd} is also written by {p.where(writer[wd])}")
            writer[wd] = int(i)
    # readers: (task, word, where it is read)
    rt, rw, rl = [], [], []
    labels = ["TARGET0", "TARGET1", "TASK_WAIT_TARGET"]
    for lab, (col, wcol) in enumerate(((H.TARGET0, H.WAIT0), (H.TARGET1, H.WAIT1))):
        v = p.words[:, col].astype(np.int64)
        i = np.flatnonzero((p.words[:, wcol] >= 0) & (v >= 0) & ((v & DYN_FLAG) != 0))
        rt.append(i), rw.append(v[i] & DYN_INDEX_MASK), rl.append(np.full(len(i), lab))
    for op_, name in sorted(abi.DYN_CAPABLE):
        idx = np.flatnonzero(p.op == op_)
        v = p.words[idx, F(op_, name)].astype(np.int64)
        j = np.flatnonzero((v >= 0) & ((v & DYN_FLAG) != 0))
        labels.append(name)
        rt.append(idx[j]), rw.append(v[j] & DYN_INDEX_MASK), rl.append(np.full(len(j), len(labels) - 1))
    for g in p.groups:  # a claimer runs claimed tasks (and their targets) after its own waits
        for _, t in g.waits:
            if _isdyn(t):
                rt.append(g.claimers), rw.append(np.full(len(g.claimers), t & DYN_INDEX_MASK))
                rl.append(np.full(len(g.claimers), 2))
    rt, rw, rl = (np.concatenate(x).astype(np.int64) for x in (rt, rw, rl))
    m = (rw >= tw.host_words) & (rw < tw.total)
    readers = list(zip(rt[m].tolist(), rw[m].tolist(), [labels[x] for x in rl[m].tolist()]))
    dev = [r for r in readers if tw.host_words <= r[1] < tw.total]
    for i, wd, lab in dev:
        if wd not in writer:
            out.add("dyn_unwritten", f"{p.where(i)}: {lab} reads device target word {wd}, which no task writes")
    chk = [r for r in dev if r[1] in writer]
    if not chk:
        return
    ri = _arr([c[0] for c in chk])
    wi = _arr([writer[c[1]] for c in chk])
    # the device reads TARGET1 and dynamic fields after WAIT0: order through WAIT0 only
    w0 = np.where(p.w0[ri] < p.num_counters, p.w0[ri], -1)
    ok = hb.cl.test(w0, hb.sig[wi])
    # TARGET0 is read before WAIT0 completes: nothing of the task orders it
    ok &= np.array([lab != "TARGET0" for _, _, lab in chk], dtype=bool)
    for k in np.flatnonzero(~ok):
        i, wd, lab = chk[k]
        if lab == "TARGET0":
            why = "TARGET0 is read before any wait"
        elif p.w0[i] < 0:
            why = "the task has no WAIT0"
        else:
            why = f"WAIT0 {p.cname(p.w0[i])} does not follow the writer"
        out.add("dyn_order", f"{p.where(i)}: {lab} reads target word {wd} before its writer {p.where(int(wi[k]))} is done: {why}")


# ==========================================================================
# 4. claimer rule + deadlock simulation
# ==========================================================================
_NEVER = np.iinfo(np.int64).max


def _check_claimer_rule(p: Program, out: _Sink) -> None:
    """Every input of a claimed task is produced before the first claimer of
    its queue on the producer's SM (else that claimer may claim the task and
    wait on work queued behind itself). Producers: the signallers of the
    counters the claimed tasks wait on (static tasks, or another queue)."""
    S, G = p.num_sms, len(p.groups)
    if not G:
        return
    first = np.full((G, S), _NEVER)
    last = np.full((G, S), -1)
    for gi, g in enumerate(p.groups):
        np.minimum.at(first[gi], p.sm[g.claimers], p.slot[g.claimers])
        np.maximum.at(last[gi], p.sm[g.claimers], p.slot[g.claimers])
    # (group, counter) pairs joined with the static tasks signalling that counter
    pg, pc = [], []
    for gi, g in enumerate(p.groups):
        for c in sorted({c for c, _ in g.waits if 0 <= c < p.num_counters}):
            pg.append(gi)
            pc.append(c)
    pg, pc = _arr(pg), _arr(pc)
    o = np.argsort(p.sig, kind="stable")
    ss = p.sig[o]
    k, pos = _expand(np.searchsorted(ss, pc, "left"), np.searchsorted(ss, pc, "right"))
    prod = o[pos]
    gk = pg[k]
    bad = np.flatnonzero(p.slot[prod] >= first[gk, p.sm[prod]])
    for j in bad:
        i, gi = int(prod[j]), int(gk[j])
        cl = p.start[p.sm[i]] + first[gi, p.sm[i]]
        out.add("claimer_rule", f"{p.where(cl)} claims tasks that wait {p.cname(pc[k[j]])}, but that counter's producer {p.where(i)} is queued behind it on the same SM")
    # ... and the writers of the regions the claimed tasks read (inputs the
    # claimed tasks reach only through other counters)
    reported = {(int(prod[j]), int(gk[j])) for j in bad}
    for buf, t in sorted(_access_tables(p).items()):
        r = np.flatnonzero(~t.write & (t.node >= p.n))
        w = np.flatnonzero(t.write & (t.node < p.n))
        if not len(r) or not len(w):
            continue
        a, b = _pairs(t.lo[w], t.hi[w], t.lo[r], t.hi[r])
        wi = t.node[w[a]]
        gi = p.part_group[t.node[r[b]] - p.n]
        late = np.flatnonzero(p.slot[wi] >= first[gi, p.sm[wi]])
        for j in late:
            key = (int(wi[j]), int(gi[j]))
            if key in reported:
                continue
            reported.add(key)
            i, g = key
            cl = p.start[p.sm[i]] + first[g, p.sm[i]]
            out.add("claimer_rule", f"{p.where(cl)} claims tasks that read {buf}{_box(t, int(w[a[j]]))}, written by {p.where(i)} queued behind it on the same SM")
    # a queue fed by another queue: the producing queue's claimers come first on every SM holding both
    signalled_by: dict[int, set[int]] = defaultdict(set)
    for gi, g in enumerate(p.groups):
        for c, _ in g.signals:
            signalled_by[c].add(gi)
    seen: set[tuple[int, int]] = set()
    for gi, c in zip(pg.tolist(), pc.tolist()):
        for src in sorted(signalled_by.get(c, ())):
            if src == gi or (gi, src) in seen:
                continue
            seen.add((gi, src))
            f = first[gi]
            for s in np.flatnonzero((last[src] >= 0) & (f < _NEVER) & (last[src] > f))[:3]:
                out.add("claimer_rule", f"{p.where(p.start[s] + f[s])} claims tasks that wait {p.cname(c)}, produced by the {_opname(p.groups[src].op)} queue whose claimer {p.where(p.start[s] + last[src][s])} is queued behind it on the same SM")


@dataclass
class _SimResult:
    done: np.ndarray  # per live task
    rounds: int
    critical_path: int
    stuck: list[tuple[int, int, int]]  # (sm, task index, counter) of blocked heads
    received: np.ndarray  # signals each counter got


def _simulate(p: Program) -> _SimResult:
    """Greedy in-order execution: a head runs once every signaller of each of
    its wait counters is done; a claimer runs its whole group once all the
    group's waits are complete; later claimers of a finished group pass."""
    C = p.num_counters
    sig = np.where((p.sig >= 0) & (p.sig < C), p.sig, -1)
    units = np.bincount(sig[sig >= 0], minlength=C).astype(np.int64)
    g_sigs = [sorted({c for c, _ in g.signals if 0 <= c < C}) for g in p.groups]
    g_waits = [sorted({c for c, _ in g.waits if 0 <= c < C}) for g in p.groups]
    for ss in g_sigs:
        for c in ss:
            units[c] += 1  # a group signals as one unit
    rem = units.tolist()
    w0 = np.where((p.w0 >= 0) & (p.w0 < C), p.w0, -1).tolist()
    w1 = np.where((p.w1 >= 0) & (p.w1 < C), p.w1, -1).tolist()
    sgl = sig.tolist()
    cg = p.claimer_group.tolist()
    g_done = [False] * len(p.groups)
    cdepth = [0] * C
    depth_max = 0
    end = p.start[1:].tolist()
    head = p.start[:-1].tolist()
    blocked: dict[int, list[int]] = defaultdict(list)
    ready = list(range(p.num_sms))
    rounds = 0
    done = np.zeros(p.n, dtype=bool)
    done_l: list[int] = []
    while ready:
        rounds += 1
        nxt: list[int] = []
        for s in ready:
            k = head[s]
            e = end[s]
            while k < e:
                a, b = w0[k], w1[k]
                if a >= 0 and rem[a] > 0:
                    blocked[a].append(s)
                    break
                if b >= 0 and rem[b] > 0:
                    blocked[b].append(s)
                    break
                d = max(cdepth[a] if a >= 0 else 0, cdepth[b] if b >= 0 else 0)
                gi = cg[k]
                if gi >= 0 and not g_done[gi]:
                    wait_on = -1
                    for c in g_waits[gi]:
                        if rem[c] > 0:
                            wait_on = c
                            break
                    if wait_on >= 0:
                        blocked[wait_on].append(s)
                        break
                    g_done[gi] = True
                    gd = 1 + max([d] + [cdepth[c] for c in g_waits[gi]])
                    if gd > depth_max:
                        depth_max = gd
                    for c in g_sigs[gi]:
                        if gd > cdepth[c]:
                            cdepth[c] = gd
                        rem[c] -= 1
                        if rem[c] == 0 and c in blocked:
                            nxt.extend(blocked.pop(c))
                d += 1
                if d > depth_max:
                    depth_max = d
                c = sgl[k]
                if c >= 0:
                    if d > cdepth[c]:
                        cdepth[c] = d
                    rem[c] -= 1
                    if rem[c] == 0 and c in blocked:
                        nxt.extend(blocked.pop(c))
                done_l.append(k)
                k += 1
            head[s] = k
        ready = nxt
    done[done_l] = True
    stuck = sorted((s, head[s], c) for c, sms in blocked.items() for s in sms)
    received = np.bincount(sig[(sig >= 0) & done], minlength=C)
    return _SimResult(done, rounds, depth_max, stuck, received)


def _report_deadlock(p: Program, sim: _SimResult, out: _Sink) -> None:
    """One violation per stuck SM head, the heads on a wait-for cycle first
    (SM a's head waits on a producer queued on SM b behind b's head, ...)."""
    heads = {s: k for s, k, _ in sim.stuck}
    info = {}
    nxt: dict[int, int] = {}
    for s, k, c in sim.stuck:
        tgt = next((t for cc, t in _header_waits(p, k) if cc == c), None)
        gi = int(p.claimer_group[k])
        via = ""
        if tgt is None and gi >= 0:
            tgt = next((t for cc, t in p.groups[gi].waits if cc == c), None)
            via = " for its claimed tasks"
        prod = np.flatnonzero((p.sig == c) & ~sim.done)
        if len(prod):
            i = int(prod[0])
            hs = int(p.sm[i])
            behind = ""
            if hs in heads and heads[hs] <= i:
                nxt[s] = hs
                behind = (f", queued behind the blocked head of SM {hs} (slot {heads[hs] - p.start[hs]})"
                          if heads[hs] < i else " (a blocked head itself)")
            missing = f"; producer {p.where(i)} never arrived{behind}"
        else:
            gs = [g for g in p.groups if any(cc == c for cc, _ in g.signals)]
            missing = (f"; producer: the {_opname(gs[0].op)} queue of layer {gs[0].layer}, never drained"
                       if gs else "; no task signals it")
        tshow = _fmt_target(tgt) if tgt is not None else "?"
        info[s] = (f"SM {s} slot {k - p.start[s]} {_opname(int(p.op[k]))} layer {int(p.layer[k])} waits{via} "
                   f"{p.cname(c)} (value {int(sim.received[c])}, target {tshow}){missing}")
    # cycles in the wait-for graph between SMs
    first: list[int] = []
    seen: set[int] = set()
    for s0 in sorted(nxt):
        path, s = [], s0
        while s in nxt and s not in seen and s not in path:
            path.append(s)
            s = nxt[s]
        if s in path:
            cyc = path[path.index(s):]
            ring = " -> ".join(f"SM {x}" for x in cyc + [cyc[0]])
            for x in cyc:
                info[x] += f" [wait cycle {ring}]"
            first += cyc
        seen.update(path)
    for s in first + [s for s in sorted(info) if s not in first]:
        out.add("deadlock", info[s])


# ==========================================================================
# 5. hazards
# ==========================================================================
@dataclass
class _AccessTable:
    """Per buffer: node, lo[n, D], hi[n, D], is_write."""

    node: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    write: np.ndarray


def _access_tables(p: Program) -> dict[str, _AccessTable]:
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
        out[buf] = _AccessTable(
            np.concatenate([_arr(t) for t, _, _, _ in items]),
            np.concatenate([lo for _, lo, _, _ in items]),
            np.concatenate([hi for _, _, hi, _ in items]),
            np.concatenate([np.full(len(t), w) for t, _, _, w in items]),
        )
    p._tables = out
    return out


def _check_regions(p: Program, out: _Sink) -> None:
    """Every region lies inside its buffer's logical shape (a field that
    passed its own range check can still point outside, e.g. a split count)."""
    shapes = p.access.logical_shapes(p.geo)
    ignore = set(getattr(p.access, "STEP_INPUT_BUFFERS", ()))
    for buf, t in sorted(_access_tables(p).items()):
        if buf in ignore:
            continue
        if buf not in shapes:
            out.add("region_range", f"{p.where(t.node[0])} touches unknown buffer {buf}")
            continue
        shp = _arr(shapes[buf])
        if t.lo.shape[1] != len(shp):
            out.add("region_range", f"{p.where(t.node[0])}: {buf} region has {t.lo.shape[1]} dims, the buffer {len(shp)}")
            continue
        bad = ((t.lo < 0) | (t.hi > shp[None, :]) | (t.hi < t.lo)).any(axis=1)
        for e in np.flatnonzero(bad):
            what = "writes" if t.write[e] else "reads"
            out.add("region_range", f"{p.where(t.node[e])} {what} {buf}{_box(t, int(e))} outside its shape {tuple(shp.tolist())}")


def _expand(lo_idx: np.ndarray, hi_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ranges [lo_idx[i], hi_idx[i]): (i repeated, every position)."""
    cnt = np.maximum(hi_idx - lo_idx, 0)
    total = int(cnt.sum())
    ai = np.repeat(np.arange(len(cnt)), cnt)
    pos = np.arange(total) - np.repeat(np.cumsum(cnt) - cnt, cnt) + np.repeat(lo_idx, cnt)
    return ai, pos


def _pairs(lo_a, hi_a, lo_b, hi_b, max_candidates: int = 1 << 22) -> tuple[np.ndarray, np.ndarray]:
    """All (i, j) with box a_i overlapping box b_j (half-open, every dim).

    Candidates come from a join: dims where every box is one index form an
    exact composite key, and the most selective other dim an interval range
    join (b's whose lo lies within reach of a's interval); candidates are then
    filtered on every dim. Vectorised; no Python loop per box."""
    na, nb = len(lo_a), len(lo_b)
    empty = (np.zeros(0, np.int64), np.zeros(0, np.int64))
    if not na or not nb:
        return empty
    D = lo_a.shape[1]
    ext = np.maximum(hi_a.max(axis=0), hi_b.max(axis=0)) + 1
    one = [d for d in range(D) if (hi_a[:, d] - lo_a[:, d] == 1).all() and (hi_b[:, d] - lo_b[:, d] == 1).all()]
    key_a = np.zeros(na, np.int64)
    key_b = np.zeros(nb, np.int64)
    radix = 1
    for d in one:
        if radix * int(ext[d]) >= 1 << 40:
            break
        key_a = key_a * int(ext[d]) + lo_a[:, d]
        key_b = key_b * int(ext[d]) + lo_b[:, d]
        radix *= int(ext[d])
    best = None
    for d in [None] + [d for d in range(D) if d not in one]:
        if d is None:
            M, Lmax = 1, 0
            cb = key_b
            qa_lo, qa_hi = key_a, key_a
        else:
            Lmax = int((hi_b[:, d] - lo_b[:, d]).max())
            M = int(ext[d]) + Lmax + 2
            if radix * M >= 1 << 62:
                continue
            cb = key_b * M + lo_b[:, d] + Lmax
            qa_lo = key_a * M + lo_a[:, d] + 1
            qa_hi = key_a * M + hi_a[:, d] - 1 + Lmax
        ob = np.argsort(cb, kind="stable")
        cbs = cb[ob]
        lo_i = np.searchsorted(cbs, qa_lo, "left")
        hi_i = np.searchsorted(cbs, qa_hi, "right")
        n = int(np.maximum(hi_i - lo_i, 0).sum())
        if best is None or n < best[0]:
            best = (n, ob, lo_i, hi_i)
    _, ob, lo_i, hi_i = best
    out_i, out_j = [], []
    # chunk over a so the candidate arrays stay bounded
    cnt = np.maximum(hi_i - lo_i, 0)
    csum = np.cumsum(cnt)
    start = 0
    while start < na:
        base = csum[start - 1] if start else 0
        stop = int(np.searchsorted(csum, base + max_candidates, "right"))
        stop = max(stop, start + 1)
        ai, pos = _expand(lo_i[start:stop], hi_i[start:stop])
        ai += start
        bj = ob[pos]
        ok = np.all((lo_a[ai] < hi_b[bj]) & (lo_b[bj] < hi_a[ai]), axis=1)
        out_i.append(ai[ok])
        out_j.append(bj[ok])
        start = stop
    return np.concatenate(out_i), np.concatenate(out_j)


def _step_input_mask(p: Program, buf: str, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Boxes lying inside one of the step-input regions of ``buf``."""
    ok = np.zeros(len(lo), dtype=bool)
    for r in p.access.step_inputs(p.geo):
        if r.buffer == buf:
            box = _arr(r.box)
            ok |= np.all((lo >= box[None, :, 0]) & (hi <= box[None, :, 1]), axis=1)
    return ok


def _check_hazards(p: Program, hb: _HB, out: _Sink) -> int:
    checked = 0
    ignore = set(getattr(p.access, "STEP_INPUT_BUFFERS", ()))
    for buf, t in sorted(_access_tables(p).items()):
        if buf in ignore:
            continue
        wi = np.flatnonzero(t.write)
        ri = np.flatnonzero(~t.write)
        # ---- reads vs writes: ordered one way or the other
        a, b = _pairs(t.lo[wi], t.hi[wi], t.lo[ri], t.hi[ri])
        W, R = wi[a], ri[b]
        keep = t.node[W] != t.node[R]
        W, R = W[keep], R[keep]
        checked += len(W)
        wn, rn = t.node[W], t.node[R]
        before = hb(wn, rn)
        after = np.zeros(len(W), dtype=bool)
        if (~before).any():
            after[~before] = hb(rn[~before], wn[~before])
        # a read entry that some writer precedes reads that writer's data; an
        # unordered writer then overwrites it (WAR); with none, RAW
        has_before = np.zeros(len(t.node), dtype=bool)
        has_before[R[before]] = True
        racy = ~before & ~after
        raced = np.zeros(len(t.node), dtype=bool)
        raced[R[racy]] = True
        for k in np.flatnonzero(racy):
            w_, r_ = int(W[k]), int(R[k])
            if has_before[r_]:
                out.add("war", f"{buf}{_box(t, w_)}: writer {p.where(t.node[w_])} may overwrite data reader {p.where(t.node[r_])} still reads ({buf}{_box(t, r_)}): no counter orders the reader before it{_wait_hint(p, int(t.node[w_]))}")
            else:
                out.add("raw", f"{buf}{_box(t, r_)}: reader {p.where(t.node[r_])} is not ordered after writer {p.where(t.node[w_])} ({buf}{_box(t, w_)}){_wait_hint(p, int(t.node[r_]))}")
        # reads no writer precedes must be step inputs
        lonely = np.flatnonzero(~t.write & ~has_before & ~raced)
        for e in lonely[~_step_input_mask(p, buf, t.lo[lonely], t.hi[lonely])]:
            out.add("unwritten_read", f"{buf}{_box(t, int(e))}: {p.where(t.node[e])} reads data no task writes before it, and it is not a step input")
        # writes no other task reads (in any order) are wasted or misplaced
        if buf not in STEP_OUTPUTS:
            read = np.zeros(len(t.node), dtype=bool)
            read[W] = True
            for e in wi[~read[wi]]:
                out.add("dead_write", f"{buf}{_box(t, int(e))}: {p.where(t.node[e])} writes data no task reads (not a step output)")
        # ---- writes vs writes
        a, b = _pairs(t.lo[wi], t.hi[wi], t.lo[wi], t.hi[wi])
        m = t.node[wi[a]] < t.node[wi[b]]
        A, B = wi[a[m]], wi[b[m]]
        checked += len(A)
        an, bn = t.node[A], t.node[B]
        ordered = hb(an, bn)
        if (~ordered).any():
            ordered[~ordered] = hb(bn[~ordered], an[~ordered])
        for k in np.flatnonzero(~ordered):
            out.add("waw", f"{buf}{_box(t, int(A[k]))}: writers {p.where(an[k])} and {p.where(bn[k])} ({buf}{_box(t, int(B[k]))}) overlap and no counter orders them")
    return checked


def _box(t: _AccessTable, e: int) -> str:
    return "[" + ", ".join(f"{lo}:{hi}" for lo, hi in zip(t.lo[e].tolist(), t.hi[e].tolist())) + "]"


def _wait_hint(p: Program, node: int) -> str:
    if node >= p.n:
        return ""
    ws = [p.cname(c) for c in (p.w0[node], p.w1[node]) if c >= 0]
    return f"; it waits {', '.join(ws)}" if ws else "; it waits nothing"


# ==========================================================================
# entry points
# ==========================================================================
def check_program(p: Program, *, stop_early: bool = False) -> tuple[list[Violation], VerifyReport, dict[str, int]]:
    """Run the checks in CHECK_ORDER. With ``stop_early`` stop after the first
    class that found something (what :func:`verify` needs)."""
    t_all = time.perf_counter()
    out = _Sink()
    rep = VerifyReport(tasks=p.n, counters=p.num_counters)

    def lap(name, t0):
        rep.check_ms[name] = round((time.perf_counter() - t0) * 1e3, 2)

    t0 = time.perf_counter()
    _check_structure(p, out)
    if not out.of("structure"):
        _build_groups(p, out)
    if not out.of("structure"):
        _check_regions(p, out)
        _check_field_pairs(p, out)
    rep.claimers = int((p.claimer_group >= 0).sum())
    rep.groups = len(p.groups)
    lap("structure", t0)
    # out-of-range indices make every later check meaningless
    if out.of("structure"):
        return _finish(out, rep, t_all)
    t0 = time.perf_counter()
    _check_targets(p, out)
    lap("targets", t0)
    if stop_early and out.of("targets"):
        return _finish(out, rep, t_all)
    t0 = time.perf_counter()
    pw = _part_wait_sets(p)
    cl, prow, _ = _closure(p, pw)
    hb = _HB(p, cl, prow)
    used = np.zeros(p.num_counters, dtype=bool)
    for arr in (p.w0, p.w1, p.sig):
        used[arr[(arr >= 0) & (arr < p.num_counters)]] = True
    for g in p.groups:
        for c, _ in g.waits + g.signals:
            if 0 <= c < p.num_counters:
                used[c] = True
    rep.counters_used = int(used.sum())
    lap("closure", t0)
    t0 = time.perf_counter()
    _check_dynamic(p, hb, out)
    lap("dynamic", t0)
    if stop_early and out.of("dynamic"):
        return _finish(out, rep, t_all)
    t0 = time.perf_counter()
    _check_claimer_rule(p, out)
    sim = _simulate(p)
    rep.sim_rounds = sim.rounds
    rep.critical_path = sim.critical_path
    _report_deadlock(p, sim, out)
    lap("deadlock", t0)
    if stop_early and out.of("deadlock"):
        return _finish(out, rep, t_all)
    t0 = time.perf_counter()
    rep.checked_pairs = _check_hazards(p, hb, out)
    lap("hazards", t0)
    return _finish(out, rep, t_all)


def _finish(out: _Sink, rep: VerifyReport, t_all: float):
    rep.elapsed_ms = round((time.perf_counter() - t_all) * 1e3, 1)
    return out.items, rep, dict(out.dropped)


def _raise_first(items: list[Violation], dropped: dict[str, int]) -> None:
    for cls in CHECK_ORDER:
        vs = [v for v in items if v.check == cls]
        if vs:
            raise VerifyError(vs, sum(n for k, n in dropped.items() if KINDS[k] == cls))


def verify_program(p: Program) -> VerifyReport:
    items, rep, dropped = check_program(p, stop_early=True)
    _raise_first(items, dropped)
    return rep


def check(schedule, *, access=None) -> list[Violation]:
    """Every violation of ``schedule`` (kept: MAX_PER_KIND per kind)."""
    items, _, _ = check_program(Program.from_schedule(schedule, access))
    return items


def verify(schedule, *, access=None) -> VerifyReport:
    """Prove ``schedule`` safe, or raise :class:`VerifyError` for the first
    check class (in CHECK_ORDER) that finds a violation."""
    return verify_program(Program.from_schedule(schedule, access))


# ==========================================================================
# the pass (megac.passes protocol: NAME, requires, run, ensures)
# ==========================================================================
def requires(lw) -> None:
    from megac.passes import PassError

    if getattr(lw, "tasks", None) is None or getattr(lw, "task_counts", None) is None:
        raise PassError(NAME, "needs the encoded task array (run encode first)")


def run(lw) -> str:
    p = Program(lw.tasks, lw.task_counts, len(lw.counters), lw.geo, counters=lw.counters)
    rep = verify_program(p)
    lw.scratch["verify"] = rep
    return rep.summary()


def ensures(lw) -> None:
    from megac.passes import PassError

    rep = lw.scratch.get("verify")
    if rep is None or rep.tasks != int(np.asarray(lw.task_counts).sum()):
        raise PassError(NAME, "did not verify every encoded task")

"""What every opcode definition shares: the :class:`OpDef` protocol, the box
collector the access model fills, and small field helpers.

An :class:`OpDef` is the one home of one opcode (or one member of a family):

* ``op`` and its fields come from :mod:`megac.abi` (numbers live there only);
* ``node_kinds`` / ``flags`` / ``check_tiles``: how ``passes.select`` lowers
  IR tiles onto it;
* ``access``: the buffer regions its tasks read and write (``megac.access``);
* ``field_rules``: the field ranges the verifier proves (``passes.verify``);
* ``run``: its CPU semantics, executed by the VM (``megac.vm``);
* ``task_bytes``: what one task streams (``megac.costmodel``);
* ``header`` / ``device_fn``: the device header in ``opcodes/`` that
  implements it (the megakernel's dispatch is generated from these).

Claimer opcodes (:class:`ClaimerOp`) also own their queue: the records a
queue may hold, the counters a claimed record waits on and signals, its
access, cost and semantics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar

import numpy as np

from megac import abi
from megac.abi import H, Op, Queue

if TYPE_CHECKING:
    from megac.geometry import Geometry

#: KV-head columns the checked VM tracks as one (a QKV tile of part of a head
#: is a multiple of 16 columns: target tile qkv_bn)
KV_PIECE = 16
BF16 = 2
FP32 = 4

#: the buffer (access model, VM state, launch descriptor) each claimer queue lives in
QUEUE_BUFFER = {Queue.ATTN: "attn_queue", Queue.MOE_UP: "moe_up_queue", Queue.MOE_DOWN: "moe_down_queue"}
#: an upper bound that means "no bound" in a field rule
BIG = 1 << 30


# ---------------------------------------------------------------------------
# Boxes: the vectorised regions of many tasks at once
# ---------------------------------------------------------------------------
@dataclass
class Boxes:
    """Regions of ``buffer`` touched by tasks ``task`` (int64 ``[m]``):
    half-open ``[lo, hi)`` per dimension (int64 ``[m, ndim]``)."""

    buffer: str
    write: bool
    task: np.ndarray
    lo: np.ndarray
    hi: np.ndarray

    def __len__(self) -> int:
        return len(self.task)


@dataclass
class SubTasks:
    """Every task a claimer queue may hold for one layer (worst case):
    per-subtask record fields (int64 ``[m]``; merged subtasks carry a
    ``SPLIT_HI`` / ``N_TILE_HI`` range end), and the ABI offsets: a claimed
    task waits ``TASK_WAIT_BASE + wait_offset`` and signals
    ``TASK_SIGNAL_BASE + signal_offset``."""

    queue: Queue
    layer: int
    fields: dict[str, np.ndarray]
    wait_offset: np.ndarray
    signal_offset: np.ndarray

    def __len__(self) -> int:
        return len(self.wait_offset)


class BoxCollector:
    """Collects :class:`Boxes`; each dimension is a ``(lo, hi)`` pair of
    scalars or per-task arrays."""

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


def span(n: int) -> tuple[int, int]:
    """The whole dimension ``[0, n)``."""
    return (0, n)


def at(x) -> tuple:
    """One index ``[x, x+1)`` (scalar or per-task array)."""
    return (x, x + 1)


def field(words: np.ndarray, op: Op, name: str) -> np.ndarray:
    """Field ``name`` of ``op`` for every task of ``words [n, 32]`` (int64)."""
    return words[:, FIELD_INDEX[(int(op), name)]].astype(np.int64)


FIELD_INDEX = {(int(op), name): abi.field_index(op, name) for op, fs in abi.OP_FIELDS.items() for name, _ in fs}


def dyn_mask(v: np.ndarray) -> np.ndarray:
    return (v >= 0) & ((v & abi.DYN_FLAG) != 0)


def bound(values: np.ndarray, geo: "Geometry") -> np.ndarray:
    """Largest value of a count field: itself, or the bound of its target word."""
    out = values.copy()
    dm = dyn_mask(values)
    if dm.any():
        words = values[dm] & abi.DYN_INDEX_MASK
        uw, inv = np.unique(words, return_inverse=True)
        out[dm] = np.array([geo.dyn_bound(int(w)) for w in uw], dtype=np.int64)[inv.ravel()]
    return out


def resolve_dyn(v: np.ndarray, fallback: int) -> np.ndarray:
    """A count field: itself, or ``fallback`` when it is a dynamic reference."""
    v = v.astype(np.int64)
    return np.where(dyn_mask(v), fallback, v)


# ---------------------------------------------------------------------------
# Field rules (verifier)
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Limits:
    """Everything a field rule may bound a field by: the geometry, the number
    of counters and the target-word layout of one schedule."""

    geo: "Geometry"
    num_counters: int

    @property
    def tw(self) -> abi.TargetWords:
        return self.geo.target_words


#: One rule: (field name or function of the task words, lo, hi exclusive,
#: dynamic-capable). lo / hi are ints or functions of the task words.
Rule = tuple


def summed(op: Op, a: str, b: str) -> Callable:
    """Rule subject ``a + b`` (labelled for messages)."""
    fa, fb = abi.field_index(op, a), abi.field_index(op, b)

    def fn(sub):
        return sub[:, fa] + sub[:, fb]

    fn.label = f"{a}+{b}"
    return fn


def last_of(op: Op, name: str, span_: int) -> Callable:
    """Rule subject ``name + span - 1`` (a base plus the offsets it spans)."""
    f = abi.field_index(op, name)

    def fn(sub):
        return sub[:, f] + span_ - 1

    fn.label = f"{name}+{span_ - 1}"
    return fn


# ---------------------------------------------------------------------------
# The opcode definition
# ---------------------------------------------------------------------------
class OpDef:
    """One opcode's definition (see the module docstring). Subclasses set the
    class attributes and override what applies; the defaults describe an
    opcode that reads and writes nothing and costs nothing."""

    op: ClassVar[Op]
    #: IR node kinds ``passes.select`` lowers onto this opcode
    node_kinds: ClassVar[tuple[str, ...]] = ()
    #: for attention nodes: the opcode of sliding (True) or full (False) layers; None: any
    sliding: ClassVar[bool | None] = None
    #: "dense" / "moe": the layer's FFN must be of this kind; None: any layer
    ffn_kind: ClassVar[str | None] = None
    #: device header in opcodes/ implementing the opcode, and its entry point
    header: ClassVar[str | None] = None
    device_fn: ClassVar[str | None] = None
    #: device function giving the task's weight tile from its static words
    #: (``rows::WeightSpan``): the megakernel prefetches it into L2 ahead of
    #: the task's waits. None: the opcode streams no weights of its own.
    weights_fn: ClassVar[str | None] = None
    #: device function ``fn<Model>(c, words, lane)`` (warp 0, before the
    #: task's waits) that starts inputs not produced in this launch toward
    #: L2 (built in with MEGAC_ATTN_WARM or MEGAC_NORM_WARM; each function
    #: checks its own switch); None: nothing to warm
    warm_fn: ClassVar[str | None] = None

    # -- fields (abi) ------------------------------------------------------
    @property
    def name(self) -> str:
        return self.op.name

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(n for n, _ in abi.OP_FIELDS[self.op])

    @property
    def claimer(self) -> bool:
        return False

    # -- select ------------------------------------------------------------
    def flags(self, nt, geo: "Geometry") -> int | np.ndarray:
        """Flag word(s) of the tasks of node tiles ``nt``."""
        return 0

    def check_tiles(self, F: dict[str, np.ndarray], geo: "Geometry") -> str | None:
        """Why the tile fields ``F`` are out of range, or None."""
        return None

    # -- access model ------------------------------------------------------
    def access(self, acc: BoxCollector, w: np.ndarray, idx: np.ndarray, layer: np.ndarray,
               geo: "Geometry") -> None:
        """Regions tasks ``w`` (their rows in the caller's array: ``idx``) touch."""

    # -- verifier ----------------------------------------------------------
    def field_rules(self, lim: Limits) -> list[Rule] | None:
        """Field ranges; None: this opcode cannot appear in this model."""
        return []

    # -- CPU semantics -------------------------------------------------------
    def run(self, vm, words: np.ndarray) -> None:
        """Execute tasks ``words [n, 32]`` of this opcode on the VM ``vm``."""

    # -- cost ----------------------------------------------------------------
    def task_bytes(self, w: np.ndarray, geo: "Geometry", params) -> np.ndarray:
        """Bytes each task streams (weights, activations, KV, partials)."""
        return np.zeros(len(w), dtype=np.float64)


class ClaimerOp(OpDef):
    """A claimer: its tasks pull records from ``queue`` with an atomic cursor
    and run them as claimed tasks. The claimer's own access is its queue
    (and the QUEUE_LEN word); the claimed tasks' is :meth:`subtask_access`."""

    queue: ClassVar[Queue]

    @property
    def claimer(self) -> bool:
        return True

    @property
    def queue_buffer(self) -> str:
        """The queue's buffer in the access model and the VM."""
        return QUEUE_BUFFER[self.queue]

    def access(self, acc, w, idx, layer, geo) -> None:
        if self.queue == Queue.ATTN:
            acc.add(self.queue_buffer, False, idx, span(1))
        else:
            acc.add(self.queue_buffer, False, idx, at(layer))

    # -- the queue -----------------------------------------------------------
    def subtasks(self, layer: int, geo: "Geometry", merged: bool = False):
        """Every record the queue may hold for ``layer`` in a step (worst case)
        as :class:`megac.access.SubTasks`."""
        raise NotImplementedError

    def subtask_access(self, acc: BoxCollector, sub, geo: "Geometry") -> None:
        raise NotImplementedError

    def offsets(self, records: np.ndarray, geo: "Geometry") -> tuple[np.ndarray, np.ndarray]:
        """(wait offset, signal offset) of claimed ``records [m, 4]``: a claimed
        task waits ``TASK_WAIT_BASE + wait offset`` and signals
        ``TASK_SIGNAL_BASE + signal offset``."""
        raise NotImplementedError

    def signal_span(self, geo: "Geometry") -> int:
        """Counters from TASK_SIGNAL_BASE the claimed tasks may signal."""
        raise NotImplementedError

    def signal_count(self, layer: int, offset: int, geo: "Geometry") -> int:
        """Signals counter ``TASK_SIGNAL_BASE + offset`` receives in a step: a
        number, or ``abi.dyn(word)`` naming the target word that holds it."""
        raise NotImplementedError

    def claimed_work(self, geo: "Geometry", params) -> tuple[int, float]:
        """(claimed tasks, bytes per claimed task) of one queue of one layer."""
        raise NotImplementedError

    def run_claimed(self, vm, cw: np.ndarray, records: np.ndarray) -> None:
        """Run claimed ``records [m, 4]`` of claimer task ``cw``."""
        raise NotImplementedError

    def routed_queue(self, vm, cw: np.ndarray) -> np.ndarray | None:
        """The records claimer task ``cw`` derives itself (int64 ``[m, 4]``,
        its queue's length = m), or None when it claims from its queue in
        memory (every claimer but routed expert claims)."""
        return None

    def run(self, vm, words: np.ndarray) -> None:
        """Fast mode: the first claimer of a queue claims every record (an
        atomic cursor that one claimer happens to win every time); the others
        find the queue empty (each claims one index past the end)."""
        vm.drain(self, words)


def claim_sync(opdef: ClaimerOp, cw: np.ndarray, record: np.ndarray, geo) -> tuple[int, int, int]:
    """(wait counter, raw wait target, signal counter) of one claimed
    ``record`` of claimer words ``cw`` (-1: none)."""
    op = opdef.op
    base = int(cw[abi.field_index(op, "TASK_WAIT_BASE")])
    target = int(cw[abi.field_index(op, "TASK_WAIT_TARGET")])
    sbase = int(cw[abi.field_index(op, "TASK_SIGNAL_BASE")])
    woff, soff = opdef.offsets(np.asarray(record).reshape(1, -1), geo)
    wc = base + int(woff[0]) if base >= 0 else -1
    sg = sbase + int(soff[0]) if sbase >= 0 else -1
    return wc, target, sg


def header_layer(words: np.ndarray) -> np.ndarray:
    return words[:, H.LAYER].astype(np.int64)


__all__ = ["BF16", "BIG", "BoxCollector", "Boxes", "ClaimerOp", "FIELD_INDEX", "FP32", "QUEUE_BUFFER", "SubTasks", "Limits", "OpDef", "Rule",
           "at", "bound", "claim_sync", "dyn_mask", "field", "header_layer", "last_of", "resolve_dyn", "span",
           "summed"]

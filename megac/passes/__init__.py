"""The lowering passes and the state they share.

Each pass is a module with ``NAME``, ``requires(lw)``, ``run(lw) -> str``
(a one-line summary) and ``ensures(lw)``; ``requires``/``ensures`` raise
:class:`PassError` (one line, naming the pass) when a contract is broken.
``megac.passes.pipeline`` runs them in order::

    tile -> select -> depend -> order -> assign -> plan -> encode -> verify

The state is one :class:`Lowering` per schedule key. Tasks live in numpy
arrays per op node (:class:`NodeTasks`): ``tile`` fills named coordinate
fields, ``select`` turns them into int32 task words, ``depend`` fills the
header (waits, targets, signal) and the counter table, ``order`` builds the
global list, ``assign`` the SM queues, ``plan`` the buffer plan and ``encode``
the int32 ``[num_sms, max_tasks, 32]`` array.

Kept import-light: ``megac.passes.verify`` is imported on its own too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megac.errors import MegacError


class PassError(MegacError):
    """A pass's contract is broken (a compiler bug or an unsupported input)."""

    def __init__(self, pass_name: str, message: str) -> None:
        super().__init__(f"{pass_name}: {message}")
        self.pass_name = pass_name


@dataclass
class NodeTasks:
    """The tasks of one op node.

    ``claimer`` nodes hold ONE template task (their claimer word); ``order``
    emits it ``num_sms`` times. Their real work is the queue's subtasks
    (``megac.access.queue_subtasks``).
    """

    name: str
    kind: str
    layer: int
    index: int  # program order
    fields: dict[str, np.ndarray] = field(default_factory=dict)  # tile: int64 [n] per field
    out_shape: tuple[int, ...] = ()  # tile: the node's output space
    out_lo: np.ndarray | None = None  # tile: int64 [n, d] output box per tile
    out_hi: np.ndarray | None = None
    claimer: bool = False
    queue: int | None = None  # abi.Queue of a claimer
    op: Any = None  # select: abi.Op
    words: np.ndarray | None = None  # select/depend: int32 [n, 32]

    @property
    def n(self) -> int:
        if self.words is not None:
            return len(self.words)
        return len(next(iter(self.fields.values()))) if self.fields else 0


@dataclass
class Lowering:
    spec: Any
    geo: Any
    graph: Any
    order_name: str = "tuned"
    nodes: list[NodeTasks] = field(default_factory=list)
    by_name: dict[str, NodeTasks] = field(default_factory=dict)
    # depend
    counters: list = field(default_factory=list)  # list[schedule.Counter]
    counter_node: np.ndarray | None = None  # int64 [num_counters]: producer node index
    # order
    waves: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    layer_kinds: list[str] = field(default_factory=list)
    g_node: np.ndarray | None = None  # int64 [n]: node index of global task k
    g_task: np.ndarray | None = None  # int64 [n]: task index within the node
    g_claimer: np.ndarray | None = None  # int64 [n]: claimer ordinal, -1 for static tasks
    g_cursor: np.ndarray | None = None  # int64 [n]: assign's SM cursor at task k (-1: a placed task)
    g_host: np.ndarray | None = None  # int64 [n]: global position of the task whose SM task k takes (-1: none)
    # assign
    sm: np.ndarray | None = None  # int64 [n]
    slot: np.ndarray | None = None  # int64 [n]
    # plan
    plan: Any = None
    # encode
    tasks: np.ndarray | None = None
    task_counts: np.ndarray | None = None
    # bookkeeping
    log: list[dict] = field(default_factory=list)
    scratch: dict = field(default_factory=dict)

    def add_node(self, nt: NodeTasks) -> None:
        self.nodes.append(nt)
        self.by_name[nt.name] = nt

    def global_words(self) -> np.ndarray:
        """int32 [n, 32] words of the global list (after order)."""
        sizes = np.array([len(nt.words) for nt in self.nodes], dtype=np.int64)
        start = np.cumsum(sizes) - sizes
        allw = np.concatenate([nt.words for nt in self.nodes]).astype(np.int32, copy=False)
        return allw[start[self.g_node] + self.g_task]


__all__ = ["Lowering", "NodeTasks", "PassError"]

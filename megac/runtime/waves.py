"""A schedule's task lists cut into waves, for the ``waves`` baseline.

The ``waves`` backend (:mod:`megac.gpu.waves`) runs the megakernel's own
opcode device functions as one kernel launch per wave instead of one
persistent launch per step: launch ``w`` gives SM ``s`` exactly the tasks of
wave ``w`` from ``tasks[s]``, in their order. Kernel boundaries then order
the waves, so comparing it with the persistent launch isolates what the
persistent schedule itself gains (overlap of waves, no launch gaps).

A task's wave is its op node's wave in its layer (``Schedule.waves`` of the
layer's kind; an ``interleave(a,b)`` wave holds both nodes), numbered across
layers in order, the LM head last. :func:`split_waves` refuses a schedule in
which an SM's list is not in wave order or a task waits on a counter that
its own wave or a later one produces: a launch per wave must only wait on
finished launches (no co-residency needed, no deadlock possible). A
claimer runs in its wave's launch wherever its SM's list holds it (a split
claimer wave, ``{wave: attn, share: f, rest_after: b}``, puts some after
wave b).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megac import abi
from megac.abi import H, Op
from megac.errors import MegacError

#: claimers: the field naming the first counter their records wait on
_CLAIM_WAIT = {op: abi.field_index(op, "TASK_WAIT_BASE")
               for op in (Op.ATTN_DRAIN, Op.MOE_UPGATE_DRAIN, Op.MOE_DOWN_DRAIN)}


@dataclass(frozen=True)
class Wave:
    """One launch: ``tasks[s, :counts[s]]`` on SM ``s``."""

    name: str           # "L3.qkv", "L3.interleave(attn,moe_upgate)", "lm_head"
    tasks: np.ndarray   # int32 [num_sms, max_tasks, TASK_WORDS]
    counts: np.ndarray  # int32 [num_sms]


def wave_of_nodes(sched) -> tuple[np.ndarray, list[str]]:
    """(global wave index of every op node in ``sched.node_names``, the wave names)."""
    names: list[str] = []
    index: dict[tuple[int | None, str], int] = {}
    for layer, kind in enumerate(sched.layer_kinds):
        for wave, _n in sched.waves[kind]:
            parts = wave[len("interleave("):-1].split(",") if wave.startswith("interleave(") else [wave]
            for p in parts:
                index[(layer, p)] = len(names)
            names.append(f"L{layer}.{wave}")
    for wave, _n in sched.waves.get("final", []):
        index[(None, wave)] = len(names)
        names.append(wave)
    out = np.empty(len(sched.node_names), dtype=np.int64)
    for i, node in enumerate(sched.node_names):
        layer, kind = (int(node[1:node.index(".")]), node[node.index(".") + 1:]) if node.startswith("L") \
            else (None, node)
        if (layer, kind) not in index:
            raise MegacError(f"waves: op node {node} is in no wave of its layer")
        out[i] = index[(layer, kind)]
    return out, names


def split_waves(sched) -> list[Wave]:
    """``sched``'s task lists as one :class:`Wave` per launch (see the module
    docstring); waves with no task are left out."""
    node_wave, names = wave_of_nodes(sched)
    S = sched.num_sms
    wave_at = np.full((S, sched.tasks.shape[1]), -1, dtype=np.int64)
    sm, slot = sched.global_order[:, 0], sched.global_order[:, 1]
    wave_at[sm, slot] = node_wave[sched.task_node]
    counter_wave = {i: node_wave[sched.node_names.index(c.producer)] for i, c in enumerate(sched.counters)
                    if c.producer in sched.node_names}
    claimer_ops = np.array([int(op) for op in abi.CLAIMERS], dtype=np.int64)
    for s in range(S):
        w = wave_at[s, : sched.task_counts[s]]
        if (w < 0).any():
            raise MegacError(f"waves: SM {s} runs a task of no op node")
        # a claimer joins its wave's launch wherever its SM's list holds it
        # (a split claimer wave's later claimers: the launch's claimers drain
        # the queue together, so its place among the SM's tasks is moot)
        static = ~np.isin(sched.tasks[s, : sched.task_counts[s], H.OPCODE], claimer_ops)
        if (np.diff(w[static]) < 0).any():
            raise MegacError(f"waves: SM {s}'s tasks are not in wave order")
        for k in range(int(sched.task_counts[s])):
            t = sched.tasks[s, k]
            waits = [int(t[H.WAIT0]), int(t[H.WAIT1])]
            op = int(t[H.OPCODE])
            if op in _CLAIM_WAIT:
                waits.append(int(t[_CLAIM_WAIT[op]]))
            for c in waits:
                if c >= 0 and counter_wave.get(c, -1) >= w[k]:
                    raise MegacError(f"waves: SM {s} task {k} ({names[w[k]]}) waits on counter {c} of its own "
                                     f"or a later wave ({names[counter_wave[c]]})")
    out = []
    for wi, name in enumerate(names):
        sel = [np.flatnonzero(wave_at[s, : sched.task_counts[s]] == wi) for s in range(S)]
        counts = np.array([len(x) for x in sel], dtype=np.int32)
        if not counts.any():
            continue
        tasks = np.zeros((S, int(counts.max()), sched.tasks.shape[2]), dtype=np.int32)
        for s, x in enumerate(sel):
            tasks[s, : len(x)] = sched.tasks[s, x]
        out.append(Wave(name, tasks, counts))
    return out


__all__ = ["Wave", "split_waves", "wave_of_nodes"]

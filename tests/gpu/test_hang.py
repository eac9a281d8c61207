"""The watchdog report's root-cause chase (no GPU: hand-built stuck states)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from megac import abi
from megac.abi import H, Op
from megac.gpu import hang


def _sched(queues: list[list[tuple[int, int, int]]], n_counters: int):
    """queues[s] = [(wait counter, target, signal counter), ...]"""
    m = max(len(q) for q in queues)
    t = np.full((len(queues), m, abi.TASK_WORDS), -1, dtype=np.int32)
    for s, q in enumerate(queues):
        for j, (c, tgt, sig) in enumerate(q):
            t[s, j, H.OPCODE] = int(Op.ADD_RMSNORM)
            t[s, j, H.LAYER] = j
            t[s, j, H.WAIT0], t[s, j, H.TARGET0] = c, tgt
            t[s, j, H.WAIT1], t[s, j, H.TARGET1] = -1, 0
            t[s, j, H.SIGNAL] = sig
            t[s, j, H.FLAGS] = 0
    return SimpleNamespace(tasks=t, task_counts=np.array([len(q) for q in queues]), geometry=None,
                           counters=[SimpleNamespace(name=f"c{i}") for i in range(n_counters)])


def _record(sm, task, counter, value, target):
    return dict(sm=sm, task=task, opcode=int(Op.ADD_RMSNORM), counter=counter, value=value, target=target, layer=task,
                kind=int(abi.ErrorKind.COUNTER_TIMEOUT))


def test_chase_reaches_the_counter_whose_target_no_signal_can_meet() -> None:
    # SM0 waits c0 (signalled by SM1's 2nd task); SM1's 2nd task waits c2 for 2,
    # but only SM2 signals c2, once, and SM2 is done.
    sched = _sched([[(0, 1, -1)], [(-1, 0, 1), (2, 2, 0)], [(-1, 0, 2)]], 3)
    counters = np.array([0, 1, 1])
    progress = np.array([0, 1, 1])  # SM1 started its task 1, SM2 finished (its count)
    text, missing = hang.describe(sched, _record(0, 0, 0, 0, 1), counters, progress, np.zeros(4, np.int32), 1.0)
    assert missing == ["SM 1 task 1 ADD_RMSNORM layer 1"]
    root = text.split("Root cause:")[1]
    assert root.startswith(" counter 2 stays at 1 of 2: no task left")
    assert "SM 1 task 1 ADD_RMSNORM layer 1 waits counter 2 (1 of 2)" in text


def test_chase_names_a_wait_cycle() -> None:
    sched = _sched([[(0, 1, 1)], [(1, 1, 0)]], 2)
    text, _ = hang.describe(sched, _record(0, 0, 0, 0, 1), np.array([0, 0]), np.array([0, 0]),
                            np.zeros(4, np.int32), 1.0)
    assert "wait cycle: SM 0 is already on the chain" in text


def test_finished_ctas_are_not_blamed_and_dynamic_targets_resolve() -> None:
    # SM1 signalled c0 once and finished; SM0 waits c0 for the value of target word 3 (= 2)
    sched = _sched([[(0, abi.dyn(3), -1)], [(-1, 0, 0)]], 1)
    targets = np.array([0, 0, 0, 2], np.int32)
    assert hang.producers_not_run(sched, 0, np.array([0, 1])) == []
    assert hang.unmet_wait(sched, 0, 0, np.array([1]), targets).target == 2
    text, missing = hang.describe(sched, _record(0, 0, 0, 1, 2), np.array([1]), np.array([0, 1]), targets, 1.0)
    assert missing == [] and "counter 0 stays at 1 of 2" in text

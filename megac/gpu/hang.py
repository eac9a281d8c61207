"""What a watchdog abort of the megakernel means, in words.

The kernel records the first wait that timed out (SM, task, counter, value,
target) and where every CTA had got to (``progress``: the task it started
last, or its task count once all of them signalled). From that and the
counters at exit this module names the producers of the awaited counter that
never ran, then follows the chain: each such producer's CTA is itself stuck
on some task whose wait is unmet, whose producers are stuck ... until the
chain reaches

* a counter none of whose producers is pending: its target exceeds every
  signal that can arrive (a counting bug in the schedule), or
* a CTA already on the chain: a wait cycle (an ordering bug), or
* a CTA stuck inside a claimer (its claimed tasks' waits are not in the task
  words; the chain stops there).

The root cause comes first in the message: the task that hung is usually a
bystander.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megac import abi
from megac.abi import H, Op


@dataclass(frozen=True)
class Stuck:
    """One link of the chain: CTA ``sm`` at ``slot`` waits ``counter``."""

    sm: int
    slot: int
    op: str
    layer: int
    counter: int
    value: int
    target: int

    def __str__(self) -> str:
        return (f"SM {self.sm} task {self.slot} {self.op} layer {self.layer} waits counter {self.counter} "
                f"({self.value} of {self.target})")


def _signals(sched, w: np.ndarray, counter: int) -> bool:
    if int(w[H.SIGNAL]) == counter:
        return True
    op = int(w[H.OPCODE])
    if op in abi.CLAIMERS:
        from megac.ops import opdef  # noqa: PLC0415 (ops imports the passes; keep this module light)

        d = opdef(op)
        base = int(w[abi.field_index(d.op, "TASK_SIGNAL_BASE")])
        return base >= 0 and base <= counter < base + d.signal_span(sched.geometry)
    return False


def producers_not_run(sched, counter: int, progress: np.ndarray) -> list[tuple[int, int]]:
    """(sm, slot) of every task of ``sched`` that signals ``counter`` (itself
    or through its claimed tasks) at or after the task its CTA had reached."""
    if counter < 0:
        return []
    out = []
    tasks, counts = np.asarray(sched.tasks), np.asarray(sched.task_counts)
    for s in range(tasks.shape[0]):
        reached = int(progress[s]) if s < len(progress) else 0
        for j in range(reached, int(counts[s])):
            if _signals(sched, tasks[s, j], counter):
                out.append((s, j))
    return out


def _target(value: int, targets: np.ndarray) -> int:
    return int(targets[value & ~abi.DYN_FLAG]) if abi.is_dyn(value) else int(value)


def unmet_wait(sched, sm: int, slot: int, counters: np.ndarray, targets: np.ndarray) -> Stuck | None:
    """The first header wait of task ``slot`` on ``sm`` whose counter is below
    its target, or None (the task waits inside a claimer, or is running)."""
    w = np.asarray(sched.tasks)[sm, slot]
    for c_f, t_f in ((H.WAIT0, H.TARGET0), (H.WAIT1, H.TARGET1)):
        c = int(w[c_f])
        if c < 0:
            continue
        t = _target(int(w[t_f]), targets)
        v = int(counters[c]) if c < len(counters) else -1
        if v < t:
            return Stuck(sm, slot, _opname(int(w[H.OPCODE])), int(w[H.LAYER]), c, v, t)
    return None


def _opname(op: int) -> str:
    try:
        return Op(op).name
    except ValueError:
        return f"opcode {op}"


def chase(sched, first: Stuck, counters: np.ndarray, progress: np.ndarray, targets: np.ndarray,
          limit: int = 64) -> tuple[list[Stuck], str]:
    """The chain of waits from ``first`` and a sentence on where it ends."""
    chain, seen = [first], {first.sm}
    cur = first
    for _ in range(limit):
        pending = producers_not_run(sched, cur.counter, progress)
        if not pending:
            return chain, (f"counter {cur.counter} stays at {cur.value} of {cur.target}: no task left to signal it "
                           f"(its target exceeds the signals the schedule sends)")
        sm, slot = pending[0]
        at = int(progress[sm]) if sm < len(progress) else 0
        if sm in seen:
            return chain, f"wait cycle: SM {sm} is already on the chain"
        seen.add(sm)
        nxt = unmet_wait(sched, sm, at, counters, targets)
        if nxt is None:
            w = np.asarray(sched.tasks)[sm, at]
            return chain, (f"SM {sm} is inside task {at} {_opname(int(w[H.OPCODE]))} layer {int(w[H.LAYER])} "
                           f"(before producer task {slot}), whose header waits are met: it waits on claimed "
                           f"work or never finished")
        chain.append(nxt)
        cur = nxt
    return chain, f"chain longer than {limit} links"


def describe(sched, record: dict, counters: np.ndarray, progress: np.ndarray, targets: np.ndarray,
             watchdog_s: float) -> tuple[str, list[str]]:
    """The one-paragraph report of a hang and the pending producers of the
    awaited counter (as text)."""
    kind = abi.ErrorKind(record["kind"]).name if record["kind"] in abi.ErrorKind._value2member_map_ else record["kind"]
    c = record["counter"]
    cname = sched.counters[c].name if 0 <= c < len(sched.counters) else "?"
    tasks = np.asarray(sched.tasks)
    missing = []
    for s, j in producers_not_run(sched, c, progress):
        w = tasks[s, j]
        missing.append(f"SM {s} task {j} {_opname(int(w[H.OPCODE]))} layer {int(w[H.LAYER])}"
                       + (" (claimed tasks)" if int(w[H.OPCODE]) in abi.CLAIMERS else ""))
    head = (f"megakernel hang ({kind}): SM {record['sm']} task {record['task']} {_opname(record['opcode'])} layer "
            f"{record['layer']} waited on counter {c} {cname}: {record['value']} of {record['target']} after the "
            f"watchdog ({watchdog_s:g} s)")
    if c < 0 or not 0 <= record["sm"] < tasks.shape[0]:
        return head, missing
    first = Stuck(record["sm"], record["task"], _opname(record["opcode"]), record["layer"], c,
                  int(counters[c]) if c < len(counters) else record["value"], record["target"])
    chain, end = chase(sched, first, counters, progress, targets)
    text = f"{head}. Root cause: {end}"
    if len(chain) > 1:
        text += ". Chain: " + " <- ".join(str(x) for x in chain[:8]) + (" ..." if len(chain) > 8 else "")
    if missing:
        text += "; producers that never arrived: " + ", ".join(missing[:6]) + (
            f" (+{len(missing) - 6} more)" if len(missing) > 6 else "")
    return text, missing


__all__ = ["Stuck", "chase", "describe", "producers_not_run", "unmet_wait"]

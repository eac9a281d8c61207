"""The one walker of in-order SM queues: the execution semantics of a
schedule, shared by the verifier's deadlock proof, the cost model's
timeline and the CPU VM's checked mode.

Each SM runs its queue ``tasks[s, :task_counts[s]]`` in order. A task goes
through phases, as the device does:

    START   read TARGET0 (it may be a dynamic target word)
    WAIT0   wait until counter WAIT0 reaches TARGET0; then read TARGET1
            (and any dynamic field: the device reads them after WAIT0)
    WAIT1   wait until counter WAIT1 reaches TARGET1
    run     a static task runs and signals SIGNAL;
            a claimer CLAIMs a record, HOLDs it until the claimed task's
            waits are met, runs it, signals what it signals, and claims
            again until the queue is drained; then it signals SIGNAL.
    RUN, RUN_CLAIMED
            (``time`` policy only) the task or claimed task runs, and its
            end is not known yet: it depends on what starts meanwhile (the
            cost model's streams share the GPU's bandwidth fairly). The
            hooks' own events (:meth:`Hooks.next_event`) interleave with
            the SMs' turns in time order and :meth:`Walker.resume` the SM.

What "reaches", "runs" and "claims" mean is the user's: a
:class:`Counters` model (``UnitCounters``: a counter is complete once every
signalling unit is done, with a release time for the cost model;
``ValueCounters``: the device's counts against resolved targets) and
:class:`Hooks` (the verifier records depth, the cost model time and bytes,
the VM executes the opcodes and tracks happens-before). A blocked SM waits
on its counter's list and is woken when that counter is signalled.

Policies (:meth:`Walker.run`): ``greedy`` (each ready SM runs as far as it
can, round after round: the verifier), ``time`` (the SM free earliest runs
its next task or claimed task: the cost model), ``round_robin`` /
``random`` (each ready SM makes one phase step per round, in SM order or
shuffled with 1..3 steps: the VM's interleavings).
"""

from __future__ import annotations

import heapq
import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

START, WAIT0, WAIT1, CLAIM, HELD, RUN, RUN_CLAIMED = range(7)
PHASE_NAMES = ("START", "WAIT0", "WAIT1", "CLAIM", "HELD", "RUN", "RUN_CLAIMED")


@dataclass
class Claim:
    """One claimed piece of work: its waits ``(counter, target)``, the
    counters the walker signals when it ends, and whatever the hooks need."""

    waits: list[tuple[int, int]]
    signals: list[int] = field(default_factory=list)
    payload: Any = None


@dataclass
class Blocked:
    """A stuck SM head: task ``task`` (SM-major live index) waits in
    ``phase`` on ``counter`` for ``target``."""

    sm: int
    task: int
    phase: int
    counter: int
    target: int


class UnitCounters:
    """A counter is complete once every one of its ``units`` signalling
    units (tasks, or claimer groups) is done; its waiters may start
    ``latency`` after the last signal."""

    def __init__(self, units: np.ndarray, latency: float = 0.0) -> None:
        self.rem = [int(u) for u in units]
        self.last = [0.0] * len(self.rem)
        self.latency = latency

    def ready(self, c: int, target: int) -> bool:
        return self.rem[c] <= 0

    def release(self, c: int) -> float:
        return self.last[c] + self.latency

    def signal(self, c: int, t: float) -> bool:
        """Count one unit; True when waiters may now pass."""
        self.rem[c] -= 1
        if t > self.last[c]:
            self.last[c] = t
        return self.rem[c] <= 0


class ValueCounters:
    """The device's counters: a wait passes once ``values[c] >= target``."""

    def __init__(self, values) -> None:
        self.values = values

    def ready(self, c: int, target: int) -> bool:
        return self.values[c] >= target

    def release(self, c: int) -> float:
        return 0.0

    def signal(self, c: int, t: float) -> bool:
        self.values[c] += 1
        return True


class Hooks:
    """What running means; every method may be overridden. The walker sets
    ``self.walker`` to itself."""

    walker: "Walker"

    def target(self, s: int, k: int, which: int, raw: int) -> int:
        """The value a wait waits for (``which`` 0/1: TARGET0/1)."""
        return raw

    def start(self, s: int, k: int) -> None:
        """Task ``k`` becomes the head of SM ``s``."""

    def acquired(self, s: int, k: int, c: int) -> None:
        """A wait of task ``k`` on counter ``c`` (or of its claimed task) passed."""

    def after_wait0(self, s: int, k: int) -> None:
        """WAIT0 passed: the task reads TARGET1 and its dynamic fields."""

    def run_task(self, s: int, k: int, t: float) -> float | None:
        """Run static task ``k`` starting at ``t``; its end time, or None
        under the ``time`` policy when the end depends on work that starts
        later (streams sharing bandwidth): the hooks then call
        :meth:`Walker.resume` once it is known (see :meth:`next_event`)."""
        return t

    def claim(self, s: int, k: int, t: float) -> Claim | None:
        """Claimer ``k`` claims its next piece, or None: the queue is drained."""
        return None

    def run_claimed(self, s: int, k: int, claim: Claim, t: float) -> float | None:
        """Run a claimed piece starting at ``t``; its end time, or None as
        for :meth:`run_task`."""
        return t

    def next_event(self) -> float:
        """Time of the hooks' own next event (``time`` policy): the walker
        fires it (:meth:`fire`) before any SM turn that comes later."""
        return float("inf")

    def fire(self) -> None:
        """Process the hooks' next event (it may :meth:`Walker.resume` SMs)."""

    def finish(self, s: int, k: int, t: float) -> float:
        """Claimer ``k`` found its queue drained at ``t``; its end time."""
        return t


class Walker:
    """Walks the SM queues of one decoded schedule (``start``/``end``: the
    live-task range of each SM in SM-major order; per task its header and
    whether it is a claimer)."""

    def __init__(self, start, w0, t0, w1, t1, sig, claimer, counters, hooks: Hooks, *,
                 pre=None, lead=None) -> None:
        self.start = [int(x) for x in start[:-1]]
        self.end = [int(x) for x in start[1:]]
        self.head = list(self.start)
        self.w0, self.t0 = [int(x) for x in w0], [int(x) for x in t0]
        self.w1, self.t1 = [int(x) for x in w1], [int(x) for x in t1]
        self.sig = [int(x) for x in sig]
        self.claimer = [bool(x) for x in claimer]
        n = len(self.sig)
        #: per task, time (the cost model's) it spends before its header waits (a GEMM
        #: issues its first weight stages, then waits: that work overlaps the wait) and,
        #: for a claimer, after them before its first claim (a routed claimer ranks the
        #: rows); zeros unless given
        self.pre = [float(x) for x in pre] if pre is not None else [0.0] * n
        self.lead = [float(x) for x in lead] if lead is not None else [0.0] * n
        self.counters = counters
        self.hooks = hooks
        hooks.walker = self  # hooks may signal counters themselves (walker.signal)
        S = len(self.start)
        self.num_sms = S
        self.phase = [START] * S
        self.target = [0] * S  # resolved target of the current wait
        self.held: list[Claim | None] = [None] * S
        self.held_i = [0] * S  # waits of the held claim passed so far
        self.now = [0.0] * S
        self.waiting: dict[int, list[int]] = defaultdict(list)
        self.blocked_on: list[int] = [-1] * S
        #: the SM runs a piece of work whose end the hooks have yet to give (resume)
        self.running: list[bool] = [False] * S
        self.rounds = 0
        #: pieces of work each SM finished (tasks, claimed pieces, drained claimers)
        self.turns = [0] * S
        self._woken: list[int] = []
        self._policy = "greedy"
        self._heap: list[tuple[float, int]] = []
        # hooks that leave the waits alone (the verifier, the cost model) let a
        # static task run START..SIGNAL in one call (_fast_task)
        base = Hooks
        self._plain = all(getattr(type(hooks), m) is getattr(base, m)
                          for m in ("target", "start", "acquired", "after_wait0"))

    # ------------------------------------------------------------------ signals
    def signal(self, c: int, t: float) -> None:
        """Counter ``c`` receives one signal at time ``t``; wake its waiters."""
        if c < 0:
            return
        if self.counters.signal(c, t) and c in self.waiting:
            for s in self.waiting.pop(c):
                self.blocked_on[s] = -1
                if self._policy == "time":
                    heapq.heappush(self._heap, (max(self.now[s], self.counters.release(c)), s))
                else:
                    self._woken.append(s)

    def _block(self, s: int, c: int) -> bool:
        self.waiting[c].append(s)
        self.blocked_on[s] = c
        return False

    def done(self, s: int) -> bool:
        return self.head[s] >= self.end[s]

    # ------------------------------------------------------------------ one phase
    def step(self, s: int) -> bool:
        """Advance SM ``s`` by one phase; False if it is blocked or done."""
        k = self.head[s]
        if k >= self.end[s]:
            return False
        h = self.hooks
        ph = self.phase[s]
        if ph == START:
            self.now[s] += self.pre[k]
            h.start(s, k)
            self.target[s] = h.target(s, k, 0, self.t0[k]) if self.w0[k] >= 0 else 0
            self.phase[s] = WAIT0
            return True
        if ph == WAIT0:
            c = self.w0[k]
            if c >= 0:
                if not self.counters.ready(c, self.target[s]):
                    return self._block(s, c)
                self.now[s] = max(self.now[s], self.counters.release(c))
                h.acquired(s, k, c)
            h.after_wait0(s, k)
            self.target[s] = h.target(s, k, 1, self.t1[k]) if self.w1[k] >= 0 else 0
            self.phase[s] = WAIT1
            return True
        if ph == WAIT1:
            c = self.w1[k]
            if c >= 0:
                if not self.counters.ready(c, self.target[s]):
                    return self._block(s, c)
                self.now[s] = max(self.now[s], self.counters.release(c))
                h.acquired(s, k, c)
            if self.claimer[k]:
                self.now[s] += self.lead[k]
                self.phase[s] = CLAIM
                return True
            e = h.run_task(s, k, self.now[s])
            if e is None:
                return self._run_deferred(s, RUN)
            self.now[s] = e
            self._next(s, k)
            return True
        if ph == CLAIM:
            cl = h.claim(s, k, self.now[s])
            if cl is None:
                self.now[s] = h.finish(s, k, self.now[s])
                self._next(s, k)
                return True
            self.held[s], self.held_i[s] = cl, 0
            self.phase[s] = HELD
            return True
        if ph in (RUN, RUN_CLAIMED):
            return False  # its end comes through resume()
        # HELD
        cl = self.held[s]
        while self.held_i[s] < len(cl.waits):
            c, tgt = cl.waits[self.held_i[s]]
            if c >= 0:
                if not self.counters.ready(c, tgt):
                    return self._block(s, c)
                self.now[s] = max(self.now[s], self.counters.release(c))
                h.acquired(s, k, c)
            self.held_i[s] += 1
        e = h.run_claimed(s, k, cl, self.now[s])
        if e is None:
            return self._run_deferred(s, RUN_CLAIMED)
        self.now[s] = e
        self._claimed_done(s)
        return True

    def _claimed_done(self, s: int) -> None:
        self.turns[s] += 1
        for c in self.held[s].signals:
            self.signal(c, self.now[s])
        self.held[s] = None
        self.phase[s] = CLAIM

    def _run_deferred(self, s: int, phase: int) -> bool:
        if self._policy != "time":
            raise RuntimeError("walk: a piece of work without an end time needs the time policy")
        self.phase[s] = phase
        self.running[s] = True
        return False

    def resume(self, s: int, t: float) -> None:
        """The deferred piece of work SM ``s`` runs ends at ``t``: finish it
        (signal, move on) and let the SM take its next turn at ``t``."""
        if not self.running[s]:
            raise RuntimeError(f"walk: SM {s} has no piece of work to resume")
        self.running[s] = False
        self.now[s] = t
        if self.phase[s] == RUN:
            self._next(s, self.head[s])
        else:
            self._claimed_done(s)
        if not self.done(s) and self.blocked_on[s] < 0:
            heapq.heappush(self._heap, (t, s))

    def _fast_task(self, s: int) -> bool:
        """Run the static task at the head of SM ``s`` (phase START, plain
        hooks) in one call: False when it blocks (left in WAIT0 / WAIT1)."""
        k = self.head[s]
        cnt = self.counters
        a, b = self.w0[k], self.w1[k]
        now = self.now[s] + self.pre[k]
        if a >= 0:
            if not cnt.ready(a, self.t0[k]):
                self.phase[s], self.target[s] = WAIT0, self.t0[k]
                self.now[s] = now
                return self._block(s, a)
            r = cnt.release(a)
            if r > now:
                now = r
        if b >= 0:
            if not cnt.ready(b, self.t1[k]):
                self.phase[s], self.target[s] = WAIT1, self.t1[k]
                self.now[s] = now
                return self._block(s, b)
            r = cnt.release(b)
            if r > now:
                now = r
        e = self.hooks.run_task(s, k, now)
        if e is None:
            self.now[s] = now
            return self._run_deferred(s, RUN)
        self.now[s] = e
        self._next(s, k)
        return True

    def _advance(self, s: int, one_turn: bool) -> bool:
        """Run SM ``s`` until it blocks or finishes (or, with ``one_turn``,
        finishes one piece of work); False when it stopped without moving."""
        moved = False
        before = self.turns[s]
        while self.head[s] < self.end[s]:
            if self._plain and self.phase[s] == START and not self.claimer[self.head[s]]:
                if not self._fast_task(s):
                    return moved
            elif not self.step(s):
                return moved
            moved = True
            if one_turn and self.turns[s] != before:
                break
        return moved

    def _next(self, s: int, k: int) -> None:
        """Task ``k`` is done: signal, move the head."""
        self.turns[s] += 1
        self.signal(self.sig[k], self.now[s])
        self.head[s] = k + 1
        self.phase[s] = START

    # ------------------------------------------------------------------ policies
    def run(self, policy: str = "greedy", seed: int = 0) -> list[Blocked]:
        """Walk until no SM can move; returns the stuck heads (empty: every
        queue completed)."""
        self._policy = policy
        S = self.num_sms
        if policy == "time":
            self._heap = [(0.0, s) for s in range(S) if not self.done(s)]
            heapq.heapify(self._heap)
            h = self.hooks
            while True:
                te = h.next_event()
                if te < float("inf") and (not self._heap or te <= self._heap[0][0]):
                    h.fire()
                    continue
                if not self._heap:
                    break
                t, s = heapq.heappop(self._heap)
                if self.done(s) or self.blocked_on[s] >= 0 or self.running[s]:
                    continue
                self.now[s] = max(self.now[s], t)
                # one piece of work (a task, a claimed piece, a drained claimer) per turn
                self._advance(s, one_turn=True)
                if not self.done(s) and self.blocked_on[s] < 0 and not self.running[s]:
                    heapq.heappush(self._heap, (self.now[s], s))
            return self.stuck()
        if policy not in ("greedy", "round_robin", "random"):
            raise ValueError(f"unknown walk policy {policy!r} (greedy | time | round_robin | random)")
        rng = random.Random(seed)
        ready = [s for s in range(S) if not self.done(s)]
        while ready:
            self.rounds += 1
            self._woken = []
            if policy == "random":
                rng.shuffle(ready)
            keep = []
            for s in ready:
                if policy == "greedy":
                    self._advance(s, one_turn=False)
                else:
                    n = rng.randint(1, 3) if policy == "random" else 1
                    for _ in range(n):
                        if not self.step(s):
                            break
                if not self.done(s) and self.blocked_on[s] < 0:
                    keep.append(s)
            ready = keep + [s for s in self._woken if s not in keep and not self.done(s)]
            if policy == "round_robin":
                ready.sort()
        return self.stuck()

    def stuck(self) -> list[Blocked]:
        out = []
        for c, sms in self.waiting.items():
            for s in sms:
                k = self.head[s]
                if self.phase[s] == HELD:
                    tgt = next((t for cc, t in self.held[s].waits if cc == c), 0)
                else:
                    tgt = self.target[s]
                out.append(Blocked(s, k, self.phase[s], c, tgt))
        return sorted(out, key=lambda b: (b.sm, b.task))

    def done_mask(self) -> np.ndarray:
        """Per live task: finished."""
        n = self.end[-1] if self.end else 0
        out = np.zeros(n, dtype=bool)
        for s in range(self.num_sms):
            out[self.start[s]:self.head[s]] = True
        return out


__all__ = ["Blocked", "CLAIM", "Claim", "HELD", "Hooks", "PHASE_NAMES", "RUN", "RUN_CLAIMED", "START", "UnitCounters",
           "ValueCounters", "WAIT0", "WAIT1", "Walker"]

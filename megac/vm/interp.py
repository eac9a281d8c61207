"""The VM interpreter: runs one schedule's task words over a DeviceState.

::

    it = Interpreter(state)
    it.run_fast()                                   # global order, coalesced runs
    it.run_checked(policy="random", seed=3)          # SM queues interleaved, happens-before checked

**Fast mode** executes the tasks in the schedule's ``global_order`` (a
topological order, claimers included: the ``order`` pass guarantees every
input of a claimed task precedes the first claimer of its queue). Consecutive
tasks of one opcode and layer form a *run* executed by one vectorised call
(``VM.run`` takes ``[n, 32]`` words) unless a task of the run waits on a
counter an earlier task of the run signals. Claimers execute in place: the
first drains its queue. No counters, no tracking (``check_order=True`` keeps
the counters and raises if a task or claimed record would run before its
waits are satisfied: a non-topological global order).

**Checked mode** runs the SM queues ``tasks[s, :task_counts[s]]`` interleaved
(``policy="round_robin"``: one step per SM in index order; ``"random"``:
a seeded shuffle of the SMs and 1..3 steps each per round). A task starts by
reading a dynamic TARGET0 (before any wait), waits WAIT0, reads TARGET1 and
its dynamic fields, waits WAIT1, executes and signals. A claimer, after its
header waits, claims records one step at a time through an atomic-cursor
emulation (``queue_heads[queue, layer]``); each claimed record is its own
event that waits ``TASK_WAIT_BASE + offset`` (the claimer's header waits
included), executes and signals ``TASK_SIGNAL_BASE + offset`` (offsets per
``abi.QUEUE_RECORDS`` docs: attention waits per kv head and signals per (row,
kv head); MoE up waits the gather counter and signals per expert; MoE down
waits per expert and signals the layer counter).

Happens-before is tracked exactly: every executed task / claimed record is
an event with a bitset of the events that happen before it, built ONLY from
counter waits (a wait acquires the union of what every signaller of the
counter had released). Program order on an SM orders nothing (the device
overlaps consecutive tasks). Every buffer element remembers its last writer
and the readers since; scratch is poisoned with NaN. Errors:

* :class:`DeadlockError`: no SM can progress; names every blocked SM's slot,
  opcode, layer, counter, value, target and the producers that never ran;
* :class:`EarlyReadError`: a read of an element whose writer is not ordered
  before the reader by counters (or that nothing has written and is no step
  input);
* :class:`OverwriteError`: a write while a reader of the old value, or its
  writer, is not ordered before the writer (write-after-read / -write).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megac import abi
from megac.abi import H, Op, Queue
from megac.errors import BadTaskError, VMError
from megac.ops import opdef
from megac.ops.base import KV_PIECE, claim_sync
from megac.passes.hb import counter_closure, part_wait_sets
from megac.passes.program import Program, build_groups
from megac.passes.verify.targets import check_targets
from megac.passes.violations import Sink
from megac.passes.walk import HELD, PHASE_NAMES, WAIT0, WAIT1, Claim, Hooks, ValueCounters, Walker
from megac.vm.machine import NULL_TRACKER, VM


class DeadlockError(VMError):
    """No SM can make progress: some wait can never be satisfied. ``blocked``
    lists one dict per stuck SM."""

    def __init__(self, message: str, blocked: list[dict], **kw) -> None:
        super().__init__(message, **kw)
        self.blocked = blocked


class HazardError(VMError):
    """A data race the counters do not rule out."""


class EarlyReadError(HazardError):
    """A read of data no counter wait guarantees written."""


class OverwriteError(HazardError):
    """A write to data whose readers (or writer) no counter orders before it."""


# ---------------------------------------------------------------------------
# fast mode
# ---------------------------------------------------------------------------
def coalesced_runs(words: np.ndarray) -> list[tuple[int, int]]:
    """``(start, end)`` runs of consecutive tasks with the same opcode and layer
    and no wait on a counter signalled earlier in the run."""
    runs: list[tuple[int, int]] = []
    n = len(words)
    if n == 0:
        return runs
    op = words[:, H.OPCODE]
    layer = words[:, H.LAYER]
    start = 0
    sigs: set[int] = set()
    for i in range(n):
        if i > start:
            w0, w1 = int(words[i, H.WAIT0]), int(words[i, H.WAIT1])
            if op[i] != op[start] or layer[i] != layer[start] or (w0 >= 0 and w0 in sigs) or \
                    (w1 >= 0 and w1 in sigs):
                runs.append((start, i))
                start = i
                sigs = set()
        s = int(words[i, H.SIGNAL])
        if s >= 0:
            sigs.add(s)
    runs.append((start, n))
    return runs


# ---------------------------------------------------------------------------
# checked mode: happens-before tracking
# ---------------------------------------------------------------------------
@dataclass
class _Event:
    sm: int
    slot: int
    op: int
    layer: int
    signal: int
    note: str = ""

    def describe(self, sched=None) -> str:
        name = Op(self.op).name if self.op in Op._value2member_map_ else f"opcode {self.op}"
        sig = ""
        if self.signal >= 0:
            cname = sched.counters[self.signal].name if sched is not None and self.signal < len(sched.counters) \
                else str(self.signal)
            sig = f", signals counter {self.signal} {cname}"
        return f"SM {self.sm} slot {self.slot} {name} layer {self.layer}{self.note}{sig}"


class _Track:
    __slots__ = ("lastw", "rset", "inp")

    def __init__(self, shape, inp=None):
        self.lastw = np.full(shape, -1, dtype=np.int64)
        self.rset = np.zeros(shape, dtype=np.int64)
        self.inp = inp  # bool array (True: valid before the step) or None (nothing is)


class Tracker:
    """Element-level last-writer / readers tracking for one step. Ordering
    between events is the counter closure (:mod:`megac.passes.hb`): the
    writer's signal counter must lie in the closure of the counters the
    reader has acquired so far."""

    def __init__(self, run: "CheckedRun") -> None:
        self.run = run
        st = run.st
        geo = st.geo
        self.bufs: dict[str, _Track] = {}
        for name in st.scratch:
            # per planned element (an argmax record is one element of its words)
            shape = tuple(st.plan.buffers[name].shape)
            inp = None
            if name in ("x_resid", "x_norm"):  # slot 0 seeded before launch
                inp = np.zeros(shape, dtype=bool)
                inp[0] = True
            self.bufs[name] = _Track(shape, inp)
        tgt = np.zeros(len(st.np["targets"]), dtype=bool)
        tgt[: st.tw.host_words] = True
        self.bufs["targets"] = _Track(tgt.shape, tgt)
        aq = st.np["attn_queue"]
        self.bufs["attn_queue"] = _Track(aq.shape, np.ones(aq.shape, dtype=bool))
        for name in ("moe_up_queue", "moe_down_queue"):
            self.bufs[name] = _Track(st.np[name].shape)
        # KV pools at (block, offset, kv head, 16-dim piece) granularity (a
        # QKV tile may hold part of a head: target tile qkv_bn): everything is
        # the old cache (an input) except the current token's slots of active rows
        pool = st["k_pool"]
        pshape = tuple(pool.shape[:3]) + (-(-int(pool.shape[3]) // KV_PIECE),)
        inp = np.ones(pshape, dtype=bool)
        bs = st.block_size
        pt, pos, act = st.np["page_table"], st.np["seq_pos"], st.np["row_active"]
        for r in range(geo.rows):
            if act[r]:
                b = int(pos[r]) // bs
                for layer in range(geo.num_layers):
                    blk = int(pt[layer, r, b]) if b < pt.shape[2] else -1
                    if blk >= 0:
                        inp[blk, int(pos[r]) % bs] = False
        self.bufs["k_pool"] = _Track(pshape, inp)
        self.bufs["v_pool"] = _Track(pshape, inp.copy())
        self.sets: list[int] = [0]
        self.memo: dict[tuple[int, int], int] = {}

    def _ctx(self):
        r = self.run
        ev = r.events[r.cur_ev]
        return ev

    def _err(self, cls, msg: str, buffer: str, counter=None):
        ev = self._ctx()
        raise cls(f"{ev.describe(self.run.sched)}: {msg}", sm=ev.sm, slot=ev.slot, opcode=ev.op, layer=ev.layer,
                  counter=counter, buffer=buffer)

    def _before(self, e: int) -> bool:
        """Event ``e`` happens-before the current event (at its current phase)."""
        r = self.run
        return r.closure.ordered(r.cur_acq, r.events[e].signal)

    def read(self, name: str, index) -> None:
        t = self.bufs.get(name)
        if t is None:
            return
        r = self.run
        ev = r.cur_ev
        lw = t.lastw[index]
        if lw.size == 0:
            return
        for w in np.unique(lw).tolist():
            if w < 0:
                ok = t.inp is not None and bool(t.inp[index][lw == -1].all())
                if not ok:
                    self._err(EarlyReadError, f"reads {name}{_fmt(index)} before anything wrote it (no counter "
                                              f"wait orders its producer first){r.waits_note()}", name)
            elif w != ev and not self._before(w):
                wev = r.events[w]
                self._err(EarlyReadError,
                          f"reads {name}{_fmt(index)} written by {wev.describe(r.sched)}, but no counter wait "
                          f"orders that write before this read{r.waits_note()}", name,
                          counter=wev.signal if wev.signal >= 0 else None)
        rs = t.rset[index]
        uniq, inv = np.unique(rs, return_inverse=True)
        new = np.array([self._add(int(u), ev) for u in uniq], dtype=np.int64)
        t.rset[index] = new[inv.ravel()].reshape(rs.shape)

    def _add(self, sid: int, ev: int) -> int:
        key = (sid, ev)
        n = self.memo.get(key)
        if n is None:
            bits = self.sets[sid] | (1 << ev)
            if bits == self.sets[sid]:
                n = sid
            else:
                n = len(self.sets)
                self.sets.append(bits)
            self.memo[key] = n
        return n

    def write(self, name: str, index) -> None:
        t = self.bufs.get(name)
        if t is None:
            return
        r = self.run
        ev = r.cur_ev
        lw = t.lastw[index]
        if lw.size == 0:
            return
        for w in np.unique(lw).tolist():
            if w >= 0 and w != ev and not self._before(w):
                wev = r.events[w]
                self._err(OverwriteError, f"overwrites {name}{_fmt(index)} written by {wev.describe(r.sched)} "
                                          f"with no counter ordering the two writes{r.waits_note()}", name)
        for u in np.unique(t.rset[index]).tolist():
            bits = self.sets[u] & ~(1 << ev)
            while bits:
                rid = (bits & -bits).bit_length() - 1
                bits &= bits - 1
                if not self._before(rid):
                    rev = r.events[rid]
                    self._err(OverwriteError, f"overwrites {name}{_fmt(index)} that {rev.describe(r.sched)} reads, "
                                              f"with no counter ordering that read before this write"
                                              f"{r.waits_note()}", name)
        t.lastw[index] = ev
        t.rset[index] = 0


def _fmt(index) -> str:
    parts = []
    for x in (index if isinstance(index, tuple) else (index,)):
        if isinstance(x, slice):
            parts.append(f"{'' if x.start is None else x.start}:{'' if x.stop is None else x.stop}")
        elif isinstance(x, np.ndarray):
            v = x.ravel()
            parts.append(f"[{','.join(str(int(a)) for a in v[:4])}{',...' if len(v) > 4 else ''}]")
        else:
            parts.append(str(int(x)))
    return "[" + ", ".join(parts) + "]"


# ---------------------------------------------------------------------------
# checked mode: the SM queues (megac.passes.walk) with the VM as hooks
# ---------------------------------------------------------------------------
def _claim_sync(geo, vm: VM, op: Op, w: np.ndarray, r: np.ndarray) -> tuple[int, int, int]:
    """(wait counter, target value, signal counter) of claimed record ``r`` of
    claimer ``w`` (offsets: ``ClaimerOp.offsets``)."""
    wc, target, sg = claim_sync(opdef(op), w, r, geo)
    tgt = vm.value(target) if wc >= 0 else 0
    return wc, tgt, sg


class CheckedRun(Hooks):
    """One step of the SM queues, interleaved by ``policy``, executing every
    task and claimed record as its own event and checking every buffer
    access against happens-before (module docstring)."""

    def __init__(self, interp: "Interpreter", policy: str = "round_robin", seed: int = 0) -> None:
        if policy not in ("round_robin", "random"):
            raise ValueError(f"unknown interleaving policy {policy!r} (round_robin | random)")
        self.it = interp
        self.st = interp.st
        self.sched = interp.st.schedule
        self.tasks = np.asarray(self.sched.tasks)
        self.counts = np.asarray(self.sched.task_counts)
        self.policy = policy
        self.seed = seed
        self.C = len(self.st.counters)
        self.counters = self.st.counters
        self.events: list[_Event] = []
        self.cur_ev = -1
        self.cur_acq: tuple = ()
        self.ops = interp.ops
        p = Program(self.tasks, self.counts, self.C, self.sched.geometry)
        self.program = p
        for s, j in zip(p.sm.tolist(), p.slot.tolist()):
            for c in (int(self.tasks[s, j, H.WAIT0]), int(self.tasks[s, j, H.WAIT1]), int(self.tasks[s, j, H.SIGNAL])):
                self._check_counter(c, s, j, self.tasks[s, j])
        sink = Sink()
        build_groups(p, sink)
        # happens-before is the counter closure, which holds when a satisfied
        # wait implies every producer of its counter is done: exact targets
        check_targets(p, sink)
        low = [v for v in sink.items if v.kind in ("target_low", "target_dyn_mismatch")]
        if low:
            raise HazardError(f"checked mode needs exact targets: {low[0].message}")
        self.closure = counter_closure(p, part_wait_sets(p))[0]
        self.tracker = Tracker(self)
        self.ev_of: dict[int, int] = {}  # SM -> event of its head (or held record)
        self.acq: dict[int, list[int]] = {}  # SM -> counters its head acquired
        self.claim_of: dict[int, tuple] = {}
        #: per SM, the records its claimer derived (routed claims), else None
        self.routed_of: dict[int, np.ndarray | None] = {}

    # ----------------------------------------------------------------- helpers
    def waits_note(self) -> str:
        if not self.cur_acq:
            return " (the task waits on no counter)"
        names = []
        for c in self.cur_acq:
            nm = self.sched.counters[c].name if c < len(self.sched.counters) else "?"
            names.append(f"{c} {nm}")
        return f" (it waits on counter {', '.join(names)})"

    def _sm_slot(self, k: int) -> tuple[int, int]:
        p = self.program
        return int(p.sm[k]), int(p.slot[k])

    def _new_event(self, s: int, slot: int, w: np.ndarray, signal: int, note: str = "") -> int:
        self.events.append(_Event(s, slot, int(w[H.OPCODE]), int(w[H.LAYER]), signal, note))
        return len(self.events) - 1

    def _check_counter(self, c: int, s: int, slot: int, w) -> None:
        if not -1 <= c < self.C:
            raise BadTaskError(f"SM {s} slot {slot}: counter {c} outside 0..{self.C - 1}", sm=s, slot=slot,
                               opcode=int(w[H.OPCODE]), layer=int(w[H.LAYER]), counter=c)

    def _enter(self, s: int) -> None:
        self.cur_ev = self.ev_of[s]
        self.cur_acq = tuple(self.acq[s])

    def _words(self, k: int) -> np.ndarray:
        s, j = self._sm_slot(k)
        return self.tasks[s, j]

    # ----------------------------------------------------------------- walker hooks
    def start(self, s, k):
        w = self._words(k)
        self.ev_of[s] = self._new_event(s, self._sm_slot(k)[1], w, int(w[H.SIGNAL]))
        self.acq[s] = []
        self._enter(s)

    def target(self, s, k, which, raw):
        self._enter(s)
        return self.ops.value(raw)

    def acquired(self, s, k, c):
        self.acq[s].append(c)
        self._enter(s)

    def after_wait0(self, s, k):
        self._enter(s)
        w = self._words(k)
        op = int(w[H.OPCODE])
        for dop, name in abi.DYN_CAPABLE:
            if int(dop) == op:
                v = int(w[abi.field_index(dop, name)])
                if abi.is_dyn(v):
                    self.ops.value(v)

    def run_task(self, s, k, t):
        self._enter(s)
        self.ops.run(self._words(k)[None, :])
        return t

    def claim(self, s, k, t):
        self._enter(s)
        w = self._words(k)
        o = Op(int(w[H.OPCODE]))
        if s not in self.claim_of:  # first claim of this claimer: the queue length
            routed = opdef(o).routed_queue(self.ops, w)  # a routed claimer ranks the rows now
            self.routed_of[s] = routed
            qlen = len(routed) if routed is not None else self.ops.value(int(w[abi.field_index(o, "QUEUE_LEN")]))
            self.claim_of[s] = (k, qlen)
        qlen = self.claim_of[s][1]
        q = int(w[abi.field_index(o, "QUEUE")])
        layer = int(w[H.LAYER])
        heads = self.st.queue_heads
        slot = self._sm_slot(k)[1]
        if not 0 <= q < heads.shape[0] or not 0 <= layer < heads.shape[1]:
            raise BadTaskError(f"SM {s} slot {slot}: queue {q} layer {layer} has no claim cursor",
                               sm=s, slot=slot, opcode=int(o), layer=layer)
        idx = int(heads[q, layer])
        heads[q, layer] += 1
        if idx >= qlen:
            del self.claim_of[s]
            return None
        routed = self.routed_of.get(s)
        r = routed[idx] if routed is not None else self.ops.queue_records(q, layer, idx, idx + 1)[0]
        wc, tgt, sg = _claim_sync(self.st.geo, self.ops, o, w, r)
        self._check_counter(wc, s, slot, w)
        self._check_counter(sg, s, slot, w)
        ev = self._new_event(s, slot, w, sg, note=f" (claimed {Queue(q).name} record {idx} "
                                                  f"{list(int(x) for x in r)})")
        self.claim_of[s] = (k, qlen, self.ev_of[s], list(self.acq[s]))
        self.ev_of[s] = ev
        return Claim([(wc, tgt)] if wc >= 0 else [], [sg] if sg >= 0 else [], r)

    def run_claimed(self, s, k, claim, t):
        self._enter(s)
        self.ops.claimed(self._words(k), np.asarray(claim.payload)[None, :])
        # back to the claimer's own event and waits for the next claim
        _, qlen, ev, acq = self.claim_of[s]
        self.claim_of[s] = (k, qlen)
        self.ev_of[s], self.acq[s] = ev, acq
        return t

    # ----------------------------------------------------------------- run
    def run(self) -> None:
        ops = self.ops
        ops.tr = self.tracker
        p = self.program
        walker = Walker(p.start, p.w0, p.t0, p.w1, p.t1, p.sig, np.isin(p.op, [int(o) for o in abi.CLAIMERS]),
                        ValueCounters(self.counters), self)
        self.walker = walker
        try:
            stuck = walker.run(self.policy, self.seed)
            if stuck:
                self._deadlock(stuck)
        except VMError as e:
            if e.sm is None and 0 <= self.cur_ev < len(self.events):  # say where
                ev = self.events[self.cur_ev]
                e.sm, e.slot, e.opcode = ev.sm, ev.slot, ev.op
                e.layer = ev.layer if e.layer is None else e.layer
                e.args = (f"{ev.describe(self.sched)}: {e.args[0]}",) + e.args[1:]
            raise
        finally:
            ops.tr = NULL_TRACKER

    def _deadlock(self, stuck) -> None:
        sched = self.sched
        blocked = []
        for b in stuck:
            s, slot = self._sm_slot(b.task)
            w = self.tasks[s, slot]
            what = {WAIT0: "WAIT0", WAIT1: "WAIT1", HELD: "a claimed record"}.get(b.phase, PHASE_NAMES[b.phase])
            c = b.counter
            blocked.append({
                "sm": s, "slot": slot, "opcode": Op(int(w[H.OPCODE])).name, "layer": int(w[H.LAYER]),
                "counter": c, "counter_name": sched.counters[c].name if 0 <= c < len(sched.counters) else "?",
                "value": int(self.counters[c]) if c >= 0 else None, "target": b.target, "wait": what,
                "missing": self._missing(c),
            })
        b = blocked[0]
        more = f" (+{len(blocked) - 1} more blocked SMs)" if len(blocked) > 1 else ""
        miss = "; producers not run: " + ", ".join(b["missing"][:4]) if b["missing"] else \
            "; every producer has run (the target exceeds the signals)"
        raise DeadlockError(
            f"deadlock: SM {b['sm']} slot {b['slot']} {b['opcode']} layer {b['layer']} waits ({b['wait']}) on "
            f"counter {b['counter']} {b['counter_name']} = {b['value']} < target {b['target']}{miss}{more}",
            blocked, sm=b["sm"], slot=b["slot"], opcode=int(Op[b["opcode"]]), layer=b["layer"],
            counter=b["counter"])

    def _missing(self, c: int) -> list[str]:
        if c < 0:
            return []
        out = []
        p = self.program
        for s in range(len(self.counts)):
            for j in range(self.walker.head[s] - int(p.start[s]), int(self.counts[s])):
                w = self.tasks[s, j]
                if int(w[H.SIGNAL]) == c:
                    out.append(f"SM {s} slot {j} {Op(int(w[H.OPCODE])).name} layer {int(w[H.LAYER])}")
                op = int(w[H.OPCODE])
                if op in abi.CLAIMERS:
                    o = Op(op)
                    sb = int(w[abi.field_index(o, "TASK_SIGNAL_BASE")])
                    if sb >= 0 and sb <= c < sb + opdef(o).signal_span(self.st.geo):
                        out.append(f"claimed tasks of SM {s} slot {j} {o.name} layer {int(w[H.LAYER])}")
        return out


# ---------------------------------------------------------------------------
# the interpreter
# ---------------------------------------------------------------------------
class Interpreter:
    """Runs ``state.schedule`` over ``state`` (see the module docstring)."""

    def __init__(self, state) -> None:
        self.st = state
        sched = state.schedule
        self.words = np.ascontiguousarray(sched.global_words())
        self.runs = coalesced_runs(self.words)
        self.ops = VM(state)
        self._fast: list | None = None

    def fast_program(self) -> list:
        """``(definition, words, plan key)`` per run, looked up once (an
        unknown opcode raises here, at the first fast step)."""
        if self._fast is None:
            self._fast = [(opdef(self.words[a, H.OPCODE]), self.words[a:b], ("run", a)) for a, b in self.runs]
        return self._fast

    def run_fast(self, *, check_order: bool = False) -> None:
        """Execute the global order. ``check_order``: also keep the counters and
        raise :class:`VMError` if a task (or a claimed record) would run before
        its waits are satisfied -- i.e. the global order is not topological."""
        ops = self.ops
        ops.tr = NULL_TRACKER
        ops.begin_step()
        words = self.words
        if not check_order:
            execute = ops.execute
            for d, w, key in self.fast_program():
                execute(d, w, key)
            return
        counters = self.st.counters
        sched = self.st.schedule

        def check(w: np.ndarray, waits, what: str) -> None:
            for c, t in waits:
                if c >= 0 and counters[c] < ops.value(t):
                    name = sched.counters[c].name if c < len(sched.counters) else "?"
                    raise VMError(f"fast mode: {what} {Op(int(w[H.OPCODE])).name} layer {int(w[H.LAYER])} runs "
                                  f"before counter {c} {name} reaches {ops.value(t)} (it is {int(counters[c])}): "
                                  f"the global order is not topological", opcode=int(w[H.OPCODE]),
                                  layer=int(w[H.LAYER]), counter=c)

        def on_claimed(cw: np.ndarray, recs: np.ndarray) -> None:
            op = Op(int(cw[H.OPCODE]))
            for r in recs:
                wc, tgt, sg = _claim_sync(self.st.geo, ops, op, cw, r)
                check(cw, [(wc, tgt)] if wc >= 0 else [], "a claimed record of")
                if sg >= 0:
                    counters[sg] += 1

        ops.on_claimed = on_claimed
        try:
            for a, b in self.runs:
                for k in range(a, b):
                    w = words[k]
                    check(w, [(int(w[H.WAIT0]), int(w[H.TARGET0])), (int(w[H.WAIT1]), int(w[H.TARGET1]))],
                          f"global task {k}")
                ops.run(words[a:b])
                sig = words[a:b, H.SIGNAL].astype(np.int64)
                np.add.at(counters, sig[sig >= 0], 1)
        finally:
            ops.on_claimed = None

    def run_checked(self, *, policy: str = "round_robin", seed: int = 0) -> CheckedRun:
        self.ops.begin_step()
        run = CheckedRun(self, policy, seed)
        run.run()
        return run


__all__ = ["CheckedRun", "DeadlockError", "EarlyReadError", "HazardError", "Interpreter", "OverwriteError",
           "Tracker", "coalesced_runs"]

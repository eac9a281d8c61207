"""The VM interpreter: runs one schedule's task words over a DeviceState.

::

    it = Interpreter(state)
    it.run_fast()                                   # global order, coalesced runs
    it.run_checked(policy="random", seed=3)          # SM queues interleaved, happens-before checked

**Fast mode** executes the tasks in the schedule's ``global_order`` (a
topological order, claimers included: the ``order`` pass guarantees every
input of a claimed task precedes the first claimer of its queue). Consecutive
tasks of one opcode and layer form a *run* executed by one vectorised call
(``Ops`` methods take ``[n, 32]`` words) unless a task of the run waits on a
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

import random
from dataclasses import dataclass, field

import numpy as np

from megac import abi
from megac.abi import H, Op, Queue
from megac.vm.ops import NULL_TRACKER, BadTaskError, Ops, VMError


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
    """Element-level last-writer / readers tracking for one step."""

    def __init__(self, run: "CheckedRun") -> None:
        self.run = run
        st = run.st
        geo = st.geo
        self.bufs: dict[str, _Track] = {}
        for name in st.scratch:
            # per planned element (an argmax record is one element of its words)
            shape = tuple(st.plan.buffers[name].shape)
            inp = None
            if name == "x_resid":
                inp = np.ones(shape, dtype=bool)
            elif name == "x_norm":
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
        # KV pools at (block, offset, kv head) granularity: everything is the
        # old cache (an input) except the current token's slots of active rows
        pool = st["k_pool"]
        pshape = tuple(pool.shape[:3])
        inp = np.ones(pshape, dtype=bool)
        bs = st.block_size
        pt, pos, act = st.np["page_table"], st.np["seq_pos"], st.np["row_active"]
        for r in range(geo.rows):
            if act[r]:
                b = int(pos[r]) // bs
                for layer in range(geo.num_layers):
                    blk = int(pt[layer, r, b]) if b < pt.shape[2] else -1
                    if blk >= 0:
                        inp[blk, int(pos[r]) % bs, :] = False
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

    def read(self, name: str, index) -> None:
        t = self.bufs.get(name)
        if t is None:
            return
        r = self.run
        ev, hb = r.cur_ev, r.cur_hb
        lw = t.lastw[index]
        if lw.size == 0:
            return
        for w in np.unique(lw).tolist():
            if w < 0:
                ok = t.inp is not None and bool(t.inp[index][lw == -1].all())
                if not ok:
                    self._err(EarlyReadError, f"reads {name}{_fmt(index)} before anything wrote it (no counter "
                                              f"wait orders its producer first){r.waits_note()}", name)
            elif w != ev and not (hb >> w) & 1:
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
        ev, hb = r.cur_ev, r.cur_hb
        lw = t.lastw[index]
        if lw.size == 0:
            return
        for w in np.unique(lw).tolist():
            if w >= 0 and w != ev and not (hb >> w) & 1:
                wev = r.events[w]
                self._err(OverwriteError, f"overwrites {name}{_fmt(index)} written by {wev.describe(r.sched)} "
                                          f"with no counter ordering the two writes{r.waits_note()}", name)
        mine = ~(1 << ev)
        for u in np.unique(t.rset[index]).tolist():
            bad = self.sets[u] & mine & ~hb
            if bad:
                rid = (bad & -bad).bit_length() - 1
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
# checked mode: the SM simulation
# ---------------------------------------------------------------------------
def _claim_sync(geo, ops: Ops, op: Op, w: np.ndarray, r: np.ndarray) -> tuple[int, int, int]:
    """(wait counter, target, signal counter) of claimed record ``r`` of claimer
    ``w`` (the ABI's offsets: attention waits TASK_WAIT_BASE + kv_head and
    signals TASK_SIGNAL_BASE + row*kv_heads + kv_head; MoE up waits
    TASK_WAIT_BASE and signals + expert; MoE down waits + expert and signals
    TASK_SIGNAL_BASE)."""
    base = int(w[abi.field_index(op, "TASK_WAIT_BASE")])
    target = int(w[abi.field_index(op, "TASK_WAIT_TARGET")])
    sbase = int(w[abi.field_index(op, "TASK_SIGNAL_BASE")])
    q = Queue(int(w[abi.field_index(op, "QUEUE")]))
    if q == Queue.ATTN:
        kvh = int(r[abi.record_index(q, "KV_HEAD")])
        row = int(r[abi.record_index(q, "ROW")])
        woff, soff = kvh, row * geo.kv_heads + kvh
    elif q == Queue.MOE_UP:
        woff, soff = 0, int(r[abi.record_index(q, "EXPERT")])
    else:
        woff, soff = int(r[abi.record_index(q, "EXPERT")]), 0
    wc = base + woff if base >= 0 else -1
    sg = sbase + soff if sbase >= 0 else -1
    tgt = ops.value(target) if wc >= 0 else 0
    return wc, tgt, sg


START, W0, W1, CLAIM, HELD = range(5)


@dataclass
class _SM:
    sm: int
    count: int
    slot: int = 0
    phase: int = START
    ev: int = -1
    hb: int = 0
    t0: int = 0
    t1: int = 0
    qlen: int = 0
    claim: tuple | None = None
    claimed: int = field(default=0)

    @property
    def done(self) -> bool:
        return self.slot >= self.count


class CheckedRun:
    def __init__(self, interp: "Interpreter", policy: str = "round_robin", seed: int = 0) -> None:
        if policy not in ("round_robin", "random"):
            raise ValueError(f"unknown interleaving policy {policy!r} (round_robin | random)")
        self.it = interp
        self.st = interp.st
        self.sched = interp.st.schedule
        self.tasks = np.asarray(self.sched.tasks)
        self.counts = np.asarray(self.sched.task_counts)
        self.policy = policy
        self.rng = random.Random(seed)
        self.C = len(self.st.counters)
        self.counters = self.st.counters
        self.cbits = [0] * self.C
        self.events: list[_Event] = []
        self.cur_ev = -1
        self.cur_hb = 0
        self.cur_waits: tuple = ()
        self.sms = [_SM(s, int(self.counts[s])) for s in range(len(self.counts))]
        self.tracker = Tracker(self)
        self.ops = interp.ops

    # ----------------------------------------------------------------- helpers
    def waits_note(self) -> str:
        if not self.cur_waits:
            return " (the task waits on no counter)"
        names = []
        for c in self.cur_waits:
            nm = self.sched.counters[c].name if c < len(self.sched.counters) else "?"
            names.append(f"{c} {nm}")
        return f" (it waits on counter {', '.join(names)})"

    def _new_event(self, s: int, slot: int, w: np.ndarray, signal: int, note: str = "") -> int:
        self.events.append(_Event(s, slot, int(w[H.OPCODE]), int(w[H.LAYER]), signal, note))
        return len(self.events) - 1

    def _check_counter(self, c: int, s: int, slot: int, w) -> None:
        if not -1 <= c < self.C:
            raise BadTaskError(f"SM {s} slot {slot}: counter {c} outside 0..{self.C - 1}", sm=s, slot=slot,
                               opcode=int(w[H.OPCODE]), layer=int(w[H.LAYER]), counter=c)

    def _target(self, t: int) -> int:
        return self.ops.value(t)

    def _enter(self, ev: int, hb: int, waits: tuple) -> None:
        self.cur_ev, self.cur_hb, self.cur_waits = ev, hb, waits

    def _signal(self, c: int, ev: int, hb: int) -> None:
        if c < 0:
            return
        self.counters[c] += 1
        self.cbits[c] |= hb | (1 << ev)

    def _dyn_fields(self, w: np.ndarray) -> None:
        op = int(w[H.OPCODE])
        for dop, name in abi.DYN_CAPABLE:
            if int(dop) == op:
                v = int(w[abi.field_index(dop, name)])
                if abi.is_dyn(v):
                    self.ops.value(v)

    # ----------------------------------------------------------------- one step
    def step(self, s: int) -> bool:
        sm = self.sms[s]
        if sm.done:
            return False
        w = self.tasks[s, sm.slot]
        op = int(w[H.OPCODE])
        progress = False
        if sm.phase == START:
            if op == Op.NOP:
                sm.slot += 1
                return True
            for c in (int(w[H.WAIT0]), int(w[H.WAIT1]), int(w[H.SIGNAL])):
                self._check_counter(c, s, sm.slot, w)
            sm.ev = self._new_event(s, sm.slot, w, int(w[H.SIGNAL]))
            sm.hb = 0
            self._enter(sm.ev, 0, ())
            sm.t0 = self._target(int(w[H.TARGET0])) if int(w[H.WAIT0]) >= 0 else 0
            sm.phase = W0
            progress = True
        if sm.phase == W0:
            c = int(w[H.WAIT0])
            if c >= 0:
                if self.counters[c] < sm.t0:
                    return progress
                sm.hb |= self.cbits[c]
            sm.phase = W1
            progress = True
            self._enter(sm.ev, sm.hb, (c,) if c >= 0 else ())
            sm.t1 = self._target(int(w[H.TARGET1])) if int(w[H.WAIT1]) >= 0 else 0
            self._dyn_fields(w)
        if sm.phase == W1:
            c = int(w[H.WAIT1])
            if c >= 0:
                if self.counters[c] < sm.t1:
                    return progress
                sm.hb |= self.cbits[c]
            waits = tuple(x for x in (int(w[H.WAIT0]), c) if x >= 0)
            self._enter(sm.ev, sm.hb, waits)
            if op in abi.CLAIMERS:
                o = Op(op)
                sm.qlen = self.ops.value(int(w[abi.field_index(o, "QUEUE_LEN")]))
                sm.phase = CLAIM
                progress = True
            else:
                self.ops.run(w[None, :])
                self._signal(int(w[H.SIGNAL]), sm.ev, sm.hb)
                sm.slot += 1
                sm.phase = START
                return True
        if sm.phase == CLAIM:
            o = Op(op)
            q = int(w[abi.field_index(o, "QUEUE")])
            layer = int(w[H.LAYER])
            heads = self.st.queue_heads
            if not 0 <= q < heads.shape[0] or not 0 <= layer < heads.shape[1]:
                raise BadTaskError(f"SM {s} slot {sm.slot}: queue {q} layer {layer} has no claim cursor",
                                   sm=s, slot=sm.slot, opcode=op, layer=layer)
            idx = int(heads[q, layer])
            heads[q, layer] += 1
            if idx >= sm.qlen:
                self._signal(int(w[H.SIGNAL]), sm.ev, sm.hb)
                sm.slot += 1
                sm.phase = START
                return True
            self._enter(sm.ev, sm.hb, self.cur_waits)
            r = self.ops.queue_records(q, layer, idx, idx + 1)[0]
            wc, tgt, sg = self._claim_sync(o, w, r)
            self._check_counter(wc, s, sm.slot, w)
            self._check_counter(sg, s, sm.slot, w)
            ev = self._new_event(s, sm.slot, w, sg, note=f" (claimed {Queue(q).name} record {idx} "
                                                        f"{list(int(x) for x in r)})")
            sm.claim = (r, wc, tgt, sg, ev, sm.hb)
            sm.phase = HELD
            progress = True
        if sm.phase == HELD:
            r, wc, tgt, sg, ev, hb = sm.claim
            if wc >= 0:
                if self.counters[wc] < tgt:
                    return progress
                hb |= self.cbits[wc]
            waits = tuple(x for x in (int(w[H.WAIT0]), int(w[H.WAIT1]), wc) if x >= 0)
            self._enter(ev, hb, waits)
            self.ops.claimed(w, r[None, :])
            self._signal(sg, ev, hb)
            sm.claim = None
            sm.claimed += 1
            sm.phase = CLAIM
            return True
        return progress

    def _claim_sync(self, op: Op, w: np.ndarray, r: np.ndarray) -> tuple[int, int, int]:
        return _claim_sync(self.st.geo, self.ops, op, w, r)

    # ----------------------------------------------------------------- run
    def run(self) -> None:
        ops = self.ops
        ops.tr = self.tracker
        try:
            S = len(self.sms)
            while True:
                alive = [s for s in range(S) if not self.sms[s].done]
                if not alive:
                    break
                progressed = False
                if self.policy == "random":
                    self.rng.shuffle(alive)
                for s in alive:
                    k = self.rng.randint(1, 3) if self.policy == "random" else 1
                    for _ in range(k):
                        if not self.step(s):
                            break
                        progressed = True
                if not progressed:
                    self._deadlock(alive)
        except VMError as e:
            if e.sm is None and 0 <= self.cur_ev < len(self.events):  # say where
                ev = self.events[self.cur_ev]
                e.sm, e.slot, e.opcode = ev.sm, ev.slot, ev.op
                e.layer = ev.layer if e.layer is None else e.layer
                e.args = (f"{ev.describe(self.sched)}: {e.args[0]}",) + e.args[1:]
            raise
        finally:
            ops.tr = NULL_TRACKER

    def _deadlock(self, alive: list[int]) -> None:
        sched = self.sched
        blocked = []
        for s in sorted(alive):
            sm = self.sms[s]
            w = self.tasks[s, sm.slot]
            if sm.phase == HELD:
                c, t = sm.claim[1], sm.claim[2]
                what = "a claimed record"
            elif sm.phase == W1:
                c, t = int(w[H.WAIT1]), sm.t1
                what = "WAIT1"
            else:
                c, t = int(w[H.WAIT0]), sm.t0
                what = "WAIT0"
            blocked.append({
                "sm": s, "slot": sm.slot, "opcode": Op(int(w[H.OPCODE])).name, "layer": int(w[H.LAYER]),
                "counter": c, "counter_name": sched.counters[c].name if 0 <= c < len(sched.counters) else "?",
                "value": int(self.counters[c]) if c >= 0 else None, "target": t, "wait": what,
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
        for s, sm in enumerate(self.sms):
            for j in range(sm.slot, sm.count):
                w = self.tasks[s, j]
                if int(w[H.SIGNAL]) == c:
                    out.append(f"SM {s} slot {j} {Op(int(w[H.OPCODE])).name} layer {int(w[H.LAYER])}")
                op = int(w[H.OPCODE])
                if op in abi.CLAIMERS:
                    o = Op(op)
                    sb = int(w[abi.field_index(o, "TASK_SIGNAL_BASE")])
                    if sb >= 0 and sb <= c < sb + self._signal_span(o):
                        out.append(f"claimed tasks of SM {s} slot {j} {o.name} layer {int(w[H.LAYER])}")
        return out

    def _signal_span(self, op: Op) -> int:
        geo = self.st.geo
        if op == Op.ATTN_DRAIN:
            return geo.rows * geo.kv_heads
        if op == Op.MOE_UPGATE_DRAIN:
            return max(geo.experts, 1)
        return 1


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
        self.ops = Ops(state)

    def run_fast(self, *, check_order: bool = False) -> None:
        """Execute the global order. ``check_order``: also keep the counters and
        raise :class:`VMError` if a task (or a claimed record) would run before
        its waits are satisfied -- i.e. the global order is not topological."""
        ops = self.ops
        ops.tr = NULL_TRACKER
        ops.begin_step()
        words = self.words
        if not check_order:
            for a, b in self.runs:
                ops.run(words[a:b])
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

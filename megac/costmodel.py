"""Cost model: a per-SM timeline of one decode step under a bytes/bandwidth +
fixed-cost model.

The schedule's execution semantics are the one walker's
(``megac.passes.walk``: each SM runs its queue in order; a task starts once
every signaller of each counter it waits on is done), with time:

* a task costs ``fixed_us + bytes / per_sm_bw``, where ``per_sm_bw`` is the
  streaming ceiling (4.55e12 B/s measured on the H200) divided by the SM
  count, and ``bytes`` is what the task streams: its weight tile, the
  activations and the KV it reads, the partials it writes (derived from the
  task words and the geometry alone);
* a wait releases ``dependency_latency_us`` after the last signal arrives
  (~1 us for one grid-wide dependency on the H200); a task may work
  ``op_pre_us`` before its waits (a GEMM's first weight stages: it costs
  time only where the inputs were there already) and a claimer
  ``claimer_lead_us`` after them before its first claim (a routed claimer
  ranks the rows);
* with ``shared_bandwidth`` set, the streams also share the whole GPU's
  bandwidth: a piece of work's fixed part comes first, then its bytes stream
  at most at its own per-SM rate. How the streams share the limit is
  ``bandwidth_sharing``'s: ``fcfs`` gives each stream what the streams that
  started before it leave (first come, first served, in 0.1 µs bins;
  settled when the stream starts); ``fair`` shares it max-min fairly
  among the streams running at each moment (a stream capped by its own
  rate leaves the rest to the others), so a stream slows when others start
  and speeds up when they end, as the memory system's queues do (under
  ``fcfs`` the SM the walk reaches last in a crowd of starts waits for the
  whole crowd: the router beside 80 QKV tiles ended at 5.7 µs, 2.6 alone,
  3.7 measured). Without a limit each stream runs at its per-SM rate
  however many stream at once, so spreading work over more SMs looks free
  (128-feature expert up tiles: -6.6 % predicted at batch 1, 0 % measured);
* a claimer queue's work is claimed one task at a time by whichever claimer
  reaches it first (in time order; as on the device, a claimer claims
  before it waits on the claimed task's inputs), so it spreads over the
  claimers that reach it while there is work left; a claimed task waits on
  its own part's counters and signals its part's (an expert's up tiles
  signal that expert's counter, which its down tiles wait on). The number of claimed tasks follows the bucket's
  context (attention splits) and the expected number of active experts under
  uniform routing (``E * (1 - (1 - k/E) ** rows)``), or under the per-expert
  routing chances ``expert_probs`` (``sum_e 1 - (1 - p_e) ** rows``), unless given.
  A claimed task costs like a task of the claimer's opcode; the claimer
  itself costs ``claimer_us`` (a calibration's: its dispatch and the claim
  that finds the queue drained, which every claimer pays, most of them for
  nothing else), 0 by default.

The model ignores overlap of consecutive tasks on one SM (it is serial per
SM), caches and compute; it is a planning tool, not a prediction of the
measured step. ``predicted >= bytes / bandwidth`` always holds.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from megac.abi import H, Op, Queue
from megac.ops import REGISTRY
from megac.errors import MegacError
from megac.ops.moe import expected_active_experts
from megac.passes.program import Program, build_groups
from megac.passes.violations import Sink
from megac.passes.walk import Claim, Hooks, UnitCounters, Walker

#: Streaming-read ceiling measured on the H200 (B/s), see DESIGN.md.
CEILING_BPS = 4.55e12


@dataclass
class CostParams:
    fixed_us: float = 1.0
    dependency_latency_us: float = 1.0
    bandwidth: float = CEILING_BPS
    #: tokens per row for attention (default: the schedule's context bucket)
    context: int | None = None
    #: experts with at least one routed row per MoE layer (default: expected
    #: value from expert_probs, or under uniform routing)
    active_experts: int | None = None
    #: chance a row routes to each expert (``[E]``, sums to top_k; e.g.
    #: megac.routing_skew.selection_probs); None: uniform, k/E each
    expert_probs: tuple[float, ...] | None = None
    #: measured per-opcode costs (megac.calibration): opcode -> µs per byte
    #: of its (claimed) work, replacing num_sms / bandwidth for that opcode,
    #: and opcode -> µs a task of it costs beyond its bytes (replacing fixed_us)
    op_us_per_byte: dict[int, float] = field(default_factory=dict)
    op_fixed_us: dict[int, float] = field(default_factory=dict)
    #: claimer opcode -> µs a claimer task costs beyond its claimed tasks (its
    #: dispatch and the claim that finds the queue drained; 0 unless given)
    claimer_us: dict[int, float] = field(default_factory=dict)
    #: opcode -> µs a task of it works before its header waits pass (a GEMM
    #: issues its first weight stages, then waits: that work overlaps a wait
    #: and costs its own time only when the inputs are already there)
    op_pre_us: dict[int, float] = field(default_factory=dict)
    #: claimer opcode -> µs a claimer spends after its header waits before its
    #: first claim (a routed expert claimer ranks the rows itself first)
    claimer_lead_us: dict[int, float] = field(default_factory=dict)
    #: B/s every SM's streams share (the whole GPU's; None: no shared limit,
    #: each stream runs at its own per-SM rate whatever the others do)
    shared_bandwidth: float | None = None
    #: how streams share ``shared_bandwidth``: "fcfs" (settled when each
    #: starts, in start order) or "fair" (max-min fair at every moment)
    bandwidth_sharing: str = "fcfs"

    def task_cost(self, op: int, nbytes, default_us_per_byte: float):
        """µs of a task (or claimed task) of opcode ``op`` moving ``nbytes``."""
        return self.task_fixed(op) + nbytes * self.op_us_per_byte.get(int(op), default_us_per_byte)

    def task_fixed(self, op: int) -> float:
        """µs of a task of opcode ``op`` besides its bytes."""
        return self.op_fixed_us.get(int(op), self.fixed_us)


class SharedBandwidth:
    """The whole GPU's bandwidth, handed to streams first come, first served
    in ``dt`` µs bins: a stream takes in each bin its own per-SM rate or what
    the streams committed before it left, whichever is less."""

    def __init__(self, bps: float, dt: float = 0.1) -> None:
        if not bps > 0:
            raise MegacError(f"costmodel: shared bandwidth must be positive, got {bps!r}")
        self.dt = dt
        self.cap = bps * 1e-6 * dt  # bytes per bin
        self.used = np.zeros(1 << 14)

    def _grow(self, n: int) -> None:
        if n > len(self.used):
            self.used = np.concatenate([self.used, np.zeros(max(n, 2 * len(self.used)) - len(self.used))])

    def stream(self, t: float, nbytes: float, us_per_byte: float) -> float:
        """When ``nbytes`` that start streaming at ``t`` (µs) at most at
        1 / ``us_per_byte`` B/µs are through; commits their share of the bins."""
        if nbytes <= 0:
            return t
        if us_per_byte <= 0:
            raise MegacError("costmodel: a stream's µs per byte must be positive")
        dt, per_bin = self.dt, self.dt / us_per_byte
        i0 = int(t / dt)
        first = (i0 + 1) * dt - t  # the part of the first bin left at t
        n = int(nbytes / per_bin) + 3
        while True:
            self._grow(i0 + n)
            room = np.maximum(self.cap - self.used[i0:i0 + n], 0.0)
            take = np.minimum(room, per_bin)
            take[0] = min(take[0], per_bin * first / dt)
            cum = np.cumsum(take)
            if cum[-1] >= nbytes:
                break
            n *= 2
        j = int(np.searchsorted(cum, nbytes))  # the bin the last byte goes through
        before = cum[j - 1] if j > 0 else 0.0
        self.used[i0:i0 + j] += take[:j]
        self.used[i0 + j] += nbytes - before
        start_j = t if j == 0 else (i0 + j) * dt
        span_j = first if j == 0 else dt
        return start_j + span_j * (nbytes - before) / take[j]


class FairBandwidth:
    """The whole GPU's bandwidth shared max-min fairly by the streams
    running at each moment, at most one per SM: each gets the same share,
    except that a stream capped by its own per-SM rate leaves what it cannot
    use to the others. Rates change only when a stream starts or ends, so
    the fluid state moves from event to event. A stream's start is an event
    too (it is known before it comes: an SM's fixed part precedes it)."""

    def __init__(self, bps: float, num_sms: int) -> None:
        if not bps > 0:
            raise MegacError(f"costmodel: shared bandwidth must be positive, got {bps!r}")
        self.cap = bps * 1e-6  # bytes per µs
        self.t = 0.0
        self.rem = np.zeros(num_sms)
        self.maxr = np.zeros(num_sms)
        self.rate = np.zeros(num_sms)
        self.active = np.zeros(num_sms, dtype=bool)
        self._starts: list[tuple[float, int, float, float]] = []
        self._done_at = math.inf
        self._done_sm = -1

    def start(self, t: float, sm: int, nbytes: float, us_per_byte: float) -> None:
        """SM ``sm`` starts streaming ``nbytes`` at ``t`` (µs), at most at
        1 / ``us_per_byte`` B/µs."""
        if us_per_byte <= 0:
            raise MegacError("costmodel: a stream's µs per byte must be positive")
        if self.active[sm] or any(x[1] == sm for x in self._starts):
            raise MegacError(f"costmodel: SM {sm} starts a stream while its last one runs")
        heapq.heappush(self._starts, (max(t, self.t), sm, float(nbytes), 1.0 / us_per_byte))

    def next_event(self) -> float:
        ts = self._starts[0][0] if self._starts else math.inf
        return min(ts, self._done_at)

    def fire(self) -> tuple[int, float] | None:
        """Process the next event: a start (None) or the end of a stream:
        (its SM, the time it ends)."""
        ts = self._starts[0][0] if self._starts else math.inf
        if ts <= self._done_at:
            t, sm, nbytes, r = heapq.heappop(self._starts)
            self._advance(t)
            self.rem[sm], self.maxr[sm], self.active[sm] = nbytes, r, True
            self._share()
            return None
        t, sm = self._done_at, self._done_sm
        self._advance(t)
        self.rem[sm], self.rate[sm], self.active[sm] = 0.0, 0.0, False
        self._share()
        return sm, t

    def _advance(self, t: float) -> None:
        if t > self.t:
            a = self.active
            self.rem[a] = np.maximum(self.rem[a] - self.rate[a] * (t - self.t), 0.0)
            self.t = t

    def _share(self) -> None:
        """Water-fill the capacity over the running streams, and find the
        one that ends first at these rates."""
        idx = np.flatnonzero(self.active)
        if len(idx) == 0:
            self._done_at, self._done_sm = math.inf, -1
            return
        m = self.maxr[idx]
        if m.sum() <= self.cap:
            r = m
        else:
            o = np.argsort(m)
            ms = m[o]
            n = len(ms)
            before = np.concatenate(([0.0], np.cumsum(ms)[:-1]))
            level = (self.cap - before) / (n - np.arange(n))
            k = int(np.argmax(ms >= level))  # the first stream the level caps (one must: sum > cap)
            r = np.minimum(m, level[k])
        self.rate[idx] = r
        left = self.rem[idx] / r
        j = int(np.argmin(left))
        self._done_at, self._done_sm = self.t + float(left[j]), int(idx[j])


@dataclass
class CostResult:
    """Per executed piece of work (a static task, or one claimed task run by
    a claimer): sm, start/end (us), opcode, layer, bytes, claimed, and task
    (index of the static task in SM-major order of the live tasks, -1 for
    claimed work)."""

    sm: np.ndarray
    start: np.ndarray
    end: np.ndarray
    opcode: np.ndarray
    layer: np.ndarray
    nbytes: np.ndarray
    claimed: np.ndarray
    task: np.ndarray
    num_sms: int
    rows: int
    spec_name: str
    params: CostParams
    step_us: float = 0.0
    total_bytes: float = 0.0
    lower_bound_us: float = 0.0
    tokens_per_s: float = 0.0
    bw_fraction: float = 0.0
    meta: dict = field(default_factory=dict)

    def summary(self) -> str:
        return (
            f"{self.spec_name} rows={self.rows}: step {self.step_us:.1f} us "
            f"({self.tokens_per_s:.0f} tok/s), {self.total_bytes / 1e9:.3f} GB moved, "
            f"{100 * self.bw_fraction:.1f}% of {self.params.bandwidth / 1e12:.2f} TB/s "
            f"(bandwidth bound {self.lower_bound_us:.1f} us)"
        )

    def busy_by_opcode(self) -> dict[str, float]:
        """Summed SM-time per opcode (us)."""
        out: dict[str, float] = {}
        for op in np.unique(self.opcode):
            out[Op(int(op)).name] = float((self.end - self.start)[self.opcode == op].sum())
        return out


# --------------------------------------------------------------------------
# bytes per task, from the words (each opcode's definition: megac.ops)
# --------------------------------------------------------------------------
def _ctx(geo, params: CostParams) -> int:
    return int(params.context or geo.context)


def task_bytes(words: np.ndarray, geo, params: CostParams | None = None) -> np.ndarray:
    """Bytes each task (rows of ``words [n, 32]``) moves (``OpDef.task_bytes``).
    Claimers: 0 (their claimed work is costed separately)."""
    params = params or CostParams()
    words = np.asarray(words)
    op = words[:, H.OPCODE]
    out = np.zeros(len(words), dtype=np.float64)
    for opv in np.unique(op):
        m = op == opv
        d = REGISTRY[Op(int(opv))]
        if not d.claimer:
            out[m] = d.task_bytes(words[m].astype(np.int64), geo, params)
    return out


# --------------------------------------------------------------------------
# timed simulation (the one walker of SM queues: megac.passes.walk)
# --------------------------------------------------------------------------
class _TimedHooks(Hooks):
    """Time and bytes per piece of work. A claimer queue's claimed tasks are
    claimed one at a time by whichever claimer gets there first; each waits
    on its own part's counters and signals its part's (an expert's down
    tiles wait on that expert's up tiles alone, as on the device, not on
    every up tile of the layer)."""

    def __init__(self, p, cost: list[float], nbytes, op, layer, params: CostParams) -> None:
        geo = p.geo
        self.cost, self.nbytes, self.op, self.layer = cost, nbytes, op, layer
        self.cg = p.claimer_group.tolist()
        us_per_byte = 1e6 * p.num_sms / params.bandwidth
        C = p.num_counters
        if params.bandwidth_sharing not in ("fcfs", "fair"):
            raise MegacError(f"costmodel: bandwidth sharing must be fcfs or fair, got {params.bandwidth_sharing!r}")
        self.shared = self.fair = None
        if params.shared_bandwidth and params.bandwidth_sharing == "fair":
            self.fair = FairBandwidth(params.shared_bandwidth, p.num_sms)
        elif params.shared_bandwidth:
            self.shared = SharedBandwidth(params.shared_bandwidth)
        limited = self.shared is not None or self.fair is not None
        # per task (with a shared limit): its fixed µs and its stream's µs per byte
        self.fixed = [params.task_fixed(int(o)) for o in op.tolist()] if limited else None
        self.upb = [params.op_us_per_byte.get(int(o), us_per_byte) for o in op.tolist()] if limited else None
        self.pending: dict[int, tuple] = {}  # SM -> (its running stream's start, its record less the times) (fair)
        self.g_cost, self.g_bytes, self.g_pieces, self.g_next = [], [], [], []
        self.g_fixed, self.g_upb = [], []
        for g in p.groups:
            n, b = REGISTRY[Op(g.op)].claimed_work(geo, params)
            self.g_bytes.append(b)
            self.g_cost.append(params.task_cost(g.op, b, us_per_byte))
            self.g_fixed.append(params.task_fixed(g.op))
            self.g_upb.append(params.op_us_per_byte.get(int(g.op), us_per_byte))
            self.g_pieces.append(_claimed_parts(p, g, int(n)))
            self.g_next.append(0)
        self.part_waits = [[(c, t) for c, t in w if 0 <= c < C] for w in p.part_waits]
        self.part_sigs = [[c for c in s if 0 <= c < C] for s in p.part_sigs]
        self.claimer_us = {int(o): float(v) for o, v in params.claimer_us.items()}
        self.rec: list[tuple] = []  # (sm, start, end, opcode, layer, bytes, claimed, task)

    def claimed_signals(self):
        """Every counter signal the claimed pieces will make (one per piece per counter)."""
        for pieces in self.g_pieces:
            for j in pieces:
                yield from self.part_sigs[j]

    def run_task(self, s, k, t):
        if self.fair is not None:
            return self._fair(s, t, self.fixed[k], float(self.nbytes[k]), self.upb[k],
                              (int(self.op[k]), int(self.layer[k]), float(self.nbytes[k]), False, k))
        if self.shared is not None:
            e = self.shared.stream(t + self.fixed[k], float(self.nbytes[k]), self.upb[k])
        else:
            e = t + self.cost[k]
        self.rec.append((s, t, e, int(self.op[k]), int(self.layer[k]), float(self.nbytes[k]), False, k))
        return e

    def claim(self, s, k, t):
        gi = self.cg[k]
        i = self.g_next[gi]
        if i >= len(self.g_pieces[gi]):
            return None
        self.g_next[gi] = i + 1
        j = self.g_pieces[gi][i]
        return Claim(self.part_waits[j], self.part_sigs[j], gi)

    def run_claimed(self, s, k, claim, t):
        gi = claim.payload
        if self.fair is not None:
            return self._fair(s, t, self.g_fixed[gi], float(self.g_bytes[gi]), self.g_upb[gi],
                              (int(self.op[k]), int(self.layer[k]), self.g_bytes[gi], True, -1))
        if self.shared is not None:
            e = self.shared.stream(t + self.g_fixed[gi], float(self.g_bytes[gi]), self.g_upb[gi])
        else:
            e = t + self.g_cost[gi]
        self.rec.append((s, t, e, int(self.op[k]), int(self.layer[k]), self.g_bytes[gi], True, -1))
        return e

    def _fair(self, s, t, fixed, nbytes, upb, rec):
        """Start a piece's stream after its fixed part; its end comes as an
        event of the fair share (None), or now when it moves no bytes."""
        if nbytes <= 0:
            self.rec.append((s, t, t + fixed) + rec)
            return t + fixed
        self.fair.start(t + fixed, s, nbytes, upb)
        self.pending[s] = (t, rec)
        return None

    def next_event(self):
        return self.fair.next_event() if self.fair is not None else math.inf

    def fire(self):
        done = self.fair.fire()
        if done is None:
            return
        s, e = done
        t, rec = self.pending.pop(s)
        self.rec.append((s, t, e) + rec)
        self.walker.resume(s, e)

    def finish(self, s, k, t):
        c = self.claimer_us.get(int(self.op[k]), 0.0)
        if c <= 0:
            return t
        self.rec.append((s, t, t + c, int(self.op[k]), int(self.layer[k]), 0.0, False, k))
        return t + c


def _claimed_parts(p, g, n: int) -> list[int]:
    """The part (index into ``p.part_waits``) of each of a queue's ``n``
    claimed tasks, in claim order. An expert queue's parts are its experts:
    the active ones' tiles in full, expert by expert (``n`` counts active
    experts' tiles). Any other queue's parts (an attention queue's (row, KV
    head)) all take a share of ``n`` (the splits of the step's context)."""
    parts = [int(x) - p.n for x in g.parts]
    if not parts or n <= 0:
        return []
    sizes = [p.part_size[j] for j in parts]
    out: list[int] = []
    if g.queue in (int(Queue.MOE_UP), int(Queue.MOE_DOWN)):
        for j, size in zip(parts, sizes):
            take = min(size, n - len(out))
            out += [j] * take
            if len(out) >= n:
                break
    else:
        base, extra = divmod(n, len(parts))
        for i, j in enumerate(parts):
            out += [j] * (base + (i < extra))
    return out


def simulate(schedule, params: CostParams | None = None, **overrides) -> CostResult:
    """Per-SM timeline of ``schedule`` (a Schedule: tasks, task_counts,
    num_counters, geometry). ``overrides`` set CostParams fields."""
    params = params or CostParams()
    for k, v in overrides.items():
        if not hasattr(params, k):
            raise TypeError(f"unknown cost parameter {k!r}")
        setattr(params, k, v)
    geo = schedule.geometry
    p = Program(schedule.tasks, schedule.task_counts, int(schedule.num_counters), geo)
    build_groups(p, Sink())
    S, C = p.num_sms, p.num_counters
    nbytes = task_bytes(p.words, geo, params)
    us_per_byte = 1e6 * S / params.bandwidth
    cost = np.asarray(params.fixed_us + nbytes * us_per_byte, dtype=np.float64)
    for opv in set(params.op_fixed_us) | set(params.op_us_per_byte):
        m = p.op == int(opv)
        cost[m] = params.task_cost(int(opv), nbytes[m], us_per_byte)
    cost = cost.tolist()

    def ok(v):
        return np.where((v >= 0) & (v < C), v, -1)

    sig = ok(p.sig)
    units = np.bincount(sig[sig >= 0], minlength=C).astype(np.int64)
    hooks = _TimedHooks(p, cost, nbytes, p.op, p.layer, params)
    for c in hooks.claimed_signals():
        units[c] += 1  # each claimed task signals its part's counters
    pre = np.zeros(p.n)
    for opv, us in params.op_pre_us.items():
        pre[p.op == int(opv)] = us
    lead = np.zeros(p.n)
    for opv, us in params.claimer_lead_us.items():
        lead[(p.op == int(opv)) & (p.claimer_group >= 0)] = us
    walker = Walker(p.start, ok(p.w0), p.t0, ok(p.w1), p.t1, sig, p.claimer_group >= 0,
                    UnitCounters(units, params.dependency_latency_us), hooks, pre=pre, lead=lead)
    stuck = walker.run("time")
    if stuck:
        b = stuck[0]
        raise MegacError(
            f"costmodel: the schedule does not complete (SM {b.sm} stuck at slot {b.task - p.start[b.sm]} "
            f"{Op(int(p.op[b.task])).name}); run the verifier"
        )
    rec = hooks.rec
    cols = list(zip(*rec)) if rec else [()] * 8
    res = CostResult(
        sm=np.array(cols[0], dtype=np.int64),
        start=np.array(cols[1], dtype=np.float64),
        end=np.array(cols[2], dtype=np.float64),
        opcode=np.array(cols[3], dtype=np.int64),
        layer=np.array(cols[4], dtype=np.int64),
        nbytes=np.array(cols[5], dtype=np.float64),
        claimed=np.array(cols[6], dtype=bool),
        task=np.array(cols[7], dtype=np.int64),
        num_sms=S,
        rows=int(geo.rows),
        spec_name=str(getattr(schedule, "spec_name", geo.spec_name)),
        params=params,
    )
    res.step_us = float(res.end.max()) if len(res.end) else 0.0
    res.total_bytes = float(res.nbytes.sum())
    res.lower_bound_us = res.total_bytes / params.bandwidth * 1e6
    res.tokens_per_s = res.rows / (res.step_us * 1e-6) if res.step_us > 0 else math.inf
    res.bw_fraction = res.lower_bound_us / res.step_us if res.step_us > 0 else 0.0
    res.meta = {
        "context": _ctx(geo, params),
        "active_experts": expected_active_experts(geo, params),
        "fixed_us": params.fixed_us,
        "dependency_latency_us": params.dependency_latency_us,
    }
    return res


__all__ = ["CEILING_BPS", "CostParams", "CostResult", "FairBandwidth", "SharedBandwidth", "simulate", "task_bytes"]

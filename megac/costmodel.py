"""Cost model: a per-SM timeline of one decode step under a bytes/bandwidth +
fixed-cost model.

Same execution semantics as the verifier's deadlock simulation (each SM runs
its queue in order; a task starts once every signaller of each counter it
waits on is done), with time:

* a task costs ``fixed_us + bytes / per_sm_bw``, where ``per_sm_bw`` is the
  streaming ceiling (4.55e12 B/s measured on the H200) divided by the SM
  count, and ``bytes`` is what the task streams: its weight tile, the
  activations and the KV it reads, the partials it writes (derived from the
  task words and the geometry alone);
* a wait releases ``dependency_latency_us`` after the last signal arrives
  (~1 us for one grid-wide dependency on the H200);
* a claimer queue's work is claimed one task at a time by whichever claimer
  reaches it first (in time order), so it spreads over the claimers that
  reach it while there is work left; the queue's counters complete when its
  last claimed task ends. The number of claimed tasks follows the bucket's
  context (attention splits) and the expected number of active experts under
  uniform routing (``E * (1 - (1 - k/E) ** rows)``) unless given.

The model ignores overlap of consecutive tasks on one SM (it is serial per
SM), caches and compute; it is a planning tool, not a prediction of the
measured step. ``predicted >= bytes / bandwidth`` always holds.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from megac import abi
from megac.abi import DYN_FLAG, H, Op

F = abi.field_index

#: Streaming-read ceiling measured on the H200 (B/s), see DESIGN.md.
CEILING_BPS = 4.55e12

BF16 = 2
FP32 = 4


@dataclass
class CostParams:
    fixed_us: float = 1.0
    dependency_latency_us: float = 1.0
    bandwidth: float = CEILING_BPS
    #: tokens per row for attention (default: the schedule's context bucket)
    context: int | None = None
    #: experts with at least one routed row per MoE layer (default: expected
    #: value under uniform routing)
    active_experts: int | None = None


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
# bytes per task, from the words
# --------------------------------------------------------------------------
def _ctx(geo, params: CostParams) -> int:
    return int(params.context or geo.context)


def _attn_bytes(geo, span: np.ndarray, splits: np.ndarray) -> np.ndarray:
    """One (row, kv head, split): its share of K and V, the query heads, the
    partial outputs."""
    tokens = -(-np.maximum(span, 1) // np.maximum(splits, 1))
    kv = tokens * geo.head_dim * 2 * BF16
    q = geo.heads_per_kv * geo.head_dim * BF16
    part = geo.heads_per_kv * (geo.head_dim + 1) * FP32
    return kv + q + part


def _full_splits(geo, params: CostParams) -> int:
    return geo.attn_splits(_ctx(geo, params))


def _resolve(v: np.ndarray, fallback: int) -> np.ndarray:
    """A count field: itself, or ``fallback`` when it is a dynamic reference."""
    v = v.astype(np.int64)
    return np.where((v >= 0) & ((v & DYN_FLAG) != 0), fallback, v)


def task_bytes(words: np.ndarray, geo, params: CostParams | None = None) -> np.ndarray:
    """Bytes each task (rows of ``words [n, 32]``) moves. Claimers: 0 (their
    claimed work is costed separately)."""
    params = params or CostParams()
    words = np.asarray(words)
    op = words[:, H.OPCODE]
    out = np.zeros(len(words), dtype=np.float64)
    R, D = geo.rows, geo.hidden
    ctx = _ctx(geo, params)
    for opv in np.unique(op):
        m = op == opv
        w = words[m].astype(np.int64)
        o = Op(int(opv))
        if o in (Op.QKV_PROJ, Op.O_PROJ, Op.FFN_UPGATE_ACT, Op.FFN_DOWN, Op.ROUTER_GEMM, Op.LM_HEAD):
            nl, kl = w[:, F(o, "N_LEN")], w[:, F(o, "K_LEN")]
            out_elem = {Op.QKV_PROJ: BF16 * nl, Op.FFN_UPGATE_ACT: BF16 * nl // 2}.get(o, FP32 * nl)
            out[m] = nl * kl * BF16 + R * kl * BF16 + R * out_elem
        elif o == Op.ATTN_DECODE:
            window = w[:, F(o, "WINDOW")]
            span = np.where(window > 0, np.minimum(ctx, window), ctx)
            ns = _resolve(w[:, F(o, "NUM_SPLITS")], _full_splits(geo, params))
            out[m] = _attn_bytes(geo, span, ns)
        elif o == Op.ATTN_COMBINE:
            ns = _resolve(w[:, F(o, "NUM_SPLITS")], _full_splits(geo, params))
            out[m] = ns * geo.heads_per_kv * (geo.head_dim + 1) * FP32 + geo.heads_per_kv * geo.head_dim * BF16
        elif o == Op.ROUTER_TOPK:
            out[m] = w[:, F(o, "NUM_SPLITS")] * max(geo.experts, 1) * FP32 + 3 * max(geo.top_k, 1) * FP32
        elif o == Op.ROUTE_FINALIZE:
            out[m] = R * max(geo.top_k, 1) * 3 * FP32 + 2 * abi.QUEUE_RECORD_WORDS * 4 * geo.moe_queue_cap
        elif o == Op.MOE_GATHER:
            out[m] = D * BF16 * (1 + max(geo.top_k, 1))
        elif o == Op.MOE_COMBINE:
            out[m] = max(geo.top_k, 1) * D * FP32 + D * FP32
        elif o == Op.ADD_RMSNORM:
            splits = w[:, F(o, "ATTN_SPLITS")] + w[:, F(o, "FFN_SPLITS")]
            out[m] = D * (FP32 * 2 + BF16 * 2) + splits * D * FP32
    return out


def _expected_active(geo, params: CostParams) -> int:
    if params.active_experts is not None:
        return int(params.active_experts)
    E, k, R = geo.experts, geo.top_k, geo.rows
    if not E:
        return 0
    return max(min(k, E), int(round(E * (1.0 - (1.0 - k / E) ** R))))


def _claimed_work(op: int, geo, params: CostParams) -> tuple[int, float]:
    """(claimed tasks, bytes per claimed task) of one queue of one layer."""
    if op == Op.ATTN_DRAIN:
        ns = _full_splits(geo, params)
        n = geo.rows * geo.kv_heads * ns
        return n, float(_attn_bytes(geo, np.array([_ctx(geo, params)]), np.array([ns]))[0])
    act = _expected_active(geo, params)
    rows_per_expert = geo.rows * geo.top_k / max(act, 1)
    if op == Op.MOE_UPGATE_DRAIN:
        b = geo.moe_up_bn * geo.hidden * BF16 + rows_per_expert * (geo.hidden + geo.moe_up_bn // 2) * BF16
        return act * geo.up_tiles, float(b)
    b = geo.moe_down_bn * geo.expert_width * BF16 + rows_per_expert * (geo.expert_width * BF16 + geo.moe_down_bn * FP32)
    return act * geo.down_tiles, float(b)


# --------------------------------------------------------------------------
# timed simulation
# --------------------------------------------------------------------------
_CLAIMERS = {int(o) for o in abi.CLAIMERS}


def simulate(schedule, params: CostParams | None = None, **overrides) -> CostResult:
    """Per-SM timeline of ``schedule`` (a Schedule: tasks, task_counts,
    num_counters, geometry). ``overrides`` set CostParams fields."""
    params = params or CostParams()
    for k, v in overrides.items():
        if not hasattr(params, k):
            raise TypeError(f"unknown cost parameter {k!r}")
        setattr(params, k, v)
    geo = schedule.geometry
    tasks = np.asarray(schedule.tasks)
    counts = np.asarray(schedule.task_counts, dtype=np.int64)
    S = tasks.shape[0]
    C = int(schedule.num_counters)
    live = np.arange(tasks.shape[1])[None, :] < counts[:, None]
    words = tasks[live]
    sm_of = np.repeat(np.arange(S), counts)
    start_of = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    op = words[:, H.OPCODE].astype(np.int64)
    layer = words[:, H.LAYER].astype(np.int64)
    nbytes = task_bytes(words, geo, params)
    us_per_byte = 1e6 * S / params.bandwidth
    cost = (params.fixed_us + nbytes * us_per_byte).tolist()
    lat = params.dependency_latency_us

    # claimer groups: (op, layer) -> claimed tasks, their cost, waits, signals
    gkey: dict[tuple[int, int], int] = {}
    g_left: list[int] = []
    g_cost: list[float] = []
    g_bytes: list[float] = []
    g_waits: list[list[int]] = []
    g_sigs: list[list[int]] = []
    g_end: list[float] = []
    g_done: list[bool] = []
    task_group = np.full(len(words), -1, dtype=np.int64)
    from megac import access as _access

    for i in np.flatnonzero(np.isin(op, list(_CLAIMERS))):
        key = (int(op[i]), int(layer[i]))
        if key not in gkey:
            gkey[key] = len(g_left)
            n, b = _claimed_work(key[0], geo, params)
            w = words[i].astype(np.int64)
            o = Op(key[0])
            queue = _access.CLAIMER_QUEUE[o]
            sub = _access.queue_subtasks(queue, key[1], geo)
            wb, sb = int(w[F(o, "TASK_WAIT_BASE")]), int(w[F(o, "TASK_SIGNAL_BASE")])
            g_left.append(n)
            g_bytes.append(b)
            g_cost.append(params.fixed_us + b * us_per_byte)
            g_waits.append(sorted({wb + int(x) for x in np.unique(sub.wait_offset) if 0 <= wb + x < C}))
            g_sigs.append(sorted({sb + int(x) for x in np.unique(sub.signal_offset) if 0 <= sb + x < C}))
            g_end.append(0.0)
            g_done.append(False)
        task_group[i] = gkey[key]

    # counter state: signalling units left, time of the last signal
    sig = words[:, H.SIGNAL].astype(np.int64)
    sig = np.where((sig >= 0) & (sig < C), sig, -1)
    units = np.bincount(sig[sig >= 0], minlength=C).astype(np.int64)
    for ss in g_sigs:
        for c in ss:
            units[c] += 1
    rem = units.tolist()
    last = [0.0] * C

    def ok(v):
        return np.where((v >= 0) & (v < C), v, -1).tolist()

    w0, w1, sgl = ok(words[:, H.WAIT0].astype(np.int64)), ok(words[:, H.WAIT1].astype(np.int64)), sig.tolist()
    tg = task_group.tolist()
    head = start_of[:-1].tolist()
    end = start_of[1:].tolist()
    free = [0.0] * S
    blocked: dict[int, list[int]] = {}
    heap = [(0.0, s) for s in range(S) if head[s] < end[s]]
    heapq.heapify(heap)
    rec: list[tuple] = []  # (sm, start, end, opcode, layer, bytes, claimed, task)

    def signal(c: int, t: float) -> None:
        rem[c] -= 1
        if t > last[c]:
            last[c] = t
        if rem[c] == 0 and c in blocked:
            for s2 in blocked.pop(c):
                heapq.heappush(heap, (max(free[s2], last[c] + lat), s2))

    def ready_time(cs, t):
        """(blocking counter or -1, earliest start)."""
        for c in cs:
            if c >= 0:
                if rem[c] > 0:
                    return c, t
                t = max(t, last[c] + lat)
        return -1, t

    while heap:
        t, s = heapq.heappop(heap)
        k = head[s]
        if k >= end[s]:
            continue
        b, t0 = ready_time((w0[k], w1[k]), t)
        if b >= 0:
            blocked.setdefault(b, []).append(s)
            continue
        gi = tg[k]
        if gi >= 0:
            if g_done[gi]:  # queue drained: the claimer passes
                head[s] = k + 1
                free[s] = t0
                heapq.heappush(heap, (t0, s))
                continue
            b, t1 = ready_time(g_waits[gi], t0)
            if b >= 0:
                blocked.setdefault(b, []).append(s)
                continue
            if g_left[gi] > 0:
                g_left[gi] -= 1
                e = t1 + g_cost[gi]
                rec.append((s, t1, e, int(op[k]), int(layer[k]), g_bytes[gi], True, -1))
                g_end[gi] = max(g_end[gi], e)
                free[s] = e
            else:
                e = t1
            if g_left[gi] == 0:
                g_done[gi] = True
                for c in g_sigs[gi]:
                    signal(c, max(g_end[gi], t1))
            heapq.heappush(heap, (e, s))  # claim again (or pass) when free
            continue
        e = t0 + cost[k]
        rec.append((s, t0, e, int(op[k]), int(layer[k]), float(nbytes[k]), False, k))
        free[s] = e
        head[s] = k + 1
        if sgl[k] >= 0:
            signal(sgl[k], e)
        heapq.heappush(heap, (e, s))
    stuck = [s for s in range(S) if head[s] < end[s]]
    if stuck:
        from megac.errors import MegacError

        s = stuck[0]
        raise MegacError(
            f"costmodel: the schedule does not complete (SM {s} stuck at slot {head[s] - start_of[s]} "
            f"{Op(int(op[head[s]])).name}); run the verifier"
        )
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
        "active_experts": _expected_active(geo, params),
        "fixed_us": params.fixed_us,
        "dependency_latency_us": params.dependency_latency_us,
    }
    return res


__all__ = ["CEILING_BPS", "CostParams", "CostResult", "simulate", "task_bytes"]

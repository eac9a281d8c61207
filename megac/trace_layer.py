"""One layer of a profiled step, SM by SM (``megac trace TRACE --layer N``).

The bandwidth profile (megac/trace_report.py) says how much a layer moves
and when; this says who did what: every SM's tasks of the layer in the
order it ran them, each as its header wait and its run, in µs from the
moment the layer's first task started to run. Reading it is how the late
tasks of a layer show up: the up claims taken by the QKV SMs after their
QKV tile, the O-projection tiles queued behind them, the down claims
claimed late and unprimed (docs/perf-notes.md, thirty-fourth and
thirty-fifth sessions). It needs the trace's records only, not the
schedule the step ran, so it reads traces of any tile set.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from megac.errors import MegacError

#: opcode names shortened for the per-SM lines (the rest print whole)
SHORT = {
    "QKV_PROJ": "QKV", "O_PROJ": "OPROJ", "ATTN_DECODE": "ATTN", "ATTN_DRAIN": "ATTN*", "ATTN_COMBINE": "ACOMB",
    "ROUTER_GEMM": "ROUTER", "ROUTER_TOPK": "TOPK", "ROUTE_FINALIZE": "FINAL", "MOE_GATHER": "GATHER",
    "MOE_UPGATE_DRAIN": "UP*", "MOE_DOWN_DRAIN": "DOWN*", "MOE_COMBINE": "COMB", "ADD_RMSNORM": "NORM",
    "FFN_UPGATE_ACT": "FFNUP", "FFN_DOWN": "FFNDN", "LM_HEAD": "LMHEAD",
}


@dataclass
class Task:
    """One task of the layer on its SM: times in µs from the layer's first run."""

    op: str
    wait_from: float  # its header wait began (its prime, if any, went out then)
    run_from: float  # the wait ended, the task ran
    end: float
    claims: int  # records a claimer ran (0: a static task, or a claimer that found its queue drained)


@dataclass
class LayerView:
    layer: int
    origin_us: float  # the trace's time of the layer's first run (the view's 0)
    sms: dict[int, list[Task]] = field(default_factory=dict)

    @property
    def span_us(self) -> float:
        """From the first run to the last end."""
        return max(t.end for ts in self.sms.values() for t in ts)

    def by_op(self) -> dict[str, tuple[int, float, float, float]]:
        """Per opcode: (tasks, first run, median end, last end)."""
        out: dict[str, list[Task]] = {}
        for ts in self.sms.values():
            for t in ts:
                out.setdefault(t.op, []).append(t)
        return {op: (len(ts), min(t.run_from for t in ts), statistics.median(t.end for t in ts),
                     max(t.end for t in ts)) for op, ts in out.items()}

    def last(self, n: int = 5) -> list[tuple[int, Task]]:
        """The n tasks that ended last (SM, task): where the layer's end came from."""
        every = [(sm, t) for sm, ts in self.sms.items() for t in ts]
        return sorted(every, key=lambda st: -st[1].end)[:n]


def layer_view(records, layer: int) -> LayerView:
    """The view of ``layer`` from a trace's records (megac.gpu.profile's)."""
    if not records:
        raise MegacError("trace: the trace holds no task records")
    mine = [r for r in records if r["layer"] == layer]
    if not mine:
        layers = sorted({r["layer"] for r in records})
        raise MegacError(f"trace: no task of layer {layer} in the trace (its layers: {layers[0]}-{layers[-1]})")
    origin = min(r["waited_us"] for r in mine)
    view = LayerView(layer, origin)
    for r in sorted(mine, key=lambda r: (r["sm"], r["waited_us"])):
        view.sms.setdefault(r["sm"], []).append(
            Task(r["op"], r["start_us"] - origin, r["waited_us"] - origin, r["end_us"] - origin, int(r["claims"])))
    return view


def _task_text(t: Task) -> str:
    name = SHORT.get(t.op, t.op)
    if t.op.endswith("_DRAIN"):
        name += str(t.claims)  # a claimer's records: 0 = drained
    wait = t.run_from - t.wait_from
    # a wait shorter than 0.05 us prints nothing: the task ran as soon as its turn came
    lead = f"~{wait:.1f} " if wait >= 0.05 else ""
    return f"{lead}{name} {t.run_from:.1f}-{t.end:.1f}"


def format_layer_view(view: LayerView) -> str:
    """Text: a summary per opcode, the tasks that ended last, then one line
    per SM (``~w OP a-b``: waited w µs, ran from a to b; a claimer's name
    carries the records it ran)."""
    lines = [f"layer {view.layer}: {view.span_us:.1f} us from its first task's run to its last task's end "
             f"(0 = {view.origin_us:.1f} us into the step)",
             "", f"{'opcode':>18} {'tasks':>6} {'first run':>10} {'median end':>11} {'last end':>9}"]
    for op, (n, first, med, last) in sorted(view.by_op().items(), key=lambda kv: kv[1][1]):
        lines.append(f"{op:>18} {n:>6} {first:>10.1f} {med:>11.1f} {last:>9.1f}")
    lines += ["", "ended last: " + ", ".join(f"SM {sm} {t.op} {t.end:.1f}" for sm, t in view.last()), "",
              "per SM (~w: waited w us before running; UP*/DOWN*/ATTN*n: a claimer that ran n records):"]
    for sm in sorted(view.sms):
        lines.append(f"{sm:>4}  " + "  ".join(_task_text(t) for t in view.sms[sm]))
    return "\n".join(lines)


#: a task that began within this many µs before its layer's last up claim
#: ended, or after it, began as the up tiles ended: a down claim then could
#: not prime ahead of its wait (the router SMs' come ~0.7 µs before)
LATE_US = 1.0
#: a down claimer that found the queue drained within this many µs after the
#: up claims ended was free to share the expert chain's tail
TAIL_ASK_US = 3.0


@dataclass
class Tails:
    """How a MoE layer's two chains end (µs from the layer's first run): the
    attention chain's last O-projection tile and the expert chain's last down
    claim, and what put them there (``megac trace --tails``)."""

    layer: int
    kind: str  # "full" (its attention claimed: ATTN_DRAIN) or "sliding"
    span: float
    up_end: float  # the last up claim's end
    oproj_end: float
    down_end: float  # the last down claimer that ran a claim
    combine_end: float
    late_down: int  # down claimers that ran a claim and began as the up claims ended (LATE_US)
    late_drained: int  # down claimers that began then (up to TAIL_ASK_US after) and found the queue drained
    oproj_behind_up: int  # O-projection tiles begun then, right after an up claimer that ran a claim on its SM


def layer_tails(view: LayerView) -> Tails | None:
    """The view's Tails; None for a layer without expert claims (dense)."""
    tasks = [t for ts in view.sms.values() for t in ts]
    ups = [t for t in tasks if t.op == "MOE_UPGATE_DRAIN" and t.claims > 0]
    downs = [t for t in tasks if t.op == "MOE_DOWN_DRAIN"]
    if not ups or not any(t.claims > 0 for t in downs):
        return None
    up_end = max(t.end for t in ups)
    late = [t for t in downs if t.run_from >= up_end - LATE_US]
    asked = [t for t in late if t.claims == 0 and t.run_from <= up_end + TAIL_ASK_US]
    behind = sum(1 for ts in view.sms.values() for a, b in zip(ts, ts[1:])
                 if a.op == "MOE_UPGATE_DRAIN" and a.claims > 0 and b.op == "O_PROJ"
                 and b.run_from >= up_end - LATE_US)
    ends = lambda op: max((t.end for t in tasks if t.op == op), default=float("nan"))  # noqa: E731
    return Tails(view.layer, "full" if any(t.op == "ATTN_DRAIN" for t in tasks) else "sliding", view.span_us, up_end,
                 ends("O_PROJ"), max(t.end for t in downs if t.claims > 0), ends("MOE_COMBINE"),
                 sum(1 for t in late if t.claims > 0), len(asked), behind)


def step_tails(records) -> list[Tails]:
    """Every MoE layer's Tails, in layer order."""
    if not records:
        raise MegacError("trace: the trace holds no task records")
    layers = sorted({r["layer"] for r in records if r["layer"] >= 0})
    out = [layer_tails(layer_view(records, layer)) for layer in layers]
    tails = [t for t in out if t is not None]
    if not tails:
        raise MegacError("trace: no layer of the trace ran expert claims (--tails reads MoE layers)")
    return tails


def format_tails(tails: list[Tails]) -> str:
    """A line per layer, then the medians per kind of layer."""
    head = (f"{'layer':>5} {'kind':>8} {'span':>6} {'up end':>7} {'O-proj end':>11} {'down end':>9} "
            f"{'combine end':>12} {'late down':>10} {'late drained':>13} {'O-proj behind up':>17}")
    def row(t: Tails, label: str) -> str:
        return (f"{label:>5} {t.kind:>8} {t.span:>6.1f} {t.up_end:>7.1f} {t.oproj_end:>11.1f} {t.down_end:>9.1f} "
                f"{t.combine_end:>12.1f} {t.late_down:>10} {t.late_drained:>13} {t.oproj_behind_up:>17}")

    lines = ["how each MoE layer's chains end (us from the layer's first run): the attention chain's last "
             "O-projection tile, the expert chain's last down claim",
             f"late down: down claims begun as the up claims ended (from {LATE_US:g} us before); late drained: "
             f"down claimers that asked then (to {TAIL_ASK_US:g} us after) and found none; O-proj behind up: "
             "tiles begun then, right after their SM's up claim",
             "", head] + [row(t, str(t.layer)) for t in tails] + ["", "median by kind of layer:", head]
    for kind in ("sliding", "full"):
        mine = [t for t in tails if t.kind == kind]
        if mine:
            med = Tails(-1, kind, *(statistics.median(getattr(t, f) for t in mine) for f in
                                    ("span", "up_end", "oproj_end", "down_end", "combine_end")),
                        *(round(statistics.median(getattr(t, f) for t in mine)) for f in
                          ("late_down", "late_drained", "oproj_behind_up")))
            lines.append(row(med, f"x{len(mine)}"))  # the label: how many layers the median is of
    return "\n".join(lines)


#: the first up claimers a head's "ranked" and "handed" are the median of (the ones that claim as
#: routing ends, before the QKV SMs join)
FIRST_CLAIMERS = 8
#: MEGAC_MARK indices (megac/gpu/profile.py MARK_NAMES): a GEMM tile's activations staged and first
#: stage landed, a folding QKV tile's loads and adds, a routed up claimer's ranking done and its claim
#: handed to the CTA
MARK_STAGED, MARK_LANDED, MARK_FOLDED, MARK_RANKED, MARK_HANDED = 2, 3, 0, 7, 8


@dataclass
class Head:
    """How a MoE layer's chains start (``megac trace --heads``), in µs from
    the end of the layer before's last down claimer that ran a claim (its
    expert outputs are an input of both chains): the layer before's last
    O-projection tile (the other input: where it ends later, the attention
    chain gates the layer); the router tiles' waits ended, their
    activations staged and their end; the layer before's
    norm task (the x_norm its up claims wait on); the first up claimers'
    ranking done and their first claim handed to the CTA (median of the
    FIRST_CLAIMERS that ran first); the first expert weight stage landed;
    how long a QKV tile's fold took after its wait (median); the layer's
    last QKV tile's end, how far after the median tile's end it came, and
    the opcode its SM ran just before it (the attention splits of its KV
    head wait for it, and every O-projection tile for them: fifty-fourth
    session, the norm's SM). NaN (or "") where the trace has no such task or
    stamp (a build without MEGAC_MARK)."""

    layer: int
    kind: str  # "full" (its attention claimed) or "sliding"
    oproj_end: float
    router_waited: float
    router_staged: float
    router_end: float
    norm_end: float
    ranked: float
    handed: float
    first_byte: float
    qkv_fold: float
    qkv_last: float = float("nan")
    qkv_late: float = float("nan")
    qkv_last_after: str = ""


_NAN = float("nan")


def _mark(r: dict, i: int) -> float | None:
    m = r.get("marks_us") or []
    return m[i] if i < len(m) and m[i] is not None else None


def _median(xs) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else _NAN


def layer_head(records, layer: int) -> Head | None:
    """Layer ``layer``'s Head from a trace's records; None where it or the
    layer before ran no expert claims."""
    prev = [r for r in records if r["layer"] == layer - 1]
    mine = [r for r in records if r["layer"] == layer]
    downs = [r for r in prev if r["op"] == "MOE_DOWN_DRAIN" and r["claims"] > 0]
    ups = sorted((r for r in mine if r["op"] == "MOE_UPGATE_DRAIN" and r["claims"] > 0), key=lambda r: r["waited_us"])
    if not downs or not ups:
        return None
    t0 = max(r["end_us"] for r in downs)

    def last(times) -> float:  # the latest, from t0
        return max((x - t0 for x in times), default=_NAN)

    def mid(times) -> float:  # the median of those stamped, from t0
        return _median(x - t0 for x in times if x is not None)

    routers = [r for r in mine if r["op"] == "ROUTER_GEMM"]
    staged = [_mark(r, MARK_STAGED) for r in routers]
    first = ups[:FIRST_CLAIMERS]
    landed = [x for x in (_mark(r, MARK_LANDED) for r in ups) if x is not None]
    folds = [_mark(r, MARK_FOLDED) - r["waited_us"] for r in mine
             if r["op"] == "QKV_PROJ" and _mark(r, MARK_FOLDED) is not None]
    qkvs = [r for r in mine if r["op"] == "QKV_PROJ"]
    qkv_last, qkv_late, after = _NAN, _NAN, ""
    if qkvs:
        lq = max(qkvs, key=lambda r: r["end_us"])
        qkv_last = lq["end_us"] - t0
        qkv_late = lq["end_us"] - statistics.median(r["end_us"] for r in qkvs)
        before = [r for r in records if r["sm"] == lq["sm"] and r["end_us"] <= lq["start_us"]]
        after = max(before, key=lambda r: r["end_us"])["op"] if before else ""
    return Head(layer, "full" if any(r["op"] == "ATTN_DRAIN" for r in mine) else "sliding",
                last(r["end_us"] for r in prev if r["op"] == "O_PROJ"),
                last(r["waited_us"] for r in routers),
                last(staged) if None not in staged else _NAN,  # every router stamped, or no figure
                last(r["end_us"] for r in routers),
                last(r["end_us"] for r in prev if r["op"] == "ADD_RMSNORM"),
                mid(_mark(r, MARK_RANKED) for r in first),
                mid(_mark(r, MARK_HANDED) for r in first),
                min((x - t0 for x in landed), default=_NAN), _median(folds), qkv_last, qkv_late, after)


#: (Head field, column label) in the order format_heads prints them
_HEAD_COLUMNS = (("oproj_end", "O-proj end"), ("router_waited", "router wait"), ("router_staged", "router staged"),
                 ("router_end", "router end"), ("norm_end", "norm end"), ("ranked", "ranked"),
                 ("handed", "claim handed"), ("first_byte", "first byte"), ("qkv_fold", "QKV fold"),
                 ("qkv_last", "QKV last"), ("qkv_late", "QKV late"))


def step_heads(records) -> list[Head]:
    """Every MoE layer's Head (after the first MoE layer), in layer order."""
    if not records:
        raise MegacError("trace: the trace holds no task records")
    layers = sorted({r["layer"] for r in records if r["layer"] >= 0})
    heads = [h for h in (layer_head(records, layer) for layer in layers) if h is not None]
    if not heads:
        raise MegacError("trace: no two consecutive layers of the trace ran expert claims (--heads reads the "
                         "MoE layers after a MoE layer)")
    return heads


def format_heads(heads: list[Head]) -> str:
    """A line per layer, then the medians per kind of layer."""
    widths = [max(len(label), 7) for _, label in _HEAD_COLUMNS]
    head = f"{'layer':>5} {'kind':>8} " + " ".join(f"{label:>{w}}" for (_, label), w in zip(_HEAD_COLUMNS, widths))

    head += "  QKV last after"

    def row(label: str, kind: str, values, after: str = "") -> str:
        return (f"{label:>5} {kind:>8} " + " ".join(f"{v:>{w}.2f}" for v, w in zip(values, widths))
                + (f"  {SHORT.get(after, after)}" if after else ""))

    lines = ["how each MoE layer's chains start (us from the end of the layer before's last down claim): the "
             "layer before's last O-projection tile; the router tiles' waits, staged inputs and end; the layer "
             f"before's norm (the up claims' wait); the first {FIRST_CLAIMERS} up claimers' ranking and first claim "
             "handed to the CTA (median); the first expert weight stage landed; a QKV tile's fold after its wait "
             "(median, a duration); the last QKV tile's end, how long after the median tile's it came (its KV "
             "head's attention waits for it) and what its SM ran before it",
             "", head] + [row(str(h.layer), h.kind, [getattr(h, f) for f, _ in _HEAD_COLUMNS], h.qkv_last_after)
                          for h in heads]
    lines += ["", "median by kind of layer:", head]
    for kind in ("sliding", "full"):
        mine = [h for h in heads if h.kind == kind]
        if mine:
            meds = [_median(v for h in mine if (v := getattr(h, f)) == v) for f, _ in _HEAD_COLUMNS]  # NaN left out
            lines.append(row(f"x{len(mine)}", kind, meds))
    late = [h for h in heads if h.norm_end == h.norm_end and h.ranked == h.ranked]
    if late:
        n = sum(1 for h in late if h.norm_end > h.ranked)
        lines += ["", f"the norm ended after the first claimers ranked in {n} of {len(late)} layers (their "
                      "claims then wait on it)"]
    gated = [h for h in heads if h.oproj_end == h.oproj_end]
    if gated:
        n = sum(1 for h in gated if h.oproj_end > 0)
        lines.append(f"the layer before's last O-projection tile ended after its last down claim in {n} of "
                     f"{len(gated)} layers (the attention chain gates the layer's start there)")
    afters = [h.qkv_last_after for h in heads if h.qkv_last_after]
    if afters:
        top = max(set(afters), key=afters.count)
        lines.append(f"the last QKV tile ran after {top} on its SM in {afters.count(top)} of {len(afters)} layers")
    return "\n".join(lines)


def layer_records(records, view: LayerView) -> list[dict]:
    """The layer's records with times from the layer's first run (for
    megac.plot.plot_measured)."""
    o = view.origin_us
    return [{**r, "start_us": r["start_us"] - o, "waited_us": r["waited_us"] - o, "end_us": r["end_us"] - o}
            for r in records if r["layer"] == view.layer]


__all__ = ["Head", "LayerView", "Tails", "Task", "format_heads", "format_layer_view", "format_tails", "layer_head",
           "layer_records", "layer_tails", "layer_view", "step_heads", "step_tails"]

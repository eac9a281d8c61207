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


def layer_records(records, view: LayerView) -> list[dict]:
    """The layer's records with times from the layer's first run (for
    megac.plot.plot_measured)."""
    o = view.origin_us
    return [{**r, "start_us": r["start_us"] - o, "waited_us": r["waited_us"] - o, "end_us": r["end_us"] - o}
            for r in records if r["layer"] == view.layer]


__all__ = ["LayerView", "Task", "format_layer_view", "layer_records", "layer_view"]

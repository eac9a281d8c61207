"""Where a measured step's bandwidth goes, layer by layer (``megac trace``).

A profiled step (``megac bench --profile``) says when each task ran; the
schedule it ran says how many bytes each task moved (``costmodel.task_bytes``,
and a claimer's claims times the bytes of one). Spreading each task's bytes
evenly over the span it streamed and summing per time bin gives the HBM
bandwidth over the step. Lined up on each layer's start (the end of the
previous layer's last norm) and averaged over the layers of one kind
(sliding / full attention), it shows which part of a layer streams at the
ceiling and which waits on latency: the routing ramp, the hand-over between
the expert phases, the tail.

A task's streaming span is what its stamps mark where it has them (a GEMM
tile's first weight stage landed -> stages consumed, an attention split's
first chunk landed -> keys consumed; a claimer's stamps are its first
claim's, so only a claimer of one claim uses them), else its run (header
waits passed -> end). The bytes are the model's (what the step must move),
not a hardware counter's: the picture is as good as the spread assumption,
which the stamps keep tight where most bytes move.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megac.abi import H, Op
from megac.errors import MegacError

#: (first byte, last byte) stamp names of the opcodes that stamp them (megac.gpu.profile.MARK_NAMES)
_SPAN_MARKS = (("first stage landed", "stages consumed"), ("first chunk landed", "keys consumed"))


def _span_marks() -> dict[str, tuple[int, int]]:
    from megac.gpu.profile import MARK_NAMES

    out = {}
    for op, names in MARK_NAMES.items():
        for a, b in _SPAN_MARKS:
            if a in names and b in names:
                out[op] = (names.index(a), names.index(b))
    return out


def record_bytes(recs: list[dict], sched, context: int) -> np.ndarray:
    """Bytes each record's task moved: a static task's from its words, a
    claimer's its claims times one claim's bytes at ``context``."""
    from megac.costmodel import CostParams, task_bytes
    from megac.ops import REGISTRY

    geo = sched.geometry
    params = CostParams(context=int(context))
    words = np.asarray(sched.tasks)
    counts = np.asarray(sched.task_counts)
    bad = next((r for r in recs if r["task"] >= counts[r["sm"]]), None)
    if bad is not None:
        raise MegacError(f"trace: SM {bad['sm']} ran task {bad['task']}, past its {counts[bad['sm']]} in the schedule "
                         "(not the schedule this trace ran)")
    w = np.stack([words[r["sm"], r["task"]] for r in recs]) if recs else np.zeros((0, words.shape[-1]))
    out = task_bytes(w, geo, params)
    per_claim: dict[int, float] = {}
    for i, r in enumerate(recs):
        op = int(w[i, H.OPCODE])
        d = REGISTRY[Op(op)]
        if d.claimer and r["claims"]:
            if op not in per_claim:
                per_claim[op] = float(d.claimed_work(geo, params)[1])
            out[i] = r["claims"] * per_claim[op]
    return out


def stream_span(rec: dict, marks: dict[str, tuple[int, int]]) -> tuple[float, float]:
    """(first, last) µs of ``rec``'s streaming: its stamps where it has both
    (and a claimer made one claim), else its run."""
    ab = marks.get(rec["op"])
    m = rec.get("marks_us") or []
    if ab is not None and max(ab) < len(m) and rec["claims"] <= 1:
        a, b = m[ab[0]], m[ab[1]]
        if a is not None and b is not None and b > a:
            return float(a), float(b)
    return float(rec["waited_us"]), float(rec["end_us"])


@dataclass
class KindProfile:
    """One layer kind's bandwidth, averaged over its layers: ``rate[i, j]``
    TB/s of opcode ``ops[j]`` in bin ``[edges[i], edges[i + 1])`` µs after
    the layer's start."""

    kind: str
    layers: list[int]
    edges: np.ndarray
    ops: list[str]
    rate: np.ndarray
    layer_us: float  # median, start to the next layer's start
    bytes_per_layer: float
    #: opcode -> (first run start: its waits passed, median end, last end), medians over the layers
    milestones: dict[str, tuple[float, float, float]] = field(default_factory=dict)

    @property
    def total(self) -> np.ndarray:
        return self.rate.sum(axis=1)


@dataclass
class TraceProfile:
    model: str
    batch: int
    context: int
    step_us: float
    total_bytes: float
    kinds: list[KindProfile]
    ceiling_tbs: float

    def to_json(self) -> dict:
        return {"model": self.model, "batch": self.batch, "context": self.context, "step_us": self.step_us,
                "total_bytes": self.total_bytes, "ceiling_tbs": self.ceiling_tbs,
                "kinds": [{"kind": k.kind, "layers": k.layers, "edges_us": k.edges.tolist(), "ops": k.ops,
                           "tbs": k.rate.round(4).tolist(), "layer_us": k.layer_us,
                           "bytes_per_layer": k.bytes_per_layer,
                           "milestones_us": {o: list(v) for o, v in k.milestones.items()}} for k in self.kinds]}


def layer_starts(recs: list[dict]) -> dict[int, float]:
    """Per layer with a norm: when its last ADD_RMSNORM ended (the next
    layer's start)."""
    ends: dict[int, float] = {}
    for r in recs:
        if r["op"] == Op.ADD_RMSNORM.name:
            ends[r["layer"]] = max(ends.get(r["layer"], -np.inf), r["end_us"])
    return ends


def profile(recs: list[dict], sched, context: int, *, bin_us: float = 2.0, lead_us: float = 4.0,
            ceiling_tbs: float = 4.55, model: str = "") -> TraceProfile:
    """The bandwidth of the step ``recs`` recorded (run by ``sched`` at
    ``context``), per layer kind; bins from ``lead_us`` before a layer's
    start (work primed before the previous norm ended) to its longest span."""
    if not bin_us > 0:
        raise MegacError(f"trace: the bin must be positive, got {bin_us} us")
    if not recs:
        raise MegacError("trace: no task records")
    nbytes = record_bytes(recs, sched, context)
    marks = _span_marks()
    spans = [stream_span(r, marks) for r in recs]
    norm_end = layer_starts(recs)
    geo = sched.geometry
    # a layer's window: the previous layer's norm end to its own (both must be in the trace)
    layers = [L for L in sorted(norm_end) if L - 1 in norm_end and 0 <= L < len(geo.sliding)]
    if not layers:
        raise MegacError("trace: no layer has both its norm and the previous layer's (too short a trace?)")
    by_layer: dict[int, list[int]] = {}
    for i, r in enumerate(recs):
        by_layer.setdefault(r["layer"], []).append(i)
    kinds: dict[str, list[int]] = {}
    for L in layers:
        kinds.setdefault("sliding" if geo.sliding[L] else "full", []).append(L)
    out = []
    for kind, Ls in kinds.items():
        length = [norm_end[L] - norm_end[L - 1] for L in Ls]
        edges = np.arange(-lead_us, max(length) + bin_us, bin_us)
        ops = sorted({recs[i]["op"] for L in Ls for i in by_layer.get(L, []) if nbytes[i] > 0},
                     key=lambda o: Op[o].value)
        col = {o: j for j, o in enumerate(ops)}
        acc = np.zeros((len(edges) - 1, len(ops)))
        per_layer = []
        firsts: dict[str, list[float]] = {}
        meds: dict[str, list[float]] = {}
        lasts: dict[str, list[float]] = {}
        for L in Ls:
            t0 = norm_end[L - 1]
            tot = 0.0
            per_op: dict[str, list[dict]] = {}
            for i in by_layer.get(L, []):
                r = recs[i]
                per_op.setdefault(r["op"], []).append(r)
                if nbytes[i] <= 0:
                    continue
                tot += nbytes[i]
                a, b = spans[i][0] - t0, spans[i][1] - t0
                if b <= a:  # an instant: all its bytes in its bin
                    b = a + 1e-9
                over = np.clip(np.minimum(edges[1:], b) - np.maximum(edges[:-1], a), 0.0, None)
                acc[:, col[r["op"]]] += nbytes[i] / (b - a) * over / bin_us / 1e6  # B/µs -> TB/s
            per_layer.append(tot)
            for o, rs in per_op.items():
                firsts.setdefault(o, []).append(min(r["waited_us"] for r in rs) - t0)
                meds.setdefault(o, []).append(float(np.median([r["end_us"] for r in rs])) - t0)
                lasts.setdefault(o, []).append(max(r["end_us"] for r in rs) - t0)
        ms = {o: (float(np.median(firsts[o])), float(np.median(meds[o])), float(np.median(lasts[o])))
              for o in sorted(firsts, key=lambda o: np.median(firsts[o]))}
        out.append(KindProfile(kind, Ls, edges, ops, acc / len(Ls), float(np.median(length)),
                               float(np.mean(per_layer)), ms))
    step = max(r["end_us"] for r in recs) - min(r["start_us"] for r in recs)
    return TraceProfile(model, int(geo.rows), int(context), float(step), float(nbytes.sum()),
                        sorted(out, key=lambda k: k.kind != "sliding"), float(ceiling_tbs))


def format_profile(p: TraceProfile) -> str:
    """The profile as text: per kind, the layer's time against its bytes at
    the ceiling, the TB/s of each bin by opcode, and when each opcode ran."""
    lines = [f"{p.model} batch {p.batch} context {p.context}: step {p.step_us:.1f} us, "
             f"{p.total_bytes / 1e9:.3f} GB ({p.total_bytes / p.step_us / 1e6:.2f} TB/s on average, "
             f"{100 * p.total_bytes / p.step_us / 1e6 / p.ceiling_tbs:.1f} % of {p.ceiling_tbs:.2f})"]
    for k in p.kinds:
        sol = _ceiling_us(k.bytes_per_layer, p.ceiling_tbs)
        lines.append("")
        lines.append(f"{k.kind} layers ({len(k.layers)}): {k.layer_us:.1f} us each (median), "
                     f"{k.bytes_per_layer / 1e6:.1f} MB = {sol:.1f} us at {p.ceiling_tbs:.2f} TB/s "
                     f"({100 * sol / k.layer_us:.0f} %)")
        short = [o.lower().replace("_drain", "").replace("moe_", "")[:9] for o in k.ops]
        lines.append(f"{'us':>6} {'TB/s':>5}  " + " ".join(f"{s:>9}" for s in short))
        for i in range(len(k.edges) - 1):
            if k.total[i] < 0.005:
                continue
            bar = "#" * int(round(10 * k.total[i] / p.ceiling_tbs))
            lines.append(f"{k.edges[i]:6.1f} {k.total[i]:5.2f}  " + " ".join(f"{x:9.2f}" for x in k.rate[i])
                         + f"  {bar}")
        lines.append(f"{'when (us)':>18} {'first run':>12} {'median end':>11} {'last end':>9}")
        for o, (a, m, b) in k.milestones.items():
            lines.append(f"{o.lower():>18} {a:12.1f} {m:11.1f} {b:9.1f}")
    return "\n".join(lines)


def _ceiling_us(nbytes: float, tbs: float) -> float:
    """µs ``nbytes`` take at ``tbs`` TB/s (1 TB/s = 1e6 B/µs)."""
    return nbytes / (tbs * 1e6)


def plot_profile(p: TraceProfile, path) -> Path:
    """Stacked TB/s per opcode over a layer, one panel per kind, with the
    ceiling and the layer's median end (PNG or SVG)."""
    from megac.plot import OP_COLORS, check_plot_path

    path = check_plot_path(path)
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(p.kinds), 1, figsize=(12, 3.2 * len(p.kinds) + 0.6), dpi=110, squeeze=False)
    for ax, k in zip(axes[:, 0], p.kinds):
        x = np.repeat(k.edges, 2)[1:-1]
        ys = [np.repeat(k.rate[:, j], 2) for j in range(len(k.ops))]
        ax.stackplot(x, ys, labels=[o.lower() for o in k.ops], colors=[OP_COLORS.get(Op[o], "#000") for o in k.ops])
        ax.axhline(p.ceiling_tbs, color="k", lw=0.8, ls="--")
        ax.axvline(k.layer_us, color="k", lw=0.8, ls=":")
        ax.set_xlim(k.edges[0], k.edges[-1])
        ax.set_ylim(0, max(p.ceiling_tbs, float(k.total.max())) * 1.1)
        ax.set_ylabel("TB/s")
        ax.set_title(f"{k.kind} layers ({len(k.layers)}): {k.layer_us:.1f} us each, "
                     f"{k.bytes_per_layer / 1e6:.1f} MB ({100 * _ceiling_us(k.bytes_per_layer, p.ceiling_tbs) / k.layer_us:.0f} % "
                     f"of the dashed ceiling)", fontsize=9)
        ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False)
    axes[-1, 0].set_xlabel("us after the previous layer's norm ended (dotted: the layer's median end)")
    fig.suptitle(f"{p.model} batch {p.batch} context {p.context}: HBM bandwidth through a layer (measured timing, "
                 "each task's bytes over its streaming span)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format=path.suffix.lower()[1:])
    plt.close(fig)
    return path


__all__ = ["KindProfile", "TraceProfile", "format_profile", "layer_starts", "plot_profile", "profile",
           "record_bytes", "stream_span"]

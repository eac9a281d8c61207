"""Timeline plot of a cost-model result: one row per SM, one bar per task,
coloured by opcode, with a legend and the predicted step time in the title.
PNG or SVG by the file extension (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megac.abi import Op
from megac.errors import MegacError

#: Fixed colour per opcode, so plots of different schedules compare at a
#: glance: attention blues/cyans, dense FFN greens, routing olive/brown, MoE
#: expert work orange (gate/up) and red (down), norms grey, LM head purple.
OP_COLORS = {
    Op.QKV_PROJ: "#1f77b4",
    Op.ATTN_DECODE: "#aec7e8",
    Op.ATTN_DRAIN: "#17becf",
    Op.ATTN_COMBINE: "#9edae5",
    Op.O_PROJ: "#393b79",
    Op.FFN_UPGATE_ACT: "#2ca02c",
    Op.FFN_DOWN: "#98df8a",
    Op.ROUTER_GEMM: "#bcbd22",
    Op.ROUTER_TOPK: "#dbdb8d",
    Op.ROUTE_FINALIZE: "#8c564b",
    Op.MOE_GATHER: "#c49c94",
    Op.MOE_UPGATE_DRAIN: "#ff7f0e",
    Op.MOE_DOWN_DRAIN: "#d62728",
    Op.MOE_COMBINE: "#ff9896",
    Op.ADD_RMSNORM: "#7f7f7f",
    Op.LM_HEAD: "#9467bd",
    Op.NOP: "#ffffff",
}


def check_plot_path(path, what: str = "plot:") -> Path:
    """``path`` as a Path when it names a picture this module writes; a
    one-line error naming ``what`` (e.g. the option) otherwise. Commands
    call it before any slow work."""
    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg"):
        raise MegacError(f"{what} {path}: use a .png or .svg file name")
    return path


def _figure(S: int):
    """A figure one row per SM tall (matplotlib's Agg backend, imported here)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(14, min(12.0, max(3.0, 0.06 * S + 1.8))), dpi=110)


def _bars(ax, x0, x1, y, color, edge=("none", 0)) -> None:
    """One horizontal bar per (x0, x1, y), drawn as one collection (fast for ~30K bars)."""
    from matplotlib.collections import PolyCollection

    h = 0.8
    x0, x1, y = np.asarray(x0, float), np.asarray(x1, float), np.asarray(y, float)
    verts = np.stack([np.stack([x0, y - h / 2], 1), np.stack([x0, y + h / 2], 1),
                      np.stack([x1, y + h / 2], 1), np.stack([x1, y - h / 2], 1)], axis=1)
    ax.add_collection(PolyCollection(verts, facecolors=color, edgecolors=edge[0], linewidths=edge[1]))


def _sm_axis(ax, S: int, xlim, xlabel: str) -> None:
    ax.set_xlim(*xlim)
    ax.set_ylim(S - 0.5, -0.5)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("SM")
    if S > 40:
        ax.set_yticks(np.arange(0, S, max(1, S // 12)))


def _op_handles(ops) -> list:
    from matplotlib.patches import Patch

    return [Patch(facecolor=OP_COLORS.get(o, "#000"), label=o.name.lower()) for o in ops]


def _save(fig, ax, path: Path, title: str, handles) -> Path:
    import matplotlib.pyplot as plt

    ax.set_title(title, fontsize=10)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format=path.suffix.lower()[1:])
    plt.close(fig)
    return path


def plot_timeline(result, path, *, title: str | None = None, max_sms: int | None = None,
                  time_range: tuple[float, float] | None = None) -> Path:
    """Draw ``result`` (a :class:`megac.costmodel.CostResult`) to ``path``
    (.png or .svg). ``max_sms`` limits the rows drawn (the first SMs);
    ``time_range`` (us) zooms into part of the step."""
    path = check_plot_path(path)
    S = result.num_sms if max_sms is None else min(max_sms, result.num_sms)
    keep = result.sm < S
    sm, t0, t1, op = result.sm[keep], result.start[keep], result.end[keep], result.opcode[keep]
    fig, ax = _figure(S)
    # thin white edges separate back-to-back tasks while they are wide enough to see
    edge = ("white", 0.4) if len(t0) < 3000 else ("none", 0)
    present = []
    for code in sorted(set(op.tolist())):
        m = op == code
        _bars(ax, t0[m], t1[m], sm[m], OP_COLORS.get(Op(code), "#000000"), edge)
        present.append(Op(code))
    step = result.step_us
    _sm_axis(ax, S, time_range or (0, step * 1.01 if step > 0 else 1), "time (us)")
    bound = ax.axvline(result.lower_bound_us, color="black", linestyle="--", linewidth=1.2)
    if title is None:
        title = (
            f"{result.spec_name}, batch {result.rows}: predicted step {step:.1f} us, "
            f"{result.tokens_per_s:.0f} tok/s, {100 * result.bw_fraction:.0f}% of "
            f"{result.params.bandwidth / 1e12:.2f} TB/s\n"
            f"({result.total_bytes / 1e9:.2f} GB moved; {result.params.fixed_us:g} us fixed per task, "
            f"{result.params.dependency_latency_us:g} us per dependency)"
        )
    bound.set_label(f"bandwidth bound\n{result.lower_bound_us:.0f} us")
    return _save(fig, ax, path, title, _op_handles(present) + [bound])


WAIT_COLOR = "#e8e8e8"


def plot_measured(recs, path, *, title: str, max_sms: int | None = None,
                  time_range: tuple[float, float] | None = None,
                  xlabel: str = "time (us, from the first task's start)") -> Path:
    """Draw a measured step (:func:`megac.gpu.profile.read` records) to
    ``path`` (.png or .svg): one row per SM, each task's header wait as a
    light grey bar and its run in the opcode's colour (a claimer's bar
    includes the waits of the records it claimed)."""
    from matplotlib.patches import Patch

    path = check_plot_path(path)
    recs = list(recs)
    if not recs:
        raise MegacError("plot: no task records (did the step run with a MEGAC_PROFILE build?)")
    n_sms = max(r["sm"] for r in recs) + 1
    S = n_sms if max_sms is None else min(max_sms, n_sms)
    recs = [r for r in recs if r["sm"] < S]
    fig, ax = _figure(S)
    _bars(ax, [r["start_us"] for r in recs], [r["waited_us"] for r in recs], [r["sm"] for r in recs], WAIT_COLOR)
    present = sorted({Op[r["op"]] for r in recs})
    for o in present:
        mine = [r for r in recs if r["op"] == o.name]
        _bars(ax, [r["waited_us"] for r in mine], [r["end_us"] for r in mine], [r["sm"] for r in mine],
              OP_COLORS.get(o, "#000000"))
    span = max(r["end_us"] for r in recs)
    _sm_axis(ax, S, time_range or (0, span * 1.01), xlabel)
    handles = [Patch(facecolor=WAIT_COLOR, label="header wait")] + _op_handles(o for o in present if o != Op.NOP)
    return _save(fig, ax, path, title, handles)


__all__ = ["OP_COLORS", "check_plot_path", "plot_measured", "plot_timeline"]

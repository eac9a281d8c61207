"""``megac trace``: where a profiled step's bandwidth goes, layer by layer.

::

    megac bench north-mini-code --backend cuda --random-weights --batch-size 1 --context 8192 \\
        --profile step.json                       # on the GPU: one profiled step
    megac trace step.json --plot layer-bw.png     # here: TB/s through a layer, by opcode
    megac trace step.json --heads                 # how each MoE layer's chains start (the routing chain)
    megac trace step.json --tails                 # how they end

See megac/trace_report.py for what the numbers are.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from megac.calibrate_cli import traced_step_options


@click.command("trace")
@traced_step_options
@click.option("--bin-us", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              help="Width of a time bin (µs).")
@click.option("--ceiling", type=click.FloatRange(min=0, min_open=True), default=4.55, show_default=True,
              metavar="TB/S", help="The streaming ceiling the layers are held against (megac bench measures it).")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Draw TB/s through a layer, stacked by opcode, one panel per layer kind (.png or .svg).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the profile as JSON.")
@click.option("--marks", is_flag=True,
              help="Also print, per opcode, the points stamped inside its tasks (MEGAC_MARK): median us after "
                   "the task's wait, in time order.")
@click.option("--layer", type=click.IntRange(0), default=None,
              help="Instead: layer N SM by SM (each SM's tasks of the layer, their waits and runs, in us from the "
                   "layer's first run), the opcodes' spans and the tasks that ended last.")
@click.option("--timeline", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="With --layer: draw that layer's per-SM timeline (.png or .svg).")
@click.option("--heads", is_flag=True,
              help="Instead: how every MoE layer's chains start after the layer before's last down claim (the "
                   "router tiles, the norm the up claims wait on, the first claimers' ranking and first expert "
                   "byte, a QKV tile's fold), with the medians per kind of layer.")
@click.option("--tails", is_flag=True,
              help="Instead: how every MoE layer's two chains end (the last O-projection tile, the last down "
                   "claim), the down claims taken after the up claims ended and the O-projection tiles queued "
                   "behind up claims, with the medians per kind of layer.")
def trace_cmd(trace, model, batch_size, context, order, bin_us, ceiling, plot, json_out, marks, layer, timeline,
              heads, tails):
    """Where the bandwidth of the step in TRACE goes: per layer kind, TB/s by opcode through a layer.
    With --layer N: who did what in layer N, SM by SM."""
    from megac.calibrate_cli import traced_step
    from megac.gpu.profile import format_marks, marks_summary
    from megac.trace_report import format_profile, plot_profile, profile

    say = lambda m: click.echo(m, err=True)  # noqa: E731
    if timeline is not None and layer is None:
        raise click.UsageError("--timeline draws one layer: pass --layer N too")
    if tails and layer is not None:
        raise click.UsageError("--tails reads every layer: pass it without --layer")
    if heads and (layer is not None or tails):
        raise click.UsageError("--heads reads every layer: pass it without --layer or --tails")
    if heads or tails:  # every layer, from the trace's records alone
        from megac.calibrate_cli import read_trace, trace_records
        from megac.trace_layer import format_heads, format_tails, step_heads, step_tails

        records = trace_records(read_trace(trace, "trace"), trace, "trace")
        click.echo(format_heads(step_heads(records)) if heads else format_tails(step_tails(records)))
        return
    if layer is not None:
        _layer(trace, layer, timeline, say)
        return
    if plot is not None:
        from megac.plot import check_plot_path

        check_plot_path(plot, "--plot")
    _, _, spec, sched, records, _, ctx, _ = traced_step(trace, model, batch_size, context, order, say, what="trace")
    p = profile(records, sched, ctx, bin_us=bin_us, ceiling_tbs=ceiling, model=spec.name)
    click.echo(format_profile(p))
    inside = marks_summary(records) if marks or json_out is not None else None
    if marks:
        click.echo("")
        click.echo(format_marks(inside))
    if plot is not None:
        plot_profile(p, plot)
        say(f"wrote {plot}")
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps({**p.to_json(), "marks": inside}, indent=1))
        say(f"wrote {json_out}")


def _layer(trace: Path, layer: int, timeline: Path | None, say) -> None:
    """megac trace --layer: from the trace's records alone (no schedule rebuilt, so any tile set's trace)."""
    from megac.calibrate_cli import read_trace, trace_records
    from megac.trace_layer import format_layer_view, layer_records, layer_view

    if timeline is not None:
        from megac.plot import check_plot_path

        check_plot_path(timeline, "--timeline")
    data = read_trace(trace, "trace")
    records = trace_records(data, trace, "trace")
    view = layer_view(records, layer)
    click.echo(format_layer_view(view))
    if timeline is not None:
        from megac.plot import plot_measured

        recs = layer_records(records, view)
        meta = data.get("otherData") or {}
        what = " ".join(str(x) for x in (meta.get("model"), f"batch {meta.get('batch')}" if meta.get("batch") else None,
                                          f"context {meta.get('context')}" if meta.get("context") else None) if x)
        # a primed task's wait can begin long before the layer's first run: show the last 10 us of them
        lo = max(-10.0, min(r["start_us"] for r in recs))
        plot_measured(recs, timeline, title=f"{what}: layer {layer}, {view.span_us:.1f} us".strip(": "),
                      time_range=(lo, view.span_us * 1.02), xlabel="time (us, from the layer's first run)")
        say(f"wrote {timeline}")


__all__ = ["trace_cmd"]

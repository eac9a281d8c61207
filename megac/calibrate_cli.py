"""``megac calibrate``: fit the cost model to one measured step.

::

    megac bench north-mini-code --backend cuda --random-weights --batch-size 1 --context 8192 \\
        --profile step.json                        # on the GPU: one profiled step
    megac calibrate step.json -o h200-nmc.json     # here: the fit, and how well it predicts
    megac calibrate step.json --steps bench.json   # ... and every step bench.json measured
    megac schedule north-mini-code --calibration h200-nmc.json --plot timeline.png

The trace names its model, batch, context and order (``otherData``, written
by ``megac bench --profile``); a trace recorded before they were written
needs ``--model``, ``--batch-size``, ``--context`` and the order it ran.
With ``--steps`` (``megac bench --json`` files of the same model) the
attention claims' streaming rate is refit to the measured steps at
``--min-context`` and above (one trace holds one claim size, so it cannot
tell a claim's fixed part from its rate), and every step is predicted
against its measured kernel time.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import click

from megac.errors import MegacError
from megac.order_option import ORDER_HELP, OrderType


def read_trace(path: Path, what: str = "calibrate") -> dict:
    """A Chrome trace written by ``megac bench --profile`` (``.json`` or
    ``.json.gz``); errors name the command ``what``."""
    try:
        raw = path.read_bytes()
        text = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
        trace = json.loads(text)
    except FileNotFoundError:
        raise MegacError(f"{what}: {path}: no such file") from None
    except (OSError, ValueError, EOFError) as err:
        raise MegacError(f"{what}: {path}: not a JSON trace ({type(err).__name__}: {err})") from None
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise MegacError(f"{what}: {path}: no traceEvents (write one with megac bench --profile FILE.json)")
    return trace


def trace_records(data: dict, path: Path, what: str = "calibrate") -> list[dict]:
    """The task records of a trace :func:`read_trace` read; errors name the
    command ``what`` and the file."""
    from megac.gpu.profile import records_from_trace

    try:
        records = records_from_trace(data)
    except (KeyError, TypeError) as err:
        raise MegacError(f"{what}: {path}: not a megac profile trace (an event lacks {err})") from None
    if not records:
        raise MegacError(f"{what}: {path}: the trace holds no task records")
    return records


def traced_step(path: Path, model, batch_size, context, order, say, what: str = "calibrate"):
    """The step a profile trace recorded, rebuilt: (trace, its ``otherData``,
    the spec with the tiles it ran, the schedule it ran, its records, batch,
    context, order). The trace's own model, batch, context and order unless
    given; a trace that does not name them needs them given."""
    from megac.spec import load_spec

    data = read_trace(path, what)
    meta = data.get("otherData") or {}
    model = model or meta.get("model")
    batch = batch_size or meta.get("batch")
    ctx = context or meta.get("context")
    if order is None:
        order = _recorded_order(meta.get("order") or "tuned", meta.get("order_doc"), say)
    missing = [n for n, v in (("--model", model), ("--batch-size", batch), ("--context", ctx)) if not v]
    if missing:
        raise MegacError(f"{what}: {path} does not name its {', '.join(m[2:] for m in missing)} "
                         f"(a trace from before megac bench recorded them): pass {', '.join(missing)}")
    records = trace_records(data, path, what)
    if meta.get("tiles") is None:
        # a trace that does not record its tiles (before the twenty-first session, or written by
        # the GPU checks): today's tiles where its records are that schedule's, else the plain ones
        from megac.calibration import check_records
        from megac.passes.pipeline import compile_one

        spec = load_spec(model)
        sched = compile_one(spec, order=order, rows=int(batch), context=int(meta.get("schedule_context") or ctx))
        try:
            check_records(records, sched)
            return data, meta, spec, sched, records, int(batch), int(ctx), order
        except MegacError:
            pass
    spec = _with_tiles(load_spec(model), meta.get("tiles"), say)
    sched = _traced_schedule(spec, order, int(batch), int(ctx), meta.get("schedule_context"), records, say)
    return data, meta, spec, sched, records, int(batch), int(ctx), order


def _recorded_order(order: str, doc, say) -> str:
    """``order``, or where the trace recorded its waves (``order_doc``, since
    the thirty-third session) and the order file no longer holds them (a
    default order retuned since), a copy of the recorded waves to compile."""
    import hashlib
    import tempfile

    import yaml

    from megac.passes.order import order_doc

    if not isinstance(doc, dict) or order_doc(order) == doc:
        return order
    text = yaml.safe_dump(doc, sort_keys=False)
    where = Path(tempfile.gettempdir()) / "megac-traced-orders"
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"{Path(order).stem}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.yaml"
    path.write_text(text)
    say(f"the order {order} has changed since the trace: compiling with the waves it recorded ({path})")
    return str(path)


def _step_rows(paths, model: str) -> list[tuple[int, int, float, int]]:
    """(batch, context, kernel ms, the median timed step's context: its schedule's bucket)."""
    from megac.decode_bench import timed_context

    rows = []
    for p in paths:
        try:
            run = json.loads(Path(p).read_text())
            got = run["run"]["model"]
            w, n = int(run["run"].get("warmup", 0)), int(run["run"].get("steps", 0))
            these = [(int(r["batch"]), int(r["context"]), float(r["kernel_ms"]), timed_context(int(r["context"]), w, n))
                     for r in run["rows"]]
        except FileNotFoundError:
            raise MegacError(f"calibrate: --steps {p}: no such file") from None
        except (ValueError, KeyError, TypeError) as err:
            raise MegacError(f"calibrate: --steps {p}: not a megac bench --json file ({type(err).__name__}: {err})") from None
        if got != model:
            raise MegacError(f"calibrate: --steps {p} measured {got}, the trace {model}")
        rows += these
    return rows


def _with_tiles(spec, tiles, say):
    """``spec`` compiled with the tile settings the trace recorded (``otherData``
    ``tiles``, written since the twenty-first session), where they differ from
    what it asks for today: the traced schedule is rebuilt as it ran even after
    a default tile changed. A key the trace does not name (it predates the
    key) takes its value from before the key existed (``PLAIN_TILES``: the
    split configuration off); traces without tiles: ``spec`` with those."""
    from megac.geometry import DEFAULT_TILES, PLAIN_TILES, tiles_of

    if tiles is not None and (not isinstance(tiles, dict) or any(
            k not in DEFAULT_TILES or not isinstance(v, int) for k, v in tiles.items())):
        raise MegacError(f"calibrate: the trace's tiles are not tile settings: {tiles!r}")
    tiles = {**PLAIN_TILES, **(tiles or {})}
    now = tiles_of(spec)
    if all(now.get(k) == v for k, v in tiles.items()):
        return spec
    differ = ", ".join(f"{k} {now.get(k)} -> {v}" for k, v in sorted(tiles.items()) if now.get(k) != v)
    say(f"compiling with the trace's tiles ({differ})")
    data = spec.model_dump()
    data["target"]["tiles"] = {**(data["target"].get("tiles") or {}), **tiles}
    return type(spec).model_validate(data)


def _traced_schedule(spec, order, batch: int, ctx: int, schedule_context, records, say):
    """The schedule the trace ran: its context bucket's where the trace names
    it; else the step's context's, else whichever bucket of the compiled
    artifact the records match (a step at 1024 tokens plus its warm-up ran
    the 2048 bucket's schedule)."""
    from megac.calibration import check_records
    from megac.passes.pipeline import compile_one

    sched = compile_one(spec, order=order, rows=batch, context=int(schedule_context or ctx))
    if schedule_context:  # the bucket it ran is known: its records must be that schedule's
        check_records(records, sched)
        return sched
    try:
        check_records(records, sched)
        return sched
    except MegacError as first:
        from megac.runtime.artifacts import load_or_compile

        say(f"the trace is not the {ctx}-token schedule's; trying the compiled context buckets")
        for s in load_or_compile(spec, order).schedules:
            if int(s.geometry.rows) != batch:
                continue
            try:
                check_records(records, s)
            except MegacError:
                continue
            say(f"the trace ran the {int(s.geometry.context)}-token bucket's schedule")
            return s
        raise first


def traced_step_options(f):
    """The TRACE argument and the options that name a trace's step where the
    trace does not (:func:`traced_step`'s), for the commands that read one."""
    for opt in reversed((
            click.argument("trace", type=click.Path(dir_okay=False, path_type=Path)),
            click.option("--model", default=None, help="The traced model (default: the trace's)."),
            click.option("--batch-size", type=click.IntRange(1, 64), default=None,
                         help="The traced step's batch (default: the trace's)."),
            click.option("--context", type=click.IntRange(1), default=None,
                         help="The traced step's context (default: the trace's)."),
            click.option("--order", type=OrderType(), default=None,
                         help=ORDER_HELP + " Default: the trace's, else tuned."))):
        f = opt(f)
    return f


@click.command("calibrate")
@traced_step_options
@click.option("--steps", "step_files", multiple=True, type=click.Path(dir_okay=False, path_type=Path),
              help="megac bench --json files of the same model: refit the attention claims' rate and predict every row.")
@click.option("--refit-op", default="ATTN_DRAIN", show_default=True, help="The claimer opcode --steps refits.")
@click.option("--min-context", type=click.IntRange(1), default=8192, show_default=True,
              help="--steps rows the refit sees (the rest are only predicted).")
@click.option("-o", "--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the calibration here (for megac schedule/bench --calibration).")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Draw the traced step's predicted timeline (.png or .svg).")
@click.option("--shared-bandwidth", type=click.FloatRange(min=0, min_open=True), default=None, metavar="TB/S",
              help="Have every SM's streams share this bandwidth (the whole GPU's, e.g. the ceiling megac bench "
                   "measures), so tilings that spread work over more SMs are ranked as measured; with --steps "
                   "the traced rates are refit as uncontended ones.")
@click.option("--sharing", type=click.Choice(["fcfs", "fair"]), default="fcfs", show_default=True,
              help="How the streams share --shared-bandwidth: max-min fairly at every moment, or each settled "
                   "when it starts, first come first served (the calibrations before the thirty-first session).")
def calibrate_cmd(trace, model, batch_size, context, order, step_files, refit_op, min_context, out, plot,
                  shared_bandwidth, sharing):
    """Fit the cost model to the measured step in TRACE and report how well it predicts."""
    from megac.calibration import REFIT_RATES_GBS, fit, refit_claim_stream, trace_timing
    from megac.costmodel import simulate

    say = lambda m: click.echo(m, err=True)  # noqa: E731
    if plot is not None:
        from megac.plot import check_plot_path

        check_plot_path(plot, "--plot")
    data, meta, spec, sched, records, batch, ctx, order = traced_step(trace, model, batch_size, context, order, say)
    timing = trace_timing(records, sched)
    device = meta.get("device", "the GPU")
    source = f"{device}, {spec.name} batch {batch} context {ctx} order {order}; trace {trace.name}"
    kernel, profiled = meta.get("kernel_ms"), meta.get("profiled_ms")
    scale = kernel / profiled if kernel and profiled else 1.0
    cal = fit(records, sched, context=int(ctx), scale=scale, source=source)
    if shared_bandwidth is not None:
        from dataclasses import replace

        cal = replace(cal, shared_bandwidth_bps=float(round(shared_bandwidth * 1e12)), bandwidth_sharing=sharing)
        say(f"the streams share {shared_bandwidth:.2f} TB/s "
            + ("max-min fairly" if sharing == "fair" else "first come, first served")
            + ("" if step_files else " (the rates stay as traced, contention included: --steps refits them)"))
    span = cal.measured_step_us
    pred = simulate(sched, cal.params(context=int(ctx))).step_us
    say(f"fitted on {len(records)} task records of {spec.name} (batch {batch}, context {ctx}, order {order})")
    say(f"task loop: dispatch {cal.fixed_us:.2f} us, hand-off {cal.dependency_latency_us:.2f} us "
        f"({timing.samples['dispatch']} and {timing.samples['handoff']} samples in the trace)")
    for op in sorted(cal.notes):
        n = cal.notes[op]
        extra = []
        if op in cal.pre_us_by_op:
            extra.append(f"{cal.pre_us_by_op[op]:.2f} before its waits")
        if op in cal.claimer_lead_us:
            extra.append(f"{cal.claimer_lead_us[op]:.2f} ranking before its claims")
        per = n.get("us_per_task", n.get("us_per_claim"))
        unit = "task" if "us_per_task" in n else "claim"
        say(f"  {op:17s} {per:7.2f} us per {unit}" + (f" ({', '.join(extra)})" if extra else ""))
    if scale != 1.0:
        say(f"the stamps slowed the traced step {100 * (1 / scale - 1):.1f} % ({profiled:.3f} against {kernel:.3f} ms "
            f"unstamped): every fitted time scaled by {scale:.4f}")
        click.echo(f"predicted step {pred:.1f} us against the unstamped kernel's {1e3 * kernel:.1f} "
                   f"({100 * (pred / (1e3 * kernel) - 1):+.1f} %; the stamped trace spans {span:.1f})")
    else:
        click.echo(f"predicted step {pred:.1f} us against the traced {span:.1f} ({100 * (pred / span - 1):+.1f} %)")
    if step_files:
        from megac.progress import bar, phase
        from megac.runtime.artifacts import load_or_compile
        from megac.runtime.schedules import ScheduleSet

        rows = _step_rows(step_files, spec.name)
        with phase(say, f"the {spec.name} schedules compiled or loaded"):
            ss = ScheduleSet(load_or_compile(spec, order, progress=say).schedules)
        cases = [(ss.pick(b, tc), c, ms) for b, c, ms, tc in rows if c >= min_context]
        if not cases:
            raise MegacError(f"calibrate: no --steps row at --min-context {min_context} or above")
        rates = REFIT_RATES_GBS
        say(f"refitting {refit_op} to {len(cases)} of {len(rows)} measured steps ({len(rates)} streaming rates each)")
        with phase(say, "refit"), bar(len(rates) * len(cases), "simulating", unit="step") as b:
            cal, table = refit_claim_stream(cal, refit_op, cases, rates, source=", ".join(p.name for p in step_files),
                                            step=b.update)
        rate = 1e-3 / cal.us_per_byte[refit_op]
        click.echo(f"{refit_op}: {cal.claim_fixed_us[refit_op]:.2f} us per claim + {rate:.0f} GB/s per SM "
                   f"(mean |error| {100 * min(table.values()):.1f} % on the rows it saw)")
        if cal.shared_bandwidth_bps:
            from megac.calibration import RATE_SCALES, refit_rate_scale

            say(f"refitting the uncontended rates under the shared {shared_bandwidth:.2f} TB/s "
                f"({len(RATE_SCALES)} scales)")
            with phase(say, "rate scale"), bar(len(RATE_SCALES) * len(cases), "simulating", unit="step") as b:
                cal, table = refit_rate_scale(cal, cases, step=b.update)
            click.echo(f"every rate x {cal.rate_scale:.2f} (mean |error| {100 * min(table.values()):.1f} % "
                       f"on the rows it saw)")
        errs = []
        click.echo(f"{'batch':>5} {'context':>8} {'measured ms':>12} {'predicted':>10} {'error':>8}")
        for b, c, ms, tc in sorted(rows):
            p = simulate(ss.pick(b, tc), cal.params(context=c)).step_us / 1e3
            errs.append(p / ms - 1)
            click.echo(f"{b:5d} {c:8d} {ms:12.3f} {p:10.3f} {100 * errs[-1]:+7.1f} %" + ("" if c >= min_context else "  (held out)"))
        click.echo(f"error {100 * min(errs):+.1f} .. {100 * max(errs):+.1f} % over {len(errs)} steps")
        cal.source = f"{cal.source}; {refit_op} refit to the measured steps of {', '.join(p.name for p in step_files)}"
        if cal.shared_bandwidth_bps:
            cal.source += (f"; every rate x {cal.rate_scale:.2f} as uncontended under a shared "
                           f"{cal.shared_bandwidth_bps / 1e12:.2f} TB/s ({cal.bandwidth_sharing})")
    if plot is not None:
        from megac.plot import plot_timeline

        plot_timeline(simulate(sched, cal.params(context=int(ctx))), plot)
        say(f"wrote {plot}")
    if out is not None:
        cal.save(out)
        say(f"wrote {out} (megac schedule {spec.name} --calibration {out})")


__all__ = ["calibrate_cmd", "read_trace", "trace_records"]

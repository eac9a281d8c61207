"""``megac bench``: decode throughput of a model on one backend, as a table
and JSON (the measurement itself: :mod:`megac.decode_bench`)."""

from __future__ import annotations

import gc
import json
import platform
import sys
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import click

from megac.errors import MegacError
from megac.runtime.kinds import ROUTINGS

from megac.order_option import ORDERS, OrderType


def parse_list(text: str, what: str, *, lo: int = 1) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4]; a one-line MegacError naming ``what`` otherwise."""
    try:
        vals = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise MegacError(f"{what} {text!r}: expected comma-separated integers like 1,2,4") from None
    if not vals:
        raise MegacError(f"{what}: empty list")
    bad = [v for v in vals if v < lo]
    if bad:
        raise MegacError(f"{what} {bad[0]}: must be at least {lo}")
    return vals


def _commit() -> str | None:
    """HEAD's short hash, "-dirty" when tracked files differ from it (a copy
    of a working tree, as on a lent GPU machine, may carry a stale HEAD:
    ``source`` below names the code that ran)."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=5)
        head = out.stdout.strip()
        if not head:
            return None
        st = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                            capture_output=True, text=True, timeout=10)
        return head + ("-dirty" if st.returncode == 0 and st.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def source_fingerprint() -> str:
    """Hash of the code a bench runs: the compiler's text (the artifact
    cache's fingerprint) and every device header in opcodes/, so a record
    names its code even where git cannot."""
    import hashlib

    from megac.gpu.build import _headers
    from megac.resources import opcodes_dir
    from megac.runtime.artifacts import _compiler_fingerprint

    h = hashlib.sha256(_compiler_fingerprint().encode())
    # the files a cubin's cache key reads from opcodes/ (megac.gpu.build.cache_key)
    root = opcodes_dir()
    for f in _headers([root]):
        h.update(f.relative_to(root.resolve()).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


@click.command("bench")
@click.argument("model")
@click.option("--backend", type=click.Choice(["auto", "cuda", "cpu", "graphs", "waves"]), default="auto",
              show_default=True,
              help="cuda: the megakernel; cpu: the VM over the same task words; graphs: the per-op CUDA-graph "
                   "baseline (megac.baselines.graphs); waves: the megakernel's opcodes one launch per wave in a "
                   "CUDA graph (megac.gpu.waves); auto: cuda when a GPU is visible.")
@click.option("--random-weights", is_flag=True,
              help="Counter-based random weights (drawn on the GPU with --backend cuda); else MODEL's own weights.")
@click.option("--batch-size", "batch_sizes", default="1", show_default=True, help="Comma-separated, e.g. 1,2,4,8.")
@click.option("--context", "contexts", default="1024", show_default=True,
              help="Comma-separated tokens per row, e.g. 1024,8192.")
@click.option("--order", type=OrderType(extra=("all",)), default="tuned", show_default=True,
              help="The schedules' wave order (bundled, or a wave-order YAML file); all: every case once per order (an engine each, built in turn, "
                   "on the same weights) and a ranking of the orders per case.")
@click.option("--routing", type=click.Choice(ROUTINGS), default="uniform", show_default=True,
              help="skewed: scale each MoE router's rows so experts are chosen Zipf-like (megac.routing_skew; "
                   "the 16 most chosen of North Mini Code's 128 take ~50 % of the selections) before any "
                   "backend sees the weights; the bytes per step count the experts that routing touches.")
@click.option("--steps", type=click.IntRange(1), default=30, show_default=True, help="Timed decode steps per case.")
@click.option("--warmup", type=click.IntRange(0), default=5, show_default=True)
@click.option("--calibration", default=None,
              help="Cost-model calibration (a bundled name such as h200-north-mini-code, or a file) for the "
                   "predicted column; default: the bundled one for this GPU and model where there is one, "
                   "else the uncalibrated model.")
@click.option("--no-ceiling", is_flag=True, help="Skip measuring the GPU's streaming-read ceiling.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the rows and the run's facts (GPU, commit, command) here.")
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="--backend cuda: one step of the first case on a -DMEGAC_PROFILE=1 build (nvcc), each task's "
                   "start, wait end and end per SM, as a Perfetto / Chrome trace (.json).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="--backend cuda: that step's per-SM timeline, waits apart from work (.png or .svg).")
@click.option("--threads", type=click.IntRange(0), default=1, show_default=True,
              help="torch CPU threads (0: torch's default). 1 avoids OpenMP stalls on a busy small CPU "
                   "(--backend cpu: 2 threads measured 346 ms per SmolLM2 step against ~90 with 1).")
@click.option("--engines", type=click.IntRange(1), default=1, show_default=True,
              help="Engines built one after the other per order, each timing every case; the rows give the "
                   "median over them and their spread. An engine's step time depends on where its memory "
                   "landed (about +-2 % at batch 1 on an H100 or H200), so one engine is one draw.")
def bench_cmd(model, backend, random_weights, batch_sizes, contexts, order, routing, steps, warmup, calibration,
              no_ceiling, json_path, profile_path, plot_path, threads, engines):
    """Decode-only throughput of MODEL: KV noise instead of prefill, median
    step time per batch size and context, bytes per step, TB/s and % of the
    bandwidth ceiling measured in the same run."""
    from megac import decode_bench as db
    from megac.calibration import Calibration, resolve
    from megac.engine.build import EngineOptions, build_engine
    from megac.loading import load_model
    from megac.routing_skew import ALPHA, check_routing, selection_probs, skew_router
    from megac.runtime.backends import random_weights_placement, resolve_kind, runs_on_gpu
    from megac.weights.layout import LaidOutWeights, LayoutMismatch

    if threads > 0:
        import torch

        torch.set_num_threads(threads)
    batches = parse_list(batch_sizes, "--batch-size")
    ctxs = parse_list(contexts, "--context", lo=2)
    cal = Calibration.load(resolve(calibration)) if calibration else None
    kind = resolve_kind(backend)
    if kind not in ("cuda", "cpu", "graphs", "waves"):
        raise MegacError(f"bench: --backend {backend} resolved to {kind}; use cuda, cpu, graphs or waves")
    orders = ORDERS if order == "all" else (order,)
    if order == "all" and kind == "graphs":
        raise MegacError("bench: --order all: the graphs backend runs no compiled schedules, so the order "
                         "does not change it")
    if (profile_path or plot_path) and kind != "cuda":
        raise MegacError(f"bench: --profile / --plot time the megakernel's tasks; they need --backend cuda "
                         f"(got {kind})")
    if plot_path is not None:
        from megac.plot import check_plot_path

        check_plot_path(plot_path, "bench: --plot")
    on_gpu = runs_on_gpu(kind)
    say = lambda msg: click.echo(f"[megac] {msg}", err=True)  # noqa: E731
    t0 = time.perf_counter()
    spec, loaded_weights = None, None
    if random_weights:
        from megac.spec import load_spec

        spec = load_spec(model)
        check_routing(spec, routing)  # before the draw (North Mini Code's is 61 GB)
    else:
        loaded = load_model(model, tokenizer=False, progress=say)
        spec, loaded_weights = loaded.spec, loaded.weights
        del loaded  # its copy of the weights would outlive the skewed / GPU copy below

    def get_weights():
        """The weights every engine of this run decodes with: drawn (again)
        or loaded, the router skewed before any engine exists (so every
        backend and order routes alike), on the GPU in bf16 there."""
        nonlocal loaded_weights
        if random_weights:
            import torch

            from megac.weights.random import random_weights as draw

            dt, dev = random_weights_placement(kind, torch.float32)
            say(f"drawing random weights for {spec.name} on the {dev}")
            w = draw(spec, 0, dt, device=dev)
        else:
            w, loaded_weights = loaded_weights, None
        w = skew_router(spec, w, routing)
        if on_gpu:  # once per engine at most (build_engine then keeps these tensors)
            import torch

            w = w.to(torch.bfloat16, "cuda")
        return w

    weights = get_weights()
    # decode only: the megakernel's engines run on their kernel-layout copy; the
    # canonical one is the prefill's. Random weights can be drawn again, so each
    # engine consumes them into its layout (one copy at the peak: batch 8 at
    # 128K fits) and the next order draws them anew.
    release = kind in ("cuda", "waves") and random_weights
    expert_probs = None
    if routing == "skewed":
        expert_probs = selection_probs(weights, spec.moe.top_k)
        n = max(1, len(expert_probs) // 8)  # North Mini Code: the top 16 of 128
        say(f"skewed routing (alpha {ALPHA}): the {n} most chosen of {len(expert_probs)} experts take "
            f"{100 * expert_probs[:n].sum() / spec.moe.top_k:.1f} % of random rows' selections")
    # each timed case's rows grow by one token per step
    longest = max(ctxs) + warmup + steps
    if longest > spec.max_context:
        raise MegacError(f"--context {max(ctxs)} + {warmup + steps} steps reaches {longest} tokens per row; "
                         f"{spec.name} holds at most {spec.max_context}")
    if cal is None and on_gpu:
        import torch

        from megac.calibration import bundled_for

        auto = bundled_for(spec.name, torch.cuda.get_device_name())
        if auto is not None:
            cal, calibration = Calibration.load(resolve(auto)), auto
            say(f"predicted column: the cost model calibrated by {auto}")
    rows_blocks = db.pool_blocks(spec, max(batches), longest)
    cases = [(b, c) for b in batches for c in ctxs]
    ceiling, ceiling_read, rows = None, None, []
    for oi, o in enumerate(orders):
        opts = EngineOptions(backend=kind, order=o, max_batch_size=max(batches), max_model_len=longest,
                             num_kv_blocks=rows_blocks + 16, prefix_caching=False, decode_only=release)
        per_engine = []
        for ei in range(engines):
            if weights is None:
                weights = get_weights()
            try:
                engine = build_engine(spec, weights, opts, progress=say)
            except LayoutMismatch:  # another order's interleave: its weights are drawn afresh
                weights = None
                gc.collect()
                weights = get_weights()
                engine = build_engine(spec, weights, opts, progress=say)
            if release:
                weights = None
                gc.collect()
                import torch

                torch.cuda.empty_cache()
            label = o if engines == 1 else f"{o}, engine {ei + 1} of {engines}"
            say(f"{label}: ready in {time.perf_counter() - t0:.1f} s; filling the KV cache with noise")
            db.fill_kv_noise(engine.kv)
            if oi == 0 and ei == 0 and not no_ceiling:
                ceiling_read = db.measure_ceiling("cuda" if on_gpu else "cpu")
                if ceiling_read is not None:
                    ceiling = ceiling_read.bps
                    say(ceiling_read.line())
            with click.progressbar(length=len(cases) * (steps + warmup), label=f"decoding ({label})",
                                   file=sys.stderr, show_pos=True) as bar:
                done = [0]

                def tick(_label, i, _total):
                    bar.update(i - done[0])
                    done[0] = i

                per_engine.append(db.run(engine, cases, steps=steps, warmup=warmup, ceiling=ceiling,
                                         calibration=cal, expert_probs=expert_probs, progress=tick))
            if oi == 0 and ei == 0 and (profile_path or plot_path):
                _profile(engine, cases[0], profile_path, plot_path, spec.name, say, order=str(o))
            if release and kind == "cuda":
                # the next engine takes these laid-out weights whole (no redraw; the model may fit only once)
                weights = LaidOutWeights.take(engine.backend)
            # the next engine needs the GPU memory this one holds (its KV pool, buffers)
            del engine
            gc.collect()
            if on_gpu:
                import torch

                torch.cuda.empty_cache()
            t0 = time.perf_counter()
        got = per_engine[0] if engines == 1 else db.merge_engines(per_engine)
        rows += [{"order": o, "routing": routing, **r} for r in got]
    click.echo(db.table(rows))
    if len(orders) > 1:
        click.echo("\norders, fastest first (ms/step, x the fastest):")
        click.echo(db.ranking(rows))
    if json_path is not None:
        facts = {"model": spec.name, "backend": kind, "order": order, "orders": list(orders), "routing": routing,
                 "routing_alpha": ALPHA if routing == "skewed" else None, "random_weights": bool(random_weights),
                 "steps": steps, "warmup": warmup, "engines": engines, "ceiling_bps": ceiling,
                 "ceiling": None if ceiling_read is None else ceiling_read.record(), "calibration": calibration,
                 "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": _commit(),
                 "source": source_fingerprint(), "host": platform.node(), "device": _device_name("cuda" if on_gpu else "cpu")}
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"run": facts, "rows": rows}, indent=1))
        say(f"wrote {json_path}")


def _profile(engine, case, profile_path, plot_path, name: str, say, order: str = "tuned") -> None:
    """One profiled step of ``case`` (batch, context): the trace and the
    picture, and what the instrumentation costs."""
    from megac.gpu import profile
    from megac.plot import plot_measured

    batch, context = case
    say(f"profiling one step at batch {batch}, context {context} (building the MEGAC_PROFILE megakernel)")
    got = profile.profile_step(engine.backend, engine.kv, batch, context)
    recs = got["records"]
    s = profile.summary(recs)
    say(f"instrumentation: {got['kernel_ms']:.3f} -> {got['profiled_ms']:.3f} ms per step "
        f"(+{100 * (got['profiled_ms'] / got['kernel_ms'] - 1):.1f} %); span {s['span_us']:.0f} us on {s['sms']} SMs, "
        f"{100 * s['work_fraction']:.0f} % of SM time working")
    say("where a layer's time goes (the measured step):\n" + profile.format_layer_table(
        profile.layer_table(recs, engine.spec)))
    say(profile.format_marks(profile.marks_summary(recs)))
    if profile_path is not None:
        profile_path.parent.mkdir(parents=True, exist_ok=True)
        meta = profile.trace_meta(got, model=name, spec=engine.spec, batch=batch, context=context, order=order,
                                  device=_device_name("cuda"))
        profile_path.write_text(json.dumps(profile.chrome_trace(recs, meta)))
        say(f"wrote {profile_path} (open in ui.perfetto.dev)")
    if plot_path is not None:
        plot_measured(recs, plot_path, title=f"{name}, batch {batch}, context {context}: one measured step")
        say(f"wrote {plot_path}")


def _device_name(kind: str) -> str:
    if kind == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    return platform.processor() or platform.machine()


__all__ = ["bench_cmd", "parse_list"]

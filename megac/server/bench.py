"""``megac bench-serve``: a load client for an OpenAI-compatible server, in
the manner of ``vllm bench serve`` (same definitions, same JSON key names).

Load
    ``--request-rate R`` (requests/s; ``inf``: all at once) with gamma
    inter-arrival gaps (``--burstiness``; 1 = Poisson), precomputed from
    ``--seed``; ``--max-concurrency C`` caps requests in flight (a
    semaphore; closed loop when the rate is ``inf``). ``--max-concurrency
    1,4,8`` runs the same requests once per level, one after the other
    (one warm-up before the first).

Prompts
    ``--dataset random|builtin|prompts``: see :mod:`megac.server.bench_datasets`.

Measured per request (client side, ``time.perf_counter``)
    TTFT: send -> first streamed chunk with non-empty ``choices``; ITL: gaps
    between later chunks; TPOT: ``(E2E - TTFT) / (output_tokens - 1)``;
    E2EL: send -> last chunk. Output tokens come from the final ``usage``
    chunk (``stream_options.include_usage``). Throughputs: requests/s,
    output tokens/s, total tokens/s over the level's duration. Each metric:
    mean, median, std and the ``--metric-percentiles`` (default 99).

Output: per level a table on stdout, then (with several levels) one summary
table, a row per level. ``--save-result FILE`` writes JSON: ``levels``, a
list with every level's metrics under vLLM's key names (``mean_ttft_ms``,
``p99_itl_ms``, ``output_throughput``, ...) and its per-request results;
with a single level its metrics are also at the top level, as in vLLM's
result files.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from megac.server.bench_datasets import BenchRequest, DatasetConfig, Server, build_requests


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""
    error: str = ""
    start: float = 0.0


# ---------------------------------------------------------------------------- one request


async def _one(client: httpx.AsyncClient, url: str, headers: dict, payload: dict, chat: bool) -> RequestResult:
    res = RequestResult()
    start = time.perf_counter()
    res.start = start
    last = start
    text = []
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {body[:300]}"
                return res
            buf = ""
            async for piece in resp.aiter_text():
                buf += piece
                while "\n\n" in buf:
                    event, buf = buf.split("\n\n", 1)
                    for line in event.splitlines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            continue
                        obj = json.loads(data)
                        if "error" in obj:
                            res.error = str(obj["error"].get("message"))
                            return res
                        now = time.perf_counter()
                        if obj.get("choices"):
                            c = obj["choices"][0]
                            piece_text = (c.get("delta") or {}).get("content") if chat else c.get("text")
                            if res.ttft == 0.0:
                                res.ttft = now - start
                            else:
                                res.itl.append(now - last)
                            last = now
                            if piece_text:
                                text.append(piece_text)
                        if obj.get("usage"):
                            res.output_tokens = int(obj["usage"]["completion_tokens"])
                            res.prompt_len = int(obj["usage"]["prompt_tokens"])
        res.latency = last - start
        res.text = "".join(text)
        res.success = res.ttft > 0.0
        if not res.success:
            res.error = "no chunk with choices arrived"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as err:
        res.error = f"{type(err).__name__}: {err}"
    return res


def _payload(req: BenchRequest, model: str, chat: bool, ignore_eos: bool, temperature: float,
             extra: dict) -> dict:
    p: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                         "temperature": temperature}
    if chat:
        text = req.prompt if isinstance(req.prompt, str) else " ".join(map(str, req.prompt))
        p["messages"] = [{"role": "user", "content": text}]
        p["max_completion_tokens"] = req.output_len
    else:
        p["prompt"] = req.prompt
        p["max_tokens"] = req.output_len
    if ignore_eos:
        p["ignore_eos"] = True
    p.update(extra)
    return p


# ---------------------------------------------------------------------------- statistics


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    f, c = math.floor(k), math.ceil(k)
    return s[f] if f == c else s[f] + (s[c] - s[f]) * (k - f)


def summarize(results: list[RequestResult], duration: float, percentiles: list[float]) -> dict:
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itl]
    e2es = [r.latency for r in ok]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    out: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
        "errors": sorted({r.error for r in results if not r.success})[:5],
    }
    for name, xs in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2es)):
        ms = [x * 1000.0 for x in xs]
        out[f"mean_{name}_ms"] = statistics.fmean(ms) if ms else 0.0
        out[f"median_{name}_ms"] = statistics.median(ms) if ms else 0.0
        out[f"std_{name}_ms"] = statistics.pstdev(ms) if ms else 0.0
        for p in percentiles:
            out[f"p{p:g}_{name}_ms"] = _pct(ms, p)
    mean_tpot = out["mean_tpot_ms"]
    out["decode_tokens_per_s_per_request"] = 1000.0 / mean_tpot if mean_tpot > 0 else 0.0
    return out


def format_table(s: dict, percentiles: list[float], title: str = "Serving Benchmark Result") -> str:
    w = 50
    lines = [f"{' ' + title + ' ':=^{w}}"]

    def row(label, value, fmt="{:<40} {:<10}"):
        lines.append(fmt.format(label, value))

    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    if s.get("max_concurrency") is not None:
        row("Maximum request concurrency:", s["max_concurrency"])
    row("Benchmark duration (s):", f"{s['duration']:.2f}")
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", f"{s['request_throughput']:.2f}")
    row("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}")
    row("Total Token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")
    row("Decode speed per request (tok/s, 1/TPOT):", f"{s['decode_tokens_per_s_per_request']:.2f}")
    for name, label in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{label:-^{w}}")
        row(f"Mean {name.upper()} (ms):", f"{s[f'mean_{name}_ms']:.2f}")
        row(f"Median {name.upper()} (ms):", f"{s[f'median_{name}_ms']:.2f}")
        for p in percentiles:
            row(f"P{p:g} {name.upper()} (ms):", f"{s[f'p{p:g}_{name}_ms']:.2f}")
    lines.append("=" * w)
    for e in s.get("errors", []):
        lines.append(f"error: {e}")
    return "\n".join(lines)


SUMMARY_METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"))


def _stat_keys(percentiles: list[float]) -> list[tuple[str, str]]:
    """(key prefix, column label) of the statistics the summary shows."""
    return [("mean", "mean"), ("median", "p50")] + [(f"p{p:g}", f"p{p:g}") for p in percentiles if p != 50]


def format_levels_table(levels: list[dict], percentiles: list[float]) -> str:
    """One row per concurrency level: throughputs and TTFT/TPOT/ITL in ms."""
    stats = _stat_keys(percentiles)
    heads = ["concurrency", "req/s", "out tok/s"] + [f"{label} {s}" for _, label in SUMMARY_METRICS for _, s in stats]
    rows = [[str(lv["max_concurrency"] or "inf"), f"{lv['request_throughput']:.2f}",
             f"{lv['output_throughput']:.1f}"] + [f"{lv[f'{k}_{name}_ms']:.2f}"
                                                    for name, _ in SUMMARY_METRICS for k, _ in stats]
            for lv in levels]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads)]
    title = " Summary across concurrency levels (latencies in ms) "
    lines = [f"{title:=^{sum(widths) + 2 * (len(widths) - 1)}}"]
    for cells in [heads] + rows:
        lines.append("  ".join(c.rjust(w) for c, w in zip(cells, widths)))
    return "\n".join(lines)


# ---------------------------------------------------------------------------- driver


@dataclass
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint_type: str = "openai-chat"  # openai (/v1/completions) | openai-chat (/v1/chat/completions)
    model: str | None = None
    api_key: str | None = None
    data: DatasetConfig = field(default_factory=DatasetConfig)
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: list[int] = field(default_factory=list)  # one run per level; empty: one run, no cap
    ignore_eos: bool = True
    temperature: float = 0.0
    warmup: int = 1
    percentiles: list[float] = field(default_factory=lambda: [99.0])
    extra_body: dict = field(default_factory=dict)
    timeout: float = 600.0

    @property
    def levels(self) -> list[int | None]:
        return list(self.max_concurrency) or [None]

    @property
    def chat(self) -> bool:
        return self.endpoint_type == "openai-chat"

    @property
    def base(self) -> str:
        base = self.base_url.rstrip("/")
        return base[:-3] if base.endswith("/v1") else base


def _arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    if math.isinf(rate) or n == 0:
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    gaps = [rng.gammavariate(burstiness, theta) for _ in range(n)]
    total = sum(gaps)
    target = n / rate
    return [g * target / total for g in gaps] if total > 0 else gaps


@dataclass
class _Target:
    """Where and how each request goes."""
    client: httpx.AsyncClient
    cfg: BenchConfig
    headers: dict
    model: str

    async def send(self, req: BenchRequest) -> RequestResult:
        cfg = self.cfg
        url = f"{cfg.base}/v1/chat/completions" if cfg.chat else f"{cfg.base}/v1/completions"
        payload = _payload(req, self.model, cfg.chat, cfg.ignore_eos, cfg.temperature, cfg.extra_body)
        res = await _one(self.client, url, self.headers, payload, cfg.chat)
        if not res.prompt_len:
            res.prompt_len = req.prompt_len
        return res


def _request_record(req: BenchRequest, r: RequestResult) -> dict:
    return {"kind": req.kind, "prompt_len": r.prompt_len, "output_tokens": r.output_tokens, "ttft": r.ttft,
            "latency": r.latency, "itl_count": len(r.itl), "success": r.success, "error": r.error}


async def run_level(target: _Target, reqs: list[BenchRequest], concurrency: int | None, progress=None) -> dict:
    """All ``reqs`` with at most ``concurrency`` in flight: that level's
    summary, ``max_concurrency`` and per-request ``results``."""
    cfg = target.cfg
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    done = 0

    async def limited(req: BenchRequest) -> RequestResult:
        nonlocal done
        if sem is None:
            res = await target.send(req)
        else:
            async with sem:
                res = await target.send(req)
        done += 1
        if progress:
            progress(done, len(reqs), concurrency)
        return res

    t0 = time.perf_counter()
    tasks = []
    for req, gap in zip(reqs, _arrival_gaps(len(reqs), cfg.request_rate, cfg.burstiness, cfg.data.seed)):
        if gap > 0:
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(limited(req)))
    results = await asyncio.gather(*tasks)
    level = summarize(list(results), time.perf_counter() - t0, cfg.percentiles)
    level["max_concurrency"] = concurrency
    level["results"] = [_request_record(q, r) for q, r in zip(reqs, results)]
    return level


async def _warm_up(target: _Target, reqs: list[BenchRequest], n: int) -> None:
    for i in range(n):
        w = await target.send(reqs[i % len(reqs)])
        if not w.success:
            raise RuntimeError(f"warm-up request failed: {w.error}")


async def run_benchmark(cfg: BenchConfig, progress=None) -> dict:
    """Every concurrency level of ``cfg`` over the same requests.
    ``progress(done, total, concurrency)`` is called as requests finish."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    in_flight = max([c or cfg.data.num_prompts for c in cfg.levels])
    limits = httpx.Limits(max_connections=max(16, in_flight))
    async with httpx.AsyncClient(timeout=cfg.timeout, limits=limits) as client:
        r = await client.get(f"{cfg.base}/v1/models", headers=headers)
        r.raise_for_status()
        target = _Target(client, cfg, headers, cfg.model or r.json()["data"][0]["id"])
        reqs = await build_requests(Server(client, cfg.base, headers), cfg.data, as_tokens=not cfg.chat)
        await _warm_up(target, reqs, cfg.warmup)
        levels = [await run_level(target, reqs, c, progress) for c in cfg.levels]
    out: dict[str, Any] = {
        "date": time.strftime("%Y%m%d-%H%M%S"), "model_id": target.model, "endpoint_type": cfg.endpoint_type,
        "dataset": cfg.data.name, "num_prompts": cfg.data.num_prompts,
        "request_rate": cfg.request_rate if not math.isinf(cfg.request_rate) else "inf",
        "burstiness": cfg.burstiness, "max_concurrency": cfg.max_concurrency or None,
        "config": {k: v for k, v in asdict(cfg).items() if k != "api_key"}}
    out["config"]["request_rate"] = out["request_rate"]
    if len(levels) == 1:
        out.update({k: v for k, v in levels[0].items() if k != "results"})  # vLLM's single-run layout
    out["levels"] = levels
    return out


__all__ = ["BenchConfig", "format_levels_table", "format_table", "run_benchmark", "run_level", "summarize"]

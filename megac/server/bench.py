"""``megac bench-serve``: a load client for an OpenAI-compatible server, in
the manner of ``vllm bench serve`` (same definitions, same JSON key names).

Load
    ``--request-rate R`` (requests/s; ``inf``: all at once) with gamma
    inter-arrival gaps (``--burstiness``; 1 = Poisson), precomputed from
    ``--seed``; ``--max-concurrency C`` caps requests in flight (a
    semaphore; closed loop when the rate is ``inf``).

Prompts
    ``--dataset random``: ``--random-input-len`` tokens drawn from a fixed
    word list (the server's ``/tokenize`` trims each prompt to the exact
    length; with ``--endpoint-type openai`` the token ids themselves are
    sent, so input lengths are exact), optional shared ``--random-prefix-len``
    prefix (exercises prefix caching), output ``--random-output-len`` with
    ``ignore_eos`` so output lengths are exact; ``--random-range-ratio``
    spreads both lengths. ``--dataset prompts``: ``--prompt TEXT``
    (repeatable) or ``--prompt-file FILE`` (one prompt per line), cycled.

Measured per request (client side, ``time.perf_counter``)
    TTFT: send -> first streamed chunk with non-empty ``choices``; ITL: gaps
    between later chunks; TPOT: ``(E2E - TTFT) / (output_tokens - 1)``;
    E2EL: send -> last chunk. Output tokens come from the final ``usage``
    chunk (``stream_options.include_usage``). Throughputs: requests/s,
    output tokens/s, total tokens/s over the benchmark duration. Each metric:
    mean, median, std, p99 (``--metric-percentiles``).

Output: a table on stdout and, with ``--save-result FILE``, JSON with
vLLM's key names (``mean_ttft_ms``, ``p99_itl_ms``, ``output_throughput``, ...).
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

WORDS = (
    "the of and to in is was for on that with as by at from it be this are or an have not which one had "
    "they you were their all we can has more when there been if would who will into time about other its "
    "some could them these two may then do first any my now such like our over only new also after most "
    "made many where before through back years much your way well down should because each just those "
    "people how too little state good very make world still own see men work long get here between both "
    "life being under never day same another know while last might great old year off come since against "
    "go came right used take three house water small place around however home found light river system "
    "number city market music story garden winter summer morning evening bridge mountain window paper "
    "engine kernel memory cache token model batch stream server client request answer question reason"
).split()


@dataclass
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


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


# ---------------------------------------------------------------------------- prompts


async def _tokenize(client: httpx.AsyncClient, base: str, text: str, headers: dict) -> list[int]:
    r = await client.post(f"{base}/tokenize", json={"prompt": text, "add_special_tokens": False}, headers=headers)
    r.raise_for_status()
    return r.json()["tokens"]


async def _detokenize(client: httpx.AsyncClient, base: str, ids: list[int], headers: dict) -> str:
    r = await client.post(f"{base}/detokenize", json={"tokens": ids}, headers=headers)
    r.raise_for_status()
    return r.json()["prompt"]


async def random_requests(client: httpx.AsyncClient, base: str, headers: dict, *, num: int, input_len: int,
                          output_len: int, prefix_len: int, range_ratio: float, seed: int,
                          as_tokens: bool) -> list[BenchRequest]:
    rng = random.Random(seed)

    def length(n: int) -> int:
        lo, hi = max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio)))
        return rng.randint(lo, hi)

    async def ids_of_len(n: int) -> list[int]:
        words = [rng.choice(WORDS) for _ in range(n + 8)]
        ids = await _tokenize(client, base, " ".join(words), headers)
        while len(ids) < n:
            ids += await _tokenize(client, base, " " + " ".join(rng.choice(WORDS) for _ in range(n)), headers)
        return ids[:n]

    prefix = await ids_of_len(prefix_len) if prefix_len > 0 else []
    out = []
    for _ in range(num):
        ids = prefix + await ids_of_len(length(input_len))
        prompt: str | list[int] = ids if as_tokens else await _detokenize(client, base, ids, headers)
        out.append(BenchRequest(prompt, len(ids), length(output_len)))
    return out


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


# ---------------------------------------------------------------------------- driver


@dataclass
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint_type: str = "openai-chat"  # openai (/v1/completions) | openai-chat (/v1/chat/completions)
    model: str | None = None
    api_key: str | None = None
    dataset: str = "random"
    num_prompts: int = 10
    random_input_len: int = 64
    random_output_len: int = 64
    random_prefix_len: int = 0
    random_range_ratio: float = 0.0
    prompts: list[str] = field(default_factory=list)
    output_len: int = 64
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    seed: int = 0
    warmup: int = 1
    percentiles: list[float] = field(default_factory=lambda: [99.0])
    extra_body: dict = field(default_factory=dict)
    timeout: float = 600.0


def _arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    if math.isinf(rate) or n == 0:
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    gaps = [rng.gammavariate(burstiness, theta) for _ in range(n)]
    total = sum(gaps)
    target = n / rate
    return [g * target / total for g in gaps] if total > 0 else gaps


async def run_benchmark(cfg: BenchConfig, progress=None) -> dict:
    base = cfg.base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    chat = cfg.endpoint_type == "openai-chat"
    url = f"{base}/v1/chat/completions" if chat else f"{base}/v1/completions"
    limits = httpx.Limits(max_connections=max(16, cfg.max_concurrency or cfg.num_prompts))
    async with httpx.AsyncClient(timeout=cfg.timeout, limits=limits) as client:
        r = await client.get(f"{base}/v1/models", headers=headers)
        r.raise_for_status()
        model = cfg.model or r.json()["data"][0]["id"]
        if cfg.dataset == "random":
            reqs = await random_requests(client, base, headers, num=cfg.num_prompts, input_len=cfg.random_input_len,
                                         output_len=cfg.random_output_len, prefix_len=cfg.random_prefix_len,
                                         range_ratio=cfg.random_range_ratio, seed=cfg.seed, as_tokens=not chat)
        else:
            if not cfg.prompts:
                raise ValueError("--dataset prompts needs --prompt or --prompt-file")
            reqs = [BenchRequest(cfg.prompts[i % len(cfg.prompts)], 0, cfg.output_len)
                    for i in range(cfg.num_prompts)]
        for i in range(cfg.warmup):
            w = await _one(client, url, headers, _payload(reqs[i % len(reqs)], model, chat, cfg.ignore_eos,
                                                         cfg.temperature, cfg.extra_body), chat)
            if not w.success:
                raise RuntimeError(f"warm-up request failed: {w.error}")
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        gaps = _arrival_gaps(len(reqs), cfg.request_rate, cfg.burstiness, cfg.seed)
        done = 0

        async def limited(req: BenchRequest) -> RequestResult:
            nonlocal done
            payload = _payload(req, model, chat, cfg.ignore_eos, cfg.temperature, cfg.extra_body)
            if sem is None:
                res = await _one(client, url, headers, payload, chat)
            else:
                async with sem:
                    res = await _one(client, url, headers, payload, chat)
            if not res.prompt_len:
                res.prompt_len = req.prompt_len
            done += 1
            if progress:
                progress(done, len(reqs))
            return res

        t0 = time.perf_counter()
        tasks = []
        for req, gap in zip(reqs, gaps):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    summary = summarize(list(results), duration, cfg.percentiles)
    summary.update(model_id=model, endpoint_type=cfg.endpoint_type, num_prompts=cfg.num_prompts,
                   request_rate=cfg.request_rate if not math.isinf(cfg.request_rate) else "inf",
                   burstiness=cfg.burstiness, max_concurrency=cfg.max_concurrency, date=time.strftime("%Y%m%d-%H%M%S"),
                   config={k: v for k, v in asdict(cfg).items() if k not in ("api_key",)})
    summary["config"]["request_rate"] = summary["request_rate"]
    summary["results"] = [{"prompt_len": r.prompt_len, "output_tokens": r.output_tokens, "ttft": r.ttft,
                           "latency": r.latency, "success": r.success, "error": r.error} for r in results]
    return summary


__all__ = ["BenchConfig", "format_table", "run_benchmark", "summarize"]

"""Prometheus metrics, written by hand (text exposition format 0.0.4; no
``prometheus_client`` dependency).

Names follow vLLM's with the ``megac:`` prefix; every series carries
``model_name``. Counters end in ``_total``; histograms expose ``_bucket``
(cumulative, with ``le="+Inf"``), ``_sum`` and ``_count``.

Engine-side series (timestamps are the engine's; TTFT counts from the
request's arrival at the HTTP handler, so it includes tokenisation,
queueing and prefill):

=================================================  =========  ==========================================
name                                               type       meaning
=================================================  =========  ==========================================
``megac:num_requests_running``                     gauge      requests holding a KV row
``megac:num_requests_waiting``                     gauge      queued (new or preempted)
``megac:kv_cache_usage_perc``                      gauge      used blocks / pool (0..1)
``megac:kv_blocks_used``                           gauge      blocks referenced (rows + prefix cache)
``megac:kv_blocks_active``                         gauge      blocks mapped by live requests
``megac:kv_blocks_total``                          gauge      pool size (blocks, all layers)
``megac:prefix_cache_blocks``                      gauge      blocks held by the prefix cache
``megac:num_preemptions_total``                    counter    preemptions (recompute)
``megac:prefix_cache_queries_total``               counter    prompt tokens looked up
``megac:prefix_cache_hits_total``                  counter    prompt tokens found cached
``megac:prompt_tokens_total``                      counter    prompt tokens of finished requests
``megac:generation_tokens_total``                  counter    generated tokens
``megac:request_success_total{finished_reason}``   counter    finished requests (stop, length, abort, error)
``megac:time_to_first_token_seconds``              histogram  arrival -> first token
``megac:inter_token_latency_seconds``              histogram  between consecutive tokens of a request
``megac:e2e_request_latency_seconds``              histogram  arrival -> finish
``megac:request_queue_time_seconds``               histogram  arrival -> first scheduled
``megac:iteration_seconds``                        histogram  one engine iteration (decode + prefill)
``megac:http_requests_total{handler,status}``      counter    HTTP requests by route and status
=================================================  =========  ==========================================
"""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING, Iterable

from megac.engine.scheduler import EngineObserver

if TYPE_CHECKING:
    from megac.engine.request import Request
    from megac.engine.scheduler import Engine

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0)


def _fmt(v: float) -> str:
    if v == math.inf:
        return "+Inf"
    if float(v).is_integer():
        return str(int(v))
    return repr(float(v))


def _labels(d: dict[str, str]) -> str:
    if not d:
        return ""
    esc = {k: str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for k, v in d.items()}
    return "{" + ",".join(f'{k}="{v}"' for k, v in esc.items()) + "}"


class _Metric:
    kind = "untyped"

    def __init__(self, name: str, doc: str, const: dict[str, str]) -> None:
        self.name, self.doc, self.const = name, doc, const
        self._lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} {self.kind}"]


class CounterMetric(_Metric):
    kind = "counter"

    def __init__(self, name: str, doc: str, const: dict[str, str]) -> None:
        super().__init__(name, doc, const)
        self._values: dict[tuple, float] = {}

    def inc(self, v: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + v

    def value(self, **labels: str) -> float:
        return self._values.get(tuple(sorted(labels.items())), 0.0)

    def total(self) -> float:
        return sum(self._values.values())

    def render(self) -> list[str]:
        base = self.name[:-6] if self.name.endswith("_total") else self.name
        lines = [f"# HELP {base} {self.doc}", f"# TYPE {base} counter"]
        with self._lock:
            items = sorted(self._values.items()) or [((), 0.0)]
        for key, v in items:
            lines.append(f"{self.name}{_labels({**self.const, **dict(key)})} {_fmt(v)}")
        return lines


class Gauge(_Metric):
    kind = "gauge"

    def __init__(self, name: str, doc: str, const: dict[str, str], fn=None) -> None:
        super().__init__(name, doc, const)
        self.fn = fn
        self._v = 0.0

    def set(self, v: float) -> None:
        self._v = float(v)

    def render(self) -> list[str]:
        v = self.fn() if self.fn is not None else self._v
        return self.header() + [f"{self.name}{_labels(self.const)} {_fmt(v)}"]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, doc: str, const: dict[str, str], buckets: Iterable[float]) -> None:
        super().__init__(name, doc, const)
        self.buckets = tuple(sorted(buckets)) + (math.inf,)
        self._counts = [0] * len(self.buckets)
        self._sum = 0.0
        self._n = 0

    def observe(self, v: float) -> None:
        with self._lock:
            for i, b in enumerate(self.buckets):
                if v <= b:
                    self._counts[i] += 1
                    break
            self._sum += v
            self._n += 1

    @property
    def count(self) -> int:
        return self._n

    def render(self) -> list[str]:
        with self._lock:
            counts, s, n = list(self._counts), self._sum, self._n
        lines = self.header()
        acc = 0
        for b, c in zip(self.buckets, counts):
            acc += c
            lines.append(f"{self.name}_bucket{_labels({**self.const, 'le': _fmt(b)})} {acc}")
        lines.append(f"{self.name}_sum{_labels(self.const)} {_fmt(s)}")
        lines.append(f"{self.name}_count{_labels(self.const)} {n}")
        return lines


class ServerMetrics(EngineObserver):
    """Every series of the module docstring; the engine calls the hooks."""

    def __init__(self, model_name: str) -> None:
        c = {"model_name": model_name}
        self.engine: "Engine | None" = None
        self.preemptions = CounterMetric("megac:num_preemptions_total", "Preemptions (recompute) so far.", c)
        self.prefix_queries = CounterMetric("megac:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", c)
        self.prefix_hits = CounterMetric("megac:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", c)
        self.prompt_tokens = CounterMetric("megac:prompt_tokens_total", "Prompt tokens of finished requests.", c)
        self.generation_tokens = CounterMetric("megac:generation_tokens_total", "Generated tokens.", c)
        self.request_success = CounterMetric("megac:request_success_total", "Finished requests by finish reason.", c)
        self.http_requests = CounterMetric("megac:http_requests_total", "HTTP requests by handler and status.", c)
        self.ttft = Histogram("megac:time_to_first_token_seconds", "Time to first token.", c, LATENCY_BUCKETS)
        self.itl = Histogram("megac:inter_token_latency_seconds", "Inter-token latency.", c, LATENCY_BUCKETS)
        self.e2e = Histogram("megac:e2e_request_latency_seconds", "End-to-end request latency.", c, E2E_BUCKETS)
        self.queue = Histogram("megac:request_queue_time_seconds", "Time from arrival to first scheduling.", c,
                               LATENCY_BUCKETS)
        self.iteration = Histogram("megac:iteration_seconds", "One engine iteration.", c, LATENCY_BUCKETS)

        def g(attr):
            return lambda: getattr(self.engine, attr) if self.engine is not None else 0

        def usage():
            e = self.engine
            return e.num_blocks_used / e.kv.num_blocks if e is not None else 0.0

        def cached():
            e = self.engine
            return e.prefix_cache.num_blocks_held if e is not None else 0

        def total():
            e = self.engine
            return e.kv.num_blocks if e is not None else 0

        self.gauges = [
            Gauge("megac:num_requests_running", "Requests holding a KV row.", c, g("num_running")),
            Gauge("megac:num_requests_waiting", "Requests waiting (new or preempted).", c, g("num_waiting")),
            Gauge("megac:kv_cache_usage_perc", "KV blocks used / pool size (0..1).", c, usage),
            Gauge("megac:kv_blocks_used", "KV blocks referenced (rows and prefix cache).", c, g("num_blocks_used")),
            Gauge("megac:kv_blocks_active", "KV blocks mapped by live requests.", c, g("num_blocks_active")),
            Gauge("megac:kv_blocks_total", "KV pool size in blocks (all layers).", c, total),
            Gauge("megac:prefix_cache_blocks", "KV blocks held by the prefix cache.", c, cached),
        ]

    # ---------------------------------------------------------------- engine hooks

    def on_scheduled(self, req: "Request", queue_s: float) -> None:
        self.queue.observe(queue_s)

    def on_first_token(self, req: "Request", ttft_s: float) -> None:
        self.ttft.observe(ttft_s)
        self.generation_tokens.inc()

    def on_token(self, req: "Request", itl_s: float) -> None:
        self.itl.observe(itl_s)
        self.generation_tokens.inc()

    def on_finish(self, req: "Request") -> None:
        self.request_success.inc(finished_reason=req.finish_reason or "unknown")
        self.prompt_tokens.inc(len(req.prompt_ids))
        if req.finish_time is not None:
            self.e2e.observe(req.finish_time - req.arrival_time)

    def on_preempt(self, req: "Request") -> None:
        self.preemptions.inc()

    def on_prefix_lookup(self, queried: int, hit: int) -> None:
        self.prefix_queries.inc(queried)
        self.prefix_hits.inc(hit)

    def on_iteration(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        self.iteration.observe(seconds)

    # ---------------------------------------------------------------- exposition

    def render(self) -> str:
        lines: list[str] = []
        for m in self.gauges:
            lines += m.render()
        for m in (self.preemptions, self.prefix_queries, self.prefix_hits, self.prompt_tokens,
                  self.generation_tokens, self.request_success, self.http_requests):
            lines += m.render()
        for m in (self.ttft, self.itl, self.e2e, self.queue, self.iteration):
            lines += m.render()
        return "\n".join(lines) + "\n"


def parse_metrics(text: str) -> dict[str, float]:
    """``{series (name + labels as written): value}`` of an exposition text
    (tests, bench)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, val = line.rpartition(" ")
        out[key] = float(val)
    return out


def metric_value(text_or_parsed, name: str, **labels: str) -> float:
    """Sum of the series called ``name`` whose labels include ``labels``."""
    parsed = parse_metrics(text_or_parsed) if isinstance(text_or_parsed, str) else text_or_parsed
    total = 0.0
    for key, v in parsed.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{val}"' in rest for k, val in labels.items()):
            total += v
    return total


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

__all__ = ["CONTENT_TYPE", "CounterMetric", "Gauge", "Histogram", "ServerMetrics", "metric_value", "parse_metrics"]

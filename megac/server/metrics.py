"""Prometheus metrics through ``prometheus_client`` (the library vLLM and
most Python services use), one :class:`~prometheus_client.CollectorRegistry`
per :class:`ServerMetrics`: several servers in one process (tests) and the
warm-up's throw-away instance never share or clash over series.

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
``megac:decode_step_seconds``                      histogram  one decode step as the engine waits for it
``megac:decode_device_seconds``                    histogram  its device part (kernel / graph, CUDA events)
``megac:decode_host_seconds``                      histogram  its host part (step - device)
``megac:http_requests_total{handler,status}``      counter    HTTP requests by route and status
=================================================  =========  ==========================================

The gauges are read from the engine when scraped (:class:`EngineGauges`),
so they can never lag behind it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from megac.engine.scheduler import EngineObserver

if TYPE_CHECKING:
    from megac.engine.request import Request
    from megac.engine.scheduler import Engine

# A ``*_created`` timestamp gauge beside every counter and histogram doubles
# the exposition and is no name of vLLM's (which turns it off the same way);
# the switch is process-wide in prometheus_client.
disable_created_metrics()

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)
#: a decode step and its parts: tens of microseconds (host work) to seconds (the CPU VM)
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1,
                0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0)

#: the classic text format (see :meth:`ServerMetrics.render`)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class EngineGauges(Collector):
    """The engine's occupancy, read at scrape time (0 before the engine exists)."""

    def __init__(self, owner: "ServerMetrics") -> None:
        self.owner = owner

    def _gauges(self) -> list[tuple[str, str, Callable[["Engine"], float]]]:
        return [
            ("megac:num_requests_running", "Requests holding a KV row.", lambda e: e.num_running),
            ("megac:num_requests_waiting", "Requests waiting (new or preempted).", lambda e: e.num_waiting),
            ("megac:kv_cache_usage_perc", "KV blocks used / pool size (0..1).",
             lambda e: e.num_blocks_used / e.kv.num_blocks),
            ("megac:kv_blocks_used", "KV blocks referenced (rows and prefix cache).", lambda e: e.num_blocks_used),
            ("megac:kv_blocks_active", "KV blocks mapped by live requests.", lambda e: e.num_blocks_active),
            ("megac:kv_blocks_total", "KV pool size in blocks (all layers).", lambda e: e.kv.num_blocks),
            ("megac:prefix_cache_blocks", "KV blocks held by the prefix cache.",
             lambda e: e.prefix_cache.num_blocks_held),
        ]

    def collect(self):
        engine = self.owner.engine
        for name, doc, read in self._gauges():
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.owner.model_name], float(read(engine)) if engine is not None else 0.0)
            yield family


class ServerMetrics(EngineObserver):
    """Every series of the module docstring; the engine calls the hooks."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.engine: "Engine | None" = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineGauges(self))
        r, m = self.registry, ["model_name"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, m, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, m, registry=r, buckets=buckets).labels(model_name)

        self.preemptions = counter("megac:num_preemptions_total", "Preemptions (recompute) so far.")
        self.prefix_queries = counter("megac:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("megac:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.")
        self.prompt_tokens = counter("megac:prompt_tokens_total", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("megac:generation_tokens_total", "Generated tokens.")
        self.request_success = Counter("megac:request_success_total", "Finished requests by finish reason.",
                                       m + ["finished_reason"], registry=r)
        self.http_requests = Counter("megac:http_requests_total", "HTTP requests by handler and status.",
                                     m + ["handler", "status"], registry=r)
        self.ttft = histogram("megac:time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.itl = histogram("megac:inter_token_latency_seconds", "Inter-token latency.", LATENCY_BUCKETS)
        self.e2e = histogram("megac:e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS)
        self.queue = histogram("megac:request_queue_time_seconds", "Time from arrival to first scheduling.",
                               LATENCY_BUCKETS)
        self.iteration = histogram("megac:iteration_seconds", "One engine iteration.", LATENCY_BUCKETS)
        self.decode_step = histogram("megac:decode_step_seconds", "One decode step as the engine waits for it.",
                                     STEP_BUCKETS)
        self.decode_device = histogram("megac:decode_device_seconds",
                                       "Device time of a decode step (backends that time it on the GPU).",
                                       STEP_BUCKETS)
        self.decode_host = histogram("megac:decode_host_seconds",
                                     "Host time of a decode step (step - device; backends that time the device).",
                                     STEP_BUCKETS)

    def count_http(self, handler: str, status: int) -> None:
        self.http_requests.labels(self.model_name, handler, str(status)).inc()

    def total(self, sample_name: str) -> float:
        """Sum of every series called ``sample_name`` (e.g.
        ``megac:prompt_tokens_total``), whatever its labels."""
        return sum(s.value for family in self.registry.collect() for s in family.samples if s.name == sample_name)

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
        self.request_success.labels(self.model_name, req.finish_reason or "unknown").inc()
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

    def on_decode_step(self, rows: int, seconds: float, device_seconds: float | None) -> None:
        self.decode_step.observe(seconds)
        if device_seconds is not None:
            self.decode_device.observe(device_seconds)
            self.decode_host.observe(max(0.0, seconds - device_seconds))

    # ---------------------------------------------------------------- exposition

    def render(self) -> str:
        """The classic text exposition (format 0.0.4), whatever a scraper's
        ``Accept`` asks: prometheus_client's OpenMetrics writer escapes the
        ``:`` of ``megac:`` names to ``_`` in its samples, so negotiating
        would give two names per series; Prometheus reads the classic format."""
        return generate_latest(self.registry).decode("utf-8")


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


__all__ = ["CONTENT_TYPE", "EngineGauges", "ServerMetrics", "metric_value", "parse_metrics"]

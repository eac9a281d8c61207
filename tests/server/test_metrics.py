"""/metrics through prometheus_client: the series names dashboards use, the
values the engine hooks put there, gauges read from the engine when
scraped, one registry per server (two in one process do not clash), the
HTTP counter by route and status, the same names whatever the scraper asks.
In-process (stub model); test_api.py scrapes the real server."""

from __future__ import annotations

from types import SimpleNamespace

from fastapi.testclient import TestClient

from megac.server.metrics import ServerMetrics, metric_value, parse_metrics
from stub_state import stub_app

#: every series megac exposes (vLLM's names with the megac: prefix)
SERIES = ("megac:num_requests_running", "megac:num_requests_waiting", "megac:kv_cache_usage_perc",
          "megac:kv_blocks_used", "megac:kv_blocks_active", "megac:kv_blocks_total", "megac:prefix_cache_blocks",
          "megac:num_preemptions_total", "megac:prefix_cache_queries_total", "megac:prefix_cache_hits_total",
          "megac:prompt_tokens_total", "megac:generation_tokens_total",
          "megac:time_to_first_token_seconds_bucket", "megac:inter_token_latency_seconds_bucket",
          "megac:e2e_request_latency_seconds_bucket", "megac:request_queue_time_seconds_bucket",
          "megac:iteration_seconds_bucket", "megac:decode_step_seconds_bucket",
          "megac:decode_device_seconds_bucket", "megac:decode_host_seconds_bucket")


def finished(reason: str, prompt_len: int, arrival: float, finish: float):
    return SimpleNamespace(finish_reason=reason, prompt_ids=list(range(prompt_len)), arrival_time=arrival,
                           finish_time=finish)


def fake_engine(running=0, waiting=0, used=0, active=0, total=64, cached=0):
    return SimpleNamespace(num_running=running, num_waiting=waiting, num_blocks_used=used, num_blocks_active=active,
                           kv=SimpleNamespace(num_blocks=total), prefix_cache=SimpleNamespace(num_blocks_held=cached))


def test_every_series_is_exposed_with_the_model_name():
    text = ServerMetrics("tiny").render()
    for name in SERIES:
        assert f'{name}{{' in text, name
    for line in text.splitlines():
        if line and not line.startswith("#"):
            assert 'model_name="tiny"' in line, line
    assert "# TYPE megac:time_to_first_token_seconds histogram" in text
    assert "_created" not in text  # vLLM's exposition has no creation-time gauges either


def test_engine_hooks_fill_counters_and_histograms():
    m = ServerMetrics("tiny")
    req = finished("stop", 7, arrival=10.0, finish=12.5)
    m.on_scheduled(req, 0.003)
    m.on_first_token(req, 0.2)
    m.on_token(req, 0.03)
    m.on_token(req, 0.05)
    m.on_finish(req)
    m.on_finish(finished("length", 3, arrival=0.0, finish=1.0))
    m.on_preempt(req)
    m.on_prefix_lookup(64, 32)
    p = parse_metrics(m.render())
    assert metric_value(p, "megac:request_success_total", finished_reason="stop") == 1
    assert metric_value(p, "megac:request_success_total", finished_reason="length") == 1
    assert metric_value(p, "megac:prompt_tokens_total") == 7 + 3
    assert metric_value(p, "megac:generation_tokens_total") == 3  # the first token and two more
    assert metric_value(p, "megac:num_preemptions_total") == 1
    assert (metric_value(p, "megac:prefix_cache_queries_total"), metric_value(p, "megac:prefix_cache_hits_total")) \
        == (64, 32)
    # buckets are cumulative: both gaps (0.03, 0.05) are <= 0.06, one is <= 0.04, none <= 0.02
    itl = "megac:inter_token_latency_seconds_bucket"
    assert [metric_value(p, itl, le=le) for le in ("0.02", "0.04", "0.06", "+Inf")] == [0, 1, 2, 2]
    assert metric_value(p, "megac:inter_token_latency_seconds_sum") == 0.03 + 0.05
    assert metric_value(p, "megac:e2e_request_latency_seconds_count") == 2
    assert metric_value(p, "megac:e2e_request_latency_seconds_sum") == 2.5 + 1.0
    assert metric_value(p, "megac:time_to_first_token_seconds_bucket", le="0.1") == 0
    assert metric_value(p, "megac:time_to_first_token_seconds_bucket", le="0.25") == 1
    assert m.total("megac:request_success_total") == 2


def test_decode_steps_split_into_device_and_host_time():
    m = ServerMetrics("tiny")
    m.on_decode_step(1, 0.010, 0.007)   # a GPU backend: kernel 7 ms of a 10 ms step
    m.on_decode_step(8, 0.030, 0.026)
    m.on_decode_step(1, 0.090, None)    # a backend that does not time its device work
    p = parse_metrics(m.render())
    assert metric_value(p, "megac:decode_step_seconds_count") == 3
    assert abs(metric_value(p, "megac:decode_step_seconds_sum") - 0.130) < 1e-12
    assert metric_value(p, "megac:decode_device_seconds_count") == 2
    assert abs(metric_value(p, "megac:decode_device_seconds_sum") - 0.033) < 1e-12
    assert abs(metric_value(p, "megac:decode_host_seconds_sum") - 0.007) < 1e-12
    # host parts of 3 and 4 ms: none within 2 ms, both within 6 ms
    assert [metric_value(p, "megac:decode_host_seconds_bucket", le=le) for le in ("0.002", "0.006")] == [0, 2]


def test_gauges_are_read_from_the_engine_when_scraped():
    m = ServerMetrics("tiny")
    assert metric_value(m.render(), "megac:num_requests_running") == 0  # no engine yet
    m.engine = fake_engine(running=3, waiting=2, used=16, active=12, total=64, cached=4)
    p = parse_metrics(m.render())
    assert metric_value(p, "megac:num_requests_running") == 3
    assert metric_value(p, "megac:num_requests_waiting") == 2
    assert metric_value(p, "megac:kv_cache_usage_perc") == 16 / 64
    assert metric_value(p, "megac:kv_blocks_active") == 12
    assert metric_value(p, "megac:kv_blocks_total") == 64
    assert metric_value(p, "megac:prefix_cache_blocks") == 4
    m.engine.num_running = 0
    assert metric_value(m.render(), "megac:num_requests_running") == 0


def test_two_servers_in_one_process_keep_their_own_series():
    # the same names twice in prometheus_client's global registry would
    # raise "Duplicated timeseries"; each server has its own
    a, b = ServerMetrics("same"), ServerMetrics("same")
    a.on_preempt(None)
    a.count_http("/v1/models", 200)
    assert metric_value(a.render(), "megac:num_preemptions_total") == 1
    assert metric_value(b.render(), "megac:num_preemptions_total") == 0
    assert metric_value(b.render(), "megac:http_requests_total") == 0


def test_metrics_route_counts_http_requests_by_route_and_status():
    app, state = stub_app()
    state.metrics = ServerMetrics("stub")
    c = TestClient(app)
    assert c.get("/v1/models").status_code == 200
    assert c.get("/v1/models").status_code == 200
    assert c.post("/tokenize", content=b"{not json", headers={"content-type": "application/json"}).status_code == 400
    assert c.get("/no/such/route").status_code == 404
    resp = c.get("/metrics")
    assert resp.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    p = parse_metrics(resp.text)
    count = "megac:http_requests_total"
    assert metric_value(p, count, handler="/v1/models", status="200") == 2
    assert metric_value(p, count, handler="/tokenize", status="400") == 1
    assert metric_value(p, count, handler="other", status="404") == 1  # random paths share one label
    assert metric_value(p, count, handler="/metrics") == 0  # scrapes do not count themselves


def test_a_scraper_asking_for_openmetrics_gets_the_same_names():
    # prometheus_client's OpenMetrics writer would turn megac: into megac_
    app, state = stub_app()
    state.metrics = ServerMetrics("stub")
    resp = TestClient(app).get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert resp.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert 'megac:num_preemptions_total{model_name="stub"} 0.0' in resp.text
    assert "megac_" not in resp.text

"""Graceful shutdown: requests in flight end with the 503 server_shutdown
error (a stream as its last event, then [DONE]), new ones are refused, and
SIGTERM to the real server ends its streams that way, exits 0 and logs
that it stopped."""

from __future__ import annotations

import asyncio
import signal

import httpx

from stub_state import StubEngine, async_client, stub_app
from test_util import ServerProc, sse_events, untied_tiny_yaml

MSG = [{"role": "user", "content": "hello"}]


def _shutdown_error(obj) -> None:
    assert set(obj) == {"error"}, obj
    err = obj["error"]
    assert (err["type"], err["code"]) == ("service_unavailable_error", "server_shutdown"), err
    assert "shutting down" in err["message"]


async def _stop_while_in_flight(app, state, requests):
    async with async_client(app) as c:
        tasks = [asyncio.create_task(c.post(path, json=body)) for path, body in requests]
        for _ in range(2000):  # until every request is in the engine
            if len(state.in_flight) == len(requests):
                break
            await asyncio.sleep(0.01)
        assert len(state.in_flight) == len(requests), "the requests never reached the engine"
        state.stop_requests()
        answers = await asyncio.gather(*tasks)
        late = await c.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
    return answers, late


def test_stop_requests_ends_streams_with_an_error_event():
    engine = StubEngine(answer=False)  # requests stay in flight until the shutdown
    app, state = stub_app(engine=engine)
    (chat, comp, plain), late = asyncio.run(_stop_while_in_flight(app, state, [
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": 5, "stream": True}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 5, "stream": True}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 5}),
    ]))
    for stream in (chat, comp):
        assert stream.status_code == 200
        events = sse_events(stream.text)
        assert events[-1] == "[DONE]"
        _shutdown_error(events[-2])
        assert not any("choices" in e and e["choices"] and e["choices"][0].get("finish_reason")
                       for e in events[:-2] if isinstance(e, dict))
    assert plain.status_code == 503
    _shutdown_error(plain.json())
    assert late.status_code == 503
    _shutdown_error(late.json())
    # every request was aborted in the engine (its KV blocks freed), none left in flight
    assert sorted(engine.aborted) == sorted(r.id for r in engine.submitted) and len(engine.submitted) == 3
    assert not state.in_flight


def test_sigterm_ends_streams_with_an_error_event_and_logs_stopped(tmp_path):
    spec = untied_tiny_yaml(tmp_path)
    s = ServerProc(str(spec), "--random-weights", "--served-model-name", "tiny")
    try:
        body = {"model": "tiny", "messages": MSG, "max_tokens": 4000, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", f"{s.url}/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            received = []
            for line in lines:  # up to the first generated text
                received.append(line)
                if '"content":"' in line and '"content":""' not in line:
                    break
            s.proc.send_signal(signal.SIGTERM)
            received += list(lines)
        events = sse_events("".join(line + "\n" for line in received))
        assert events[-1] == "[DONE]"
        _shutdown_error(events[-2])
        assert s.proc.wait(30) == 0
        log = s.log()
        assert "SIGTERM: shutting down; 1 request(s) in flight end with an error" in log
        assert log.rstrip().splitlines()[-1].endswith("megac serve: stopped")
    finally:
        s.stop()

"""An engine failure in the middle of a stream: the tokens already produced
are delivered, then one ``data: {"error": ...}`` event (500, engine_error,
the engine's message) and ``[DONE]``; no chunk claims a finish_reason. A
non-streamed request gets the same error as its 500 body."""

from __future__ import annotations

import asyncio

from megac.engine.request import EngineOutput
from stub_state import StubEngine, async_client, stub_app
from test_util import sse_events

MSG = [{"role": "user", "content": "hello"}]


class FailingEngine(StubEngine):
    """Two text deltas, then the engine fails for the request."""

    def submit(self, req) -> None:
        self.submitted.append(req)
        req.sink(EngineOutput(req.id, text="Hel", token_ids=[72, 101, 108], completion_tokens=3,
                              prompt_tokens=len(req.prompt_ids)))
        req.sink(EngineOutput(req.id, text="lo", token_ids=[108, 111], completion_tokens=5,
                              prompt_tokens=len(req.prompt_ids)))
        req.sink(EngineOutput(req.id, finished=True, finish_reason="error", error="device fault at step 6",
                              completion_tokens=5, prompt_tokens=len(req.prompt_ids)))


def _engine_error(obj) -> None:
    assert set(obj) == {"error"}, obj
    err = obj["error"]
    assert err["code"] == "engine_error" and err["type"] == "internal_server_error", err
    assert err["message"] == "generation failed: device fault at step 6", err


async def _post_all(app, requests):
    async with async_client(app) as c:
        answers = [await c.post(path, json=body) for path, body in requests]
        health = await c.get("/health")
    return answers, health


def test_mid_stream_engine_error_is_an_error_event():
    engine = FailingEngine()
    app, _state = stub_app(engine=engine)
    (chat, comp, plain), health = asyncio.run(_post_all(app, [
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": 20, "stream": True}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 20, "stream": True}),
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": 20}),
    ]))
    # chat: the role chunk, the two deltas as generated, the error, [DONE]
    assert chat.status_code == 200 and chat.headers["content-type"].startswith("text/event-stream")
    ev = sse_events(chat.text)
    assert ev[-1] == "[DONE]"
    _engine_error(ev[-2])
    deltas = [e["choices"][0]["delta"] for e in ev[:-2]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content") or "" for d in deltas) == "Hello"
    assert not any(e["choices"][0].get("finish_reason") for e in ev[:-2])
    # completions: the same shape
    assert comp.status_code == 200
    ev = sse_events(comp.text)
    assert ev[-1] == "[DONE]"
    _engine_error(ev[-2])
    assert "".join(e["choices"][0]["text"] for e in ev[:-2]) == "Hello"
    assert not any(e["choices"][0].get("finish_reason") for e in ev[:-2])
    # not streamed: a 500 in the OpenAI envelope
    assert plain.status_code == 500
    _engine_error(plain.json())
    assert len(engine.submitted) == 3
    assert health.status_code == 200  # one request's failure is not the engine's death

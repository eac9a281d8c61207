"""Long request work stays off the event loop, and a prompt obviously over
the context is refused before it is tokenized.

The tokenizer is gated: its first call blocks until the test lets it go,
and the test lets it go only after ``/health`` answered. Were tokenizing on
the event loop, ``/health`` could not answer while the tokenizer waits (the
loop would be the one waiting), the gate would time out, and the test
fails. No clock is read."""

from __future__ import annotations

import asyncio

import pytest

from stub_state import GATE_TIMEOUT, GatedTokenizer, StubEngine, async_client, stub_app

MSG = [{"role": "user", "content": "hello"}]

# (method, path, body, a check of the answer computed independently of the server)
GATED_ROUTES = [
    ("/tokenize", {"prompt": "x" * 1000}, lambda j: j["count"] == 1001 and j["tokens"][:2] == [1, ord("x")]),
    ("/v1/tokenize", {"messages": MSG},
     lambda j: bytes(j["tokens"]).decode() == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"),
    ("/detokenize", {"tokens": [104, 105]}, lambda j: j["prompt"] == "hi"),
    ("/v1/completions", {"prompt": "hello", "max_tokens": 2},
     lambda j: j["choices"][0]["text"] == "ok" and j["usage"]["prompt_tokens"] == 6),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 2},
     lambda j: j["choices"][0]["message"]["content"] == "ok"),
]


async def _health_during(app, tok: GatedTokenizer, path: str, body: dict):
    async with async_client(app) as c:
        work = asyncio.create_task(c.post(path, json=body))
        entered = await asyncio.to_thread(tok.entered.wait, GATE_TIMEOUT)
        health = await c.get("/health")
        gate_still_closed = not tok.release.is_set() and not tok.timed_out
        tok.release.set()
        return entered, health, gate_still_closed, await work


@pytest.mark.parametrize("path,body,check", GATED_ROUTES, ids=[f"{r[0]}-{next(iter(r[1]))}" for r in GATED_ROUTES])
def test_health_answers_while_a_request_is_tokenized(path, body, check):
    tok = GatedTokenizer()
    app, _ = stub_app(tok)
    entered, health, gate_still_closed, resp = asyncio.run(_health_during(app, tok, path, body))
    assert entered, "the request never reached the tokenizer"
    assert health.status_code == 200
    assert gate_still_closed and not tok.timed_out, "the tokenizer blocked the event loop"
    assert resp.status_code == 200, resp.text
    assert check(resp.json()), resp.json()
    assert all(name.startswith("megac-request") for name in tok.threads), tok.threads


def _context_error(resp, param: str) -> str:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "context_length_exceeded", param)
    assert err["message"].startswith("This model's maximum context length is 64 tokens. However, your request has ")
    return err["message"]


async def _post_all(app, requests):
    async with async_client(app) as c:
        return [await c.post(path, json=body) for path, body in requests]


def test_obviously_too_long_prompt_is_refused_without_tokenizing():
    tok = GatedTokenizer(gated=False)
    engine = StubEngine()
    app, _ = stub_app(tok, max_model_len=64, engine=engine)
    big = "x" * 2_000_000
    comp, chat = asyncio.run(_post_all(app, [("/v1/completions", {"prompt": big}),
                                            ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                                    "content": big}]})]))
    assert "at least 2000000 input tokens" in _context_error(comp, "prompt")
    assert "input tokens" in _context_error(chat, "messages")
    assert tok.calls == 0 and not engine.submitted
    # the same error as a prompt found too long once tokenized (64 token ids: no room to generate)
    ids = asyncio.run(_post_all(app, [("/v1/completions", {"prompt": list(range(3, 67))})]))[0]
    assert "has 64 input tokens" in _context_error(ids, "prompt")


def test_prompt_just_within_the_context_is_tokenized_and_served():
    tok = GatedTokenizer(gated=False)
    app, _ = stub_app(tok, max_model_len=64)
    # 62 bytes + BOS = 63 tokens < 64: must not be refused by the length shortcut
    resp = asyncio.run(_post_all(app, [("/v1/completions", {"prompt": "y" * 62, "max_tokens": 1})]))[0]
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] == 63 and tok.calls == 1
    # 63 bytes + BOS = 64 tokens: too long, with the error of a tokenized prompt
    resp = asyncio.run(_post_all(app, [("/v1/completions", {"prompt": "y" * 63})]))[0]
    _context_error(resp, "prompt")

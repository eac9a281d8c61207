"""Property-based fuzz of the HTTP API from its own ``/openapi.json``
(schemathesis): every operation, with bodies that fit the published
request schemas and bodies that break them, against the in-process app
over the stub model (tests/server/stub_state.py: the real routes,
validation, chat templating, grammars and tokenizer; an engine that
answers at once, so the fuzz spends its time on the HTTP layer).

Whatever comes in, the server must answer like an OpenAI server:
- never a 500 (a fault of ours, not of the request);
- never a Python traceback in a body;
- every error status carries the OpenAI envelope
  ``{"error": {"message", "type", "param", "code"}}`` with a message.

Bounded: :data:`EXAMPLES` cases per operation and mode, derandomized, so CI
runs the same cases every time and a failure reproduces."""

from __future__ import annotations

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from stub_state import stub_app

#: cases per operation and generation mode (11 operations x 2 modes)
EXAMPLES = 40


def load_schema():
    """The app's own /openapi.json, fuzzed in both generation modes."""
    app, _state = stub_app()
    loaded = schemathesis.openapi.from_asgi("/openapi.json", app)
    loaded.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    return loaded


# built at collection (a stub app: no model, no threads), because
# schemathesis' fixture-loaded schemas need a pytest private that pytest 9
# removed
schema = load_schema()


def assert_openai_answer(status: int, text: str) -> None:
    """The three promises of the module docstring for one response."""
    assert status != 500, text
    assert "Traceback (most recent call last)" not in text, text
    if status >= 400 and status != 499:  # 499: the client left, nobody reads the body
        body = json.loads(text)
        assert set(body) == {"error"}, body
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"], err
        assert isinstance(err["type"], str) and err["type"], err


def assert_stream_errors_enveloped(text: str) -> None:
    """An SSE stream's error event (``data: {"error": ...}``) has the envelope too."""
    for line in text.splitlines():
        if line.startswith("data: {") and '"error"' in line[:16]:
            err = json.loads(line[len("data: "):])["error"]
            assert set(err) == {"message", "type", "param", "code"}, err


#: (method, path) of every operation the app publishes. Each (operation,
#: mode) is a test of its own with its own id: schemathesis' parametrize
#: gave all eleven one node id, and pytest-xdist (scripts/test.sh) ran one.
#: Bodies that break the schema for the operations that take a body (the
#: GETs have nothing to break: hypothesis finds no negative case)
OPERATIONS = [(op.method.upper(), op.path) for op in (r.ok() for r in schema.get_all_operations())]
CASES = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS] + [
    (m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS if m == "POST"]


@pytest.mark.parametrize("method, path, mode", CASES,
                         ids=[f"{m} {p} {g.value}" for m, p, g in CASES])
def test_every_answer_is_an_openai_answer(method, path, mode):
    @given(case=schema[path][method].as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def fuzz(case):
        if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
            # a random model name stops nearly every request at the 404 (tested on
            # its own in test_api.py); the served name lets the fuzz reach
            # templating, grammars and the engine
            case.body["model"] = "stub"
        response = case.call()
        assert_openai_answer(response.status_code, response.text)
        if response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
            assert_stream_errors_enveloped(response.text)

    fuzz()


def with_speakable_messages(body: dict) -> dict:
    """``body`` with every message's content a text the server accepts.

    The schema allows what the server refuses at once (a user message with
    no content, a content part that is not text), so nearly every generated
    chat request stops at that 400 and the fuzz above seldom reaches tools,
    tool_choice, response_format and the sampling fields; this lets it."""
    for message in body.get("messages") or []:
        if not isinstance(message, dict):
            continue
        if message.get("content") is None:
            message["content"] = "hi"
        elif isinstance(message["content"], list):
            message["content"] = [{"type": "text", "text": "part"} for _part in message["content"]]
    return body


@given(case=schema["/v1/chat/completions"]["POST"].as_strategy(generation_mode=GenerationMode.POSITIVE))
@settings(max_examples=2 * EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_chat_requests_past_message_checks_answer_like_openai(case):
    case.body["model"] = "stub"
    with_speakable_messages(case.body)
    response = case.call()
    assert_openai_answer(response.status_code, response.text)
    if response.status_code == 200 and case.body.get("stream") is not True:
        assert response.json()["object"] == "chat.completion"


def test_the_schema_publishes_every_request_body():
    """Without the bodies the fuzz would post nothing but empty requests."""
    raw = schema.raw_schema
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/v1/tokenize", "/detokenize",
                 "/v1/detokenize"):
        body = raw["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].startswith("#/components/schemas/"), path
    chat = raw["components"]["schemas"]["ChatCompletionRequest"]
    assert "messages" in chat["required"]
    assert len(OPERATIONS) == 11 and ("POST", "/v1/chat/completions") in OPERATIONS

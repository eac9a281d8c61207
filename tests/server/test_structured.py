"""Structured output through the real server: ``response_format``
(``json_object``, ``json_schema``) and forced tool calls (``tool_choice``
``"required"`` or a named function) are held to a grammar.

The model is tiny-llama with untied random weights and the byte-level
tokenizer: its unconstrained output is random bytes, so whatever comes out
here is the grammar's doing. Outputs are checked with ``jsonschema`` and
``json.loads``, independently of the grammar library. The schemas bound
their strings, numbers and arrays, so a random model reaches the end of
every value within a few dozen tokens."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from test_util import tiny_server

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "unit": {"enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                                        "b": {"type": "integer", "minimum": -999, "maximum": 999}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}},
         {"type": "function", "function": {"name": "now", "description": "The time (no parameters)"}}]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "maxProperties": 0})
           for t in TOOLS}
REPORT = {"type": "object",
          "properties": {"title": {"type": "string", "maxLength": 16},
                         "ok": {"type": "boolean"},
                         "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                                    "maxItems": 3},
                         "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0,
                                                                           "maximum": 99}},
                                   "required": ["id"], "additionalProperties": False}},
          "required": ["title", "ok", "scores", "owner"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = tiny_server(tmp_path_factory, 2048)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Request {i}: " + "please answer in the format asked. " * (i % 4)}]


def _chat(client, i: int, **kw):
    kw.setdefault("temperature", 1.0)
    return client.chat.completions.create(model="tiny", messages=_messages(i), seed=i, **kw)


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "report", "schema": schema}}


# ------------------------------------------------------------------ response_format


def test_json_schema_outputs_validate(client):
    texts = set()
    for i in range(8):
        r = _chat(client, i, max_tokens=300, response_format=_schema_format(REPORT),
                  temperature=0.0 if i == 0 else 1.0)
        c = r.choices[0]
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), REPORT)
        texts.add(c.message.content)
    assert len(texts) > 5  # the seeds gave different objects


def test_json_schema_stream_equals_full(client):
    kw = dict(max_tokens=300, response_format=_schema_format(REPORT))
    full = _chat(client, 3, **kw).choices[0].message.content
    chunks = list(_chat(client, 3, stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_json_object_outputs_parse(client):
    # the bias on '"' and '}' makes a random model close its strings and objects soon
    for i in range(6):
        r = _chat(client, i, max_tokens=400, response_format={"type": "json_object"},
                  logit_bias={str(ord('"')): 3, str(ord("}")): 3})
        c = r.choices[0]
        assert c.finish_reason == "stop"
        assert isinstance(json.loads(c.message.content), dict)


def test_max_tokens_cuts_json_with_length(client):
    full = _chat(client, 5, max_tokens=300, response_format=_schema_format(REPORT)).choices[0].message.content
    r = _chat(client, 5, max_tokens=6, response_format=_schema_format(REPORT))
    assert r.choices[0].finish_reason == "length"
    assert full.startswith(r.choices[0].message.content) and r.choices[0].message.content


# ------------------------------------------------------------------ forced tool calls


def _check_calls(msg, declared=SCHEMAS):
    for call in msg.tool_calls:
        assert call.function.name in declared
        jsonschema.validate(json.loads(call.function.arguments), declared[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"


async def _fifty(server):
    """50 forced tool requests over varied prompts, seeds, temperatures and
    choices, 8 at a time."""
    sem = asyncio.Semaphore(8)
    names = [t["function"]["name"] for t in TOOLS]

    async def one(aclient, i):
        choice = "required" if i % 2 == 0 else {"type": "function", "function": {"name": names[i % 3]}}
        async with sem:
            r = await aclient.chat.completions.create(
                model="tiny", messages=_messages(i), seed=i, temperature=0.0 if i % 5 == 0 else 1.0,
                max_tokens=200, tools=TOOLS, tool_choice=choice, parallel_tool_calls=i % 4 != 0)
        return i, choice, r.choices[0]

    async with server.async_client() as aclient:
        return await asyncio.gather(*[one(aclient, i) for i in range(50)])


def test_fifty_forced_calls_name_declared_functions_with_valid_arguments(server):
    used = set()
    for i, choice, c in asyncio.run(_fifty(server)):
        assert c.message.content is None and c.message.tool_calls, (i, c)
        _check_calls(c.message)
        if choice == "required":
            assert c.finish_reason in ("tool_calls", "length")
            if i % 4 == 0:  # parallel_tool_calls false: exactly one call, ended by the grammar
                assert len(c.message.tool_calls) == 1 and c.finish_reason == "tool_calls"
        else:
            name = choice["function"]["name"]
            assert [t.function.name for t in c.message.tool_calls] == [name]
            assert c.finish_reason == "stop"  # a named choice answers "stop", as OpenAI does
        used |= {t.function.name for t in c.message.tool_calls}
    assert used == set(SCHEMAS)  # "required" picked each declared function somewhere


def test_forced_call_stream_equals_full(client):
    for i, choice in ((4, "required"), (7, {"type": "function", "function": {"name": "get_weather"}})):
        kw = dict(max_tokens=200, tools=TOOLS, tool_choice=choice)
        full = _chat(client, i, **kw).choices[0]
        chunks = list(_chat(client, i, stream=True, **kw))
        deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert not any(c.choices[0].delta.content for c in chunks if c.choices)
        # each call arrives whole, in one delta
        assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == \
            [(k, t.function.name, t.function.arguments) for k, t in enumerate(full.message.tool_calls)]
        assert chunks[-1].choices[0].finish_reason == full.finish_reason


@pytest.mark.parametrize("max_tokens", [1, 3, 8, 14])
def test_small_max_tokens_leaks_no_markup(client, max_tokens):
    """Cut inside the first call: finish_reason length, content null, no
    call (the cut-off one is left out), no raw <tool_call> text anywhere."""
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kw = dict(max_tokens=max_tokens, tools=TOOLS, tool_choice=choice, temperature=0.0)
        c = _chat(client, 0, **kw).choices[0]
        assert c.finish_reason == "length"
        assert c.message.content is None and c.message.tool_calls is None
        chunks = list(_chat(client, 0, stream=True, **kw))
        assert not any(c.choices[0].delta.content or c.choices[0].delta.tool_calls for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason == "length"


def test_cut_inside_a_later_call_keeps_the_complete_ones(client):
    kw = dict(tools=TOOLS, tool_choice="required", temperature=1.0)
    for i in range(20):  # a seed whose answer holds several calls
        full = _chat(client, i, max_tokens=400, **kw)
        if len(full.choices[0].message.tool_calls) > 1 and full.choices[0].finish_reason == "tool_calls":
            break
    else:
        pytest.fail("no seed made two calls")
    calls = full.choices[0].message.tool_calls
    # byte tokenizer: one token per byte. The answer ends in the last call's
    # arguments, "}", "\n</tool_call>" and EOS; cut one token before the arguments end
    cut = full.usage.completion_tokens - len("}\n</tool_call>") - 1 - 1
    c = _chat(client, i, max_tokens=cut, **kw).choices[0]
    assert c.finish_reason == "length" and c.message.content is None
    assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls] == \
        [(t.function.name, t.function.arguments) for t in calls[:-1]]


def test_forced_call_wins_over_response_format(client):
    c = _chat(client, 2, max_tokens=200, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
              response_format={"type": "json_object"}).choices[0]
    assert [t.function.name for t in c.message.tool_calls] == ["add"]
    _check_calls(c.message)


# ------------------------------------------------------------------ bad schemas


BAD = [
    ("unknown_type", {"response_format": _schema_format({"type": "strin"})}, "response_format",
     "response_format.json_schema.schema: invalid JSON schema: Invalid type: strin"),
    ("bad_ref", {"response_format": _schema_format({"properties": {"a": {"$ref": "#/nowhere"}}})},
     "response_format", "response_format.json_schema.schema"),
    ("unsatisfiable", {"response_format": _schema_format(
        {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["a"]})},
     "response_format", "unsatisfiable"),
    ("schema_missing", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "response_format.json_schema.schema must be a JSON schema object (got missing)"),
    ("schema_not_object", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format", "got a list"),
    ("json_schema_missing", {"response_format": {"type": "json_schema"}}, "response_format",
     "response_format.json_schema: required"),
    ("unknown_format", {"response_format": {"type": "yaml"}}, "response_format", "'yaml' is not supported"),
    ("bad_parameters", {"tools": TOOLS + [{"type": "function", "function": {
        "name": "broken",
        "parameters": {"type": "object", "properties": {"q": {"type": "string", "pattern": "((("}}}}}],
        "tool_choice": "required"}, "tools", "tools[3].function.parameters: invalid JSON schema for function 'broken'"),
]


@pytest.mark.parametrize("name,extra,param,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_schema_is_a_400_naming_the_field(server, name, extra, param, needle):
    r = server.post("/v1/chat/completions", {"model": "tiny", "messages": _messages(0), "max_tokens": 8, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert needle in err["message"] and "\n" not in err["message"]


def test_auto_tool_choice_stays_grammar_free(server, client):
    # broken parameters matter only where a call is forced
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]
    r = _chat(client, 1, max_tokens=4, tools=tools, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"

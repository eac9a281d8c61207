"""The HTTP API of the real server process, driven by the official
``openai`` client (and raw HTTP where the client hides details): chat and
completions, streaming and not, usage, stop strings, seeds, tools (API
shape; the parser itself is tested on canned outputs in test_tools.py),
tokenize/detokenize, models, health, metrics and every error case.

The model is tiny-llama (untied, random weights) with the built-in
byte-level tokenizer: its output is random bytes, so tests compare outputs
with each other, never with expected text."""

from __future__ import annotations

import json
import socket

import httpx
import openai
import pytest

from test_util import tiny_server

MAX_LEN = 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = tiny_server(tmp_path_factory, MAX_LEN)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


MSG = [{"role": "user", "content": "Say something."}]
IGNORE_EOS = {"ignore_eos": True}


def chat(client, **kw):
    kw.setdefault("model", "tiny")
    kw.setdefault("messages", MSG)
    return client.chat.completions.create(**kw)


def stream_text(client, **kw):
    chunks = list(chat(client, stream=True, **kw))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


# ------------------------------------------------------------------ basics


def test_health_models_version(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].model_extra["max_model_len"] == MAX_LEN
    assert server.get("/version").json()["version"]


def test_models_retrieve(server, client):
    m = client.models.retrieve("tiny")
    assert (m.id, m.object, m.owned_by) == ("tiny", "model", "megac")
    assert m.model_extra["max_model_len"] == MAX_LEN
    assert m.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")
    e = _err(server.get("/v1/models/" + "m" * 5000), 404, "model", "model_not_found")
    assert "m" * 99 + "…" in e["message"] and len(e["message"]) < 200


def test_chat_non_stream(client):
    r = chat(client, max_tokens=12, temperature=0, extra_body=IGNORE_EOS)
    c = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "tiny"
    assert c.message.role == "assistant" and isinstance(c.message.content, str) and c.message.content
    assert c.finish_reason == "length" and c.message.tool_calls is None
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_stream_matches_non_stream_and_usage(client):
    full = chat(client, max_tokens=20, temperature=0, extra_body=IGNORE_EOS).choices[0].message.content
    text, chunks = stream_text(client, max_tokens=20, temperature=0, extra_body=IGNORE_EOS,
                               stream_options={"include_usage": True})
    assert text == full
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])
    # no usage chunk without include_usage
    _, chunks = stream_text(client, max_tokens=3, temperature=0)
    assert chunks[-1].choices and chunks[-1].choices[0].finish_reason is not None


def test_raw_sse_framing(server):
    body = {"model": "tiny", "messages": MSG, "max_tokens": 4, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    objs = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert objs[-1]["choices"][0]["finish_reason"] == "length" and objs[-1]["choices"][0]["delta"] == {}
    assert len({o["id"] for o in objs}) == 1


def test_completions(client):
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0,
                                  extra_body=IGNORE_EOS)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 10
    chunks = list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body=IGNORE_EOS))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    # token-id prompts and a list of one prompt
    ids = client.post("/tokenize", body={"prompt": "Once upon a time"}, cast_to=object)["tokens"]
    r2 = client.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0, extra_body=IGNORE_EOS)
    assert r2.choices[0].text == r.choices[0].text
    r3 = client.completions.create(model="tiny", prompt=["Once upon a time"], max_tokens=10, temperature=0,
                                   extra_body=IGNORE_EOS)
    assert r3.choices[0].text == r.choices[0].text


def test_default_max_tokens_completions_is_16(client):
    r = client.completions.create(model="tiny", prompt="abc", temperature=0, extra_body=IGNORE_EOS)
    assert r.usage.completion_tokens == 16


def test_model_is_optional(server):
    r = server.post("/v1/chat/completions", {"messages": MSG, "max_tokens": 2})
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------ sampling


def test_seed_reproducible(client):
    kw = dict(max_tokens=24, temperature=1.0, top_p=0.9, extra_body={"ignore_eos": True, "top_k": 50})
    a = chat(client, seed=42, **kw).choices[0].message.content
    b = chat(client, seed=42, **kw).choices[0].message.content
    c = chat(client, seed=43, **kw).choices[0].message.content
    s, _ = stream_text(client, seed=42, **kw)
    assert a == b == s
    assert a != c


def test_greedy_ignores_seed(client):
    a = chat(client, max_tokens=10, temperature=0, seed=1).choices[0].message.content
    b = chat(client, max_tokens=10, temperature=0, seed=2).choices[0].message.content
    assert a == b


def test_stop_strings(client):
    full = chat(client, max_tokens=40, temperature=0, extra_body=IGNORE_EOS).choices[0].message.content
    # a 2-character stop string from the middle of the output
    k = next(i for i in range(5, len(full) - 2) if full[i] not in "\ufffd")
    stop = full[k:k + 2]
    want = full[:full.find(stop)]
    r = chat(client, max_tokens=40, temperature=0, stop=[stop, "\x00never\x00"], extra_body=IGNORE_EOS)
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    text, chunks = stream_text(client, max_tokens=40, temperature=0, stop=stop, extra_body=IGNORE_EOS)
    assert text == want and stop not in text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    inc = chat(client, max_tokens=40, temperature=0, stop=stop,
               extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert inc.choices[0].message.content == want + stop


def test_max_completion_tokens_wins(client):
    r = chat(client, max_tokens=30, max_completion_tokens=5, temperature=0, extra_body=IGNORE_EOS)
    assert r.usage.completion_tokens == 5


def test_eos_finishes_with_stop(client):
    # the logit bias makes EOS (id 2) the greedy choice: one token, finish "stop"
    r = chat(client, max_tokens=10, temperature=0, logit_bias={"2": 100})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
    assert r.choices[0].message.content == ""


# ------------------------------------------------------------------ tools (API shape)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def test_named_tool_choice_returns_that_call(client):
    # held to the tool's schema (test_structured.py covers it in depth); a
    # bounded city lets greedy decoding of random weights end the call
    tools = [{"type": "function", "function": {**TOOLS[0]["function"], "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
        "additionalProperties": False}}}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(client, max_tokens=40, temperature=0, tools=tools, tool_choice=choice)
    msg = r.choices[0].message
    assert msg.content is None and len(msg.tool_calls) == 1 and msg.tool_calls[0].function.name == "get_weather"
    assert msg.tool_calls[0].id.startswith("call_") and msg.tool_calls[0].type == "function"
    args = json.loads(msg.tool_calls[0].function.arguments)
    assert list(args) == ["city"] and len(args["city"]) <= 6
    assert r.choices[0].finish_reason == "stop"  # named choice: "stop" as OpenAI does
    # streamed: the call arrives whole (id, name, arguments) once its arguments are complete
    chunks = list(chat(client, max_tokens=40, temperature=0, tools=tools, tool_choice=choice, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].id and deltas[0].index == 0
    assert deltas[0].function.name == "get_weather"
    assert deltas[0].function.arguments == msg.tool_calls[0].function.arguments


def test_auto_tools_shape_and_prompt(server, client):
    r = chat(client, max_tokens=8, temperature=0, tools=TOOLS)
    c = r.choices[0]
    # the same prompt through /v1/completions (no tool parsing) is the
    # independent expectation: random bytes never spell <tool_call>, so no
    # call, the raw text as content, the same finish_reason
    ids = server.post("/tokenize", {"messages": MSG, "tools": TOOLS}).json()["tokens"]
    raw = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0).choices[0]
    assert "<tool_call>" not in raw.text and raw.finish_reason in ("stop", "length")
    assert c.message.tool_calls is None and c.message.content == raw.text
    assert c.finish_reason == raw.finish_reason and r.usage.prompt_tokens == len(ids)
    # the tools reach the prompt through the tool-aware template (SmolLM2-style ChatML ignores them)
    with_tools = server.post("/tokenize", {"messages": MSG, "tools": TOOLS}).json()
    without = server.post("/tokenize", {"messages": MSG}).json()
    assert with_tools["count"] > without["count"] + 50
    # tool_choice none: no tools in the prompt
    r = chat(client, max_tokens=4, temperature=0, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.tool_calls is None
    assert r.usage.prompt_tokens == without["count"]


def test_tool_history_renders(server, client):
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    r = chat(client, messages=msgs, tools=TOOLS, max_tokens=4, temperature=0)
    # the call and its result are in the prompt; the answer is the model's raw continuation of it
    tok = server.post("/tokenize", {"messages": msgs, "tools": TOOLS, "return_token_strs": True}).json()
    prompt = server.post("/detokenize", {"tokens": tok["tokens"]}).json()["prompt"]
    assert "get_weather" in prompt and '"Paris"' in prompt and "18 C and sunny" in prompt
    raw = client.completions.create(model="tiny", prompt=tok["tokens"], max_tokens=4, temperature=0).choices[0]
    c = r.choices[0]
    assert raw.finish_reason in ("stop", "length") and c.finish_reason == raw.finish_reason
    assert c.message.tool_calls is None and c.message.content == raw.text
    assert r.usage.prompt_tokens == tok["count"]


# ------------------------------------------------------------------ tokenize / detokenize / metrics


def test_tokenize_detokenize(server):
    t = server.post("/tokenize", {"prompt": "héllo", "return_token_strs": True}).json()
    assert t["count"] == len(t["tokens"]) and t["max_model_len"] == MAX_LEN
    assert len(t["token_strs"]) == t["count"]
    d = server.post("/detokenize", {"tokens": t["tokens"]}).json()
    assert d["prompt"].endswith("héllo")
    t2 = server.post("/v1/tokenize", {"prompt": "héllo", "add_special_tokens": False}).json()
    assert server.post("/v1/detokenize", {"tokens": t2["tokens"]}).json()["prompt"] == "héllo"
    chat_tok = server.post("/tokenize", {"messages": MSG}).json()
    r = server.client().chat.completions.create(model="tiny", messages=MSG, max_tokens=1)
    assert chat_tok["count"] == r.usage.prompt_tokens


def test_metrics_exposition(server, client):
    chat(client, max_tokens=5, temperature=0, extra_body=IGNORE_EOS)
    text = server.get("/metrics").text
    for name in ("megac:time_to_first_token_seconds_bucket", "megac:inter_token_latency_seconds_bucket",
                 "megac:e2e_request_latency_seconds_count", "megac:num_requests_running",
                 "megac:num_requests_waiting", "megac:kv_blocks_used", "megac:prefix_cache_queries_total",
                 "megac:prefix_cache_hits_total", "megac:num_preemptions_total", "megac:kv_cache_usage_perc"):
        assert name in text, name
    assert "# TYPE megac:time_to_first_token_seconds histogram" in text
    assert 'le="+Inf"' in text
    m = server.metrics()
    assert m['megac:e2e_request_latency_seconds_count{model_name="tiny"}'] >= 1


def test_prefix_cache_hit_visible(server, client):
    system = "You are a meticulous assistant who answers in one short sentence. " * 6
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "First question?"}]
    hits0 = server.metric("megac:prefix_cache_hits_total")
    a = chat(client, messages=msgs, max_tokens=3, temperature=0)
    msgs[1]["content"] = "Second, different question?"
    b = chat(client, messages=msgs, max_tokens=3, temperature=0)
    hits = server.metric("megac:prefix_cache_hits_total") - hits0
    assert hits >= 32 * (len(system) // 32 - 1)
    assert b.usage.prompt_tokens_details.cached_tokens >= 32 * (len(system) // 32 - 1)
    assert a.usage.prompt_tokens_details.cached_tokens < b.usage.prompt_tokens_details.cached_tokens


# ------------------------------------------------------------------ errors


def _err(resp, status, param=None, code=None):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    if code is not None:
        assert body["error"]["code"] == code
    return body["error"]


CHAT = "/v1/chat/completions"
GOOD = {"model": "tiny", "messages": MSG, "max_tokens": 2}

BAD_REQUESTS = [
    ("malformed_json", CHAT, b'{"messages": [', None),
    ("not_an_object", CHAT, b"[1, 2]", None),
    ("missing_messages", CHAT, {"model": "tiny"}, "messages"),
    ("empty_messages", CHAT, {"messages": []}, "messages"),
    ("messages_not_list", CHAT, {"messages": "hi"}, "messages"),
    ("bad_role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("content_missing", CHAT, {"messages": [{"role": "user"}]}, "messages"),
    ("image_part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages"),
    ("temperature_type", CHAT, {**GOOD, "temperature": "hot"}, "temperature"),
    ("temperature_range", CHAT, {**GOOD, "temperature": 2.5}, "temperature"),
    ("temperature_negative", CHAT, {**GOOD, "temperature": -0.1}, "temperature"),
    ("top_p_zero", CHAT, {**GOOD, "top_p": 0}, "top_p"),
    ("top_p_above_one", CHAT, {**GOOD, "top_p": 1.5}, "top_p"),
    ("top_k_range", CHAT, {**GOOD, "top_k": -2}, "top_k"),
    ("max_tokens_zero", CHAT, {**GOOD, "max_tokens": 0}, "max_tokens"),
    ("max_tokens_float", CHAT, {**GOOD, "max_tokens": 2.5}, "max_tokens"),
    ("max_tokens_string", CHAT, {**GOOD, "max_tokens": "ten"}, "max_tokens"),
    ("presence_penalty_range", CHAT, {**GOOD, "presence_penalty": 3}, "presence_penalty"),
    ("seed_range", CHAT, {**GOOD, "seed": 2 ** 70}, "seed"),
    ("seed_type", CHAT, {**GOOD, "seed": "abc"}, "seed"),
    ("stream_type", CHAT, {**GOOD, "stream": "yes"}, "stream"),
    ("n_two", CHAT, {**GOOD, "n": 2}, "n"),
    ("n_zero", CHAT, {**GOOD, "n": 0}, "n"),
    ("empty_stop", CHAT, {**GOOD, "stop": [""]}, "stop"),
    ("stream_options_without_stream", CHAT, {**GOOD, "stream_options": {"include_usage": True}}, "stream_options"),
    ("max_tokens_beyond_context", CHAT, {**GOOD, "max_tokens": MAX_LEN}, "max_tokens"),
    ("prompt_beyond_context", CHAT, {"messages": [{"role": "user", "content": "x" * (MAX_LEN + 10)}]}, "messages"),
    ("logprobs", CHAT, {**GOOD, "logprobs": True}, "logprobs"),
    ("response_format_type", CHAT, {**GOOD, "response_format": {"type": "yaml"}}, "response_format"),
    ("response_format_schema", CHAT, {**GOOD, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strin"}}}}, "response_format"),
    ("logit_bias_key", CHAT, {**GOOD, "logit_bias": {"abc": 1}}, "logit_bias"),
    ("logit_bias_range", CHAT, {**GOOD, "logit_bias": {"99999": 1}}, "logit_bias"),
    ("empty_tools", CHAT, {**GOOD, "tools": []}, "tools"),
    ("tool_choice_without_tools", CHAT, {**GOOD, "tool_choice": "required"}, "tool_choice"),
    ("unknown_named_tool", CHAT, {**GOOD, "tools": TOOLS,
                                  "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("bad_tool_choice", CHAT, {**GOOD, "tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ("min_tokens_over_max", CHAT, {**GOOD, "min_tokens": 5}, "min_tokens"),
    ("repetition_penalty", CHAT, {**GOOD, "repetition_penalty": 1.2}, "repetition_penalty"),
    ("completion_no_prompt", "/v1/completions", {"model": "tiny"}, "prompt"),
    ("completion_empty_prompt", "/v1/completions", {"prompt": []}, "prompt"),
    ("completion_token_out_of_vocab", "/v1/completions", {"prompt": [1, 999999]}, "prompt"),
    ("completion_two_prompts", "/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("completion_echo", "/v1/completions", {"prompt": "a", "echo": True}, "echo"),
    ("completion_max_tokens_beyond", "/v1/completions", {"prompt": "a", "max_tokens": MAX_LEN}, "max_tokens"),
    ("detokenize_out_of_vocab", "/detokenize", {"tokens": [5, 100000]}, "tokens"),
    ("detokenize_type", "/detokenize", {"tokens": "abc"}, "tokens"),
    ("tokenize_neither", "/tokenize", {}, "prompt"),
]


@pytest.mark.parametrize("name,path,body,param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_is_400_and_server_keeps_serving(server, name, path, body, param):
    if isinstance(body, bytes):
        resp = server.post(path, raw=body)
    else:
        resp = server.post(path, body)
    err = _err(resp, 400, param)
    assert err["type"] == "invalid_request_error"


def test_context_error_messages(server):
    e = _err(server.post(CHAT, {**GOOD, "max_tokens": MAX_LEN}), 400, "max_tokens", "context_length_exceeded")
    assert f"maximum context length is {MAX_LEN} tokens" in e["message"]
    e = _err(server.post(CHAT, {"messages": [{"role": "user", "content": "x" * (MAX_LEN + 10)}]}), 400,
             code="context_length_exceeded")
    assert "input tokens" in e["message"]


def test_unknown_model_is_404(server, client):
    _err(server.post(CHAT, {**GOOD, "model": "gpt-17"}), 404, "model", "model_not_found")
    _err(server.post("/v1/completions", {"model": "gpt-17", "prompt": "a"}), 404, "model", "model_not_found")
    with pytest.raises(openai.NotFoundError):
        chat(client, model="gpt-17")


def test_non_finite_numbers_are_refused_as_such(server):
    for value in ("NaN", "Infinity", "-Infinity"):
        raw = f'{{"messages": [{{"role": "user", "content": "x"}}], "temperature": {value}}}'.encode()
        e = _err(server.post(CHAT, raw=raw), 400, "temperature")
        assert "finite number" in e["message"], e
    raw = json.dumps({**GOOD, "temperature": 0.5, "logit_bias": {"5": float("nan")}}).encode()  # Python writes NaN
    e = _err(server.post(CHAT, raw=raw), 400, "logit_bias")
    assert "finite number" in e["message"]


def test_content_part_messages(server):
    e = _err(server.post(CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                          {"type": "text"}]}]}), 400, "messages")
    assert e["message"] == "messages[0].content[1]: content part of type 'text' has no 'text' field"
    e = _err(server.post(CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), 400, "messages")
    assert "only text parts are supported (got type 'image_url')" in e["message"]
    # text parts join with newlines: the prompt equals the same text sent as one string
    parts = server.post("/tokenize", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                 {"type": "text", "text": "b"}]}]})
    whole = server.post("/tokenize", {"messages": [{"role": "user", "content": "a\nb"}]})
    assert parts.json()["tokens"] == whole.json()["tokens"]


def test_unknown_model_name_is_echoed_truncated(server):
    name = "n" * 100_000
    for path, body in ((CHAT, {**GOOD, "model": name}), ("/v1/completions", {"model": name, "prompt": "a"}),
                       ("/tokenize", {"model": name, "prompt": "a"})):
        e = _err(server.post(path, body), 404, "model", "model_not_found")
        assert "n" * 99 + "…" in e["message"] and "n" * 100 not in e["message"], path
    assert "n" * 1000 not in server.log()


def _raw_http(server, request: bytes) -> tuple[int, dict]:
    """Send ``request`` (with ``Connection: close``) on a socket; read to EOF."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    return int(head.split(b" ")[1]), json.loads(body)


def test_oversized_body_is_413_before_it_is_read(server):
    """The default limit is 8 MiB: a body declared 1 byte larger is refused
    although not one byte of it was sent."""
    status, body = _raw_http(server, (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                                      f"Content-Type: application/json\r\nConnection: close\r\n"
                                      f"Content-Length: {8 * 2 ** 20 + 1}\r\n\r\n"
                                      ).encode())
    assert status == 413
    assert (body["error"]["type"], body["error"]["code"]) == ("invalid_request_error", "request_too_large")
    assert str(8 * 2 ** 20) in body["error"]["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_openai_client_sees_bad_request(client):
    with pytest.raises(openai.BadRequestError) as ei:
        chat(client, temperature=5)
    assert "temperature" in str(ei.value)
    with pytest.raises(openai.BadRequestError, match="n > 1"):
        chat(client, n=3)


def test_wrong_content_type_and_routes(server):
    _err(httpx.post(f"{server.url}{CHAT}", content=b"messages=hi",
                    headers={"content-type": "application/x-www-form-urlencoded"}), 400)
    _err(server.get("/v1/nothing"), 404)
    _err(server.get(CHAT), 405)


def test_unknown_fields_are_accepted(server):
    r = server.post(CHAT, {**GOOD, "frobnicate": 1, "messages": [{"role": "user", "content": "x", "extra": 2}],
                           "user": "me", "parallel_tool_calls": True, "service_tier": "auto"})
    assert r.status_code == 200, r.text
    assert "ignored unknown request fields: frobnicate, service_tier, messages[0].extra" in server.log()


def test_still_healthy_after_all_errors(server, client):
    assert httpx.get(f"{server.url}/health").status_code == 200
    r = chat(client, max_tokens=3, temperature=0)
    assert r.choices[0].message.content is not None
    m = server.metrics()
    assert not [k for k, v in m.items() if k.startswith("megac:http_requests_total") and 'status="500"' in k and v]


def test_health_is_503_until_loaded_and_after_engine_death():
    """In-process app (no model loaded yet): /health and the API answer 503
    until ``load`` finished; a dead engine makes /health 503 again."""
    from fastapi.testclient import TestClient

    from megac.server.app import create_app
    from megac.server.config import ServeConfig
    from megac.server.state import ServerState

    cfg = ServeConfig(model="tiny-llama", random_weights=True, log_stats_interval=0, max_model_len=256,
                      threads=0)  # 0: leave the test process's torch threads alone
    state = ServerState(cfg)
    with TestClient(create_app(cfg, state, load=False)) as c:
        assert c.get("/health").status_code == 503
        _err(c.post(CHAT, json={"messages": MSG}), 503)
        _err(c.get("/v1/models"), 503)
        state.load()
        assert c.get("/health").status_code == 200
        assert c.post(CHAT, json={"messages": MSG, "max_tokens": 2}).status_code == 200
        state.engine.dead = "simulated failure"
        assert c.get("/health").status_code == 503
        _err(c.post(CHAT, json={"messages": MSG, "max_tokens": 2}), 500)

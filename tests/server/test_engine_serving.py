"""Engine behaviour through the real server: 32 concurrent greedy streams
equal to the same requests run alone, a client disconnect mid-stream frees
its KV blocks, a pool too small for the load preempts and still returns the
same outputs, the API key on every route but /health."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from test_util import ServerProc, untied_tiny_yaml


@pytest.fixture(scope="module")
def spec_path(tmp_path_factory):
    return untied_tiny_yaml(tmp_path_factory.mktemp("spec"))


def _prompt(i: int) -> str:
    return f"{i * 7919 % 1000} stream {i}: " + "tell me more " * (i % 7) + f"({i})"


async def _stream(aclient, i: int, max_tokens: int) -> str:
    chunks = await aclient.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": _prompt(i)}], max_tokens=max_tokens, temperature=0,
        stream=True, extra_body={"ignore_eos": True})
    out = []
    async for c in chunks:
        if c.choices and c.choices[0].delta.content:
            out.append(c.choices[0].delta.content)
    return "".join(out)


def _alone(server, n: int, max_tokens: int) -> list[str]:
    client = server.client()
    return [client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": _prompt(i)}],
                                           max_tokens=max_tokens, temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0].message.content
            for i in range(n)]


async def _concurrent(server, n: int, max_tokens: int) -> list[str]:
    async with server.async_client() as aclient:
        return await asyncio.gather(*[_stream(aclient, i, max_tokens) for i in range(n)])


@pytest.fixture(scope="module")
def server(spec_path):
    # seed 1: random weights whose greedy outputs differ across the prompts
    s = ServerProc(str(spec_path), "--random-weights", "--seed", "1", "--max-model-len", "4096",
                   "--prefill-chunk", "32",
                   "--max-batch-size", "12", "--served-model-name", "tiny")
    yield s
    s.stop()


def test_32_concurrent_streams_equal_alone(server):
    alone = _alone(server, 32, 24)
    assert len(set(alone)) > 12  # the prompts really give different outputs
    together = asyncio.run(_concurrent(server, 32, 24))
    assert together == alone, [i for i in range(32) if together[i] != alone[i]]
    assert server.metric("megac:num_requests_running") == 0
    assert server.metric("megac:kv_blocks_active") == 0


def test_disconnect_mid_stream_frees_blocks(server):
    aborts0 = server.metric("megac:request_success_total", finished_reason="abort")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go on forever"}], "max_tokens": 4000,
            "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        n = 0
        lines = r.iter_lines()  # keep the iterator alive: dropping it closes the stream
        for line in lines:
            if line.startswith("data: "):
                n += 1
            if n >= 5:
                break
        assert server.metric("megac:num_requests_running") == 1
        assert server.metric("megac:kv_blocks_active") > 0
    # the connection is closed: the server aborts the request and frees its blocks
    assert server.wait_metric("megac:num_requests_running", lambda v: v == 0) == 0
    assert server.wait_metric("megac:kv_blocks_active", lambda v: v == 0) == 0
    assert server.wait_metric("megac:request_success_total", lambda v: v == aborts0 + 1,
                              finished_reason="abort") == aborts0 + 1
    assert "aborted (client went away)" in server.log()
    # and it keeps serving
    r = server.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=3)
    assert r.usage.completion_tokens >= 1


def test_disconnect_of_a_non_streaming_request(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "slow"}], "max_tokens": 4000,
            "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=1.0)
    assert server.wait_metric("megac:num_requests_running", lambda v: v == 0) == 0
    assert server.wait_metric("megac:kv_blocks_active", lambda v: v == 0) == 0


def test_small_pool_preempts_and_outputs_match(spec_path):
    # 2 layers x blocks of 16 tokens: 40 blocks = 320 token slots for 8 requests of ~100 tokens each
    s = ServerProc(str(spec_path), "--random-weights", "--max-model-len", "512", "--prefill-chunk", "32",
                   "--max-batch-size", "8", "--num-kv-blocks", "40", "--served-model-name", "tiny")
    try:
        alone = _alone(s, 8, 60)
        assert s.metric("megac:num_preemptions_total") == 0
        together = asyncio.run(_concurrent(s, 8, 60))
        assert s.metric("megac:num_preemptions_total") > 0
        assert together == alone
        assert s.metric("megac:kv_blocks_active") == 0
        # a request that can never fit the pool is refused up front
        with pytest.raises(openai.BadRequestError, match="KV"):
            s.client().completions.create(model="tiny", prompt="x" * 100, max_tokens=350)
        # without max_tokens, a chat reply may use what the pool can hold (320 tokens here)
        r = s.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                               temperature=0, extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and r.usage.total_tokens == 320
    finally:
        s.stop()


def test_api_key(spec_path):
    s = ServerProc(str(spec_path), "--random-weights", "--max-model-len", "256", "--served-model-name", "tiny",
                   "--metrics-without-key", api_key="s3cret")
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Bearer s3cre"}):
            r = httpx.post(f"{s.url}/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 401
            assert r.json()["error"]["type"] == "authentication_error"
        for path in ("/v1/models", "/v1/models/tiny", "/openapi.json", "/version"):
            assert httpx.get(f"{s.url}{path}").status_code == 401, path
        for path, req in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [97]})):
            assert httpx.post(f"{s.url}{path}", json=req).status_code == 401, path
            assert httpx.post(f"{s.url}{path}", json=req, headers=s.headers()).status_code == 200, path
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{s.url}/v1", api_key="bad", max_retries=0).models.list()
        assert s.client().chat.completions.create(model="tiny", **body).usage.completion_tokens >= 1
        assert s.client().models.retrieve("tiny").id == "tiny"
        # the scheme in any case (RFC 9110)
        r = httpx.post(f"{s.url}/v1/chat/completions", json=body, headers={"Authorization": "bearer s3cret"})
        assert r.status_code == 200, r.text
        # health stays open (probes carry no key), and metrics with --metrics-without-key
        assert httpx.get(f"{s.url}/health").status_code == 200
        assert httpx.get(f"{s.url}/metrics").status_code == 200
    finally:
        s.stop()


def test_load_error_exits_with_one_line(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "megac.cli", "serve", "tiny-llama", "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == ("error: tiny-llama: the spec tiny-llama has no weights here; add "
                                                 "--random-weights, --weights PATH, or name a checkpoint directory")
    r = subprocess.run([sys.executable, "-m", "megac.cli", "serve", "tiny-llama", "--random-weights",
                        "--backend", "cuda"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        "error: --backend cuda: no CUDA device visible (use --backend cpu)")
    # an artifact compiled for another model is refused, naming both
    art = tmp_path / "moe-art"
    r = subprocess.run([sys.executable, "-m", "megac.cli", "compile", "tiny-moe", "-o", str(art), "--batch-size", "1",
                        "--no-cubin"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "megac.cli", "serve", "tiny-llama", "--random-weights", "--port", "0",
                        "--artifact", str(art)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: artifact {art}: built for tiny-moe, whose ")


def test_hf_checkpoint_dir_serves_the_same_model(spec_path, tmp_path):
    """A checkpoint saved by transformers (same seeded weights) serves the
    same greedy text as the spec with --random-weights."""
    from models import save_checkpoint

    from megac.spec import load_spec

    save_checkpoint(load_spec(str(spec_path)), tmp_path / "ckpt", seed=0)
    body = dict(model="tiny", messages=[{"role": "user", "content": "checkpoint"}], max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True})
    texts = []
    for args in ((str(tmp_path / "ckpt"),), (str(spec_path), "--random-weights", "--seed", "0")):
        s = ServerProc(*args, "--max-model-len", "256", "--served-model-name", "tiny")
        try:
            texts.append(s.client().chat.completions.create(**body).choices[0].message.content)
        finally:
            s.stop()
    assert texts[0] == texts[1]


def test_bfloat16(spec_path):
    s = ServerProc(str(spec_path), "--random-weights", "--dtype", "bfloat16", "--max-model-len", "256",
                   "--served-model-name", "tiny")
    try:
        r = s.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "bf16"}],
                                               max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 8
    finally:
        s.stop()

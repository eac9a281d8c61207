"""``megac bench-serve`` datasets and concurrency levels, against the real
tiny server (random weights, byte tokenizer): prompt lengths as the server
counts them, the built-in prompt set, a multi-level run's JSON, and the
one-line errors. No timing thresholds: only counts and orderings."""

from __future__ import annotations

import asyncio
import fnmatch
import json
import subprocess
import sys
import tomllib

import httpx
import pytest
from click.testing import CliRunner

from megac.cli import main
from megac.server.bench_datasets import BUILTIN_FILE, DatasetConfig, Server, build_requests, load_builtin
from test_util import REPO, free_port, tiny_server

# --random-input-len 40 --random-range-ratio 0.5: vLLM's bounds [int(40*0.5), int(40*1.5)]
INPUT_LEN, OUTPUT_LEN, RATIO = 40, 12, 0.5
INPUT_BOUNDS, OUTPUT_BOUNDS = (20, 60), (6, 18)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = tiny_server(tmp_path_factory, max_model_len=512)
    yield s
    s.stop()


def _random_requests(server, seed: int, prefix_len: int = 0, num: int = 12):
    cfg = DatasetConfig(name="random", num_prompts=num, random_input_len=INPUT_LEN, random_output_len=OUTPUT_LEN,
                        random_range_ratio=RATIO, random_prefix_len=prefix_len, seed=seed)

    async def build():
        async with httpx.AsyncClient(timeout=60) as client:
            return await build_requests(Server(client, server.url, {}), cfg, as_tokens=True)

    return asyncio.run(build())


def _server_prompt_tokens(server, prompt) -> int:
    """What the server counts for this prompt (usage.prompt_tokens)."""
    r = server.post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_random_prompt_lengths_as_the_server_counts_them(server):
    reqs = _random_requests(server, seed=3)
    counted = [_server_prompt_tokens(server, q.prompt) for q in reqs]
    assert all(INPUT_BOUNDS[0] <= n <= INPUT_BOUNDS[1] for n in counted), counted
    assert len(set(counted)) > 1, counted
    assert [q.prompt_len for q in reqs] == counted
    outputs = [q.output_len for q in reqs]
    assert all(OUTPUT_BOUNDS[0] <= n <= OUTPUT_BOUNDS[1] for n in outputs) and len(set(outputs)) > 1, outputs
    again = _random_requests(server, seed=3)
    assert [q.prompt for q in again] == [q.prompt for q in reqs]
    assert [q.output_len for q in again] == outputs
    other = _random_requests(server, seed=4)
    assert [q.prompt for q in other] != [q.prompt for q in reqs]


def test_random_prefix_is_shared_and_counted(server):
    reqs = _random_requests(server, seed=5, prefix_len=8, num=4)
    counted = [_server_prompt_tokens(server, q.prompt) for q in reqs]
    assert all(INPUT_BOUNDS[0] + 8 <= n <= INPUT_BOUNDS[1] + 8 for n in counted), counted
    assert len({tuple(q.prompt[:8]) for q in reqs}) == 1


def test_builtin_dataset_loads_with_both_kinds():
    prompts = load_builtin()
    assert len(prompts) == 24
    assert sorted({p.kind for p in prompts}) == ["chat", "code"]
    assert sum(p.kind == "code" for p in prompts) == 12
    assert all(p.prompt.strip() and p.max_tokens > 0 for p in prompts)
    assert len({p.prompt for p in prompts}) == 24


def test_builtin_file_is_package_data():
    """A wheel must ship the prompts: pyproject's package-data covers the file."""
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert any(fnmatch.fnmatch(BUILTIN_FILE, p) for p in patterns.get("megac.server", []))


def _bench(server, tmp_path, *args: str) -> tuple[dict, str]:
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "megac.cli", "bench-serve", "--base-url", server.url, *args,
                        "--save-result", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text()), r.stdout


def _check_level(level: dict, num: int) -> None:
    assert level["completed"] == num and level["failed"] == 0
    results = level["results"]
    assert len(results) == num and all(r["success"] for r in results)
    assert level["total_output_tokens"] == sum(r["output_tokens"] for r in results)
    assert level["total_input_tokens"] == sum(r["prompt_len"] for r in results)
    for r in results:
        assert 0 < r["ttft"] <= r["latency"]
        # one gap between consecutive chunks; a chunk carries one token or more
        assert 0 <= r["itl_count"] <= r["output_tokens"] - 1
    for name in ("ttft", "tpot", "itl"):
        assert 0 < level[f"mean_{name}_ms"] and 0 < level[f"median_{name}_ms"] <= level[f"p99_{name}_ms"]
    assert level["median_ttft_ms"] <= level["p99_e2el_ms"]
    assert level["output_throughput"] > 0 and level["request_throughput"] > 0


def test_multi_level_random_run(server, tmp_path):
    res, stdout = _bench(server, tmp_path, "--endpoint-type", "openai", "--num-prompts", "6",
                         "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
                         "--random-range-ratio", str(RATIO), "--max-concurrency", "1,3")
    assert [lv["max_concurrency"] for lv in res["levels"]] == [1, 3]
    for level in res["levels"]:
        _check_level(level, 6)
        assert all(INPUT_BOUNDS[0] <= r["prompt_len"] <= INPUT_BOUNDS[1] for r in level["results"])
        # --ignore-eos (the default): the server generated exactly what was asked
        assert all(OUTPUT_BOUNDS[0] <= r["output_tokens"] <= OUTPUT_BOUNDS[1] for r in level["results"])
    # the same requests at every level
    assert res["levels"][0]["total_input_tokens"] == res["levels"][1]["total_input_tokens"]
    assert "completed" not in res  # several levels: no single-run layout at the top
    assert stdout.count("Serving Benchmark Result") == 2
    summary = stdout[stdout.index("Summary across concurrency levels"):].splitlines()
    assert summary[1].split()[:3] == ["concurrency", "req/s", "out"] and "ITL p99" in summary[1]
    assert [row.split()[0] for row in summary[2:4]] == ["1", "3"]


def test_builtin_chat_run_single_level(server, tmp_path):
    res, stdout = _bench(server, tmp_path, "--dataset", "builtin", "--num-prompts", "24", "--output-len", "4",
                         "--max-concurrency", "8")
    assert len(res["levels"]) == 1 and res["completed"] == 24  # vLLM's single-run keys at the top
    level = res["levels"][0]
    _check_level(level, 24)
    assert sorted(r["kind"] for r in level["results"]) == ["chat"] * 12 + ["code"] * 12
    assert all(r["output_tokens"] == 4 for r in level["results"])
    assert "Summary across" not in stdout


def test_builtin_completions_sends_the_chat_templated_prompt(server):
    cfg = DatasetConfig(name="builtin", num_prompts=2, output_len=4)

    async def build():
        async with httpx.AsyncClient(timeout=60) as client:
            return await build_requests(Server(client, server.url, {}), cfg, as_tokens=True)

    for q in asyncio.run(build()):
        text = server.post("/detokenize", {"tokens": q.prompt}).json()["prompt"]
        original = next(p.prompt for p in load_builtin() if p.prompt in text)
        assert len(text) > len(original)  # the template's role markers around it
        chat = server.post("/v1/chat/completions", {"model": "tiny", "max_tokens": 1,
                                                    "messages": [{"role": "user", "content": original}]})
        assert chat.json()["usage"]["prompt_tokens"] == _server_prompt_tokens(server, q.prompt)


@pytest.mark.parametrize("args, message", [
    (["--dataset", "sharegpt"], "'sharegpt' is not one of"),
    (["--random-input-len", "-5"], "--random-input-len"),
    (["--random-output-len", "-1"], "--random-output-len"),
    (["--random-range-ratio", "1"], "0<=x<1"),
    (["--random-range-ratio", "-0.2"], "0<=x<1"),
    (["--max-concurrency", ","], "empty list"),
    (["--max-concurrency", ""], "empty list"),
    (["--max-concurrency", "0,4"], "at least 1"),
    (["--dataset", "prompts"], "needs --prompt"),
    (["--port", "UNREACHABLE"], "cannot reach the server"),
])
def test_bad_input_is_one_line(args, message):
    args = [str(free_port()) if a == "UNREACHABLE" else a for a in args]
    r = CliRunner().invoke(main, ["bench-serve", *args])
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr
    assert "Traceback" not in r.output

"""`megac generate` end to end through the real entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megac.spec import load_spec

REPO = Path(__file__).resolve().parents[2]


def megac(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "megac.cli", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout)


def one_line_error(res, needle):
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr[-2000:])
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert needle in lines[0], lines[0]


def test_second_run_reuses_the_compiled_artifact(tmp_path):
    """The first run compiles and caches the artifact, the second loads it
    (and says so) and generates the same tokens; an artifact given with
    --artifact runs as it is."""
    env_cache = dict(os.environ, MEGAC_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "megac.cli", "generate", "tiny-llama", "--random-weights", "--prompt-ids", "1,2,3",
           "--max-tokens", "4", "--json"]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env_cache, timeout=300)
    second = subprocess.run(cmd, capture_output=True, text=True, env=env_cache, timeout=300)
    assert first.returncode == 0 and second.returncode == 0, (first.stderr, second.stderr)
    assert "compiling tiny-llama" in first.stderr and "reusing the compiled artifact" not in first.stderr
    assert "reusing the compiled artifact" in second.stderr and "compiling" not in second.stderr
    assert json.loads(first.stdout) == json.loads(second.stdout)
    art = tmp_path / "art"
    assert megac("compile", "tiny-llama", "-o", art, "--no-cubin").returncode == 0
    third = subprocess.run(cmd + ["--artifact", str(art)], capture_output=True, text=True, env=env_cache, timeout=300)
    assert third.returncode == 0 and f"loaded artifact {art}" in third.stderr, third.stderr
    assert json.loads(third.stdout) == json.loads(first.stdout)


def test_random_weights_ragged_batch_equals_each_prompt_alone():
    common = ["generate", "tiny-moe", "--random-weights", "--seed", 3, "--max-tokens", 6, "--json"]
    a, b = "5,17,33,2,9,11,4,8,21,3,60", "7,7"
    res = megac(*common, "--prompt-ids", a, "--prompt-ids", b)
    assert res.returncode == 0, res.stderr
    both = json.loads(res.stdout)["outputs"]
    assert len(both) == 2
    for item in both:
        assert len(item["token_ids"]) <= 6 and item["finish_reason"] in ("stop", "length")
        assert all(0 <= t < 256 for t in item["token_ids"])
    for ids, expect in ((a, both[0]), (b, both[1])):
        alone = json.loads(megac(*common, "--prompt-ids", ids).stdout)["outputs"][0]
        assert alone["token_ids"] == expect["token_ids"]


def test_checkpoint_dir_brings_its_weights_and_matches_transformers(tmp_path):
    from models import save_checkpoint

    spec = load_spec("tiny-llama")
    ref = save_checkpoint(spec, tmp_path / "ckpt", seed=5)
    prompt = [3, 14, 15, 92, 65]
    res = megac("generate", tmp_path / "ckpt", "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", 5,
                "--json", "--order", "interleaved")
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)["outputs"][0]["token_ids"]
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    assert got == out[0, len(prompt):].tolist()


def test_bad_invocations_exit_2_with_one_line():
    one_line_error(megac("generate", "tiny-moe", "--random-weights"), "--prompt")
    one_line_error(megac("generate", "tiny-moe", "--random-weights", "--prompt", "hi"), "no tokenizer")
    one_line_error(megac("generate", "tiny-moe", "--random-weights", "--prompt-ids", "1,x"), "--prompt-ids")
    one_line_error(megac("generate", "tiny-moe", "--random-weights", "--prompt-ids", "1,999"), "vocabulary")
    one_line_error(megac("generate", "tiny-moe", "--prompt-ids", "1,2"), "--random-weights")
    one_line_error(megac("generate", "tiny-moe", "--backend", "cuda", "--prompt-ids", "1"), "CUDA")
    one_line_error(megac("generate", "tiny-moe", "--random-weights", "--weights", "x", "--prompt-ids", "1"),
                   "exclude")


@pytest.mark.slow
def test_smollm2_prints_readable_text():
    res = megac("generate", "smollm2-135m", "--prompt", "What is the capital of France?", "--max-tokens", 12)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Paris" in res.stdout
    assert "tok/s" in res.stderr

"""`megac compile` / `megac schedule` end to end, the artifact, and bad input.

The CLI runs in a subprocess (the real entry point), so exit codes and the
"one line, no traceback" promise are what a user sees.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megac import abi
from megac.artifact import load_artifact
from megac.errors import MegacError

REPO = Path(__file__).resolve().parents[1]


def megac(*args, cwd=None, timeout=120):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "megac.cli", *map(str, args)],
        capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout,
    )


def assert_one_line_error(res, *needles):
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_compile_writes_a_loadable_artifact(tmp_path):
    out = tmp_path / "art"
    res = megac("compile", "tiny-moe", "-o", out, "--batch-size", 1, "--batch-size", 4, "--no-cubin", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "wrote" in res.stdout and "[megac]" in res.stderr  # progress goes to stderr
    # the CUDA source without its cubin (test_artifact_tampering builds one)
    assert "no cubin (--no-cubin" in res.stdout and (out / "megakernel.cu").is_file()
    assert not (out / "megakernel.cubin").exists()
    art = load_artifact(out)
    m = art.manifest
    assert m["abi_version"] == abi.ABI_VERSION
    assert {o["name"] for o in m["abi"]["opcodes"]} == {op.name for op in abi.Op}
    assert m["spec"]["name"] == "tiny-moe" and m["order"] == "tuned"
    assert sorted({s["batch_size"] for s in m["schedules"]}) == [1, 4]
    for s in art.schedules.values():
        meta = s.meta
        assert s.tasks.shape == (meta["num_sms"], meta["max_tasks"], abi.TASK_WORDS)
        assert int(s.task_counts.sum()) == meta["num_tasks"]
        assert sum(meta["tasks_per_opcode"].values()) == meta["num_tasks"]
        assert len(meta["counters"]) == meta["num_counters"]
        # every wait in the words names a counter of the table
        words = s.tasks.reshape(-1, abi.TASK_WORDS)
        used = np.concatenate([words[:, abi.H.WAIT0], words[:, abi.H.WAIT1], words[:, abi.H.SIGNAL]])
        assert used.max() < meta["num_counters"]
    from megac.runtime.schedules import ScheduleSet

    schedules = ScheduleSet(art.to_schedules())
    assert schedules.pick(3, 100).rows == 4
    with pytest.raises(MegacError, match="no compiled schedule for 5 rows"):
        schedules.pick(5, 100)


def test_artifact_tampering_is_refused(tmp_path):
    out = tmp_path / "art"
    res = megac("compile", "tiny-llama", "-o", out, "--batch-size", 2)
    assert res.returncode == 0, res.stderr
    from megac.gpu.build import nvcc_path

    if nvcc_path():  # compile builds the cubin where nvcc is, and says how it went
        built = r"built \S+megakernel\.cubin \(sm_90a, \d+ registers/thread, no spills\)"
        assert re.search(built, res.stdout), res.stdout
        assert (out / "megakernel.cubin").stat().st_size > 0
    else:
        assert "nvcc not found, so no cubin here" in res.stdout
    npz = out / "schedule.npz"
    data = bytearray(npz.read_bytes())
    data[len(data) // 2] ^= 0xFF
    npz.write_bytes(bytes(data))
    with pytest.raises(MegacError, match="content hash"):
        load_artifact(out)
    (out / "manifest.json").write_text("{not json")
    with pytest.raises(MegacError, match="corrupt JSON"):
        load_artifact(out)


def test_orders_give_different_moe_waves_and_all_verify():
    waves = {}
    for order in ("tuned", "interleaved", "attention-first"):
        res = megac("schedule", "tiny-moe", "--order", order, "--json")
        assert res.returncode == 0, res.stderr
        data = json.loads(res.stdout)
        assert set(data) >= {"waves", "tasks_per_opcode", "tasks_per_sm", "critical_path_tasks"}
        moe_kinds = [k for k in data["waves"] if k.startswith("moe")]
        assert moe_kinds
        waves[order] = [w["wave"] for w in data["waves"][moe_kinds[0]]]
        assert len(data["tasks_per_sm"]) == data["num_sms"]
        assert sum(data["tasks_per_sm"]) == data["num_tasks"]
    assert len({tuple(w) for w in waves.values()}) == 3, waves


def test_schedule_text_and_plot(tmp_path):
    png = tmp_path / "timeline.png"
    res = megac("schedule", "tiny-llama", "--batch-size", 2, "--plot", png)
    assert res.returncode == 0, res.stderr
    assert "waves per layer" in res.stdout and "tasks per opcode" in res.stdout
    assert "critical path" in res.stdout and "predicted step" in res.stdout
    assert png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


BAD_YAML = {
    "syntax": ("name: x\nhidden_size: [1, 2\n", "model.yaml"),
    "unknown": ("UNKNOWN_FIELD: 1\n", "unknown field"),
}


def _tiny_yaml() -> str:
    from megac.spec import load_spec, spec_to_yaml

    return spec_to_yaml(load_spec("tiny-moe"))


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda t: t + "bogus_field: 3\n", "bogus_field"),
        (lambda t: t.replace("q_width: 64", "q_width: 72"), "q_width"),
        (lambda t: t.replace("top_k: 2", "top_k: 99"), "top_k"),
        (lambda t: t + "hidden_size: [1, 2\n", "model.yaml"),
    ],
    ids=["unknown-field", "heads-x-head-dim", "topk-gt-experts", "yaml-syntax"],
)
def test_bad_model_yaml_exits_2_with_one_line(tmp_path, mutate, needle):
    text = _tiny_yaml()
    bad = mutate(text)
    assert bad != text, "mutation did not apply: fix the test"
    path = tmp_path / "model.yaml"
    path.write_text(bad)
    for cmd in ("compile", "schedule"):
        assert_one_line_error(megac(cmd, path, cwd=tmp_path), needle)


def test_window_beyond_context_is_refused(tmp_path):
    text = _tiny_yaml()
    import yaml

    d = yaml.safe_load(text)
    d["max_context"] = 4
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(d))
    assert_one_line_error(megac("compile", path, "-o", tmp_path / "o"), "window")


def test_missing_checkpoint_and_unknown_model(tmp_path):
    assert_one_line_error(megac("compile", tmp_path / "nope"), "nope")
    assert_one_line_error(megac("compile", "no-such-model"), "no-such-model")
    empty = tmp_path / "ckpt"
    empty.mkdir()
    assert_one_line_error(megac("compile", empty), "config.json")


def test_bad_options_are_usage_errors(tmp_path):
    res = megac("schedule", "tiny-moe", "--order", "random")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    res = megac("schedule", "tiny-moe", "--plot", tmp_path / "x.txt")
    assert_one_line_error(res, "--plot")
    res = megac("schedule", "tiny-moe", "--context", 10**9)
    assert_one_line_error(res, "max_context")

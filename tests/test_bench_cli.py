"""``megac bench`` end to end on the CPU VM: the table, the JSON record
and one-line errors for bad lists."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from megac.bench_cli import bench_cmd, parse_list, source_fingerprint
from megac.errors import MegacError


def test_bench_writes_a_row_per_case(tmp_path):
    out = tmp_path / "b.json"
    r = CliRunner().invoke(bench_cmd, ["tiny-moe", "--backend", "cpu", "--random-weights", "--batch-size", "1,2",
                                       "--context", "40,90", "--steps", "2", "--warmup", "1", "--json", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["run"]["model"] == "tiny-moe" and data["run"]["backend"] == "cpu"
    assert data["run"]["source"] == source_fingerprint()  # the code that ran, named even without git
    assert [(x["batch"], x["context"]) for x in data["rows"]] == [(1, 40), (1, 90), (2, 40), (2, 90)]
    # more rows or longer contexts move more bytes
    by = {(x["batch"], x["context"]): x["bytes"] for x in data["rows"]}
    assert by[(1, 90)] > by[(1, 40)] and by[(2, 40)] > by[(1, 40)]
    assert "ms/step" in r.output and "tok/s" in r.output


def test_parse_list_errors_name_the_option():
    assert parse_list("1, 2,8", "--batch-size") == [1, 2, 8]
    with pytest.raises(MegacError, match="--batch-size 'a,b'"):
        parse_list("a,b", "--batch-size")
    with pytest.raises(MegacError, match="--context 1: must be at least 2"):
        parse_list("1", "--context", lo=2)
    with pytest.raises(MegacError, match="empty"):
        parse_list(",", "--context")


def test_a_context_past_the_model_is_refused():
    r = CliRunner().invoke(bench_cmd, ["tiny-moe", "--backend", "cpu", "--random-weights", "--context", "4096",
                                       "--steps", "2"])
    assert isinstance(r.exception, MegacError) and "holds at most" in str(r.exception)


@pytest.mark.parametrize("flag,value", [("--profile", "t.json"), ("--plot", "t.png")])
def test_profile_and_plot_need_the_megakernel(tmp_path, flag, value):
    """They time the megakernel's tasks: on the CPU VM a one-line error comes
    before any model is loaded."""
    r = CliRunner().invoke(bench_cmd, ["tiny-moe", "--backend", "cpu", "--random-weights", flag,
                                       str(tmp_path / value)])
    assert isinstance(r.exception, MegacError) and "need --backend cuda" in str(r.exception)
    assert "drawing random weights" not in r.output


def test_the_source_fingerprint_changes_with_a_device_header(tmp_path, monkeypatch):
    """An edited opcode header is other code: another fingerprint."""
    import shutil

    import megac.resources as res

    before = source_fingerprint()
    copy = tmp_path / "opcodes"
    shutil.copytree(res.opcodes_dir(), copy)
    monkeypatch.setattr(res, "opcodes_dir", lambda: copy)
    assert source_fingerprint() == before
    (copy / "norm.cuh").write_text((copy / "norm.cuh").read_text() + "\n// edited\n")
    assert source_fingerprint() != before

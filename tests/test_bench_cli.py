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


def test_several_engines_give_the_median_and_their_spread(tmp_path):
    """--engines 3: every case timed on three engines built one after the
    other; the row's time is their median, what follows from it is
    recomputed from that, and the table shows the spread."""
    import statistics

    out = tmp_path / "e.json"
    r = CliRunner().invoke(bench_cmd, ["tiny-moe", "--backend", "cpu", "--random-weights", "--batch-size", "1",
                                       "--context", "40", "--steps", "2", "--warmup", "1", "--engines", "3",
                                       "--json", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["run"]["engines"] == 3
    (row,) = data["rows"]
    ks = row["engines_kernel_ms"]
    assert len(ks) == 3 and row["kernel_ms"] == round(statistics.median(ks), 4)
    assert row["tok_s"] == round(1e3 / row["kernel_ms"], 1)
    assert row["tb_s"] == round(row["bytes"] / (row["kernel_ms"] * 1e-3) / 1e12, 3)
    assert "engines ms" in r.output and "(3)" in r.output
    assert r.output.count("engine 2 of 3") >= 1


def test_merge_engines_takes_medians_and_recomputes_what_follows():
    from megac.decode_bench import merge_engines

    def row(k, s):
        return {"batch": 2, "context": 8192, "steps": 30, "kernel_ms": k, "step_ms": s, "tok_s": 0.0,
                "tok_s_step": 0.0, "host_fraction": 0.0, "bytes": 7_000_000_000, "tb_s": 0.0, "pct_datasheet": 0.0,
                "predicted_ms": 2.9, "pct_ceiling": 0.0, "sol_ms": 2.0}

    (got,) = merge_engines([[row(3.0, 3.1)], [row(2.9, 3.2)], [row(3.1, 3.0)], [row(2.95, 3.05)]])
    assert got["kernel_ms"] == 2.975 and got["step_ms"] == 3.075  # even count: the middle two's mean
    assert got["engines_kernel_ms"] == [3.0, 2.9, 3.1, 2.95]
    assert got["tok_s"] == round(2e3 / 2.975, 1) and got["tok_s_step"] == round(2e3 / 3.075, 1)
    assert got["host_fraction"] == round(0.1 / 3.075, 4)
    assert got["tb_s"] == round(7e9 / 2.975e-3 / 1e12, 3)
    assert got["pct_datasheet"] == round(100 * 7e9 / 2.975e-3 / 4.8e12, 1)
    assert got["pct_ceiling"] == round(100 * 2.0 / 2.975, 1)
    assert got["predicted_ms"] == 2.9 and got["sol_ms"] == 2.0
    other = row(3.0, 3.1)
    other["context"] = 1024
    with pytest.raises(MegacError, match="engines timed different cases"):
        merge_engines([[row(3.0, 3.1)], [other]])

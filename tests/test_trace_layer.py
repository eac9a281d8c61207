"""`megac trace TRACE --layer N`: one layer of a profiled step, SM by SM.

The records are written by hand (three SMs, two layers), so every number
the view prints is known: times from the layer's first run, each SM's
tasks in the order they ran, the opcodes' spans and the task that ended
last. The view reads the trace's records alone, so a trace whose model is
unknown here still shows its layers.
"""

from __future__ import annotations

import gzip
import json

import pytest
from click.testing import CliRunner

from megac.errors import MegacError
from megac.gpu.profile import chrome_trace, records_from_trace
from megac.trace_layer import format_layer_view, layer_records, layer_view


def _rec(sm, task, op, layer, start, waited, end, claims=0):
    return {"sm": sm, "task": task, "op": op, "layer": layer, "start_us": start, "waited_us": waited,
            "end_us": end, "claims": claims, "claim_wait_us": 0.0, "marks_us": [None] * 12}


# layer 3 starts running at t = 100 (SM 0's QKV); SM 1 runs its tasks out of list order in time
# (records sorted by task index differ from run order only if a trace is malformed, so run order it is)
RECORDS = [
    _rec(0, 0, "QKV_PROJ", 2, 40.0, 50.0, 58.0),  # another layer: not in the view
    _rec(0, 1, "QKV_PROJ", 3, 90.0, 100.0, 108.5),
    _rec(0, 2, "MOE_UPGATE_DRAIN", 3, 109.0, 110.0, 131.0, claims=1),
    _rec(0, 3, "O_PROJ", 3, 132.0, 133.5, 141.0),
    _rec(1, 0, "ROUTER_GEMM", 3, 95.0, 100.5, 106.0),
    _rec(1, 1, "MOE_UPGATE_DRAIN", 3, 107.0, 107.0, 128.0, claims=1),
    _rec(1, 2, "MOE_DOWN_DRAIN", 3, 129.0, 130.0, 145.25, claims=2),
    _rec(2, 0, "ATTN_DECODE", 3, 99.0, 110.0, 120.0),
    _rec(2, 1, "MOE_UPGATE_DRAIN", 3, 121.0, 122.0, 123.0, claims=0),
    _rec(2, 2, "MOE_COMBINE", 3, 124.0, 146.0, 147.5),
]


def test_the_view_puts_each_sms_tasks_in_run_order_from_the_layers_first_run():
    v = layer_view(RECORDS, 3)
    assert v.origin_us == 100.0 and v.span_us == pytest.approx(47.5)
    assert sorted(v.sms) == [0, 1, 2]
    assert [t.op for t in v.sms[0]] == ["QKV_PROJ", "MOE_UPGATE_DRAIN", "O_PROJ"]  # layer 2's task left out
    up = v.sms[0][1]
    assert (up.wait_from, up.run_from, up.end, up.claims) == (9.0, 10.0, 31.0, 1)
    assert v.sms[1][0].wait_from == -5.0  # a primed task's wait began before the layer's first run
    ops = v.by_op()
    assert ops["MOE_UPGATE_DRAIN"] == (3, 7.0, 28.0, 31.0)  # tasks, first run, median end, last end
    assert ops["MOE_DOWN_DRAIN"] == (1, 30.0, 45.25, 45.25)
    assert [(sm, t.op) for sm, t in v.last(2)] == [(2, "MOE_COMBINE"), (1, "MOE_DOWN_DRAIN")]


def test_the_text_names_waits_runs_and_records_claimed():
    text = format_layer_view(layer_view(RECORDS, 3))
    assert text.splitlines()[0].startswith("layer 3: 47.5 us")
    lines = {ln.split()[0]: ln for ln in text.splitlines() if ln[:4].strip().isdigit()}
    assert lines["0"].split() == ["0", "~10.0", "QKV", "0.0-8.5", "~1.0", "UP*1", "10.0-31.0", "~1.5", "OPROJ",
                                  "33.5-41.0"]
    assert "DOWN*2 30.0-45.2" in lines["1"] and "UP*0 22.0-23.0" in lines["2"]  # a drained claimer: 0
    assert lines["1"].split()[1] == "~5.5"  # the router waited 5.5 us (a wait under 0.05 prints nothing)
    assert "UP*1 7.0-28.0" in lines["1"] and "~0.0" not in lines["1"]
    assert "ended last: SM 2 MOE_COMBINE 47.5" in text


def test_a_layer_the_trace_lacks_is_named_with_the_layers_it_has():
    with pytest.raises(MegacError, match=r"no task of layer 7 in the trace \(its layers: 2-3\)"):
        layer_view(RECORDS, 7)
    with pytest.raises(MegacError, match="no task records"):
        layer_view([], 0)


def test_layer_records_are_shifted_to_the_views_origin():
    v = layer_view(RECORDS, 3)
    recs = layer_records(RECORDS, v)
    assert len(recs) == 9 and min(r["waited_us"] for r in recs) == 0.0
    assert max(r["end_us"] for r in recs) == pytest.approx(47.5)


def test_trace_layer_command_prints_and_draws_from_the_records_alone(tmp_path):
    from megac.cli import main

    # a model name nothing here knows: the layer view must not need the schedule
    path = tmp_path / "step.trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps(chrome_trace(RECORDS, {"model": "nmc-some-tile-set", "batch": 1,
                                                                     "context": 8192})).encode()))
    assert records_from_trace(json.loads(gzip.decompress(path.read_bytes())))  # the file round-trips
    png = tmp_path / "layer3.png"
    r = CliRunner().invoke(main, ["trace", str(path), "--layer", "3", "--timeline", str(png)])
    assert r.exit_code == 0, r.output
    assert "layer 3: 47.5 us" in r.output and "OPROJ 33.5-41.0" in r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # bad input: one line naming what is wrong, nothing written
    r = CliRunner().invoke(main, ["trace", str(path), "--layer", "9"])
    assert r.exit_code != 0 and "no task of layer 9" in r.output
    r = CliRunner().invoke(main, ["trace", str(path), "--timeline", str(tmp_path / "x.png")])
    assert r.exit_code != 0 and "--layer" in r.output and not (tmp_path / "x.png").exists()
    r = CliRunner().invoke(main, ["trace", str(path), "--layer", "3", "--timeline", str(tmp_path / "x.gif")])
    assert r.exit_code != 0 and "--timeline" in r.output


# layer 5: a MoE layer whose tails are known (µs from its first run, t = 0): the up claims end at 32;
# SM 0's O-projection tile waits behind its up claim (begins 31: as they end), SM 1 claims down late
# (32.5), SM 2 asks at 33 and finds the queue drained, SM 3 claimed early (14) and SM 4 asks long after
# (40: not one that could share the tail). Layer 6 is full (its attention claimed), layer 7 dense.
TAIL_RECORDS = [
    _rec(0, 0, "QKV_PROJ", 5, 0.0, 0.0, 8.0),
    _rec(0, 1, "MOE_UPGATE_DRAIN", 5, 9.0, 10.0, 30.0, claims=1),
    _rec(0, 2, "O_PROJ", 5, 30.5, 31.0, 40.0),
    _rec(1, 0, "MOE_UPGATE_DRAIN", 5, 4.0, 5.0, 32.0, claims=1),
    _rec(1, 1, "MOE_DOWN_DRAIN", 5, 32.2, 32.5, 42.0, claims=1),
    _rec(2, 0, "ATTN_DECODE", 5, 2.0, 10.0, 20.0),
    _rec(2, 1, "O_PROJ", 5, 20.5, 21.0, 29.0),
    _rec(2, 2, "MOE_DOWN_DRAIN", 5, 32.8, 33.0, 34.0, claims=0),
    _rec(3, 0, "MOE_UPGATE_DRAIN", 5, 10.0, 11.0, 12.0, claims=0),
    _rec(3, 1, "MOE_DOWN_DRAIN", 5, 13.0, 14.0, 38.0, claims=1),
    _rec(4, 0, "MOE_DOWN_DRAIN", 5, 39.0, 40.0, 41.0, claims=0),
    _rec(5, 0, "MOE_COMBINE", 5, 35.0, 42.5, 44.0),
    _rec(0, 3, "ATTN_DRAIN", 6, 50.0, 50.0, 70.0, claims=2),
    _rec(1, 2, "MOE_UPGATE_DRAIN", 6, 50.0, 51.0, 80.0, claims=1),
    _rec(2, 3, "O_PROJ", 6, 71.0, 72.0, 85.0),
    _rec(3, 2, "MOE_DOWN_DRAIN", 6, 60.0, 61.0, 90.0, claims=1),
    _rec(0, 4, "QKV_PROJ", 7, 95.0, 95.0, 99.0),
    _rec(1, 3, "FFN_DOWN", 7, 99.0, 100.0, 110.0),
]


def test_tails_say_which_chain_ends_a_moe_layer_and_why():
    from megac.trace_layer import format_tails, layer_tails, step_tails

    t = layer_tails(layer_view(TAIL_RECORDS, 5))
    assert (t.kind, t.span, t.up_end, t.oproj_end, t.down_end, t.combine_end) == ("sliding", 44.0, 32.0, 40.0, 42.0,
                                                                                   44.0)
    assert (t.late_down, t.late_drained, t.oproj_behind_up) == (1, 1, 1)
    tails = step_tails(TAIL_RECORDS)
    assert [(x.layer, x.kind) for x in tails] == [(5, "sliding"), (6, "full")]  # the dense layer 7 left out
    full = tails[1]
    assert (full.up_end, full.oproj_end, full.down_end, full.late_down) == (30.0, 35.0, 40.0, 0)
    assert full.combine_end != full.combine_end  # no combine in the layer: NaN, not a number made up
    text = format_tails(tails)
    rows = [ln.split() for ln in text.splitlines() if ln[:5].strip() in ("5", "x1")]
    assert rows[0][:2] == ["5", "sliding"] and rows[0][-3:] == ["1", "1", "1"]
    assert "median by kind of layer:" in text and any(r[:2] == ["x1", "sliding"] for r in rows)
    with pytest.raises(MegacError, match="no layer of the trace ran expert claims"):
        step_tails([r for r in TAIL_RECORDS if r["layer"] == 7])


def test_trace_tails_command(tmp_path):
    from megac.cli import main

    path = tmp_path / "step.trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps(chrome_trace(TAIL_RECORDS, {"model": "nmc-x", "batch": 1})).encode()))
    r = CliRunner().invoke(main, ["trace", str(path), "--tails"])
    assert r.exit_code == 0, r.output
    assert "late down" in r.output and "median by kind of layer:" in r.output
    r = CliRunner().invoke(main, ["trace", str(path), "--tails", "--layer", "5"])
    assert r.exit_code != 0 and "--tails reads every layer" in r.output


def _marked(sm, task, op, layer, start, waited, end, claims=0, **marks):
    """A record with stamps: marks m0=..., m2=... (µs, as the trace writes them)."""
    r = _rec(sm, task, op, layer, start, waited, end, claims)
    r["marks_us"] = [marks.get(f"m{i}") for i in range(16)]
    return r


# layer 4's last working down claim ends at 100 (a drained claimer later does not count); its last
# O-projection tile at 101, its norm at 106. Layer 5 (sliding) starts from there: routers wait to 101.5 /
# 102, stage at 103 / 103.5, end 105 / 106; three up claimers rank at 109, 109.5, 112, hand their claims
# to the CTA at 109.8, 110, 113, and land their first stages at 111, 112, 114 (a drained claimer and a
# QKV tile's fold of 2.5 and 3.0 us beside; the second QKV tile runs after its SM's norm, ends at 116, 3 us
# after the median tile's end). Layer 6 (full) has no stamps, no norm and no O-projection
# before it: NaN, not numbers made up.
HEAD_RECORDS = [
    _rec(0, 0, "MOE_DOWN_DRAIN", 4, 80.0, 85.0, 100.0, claims=1),
    _rec(1, 0, "MOE_DOWN_DRAIN", 4, 95.0, 96.0, 103.0, claims=0),
    _rec(2, 0, "O_PROJ", 4, 90.0, 92.0, 101.0),
    _rec(3, 0, "ADD_RMSNORM", 4, 99.0, 101.0, 106.0),
    _marked(0, 1, "ROUTER_GEMM", 5, 99.0, 101.5, 105.0, m2=103.0),
    _marked(1, 1, "ROUTER_GEMM", 5, 99.0, 102.0, 106.0, m2=103.5),
    _marked(2, 1, "QKV_PROJ", 5, 95.0, 101.5, 110.0, m0=104.0),
    _marked(3, 1, "QKV_PROJ", 5, 106.5, 107.0, 116.0, m0=110.0),  # after SM 3's norm: the layer's last QKV tile
    _marked(0, 2, "MOE_UPGATE_DRAIN", 5, 105.5, 106.5, 130.0, claims=1, m7=109.0, m8=109.8, m3=111.0),
    _marked(1, 2, "MOE_UPGATE_DRAIN", 5, 106.5, 107.0, 131.0, claims=1, m7=109.5, m8=110.0, m3=112.0),
    _marked(4, 0, "MOE_UPGATE_DRAIN", 5, 109.0, 110.0, 132.0, claims=1, m7=112.0, m8=113.0, m3=114.0),
    _marked(5, 0, "MOE_UPGATE_DRAIN", 5, 109.0, 110.0, 110.5, claims=0, m7=110.2),
    _rec(2, 2, "MOE_DOWN_DRAIN", 5, 120.0, 125.0, 140.0, claims=1),
    _rec(0, 3, "ATTN_DRAIN", 6, 141.0, 142.0, 150.0, claims=1),
    _rec(1, 3, "ROUTER_GEMM", 6, 141.0, 143.0, 146.0),
    _rec(3, 2, "MOE_UPGATE_DRAIN", 6, 146.0, 147.0, 170.0, claims=1),
]


def test_heads_say_how_each_moe_layer_starts_after_the_layer_before():
    from megac.trace_layer import format_heads, layer_head, step_heads

    h = layer_head(HEAD_RECORDS, 5)
    got = (h.kind, h.oproj_end, h.router_waited, h.router_staged, h.router_end, h.norm_end, h.ranked, h.handed,
           h.first_byte, h.qkv_fold, h.qkv_last, h.qkv_late)
    assert got == pytest.approx(("sliding", 1.0, 2.0, 3.5, 6.0, 6.0, 9.5, 10.0, 11.0, 2.75, 16.0, 3.0))
    assert h.qkv_last_after == "ADD_RMSNORM"
    full = layer_head(HEAD_RECORDS, 6)
    assert full.kind == "full" and (full.router_waited, full.router_end) == (3.0, 6.0)
    for f in ("oproj_end", "router_staged", "norm_end", "ranked", "handed", "first_byte", "qkv_fold", "qkv_last",
              "qkv_late"):
        v = getattr(full, f)
        assert v != v, f  # NaN: no such task or stamp in the trace
    assert full.qkv_last_after == ""
    assert layer_head(HEAD_RECORDS, 4) is None  # no MoE layer before it
    heads = step_heads(HEAD_RECORDS)
    assert [(x.layer, x.kind) for x in heads] == [(5, "sliding"), (6, "full")]
    text = format_heads(heads)
    assert "median by kind of layer:" in text
    assert "the norm ended after the first claimers ranked in 0 of 1 layers" in text
    assert "ended after its last down claim in 1 of 1 layers" in text
    row = next(ln.split() for ln in text.splitlines() if ln.split()[:2] == ["5", "sliding"])
    assert row[2:] == ["1.00", "2.00", "3.50", "6.00", "6.00", "9.50", "10.00", "11.00", "2.75", "16.00", "3.00",
                       "NORM"]
    assert "the last QKV tile ran after ADD_RMSNORM on its SM in 1 of 1 layers" in text
    with pytest.raises(MegacError, match="no two consecutive layers of the trace ran expert claims"):
        step_heads([r for r in HEAD_RECORDS if r["layer"] != 4 and r["layer"] != 5])
    with pytest.raises(MegacError, match="no task records"):
        step_heads([])


def test_trace_heads_command(tmp_path):
    from megac.cli import main

    path = tmp_path / "step.trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps(chrome_trace(HEAD_RECORDS, {"model": "nmc-x", "batch": 1})).encode()))
    r = CliRunner().invoke(main, ["trace", str(path), "--heads"])
    assert r.exit_code == 0, r.output
    assert "router staged" in r.output and "median by kind of layer:" in r.output
    r = CliRunner().invoke(main, ["trace", str(path), "--heads", "--tails"])
    assert r.exit_code != 0 and "--heads reads every layer" in r.output

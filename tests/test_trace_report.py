"""`megac trace`: a profiled step's bandwidth through a layer, by opcode.

The step here is synthetic, with times chosen so the answer is known by
hand: every task of layer L (but its norm) streams during [0.5, 1.5) µs
after layer L-1's norm ended, so the whole layer's bytes land in the first
2 µs bin at (bytes / 2 µs); the norm streams in the layer's last µs.
"""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
from click.testing import CliRunner

from megac.abi import H, Op
from megac.costmodel import CostParams, task_bytes
from megac.errors import MegacError
from megac.gpu.profile import chrome_trace
from megac.ops import REGISTRY
from megac.passes.pipeline import compile_one
from megac.spec import load_spec
from megac.trace_report import format_profile, profile, stream_span

CONTEXT = 64
LAYER_US = 100.0


@pytest.fixture(scope="module")
def step():
    spec = load_spec("tiny-moe")
    sched = compile_one(spec, rows=1, context=CONTEXT)
    return spec, sched


def _records(sched):
    """One record per task: layer L's tasks run [T(L-1) + 0.5, T(L-1) + 1.5),
    its norms [T(L) - 1, T(L)), T(L) = 100 (L + 1); claimers claim once."""
    counts = np.asarray(sched.task_counts)
    recs = []
    for s in range(sched.num_sms):
        for k in range(int(counts[s])):
            w = sched.tasks[s, k]
            op, layer = Op(int(w[H.OPCODE])), int(w[H.LAYER])
            t0 = LAYER_US * layer  # the previous layer's norm end
            if op == Op.ADD_RMSNORM:
                a, b = t0 + LAYER_US - 1.0, t0 + LAYER_US
            else:
                a, b = t0 + 0.5, t0 + 1.5
            recs.append({"sm": s, "task": k, "op": op.name, "layer": layer, "start_us": a - 0.25, "waited_us": a,
                         "end_us": b, "claims": 1 if REGISTRY[op].claimer else 0, "claim_wait_us": 0.0,
                         "marks_us": [None] * 12})
    return recs


def _bytes_by_layer(sched):
    """Per layer: (bytes of its tasks but the norms, bytes of its norms),
    from the task words and one claim per claimer."""
    geo = sched.geometry
    params = CostParams(context=CONTEXT)
    words = np.concatenate([sched.tasks[s, :int(sched.task_counts[s])] for s in range(sched.num_sms)])
    b = task_bytes(words, geo, params)
    out: dict[int, list[float]] = {}
    for w, x in zip(words, b):
        op = Op(int(w[H.OPCODE]))
        if REGISTRY[op].claimer:
            x = REGISTRY[op].claimed_work(geo, params)[1]
        out.setdefault(int(w[H.LAYER]), [0.0, 0.0])[op == Op.ADD_RMSNORM] += x
    return out


def test_a_layers_bytes_land_where_its_tasks_streamed(step):
    spec, sched = step
    recs = _records(sched)
    p = profile(recs, sched, CONTEXT, bin_us=2.0, lead_us=4.0, model=spec.name)
    per = _bytes_by_layer(sched)
    geo = sched.geometry
    assert {k.kind for k in p.kinds} <= {"sliding", "full"} and p.kinds
    for k in p.kinds:
        assert all(bool(geo.sliding[L]) == (k.kind == "sliding") for L in k.layers)
        assert k.layer_us == pytest.approx(LAYER_US)
        first = list(np.round(k.edges, 6)).index(0.0)  # the bin [0, 2)
        want = np.mean([per[L][0] for L in k.layers]) / 2.0 / 1e6  # B over 2 µs in TB/s
        assert k.total[first] == pytest.approx(want, rel=1e-9)
        # the norm's bytes in the layer's last bin, nothing in between
        last = int(np.searchsorted(k.edges, LAYER_US - 1.0, side="right")) - 1
        assert k.total[last] == pytest.approx(np.mean([per[L][1] for L in k.layers]) / 2.0 / 1e6, rel=1e-9)
        assert np.allclose(k.total[first + 1:last], 0.0)
        # every byte of the layer is somewhere: the bins integrate to it
        assert k.total.sum() * 2.0 * 1e6 == pytest.approx(np.mean([sum(per[L]) for L in k.layers]), rel=1e-9)
        assert k.bytes_per_layer == pytest.approx(np.mean([sum(per[L]) for L in k.layers]), rel=1e-9)
    text = format_profile(p)
    assert "tiny-moe batch 1" in text and "layers (" in text


def test_a_stamped_span_replaces_the_run():
    marks = [None] * 12
    marks[3], marks[4] = 10.0, 14.0  # first stage landed, stages consumed
    rec = {"op": "QKV_PROJ", "claims": 0, "waited_us": 8.0, "end_us": 16.0, "marks_us": marks}
    from megac.trace_report import _span_marks

    sm = _span_marks()
    assert stream_span(rec, sm) == (10.0, 14.0)
    # a claimer of several claims: its stamps are its first claim's, so its run
    assert stream_span({**rec, "op": "MOE_UPGATE_DRAIN", "claims": 2}, sm) == (8.0, 16.0)
    assert stream_span({**rec, "marks_us": [None] * 12}, sm) == (8.0, 16.0)


def test_a_trace_of_another_schedule_is_refused(step):
    _, sched = step
    recs = _records(sched)
    recs.append({**recs[0], "task": 10_000})
    with pytest.raises(MegacError, match="past its .* in the schedule"):
        profile(recs, sched, CONTEXT)
    with pytest.raises(MegacError, match="bin must be positive"):
        profile(recs[:-1], sched, CONTEXT, bin_us=0.0)


def test_trace_command_prints_plots_and_writes_json(step, tmp_path):
    from megac.cli import main

    spec, sched = step
    meta = {"model": spec.name, "batch": 1, "context": CONTEXT, "order": "tuned", "tiles": None}
    meta.pop("tiles")
    path = tmp_path / "step.trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps(chrome_trace(_records(sched), meta)).encode()))
    png, out = tmp_path / "bw.png", tmp_path / "bw.json"
    r = CliRunner().invoke(main, ["trace", str(path), "--plot", str(png), "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "layers (" in r.output and "TB/s" in r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(out.read_text())
    assert data["model"] == spec.name and data["kinds"] and all(k["tbs"] for k in data["kinds"])
    # bad input: one line naming what is wrong
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    r = CliRunner().invoke(main, ["trace", str(bad)])
    assert r.exit_code != 0 and "trace:" in r.output and "not a JSON trace" in r.output
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(chrome_trace(_records(sched))))
    r = CliRunner().invoke(main, ["trace", str(bare)])
    assert r.exit_code != 0 and "pass --model, --batch-size, --context" in r.output
    r = CliRunner().invoke(main, ["trace", str(path), "--plot", str(tmp_path / "bw.gif")])
    assert r.exit_code != 0 and "--plot" in r.output


def test_a_trace_is_checked_against_the_bucket_it_names(step, tmp_path):
    """A trace that names its context bucket (as megac bench --profile
    writes it) is still checked against that schedule: tuned's records
    under another order's name are refused in one line naming --order;
    with the waves the trace recorded (``order_doc``), those rebuild it."""
    from megac import geometry
    from megac.cli import main
    from megac.passes.order import order_doc

    spec, sched = step
    meta = {"model": spec.name, "batch": 1, "context": CONTEXT, "order": "attention-first",
            "schedule_context": CONTEXT, "tiles": geometry.tiles_of(spec)}
    path = tmp_path / "step.trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps(chrome_trace(_records(sched), meta)).encode()))
    r = CliRunner().invoke(main, ["trace", str(path)])
    assert r.exit_code != 0 and "another schedule" in r.output and "--order" in r.output, r.output
    path.write_bytes(gzip.compress(json.dumps(chrome_trace(_records(sched), {**meta, "order_doc": order_doc("tuned")})).encode()))
    r = CliRunner().invoke(main, ["trace", str(path)])
    assert r.exit_code == 0 and "the order attention-first has changed since the trace" in r.output, r.output
    assert "layers (" in r.output


def test_trace_marks_lists_each_opcodes_stamps_in_time_order(step, tmp_path):
    """``megac trace --marks``: per opcode that stamps points inside its
    tasks, each point's median µs after the task's wait and the step from the
    point before, in time order; the same medians in --json; a trace
    without stamps says so in one line."""
    from megac.cli import main

    spec, sched = step
    recs = _records(sched)
    norms = [r for r in recs if r["op"] == "ADD_RMSNORM"]
    for i, r in enumerate(norms):  # the 1/rms at +0.8 us, the loads at +0.5 (+0.1 us on every other task)
        r["marks_us"] = [r["waited_us"] + 0.5 + 0.1 * (i % 2), r["waited_us"] + 0.8] + [None] * 10
    meta = {"model": spec.name, "batch": 1, "context": CONTEXT, "order": "tuned"}
    path = tmp_path / "marks.trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps(chrome_trace(recs, meta)).encode()))
    out = tmp_path / "marks.json"
    r = CliRunner().invoke(main, ["trace", str(path), "--marks", "--json", str(out)])
    assert r.exit_code == 0, r.output
    text = r.output[r.output.index("inside the tasks"):]
    assert f"ADD_RMSNORM ({len(norms)} tasks" in text
    lines = [ln.split() for ln in text.splitlines() if "loads and adds" in ln or "1/rms known" in ln]
    median_loads = float(np.median([0.5 + 0.1 * (i % 2) for i in range(len(norms))]))
    assert [float(ln[0]) for ln in lines] == pytest.approx([median_loads, 0.8], abs=0.006)
    assert float(lines[1][1]) == pytest.approx(0.8 - median_loads, abs=0.011)
    assert "loads and adds" in " ".join(lines[0]) and "1/rms known" in " ".join(lines[1])
    marks = json.loads(out.read_text())["marks"]
    assert marks["ADD_RMSNORM"]["marks_us"]["1/rms known"] == pytest.approx(0.8)
    assert set(marks) == {"ADD_RMSNORM"}
    plain = tmp_path / "plain.trace.json.gz"
    plain.write_bytes(gzip.compress(json.dumps(chrome_trace(_records(sched), meta)).encode()))
    r = CliRunner().invoke(main, ["trace", str(plain), "--marks"])
    assert r.exit_code == 0 and "no marks in this trace" in r.output, r.output

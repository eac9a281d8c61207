"""The per-task timeline reader (megac/gpu/profile.py) on a hand-made
buffer laid out as the MEGAC_PROFILE kernel writes it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from megac.abi import H, Op
from megac.gpu import profile


def _sched(counts, max_tasks):
    tasks = np.zeros((len(counts), max_tasks, 32), dtype=np.int32)
    tasks[:, :, H.LAYER] = np.arange(max_tasks)[None, :] % 3
    return SimpleNamespace(num_sms=len(counts), max_tasks=max_tasks, task_counts=np.asarray(counts), tasks=tasks)


def test_read_summary_and_trace():
    sched = _sched([2, 1], 3)
    # the buffer is sized for a larger schedule; the kernel indexes by the launched one's max_tasks
    W = profile.WORDS  # start, waits done, end, opcode word, then the marks
    buf = torch.zeros((2, 5, W), dtype=torch.int64)
    flat = buf.view(-1)
    t0 = 1_000_000

    def put(sm, k, start, waited, end, op, claims=0, cwait=0, marks=()):
        i = (sm * sched.max_tasks + k) * W
        word = int(op) | (claims << 8) | (cwait << 32)
        stamps = [t0 + m if m is not None else 0 for m in marks] + [0] * (profile.MARKS - len(marks))
        flat[i: i + W] = torch.tensor([t0 + start, t0 + waited, t0 + end, word, *stamps])

    put(0, 0, 0, 1000, 5000, Op.QKV_PROJ)
    put(0, 1, 5000, 9000, 10000, Op.O_PROJ)
    put(1, 0, 200, 200, 30000, Op.MOE_UPGATE_DRAIN, claims=3, cwait=12000,
        marks=(1200, None, 2000, None, None, None, 9200, None, 1500))
    recs = profile.read(buf, sched)
    assert [(r["sm"], r["task"], r["op"]) for r in recs] == [(0, 0, "QKV_PROJ"), (0, 1, "O_PROJ"),
                                                            (1, 0, "MOE_UPGATE_DRAIN")]
    assert recs[1]["layer"] == 1 and recs[1]["start_us"] == 5.0 and recs[1]["waited_us"] == 9.0
    assert recs[2]["claims"] == 3 and recs[2]["claim_wait_us"] == 12.0
    assert recs[2]["marks_us"] == [1.2, None, 2.0, None, None, None, 9.2, None, 1.5] + [None] * (profile.MARKS - 9)
    assert recs[0]["marks_us"] == [None] * profile.MARKS
    # marks from the wait's end (0.2 µs), named per opcode; tasks without marks left out
    m = profile.marks_summary(recs)
    assert list(m) == ["MOE_UPGATE_DRAIN"]
    assert m["MOE_UPGATE_DRAIN"]["marks_us"] == {"head atomic and record / routed: partials summed": 1.0,
                                                  "activations staged": 1.8,
                                                  "tile done": 9.0,
                                                  "claim handed to the CTA": 1.3}
    assert m["MOE_UPGATE_DRAIN"]["run_us"] == 29.8
    s = profile.summary(recs)
    assert s["span_us"] == 30.0 and s["sms"] == 2
    assert s["per_op"]["O_PROJ"] == {"tasks": 1, "wait_us": 4.0, "run_us": 1.0, "claim_wait_us": 0.0, "claims": 0}
    # work: 4 + 1 + (29.8 - 12) µs over 2 SMs x 30 µs
    assert abs(s["work_fraction"] - (4 + 1 + 17.8) / 60) < 1e-4
    tr = profile.chrome_trace(recs)["traceEvents"]
    waits = [e for e in tr if e.get("name") == "wait"]
    assert [(e["tid"], e["dur"]) for e in waits] == [(0, 1.0), (0, 4.0)]  # the claimer had no header wait
    assert {e["args"]["name"] for e in tr if e["ph"] == "M"} == {"SM 0", "SM 1"}
    # the marks survive the trace file (and old traces without them read as unmarked)
    back = profile.records_from_trace(profile.chrome_trace(recs))
    assert [r["marks_us"] for r in back] == [r["marks_us"] for r in recs]
    for e in tr:
        e.get("args", {}).pop("marks_us", None)
    assert all(r["marks_us"] == [None] * profile.MARKS for r in profile.records_from_trace({"traceEvents": tr}))


def test_unreached_tasks_are_left_out():
    sched = _sched([2], 2)
    buf = torch.zeros((1, 2, profile.WORDS), dtype=torch.int64)
    buf[0, 0, :4] = torch.tensor([10, 20, 30, int(Op.LM_HEAD)])
    assert [r["op"] for r in profile.read(buf, sched)] == ["LM_HEAD"]


def test_plot_measured_draws_waits_apart_from_work(tmp_path):
    """The PNG exists and has pixels of the wait colour and of each opcode's
    colour (read back from the image, not from the plotting code)."""
    import matplotlib.image as mpimg

    from megac.plot import OP_COLORS, WAIT_COLOR, plot_measured

    recs = [{"sm": s, "task": 0, "op": "QKV_PROJ", "layer": 0, "start_us": 0.0, "waited_us": 40.0,
             "end_us": 100.0, "claims": 0, "claim_wait_us": 0.0} for s in range(4)]
    recs += [{"sm": s, "task": 1, "op": "LM_HEAD", "layer": 0, "start_us": 100.0, "waited_us": 100.0,
              "end_us": 200.0, "claims": 0, "claim_wait_us": 0.0} for s in range(4)]
    out = plot_measured(recs, tmp_path / "t.png", title="test")
    img = (mpimg.imread(out)[..., :3] * 255).round().astype(int).reshape(-1, 3)
    colors = {tuple(c) for c in img.tolist()}

    def rgb(hexcode):
        return tuple(int(hexcode[i:i + 2], 16) for i in (1, 3, 5))

    for name in (WAIT_COLOR, OP_COLORS[Op.QKV_PROJ], OP_COLORS[Op.LM_HEAD]):
        assert rgb(name) in colors, name


def test_layer_table_times_each_opcode_from_its_layers_start():
    """Two layers of one kind: each starts when the previous layer's norm
    ended; per opcode the medians of its last wait end, last end and slowest
    run from that start, rows in the order the chain finished."""
    from megac.spec import load_spec

    spec = load_spec("tiny-llama")

    def rec(layer, op, start, waited, end, sm=0):
        return {"sm": sm, "task": 0, "op": op, "layer": layer, "start_us": start, "waited_us": waited,
                "end_us": end, "claims": 0, "claim_wait_us": 0.0}

    recs = []
    for layer, t0 in ((0, 0.0), (1, 100.0)):
        recs += [rec(layer, "QKV_PROJ", t0, t0 + 1, t0 + 10, sm=0), rec(layer, "QKV_PROJ", t0, t0 + 2, t0 + 12, sm=1),
                 rec(layer, "O_PROJ", t0 + 12, t0 + 30, t0 + 40), rec(layer, "ADD_RMSNORM", t0 + 40, t0 + 90, t0 + 100)]
    recs.append(rec(len(spec.layers), "LM_HEAD", 200, 200, 250))  # past the layers: not in the table
    rows = profile.layer_table(recs, spec)
    kind = f"{spec.layers[0].attention}/{spec.layers[0].ffn}"
    assert [(r["layers"], r["op"]) for r in rows] == [(kind, "QKV_PROJ"), (kind, "O_PROJ"), (kind, "ADD_RMSNORM")]
    qkv, oproj, norm = rows
    assert qkv["tasks"] == 2 and qkv["ready_us"] == 2.0 and qkv["done_us"] == 12.0 and qkv["run_us"] == 10.0
    assert oproj["ready_us"] == 30.0 and norm["done_us"] == 100.0 and norm["run_us"] == 10.0
    assert all(r["n"] == 2 for r in rows)
    text = profile.format_layer_table(rows)
    assert text.splitlines()[0].startswith(f"{kind} layers (2)") and "ADD_RMSNORM" in text


def test_trace_meta_names_the_step_and_its_tiles():
    """What megac bench --profile and the GPU check write into a trace's
    ``otherData``: the step, the context bucket that ran and the spec's own
    tile settings (a target's override included), so megac trace /
    calibrate rebuild that schedule after a default changes."""
    from pathlib import Path

    from megac import geometry
    from megac.spec import load_spec
    from models import variant

    spec = load_spec("tiny-moe")
    mine = variant(spec, "tiny-moe-r2", tiles={"router_splits": 2})
    got = {"records": [], "kernel_ms": 1.5, "profiled_ms": 1.6, "schedule_context": 2048}
    meta = profile.trace_meta(got, model="tiny-moe", spec=mine, batch=2, context=1100,
                              order=Path("schedules/experiments/full-up-first.yaml"), device="H200")
    assert meta["tiles"] == geometry.tiles_of(mine) and meta["tiles"]["router_splits"] == 2
    assert geometry.DEFAULT_TILES["router_splits"] != 2
    assert meta["order"] == "schedules/experiments/full-up-first.yaml"
    # the order's waves as the file held them (a later retune of the file still rebuilds what ran)
    import yaml
    assert meta["order_doc"] == yaml.safe_load(Path("schedules/experiments/full-up-first.yaml").read_text())
    assert meta["order_doc"]["layers"]["moe_full"][5] == "moe_upgate"
    assert (meta["batch"], meta["context"], meta["schedule_context"]) == (2, 1100, 2048)
    assert (meta["kernel_ms"], meta["profiled_ms"], meta["device"]) == (1.5, 1.6, "H200")
    assert profile.chrome_trace([], meta)["otherData"] == meta


def test_marks_match_the_device_header():
    """The host reads as many stamps a record as the kernel writes
    (opcodes/profile_marks.cuh kProfileMarks), and names none past them."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "opcodes" / "profile_marks.cuh").read_text()
    assert profile.MARKS == int(re.search(r"constexpr int kProfileMarks = (\d+);", text).group(1))
    assert all(len(names) <= profile.MARKS for names in profile.MARK_NAMES.values())

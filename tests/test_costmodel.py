"""Cost model and timeline plot."""

from __future__ import annotations

import numpy as np
import pytest

from megac import costmodel as cm
from megac.abi import H, Op
from megac.errors import MegacError
from megac.plot import plot_timeline
from megac.spec import load_spec
from passes.test_verify import build_handmade, clone, find, insert, remove


def _compiled(model: str, rows: int):
    from megac.passes import pipeline as pl  # megac's own module: a broken import fails
    return pl.compile_one(load_spec(model), rows=rows, verify=False)


@pytest.fixture(scope="module")
def hand():
    return build_handmade(rows=2, num_sms=4)


@pytest.fixture(scope="module")
def moe():
    return _compiled("tiny-moe", 2)


@pytest.fixture(scope="module")
def nmc1():
    return _compiled("north-mini-code", 1)


def test_step_is_at_least_the_bandwidth_bound(hand, moe, nmc1):
    for s in (hand, moe, nmc1):
        r = cm.simulate(s)
        assert r.total_bytes > 0
        assert r.step_us >= r.lower_bound_us > 0
        assert 0 < r.bw_fraction <= 1
        assert r.tokens_per_s == pytest.approx(s.rows / (r.step_us * 1e-6))
    # with no fixed cost and no dependency latency, a one-SM schedule streams
    # at exactly the ceiling: its timeline is the bandwidth bound
    one = build_handmade(rows=1, num_sms=1)
    r = cm.simulate(one, fixed_us=0.0, dependency_latency_us=0.0)
    assert r.step_us == pytest.approx(r.lower_bound_us)


def test_fixed_cost_and_latency_move_the_step(moe):
    base = cm.simulate(moe)
    cheaper = cm.simulate(moe, fixed_us=0.25)
    slower = cm.simulate(moe, dependency_latency_us=3.0)
    assert cheaper.step_us < base.step_us
    assert slower.step_us > base.step_us
    assert cheaper.total_bytes == base.total_bytes  # bytes do not depend on timing


def test_north_mini_code_batch1_moves_the_design_estimate(nmc1):
    """DESIGN: ~6.6 GB of active weights + ~0.5 GB of KV at 8K context;
    speed of light ~1.57 ms at 4.55 TB/s."""
    r = cm.simulate(nmc1)
    assert 6.6e9 < r.total_bytes < 7.6e9
    assert 1450 < r.lower_bound_us < 1700
    assert r.meta["active_experts"] == 8 and r.meta["context"] == 8192
    by_op = {Op(int(o)).name: r.nbytes[r.opcode == o].sum() for o in np.unique(r.opcode)}
    # the LM head (tied 262144 x 2048 bf16) is ~1.07 GB of it
    assert by_op["LM_HEAD"] == pytest.approx(262144 * 2048 * 2, rel=0.02)


def test_more_context_more_attention_bytes(nmc1):
    short = cm.simulate(nmc1, context=1024)
    long = cm.simulate(nmc1, context=65536)
    a_short = short.nbytes[np.isin(short.opcode, [Op.ATTN_DECODE, Op.ATTN_DRAIN])].sum()
    a_long = long.nbytes[np.isin(long.opcode, [Op.ATTN_DECODE, Op.ATTN_DRAIN])].sum()
    assert a_long > 4 * a_short


def test_claimed_work_spreads_over_claimers(moe):
    """Each MoE layer's claimed up tiles = active experts x up_tiles, run by
    more than one SM; claimers that find the queue empty run nothing."""
    r = cm.simulate(moe, active_experts=3)
    geo = moe.geometry
    m = r.claimed & (r.opcode == Op.MOE_UPGATE_DRAIN) & (r.layer == 1)
    assert m.sum() == 3 * geo.up_tiles
    m = r.claimed & (r.opcode == Op.MOE_DOWN_DRAIN) & (r.layer == 1)
    assert m.sum() == 3 * geo.down_tiles
    assert len(np.unique(r.sm[m])) > 1


def test_timeline_respects_queues_and_dependencies(hand):
    """Per SM the pieces do not overlap; a task starts no earlier than the
    last signal of each counter it waits on plus the dependency latency."""
    lat = 0.7
    r = cm.simulate(hand, dependency_latency_us=lat)
    for s in np.unique(r.sm):
        o = np.argsort(r.start[r.sm == s], kind="stable")
        st, en = r.start[r.sm == s][o], r.end[r.sm == s][o]
        assert (st[1:] >= en[:-1] - 1e-9).all()
    tasks = hand.tasks[np.arange(hand.tasks.shape[1])[None, :] < hand.task_counts[:, None]]
    static = ~r.claimed
    t_idx = r.task[static]
    sig = tasks[t_idx, H.SIGNAL]
    last = {}
    for c, e in zip(sig.tolist(), r.end[static].tolist()):
        if c >= 0:
            last[c] = max(last.get(c, 0.0), e)
    checked = 0
    for k, st in zip(t_idx.tolist(), r.start[static].tolist()):
        for col in (H.WAIT0, H.WAIT1):
            c = int(tasks[k, col])
            if c in last:  # a counter signalled by static tasks
                assert st >= last[c] + lat - 1e-9
                checked += 1
    assert checked > 10


def test_deadlocked_schedule_is_refused(hand):
    s = clone(hand)
    sm, k = find(s, Op.O_PROJ, 0)[0]
    w = remove(s, *find(s, Op.ADD_RMSNORM, 0)[0])
    sm, k = find(s, Op.O_PROJ, 0)[0]
    insert(s, sm, k, w)
    with pytest.raises(MegacError, match="does not complete"):
        cm.simulate(s)


def test_unknown_parameter(hand):
    with pytest.raises(TypeError):
        cm.simulate(hand, fixed_ms=1)


def test_plot_png_and_svg(tmp_path, moe):
    r = cm.simulate(moe)
    png = plot_timeline(r, tmp_path / "t.png")
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = plot_timeline(r, tmp_path / "sub" / "t.svg", max_sms=16, time_range=(0, r.step_us / 2))
    text = svg.read_text()
    assert "<svg" in text and "predicted step" in text
    with pytest.raises(MegacError, match="png or .svg"):
        plot_timeline(r, tmp_path / "t.pdf")


def test_an_experts_down_tiles_wait_on_that_experts_up_tiles_alone():
    """On the device a down claim waits on its own expert's up tiles (one
    counter per expert). North Mini Code at batch 8 activates ~50 experts a
    layer: 300 up tiles over 132 SMs run in rounds, so the first experts'
    down tiles start while later experts' up tiles still run. The model had
    held every down tile until the layer's last up tile ended (the batch-4
    trace: predicted down tiles from 78.7 µs into a layer, measured from
    48.5)."""
    from megac.passes.pipeline import compile_one

    sched = compile_one(load_spec("north-mini-code"), order="tuned", rows=8, context=8192)
    sim = cm.simulate(sched)
    overlapped = 0
    for layer in range(1, 49):
        up = sim.claimed & (sim.opcode == int(Op.MOE_UPGATE_DRAIN)) & (sim.layer == layer)
        down = sim.claimed & (sim.opcode == int(Op.MOE_DOWN_DRAIN)) & (sim.layer == layer)
        assert up.sum() > sched.num_sms  # more up tiles than SMs: rounds
        assert sim.start[down].min() >= sim.end[up].min()  # no down tile before any expert's up tiles
        overlapped += sim.start[down].min() < sim.end[up].max()
    assert overlapped == 48


def test_shared_bandwidth_hands_out_the_rest_first_come_first_served():
    """Against hand arithmetic: a GPU of 1000 B/µs, two streams of 1000 B
    from t = 0, each at most 600 B/µs. The first takes 600 a µs and is
    through at 1000 / 600 = 1.667 µs; the second gets the 400 left until
    then (667 B), then 600 a µs for its last 333 B: through at 2.22 µs
    (the ledger's 0.1 µs bins round it to 2.2)."""
    bw = cm.SharedBandwidth(1e9)
    a = bw.stream(0.0, 1000.0, 1 / 600)
    b = bw.stream(0.0, 1000.0, 1 / 600)
    assert a == pytest.approx(1000 / 600, abs=0.05)
    assert b == pytest.approx(1.0 / 0.6 + (1000 - 400 / 0.6) / 600, abs=0.05)
    # a stream alone, below the shared limit, at its own rate; one that
    # starts later (3.05 µs, mid-bin) too, from where it starts
    c = bw.stream(3.05, 300.0, 1 / 200)
    assert c == pytest.approx(3.05 + 1.5, abs=1e-9)
    # nothing left: the next stream waits until the first bin with room
    full = cm.SharedBandwidth(1e9)
    full.stream(10.0, 2000.0, 1 / 1000)  # 10 .. 12 µs at the whole limit
    assert full.stream(10.0, 100.0, 1 / 1000) == pytest.approx(12.1, abs=1e-9)
    with pytest.raises(MegacError, match="positive"):
        cm.SharedBandwidth(0.0)


def _drain(bw):
    """Fire a FairBandwidth's events until none is left: {SM: end µs}."""
    ends = {}
    while bw.next_event() < float("inf"):
        done = bw.fire()
        if done is not None:
            ends[done[0]] = done[1]
    return ends


def test_fair_bandwidth_shares_the_limit_among_the_streams_running():
    """Against hand arithmetic, a GPU of 1000 B/µs. Two streams of 1000 B
    from t = 0, each at most 600 B/µs: 500 each, both through at 2 µs
    (first come, first served gave 1.67 and 2.22). One capped at 200 B/µs
    beside one at 1000: 200 and 800. A stream speeds up when another ends
    and slows when one starts."""
    bw = cm.FairBandwidth(1e9, num_sms=4)
    bw.start(0.0, 0, 1000.0, 1 / 600)
    bw.start(0.0, 1, 1000.0, 1 / 600)
    assert _drain(bw) == {0: pytest.approx(2.0), 1: pytest.approx(2.0)}

    bw = cm.FairBandwidth(1e9, num_sms=4)
    bw.start(0.0, 2, 400.0, 1 / 200)  # 200 B/µs: through at 2 µs
    bw.start(0.0, 3, 2000.0, 1 / 1000)  # 800 B/µs until 2 µs (1600 B), then 1000: 2.4 µs
    assert _drain(bw) == {2: pytest.approx(2.0), 3: pytest.approx(2.4)}

    # A alone from 0 (1000 B/µs), B from 1 µs: 500 each; B's 500 B are
    # through at 2 µs, A's last 500 B then at 1000 B/µs: 2.5 µs
    bw = cm.FairBandwidth(1e9, num_sms=2)
    bw.start(0.0, 0, 2000.0, 1 / 1000)
    bw.start(1.0, 1, 500.0, 1 / 1000)
    assert _drain(bw) == {1: pytest.approx(2.0), 0: pytest.approx(2.5)}
    with pytest.raises(MegacError, match="positive"):
        cm.FairBandwidth(0.0, num_sms=1)
    bw.start(5.0, 0, 10.0, 1 / 1000)
    with pytest.raises(MegacError, match="SM 0 starts a stream while"):
        bw.start(5.0, 0, 10.0, 1 / 1000)


def test_fair_sharing_does_not_depend_on_which_sm_the_walk_reaches_first(moe):
    """The same work on every SM at once: first come, first served settles
    the SM the walk reaches first at full speed and starves the last;
    shared fairly, the first tasks of the SMs all end together. Both keep
    the step at or above its bytes at the limit, and the fair step is not
    faster than a bound by bytes."""
    free = cm.simulate(moe)
    bps = 0.25 * free.total_bytes / (free.step_us * 1e-6)
    first = {}
    for sharing in ("fcfs", "fair"):
        r = cm.simulate(moe, shared_bandwidth=bps, bandwidth_sharing=sharing, fixed_us=0.0)
        assert r.step_us * 1e-6 >= r.total_bytes / bps * (1 - 1e-6)
        # each SM's first piece of work that moves bytes and starts at 0
        sel = [i for i in np.argsort(r.start, kind="stable")
               if r.start[i] == 0.0 and r.nbytes[i] > 0 and r.opcode[i] == r.opcode[np.argmin(r.start)]]
        ends = r.end[sel]
        first[sharing] = (len(sel), float(ends.max() - ends.min()) / float(ends.max()))
    assert first["fcfs"][0] == first["fair"][0] >= 2
    assert first["fair"][1] < 1e-6 < first["fcfs"][1]
    with pytest.raises(MegacError, match="fcfs or fair"):
        cm.simulate(moe, shared_bandwidth=bps, bandwidth_sharing="round-robin")


def test_shared_bandwidth_bounds_the_step(moe, nmc1):
    """A limit far above every stream's sum changes nothing; one the streams
    exceed makes the step slower, never faster than its bytes at that limit."""
    for s in (moe, nmc1):
        free = cm.simulate(s)
        loose = cm.simulate(s, shared_bandwidth=1e18)
        assert loose.step_us == pytest.approx(free.step_us, rel=1e-6)
        tight_bps = 0.5 * free.total_bytes / (free.step_us * 1e-6)  # half the step's average rate
        tight = cm.simulate(s, shared_bandwidth=tight_bps)
        assert tight.step_us > free.step_us
        assert tight.step_us * 1e-6 >= tight.total_bytes / tight_bps * (1 - 1e-6)


def test_shared_bandwidth_travels_with_a_calibration(tmp_path):
    from dataclasses import replace

    from megac.calibration import Calibration, resolve

    cal = Calibration.load(resolve("h200-north-mini-code"))
    # the bundled one: fitted under the H200's ceiling, its rates refit as uncontended
    assert cal.params().shared_bandwidth == 4.23e12 and cal.rate_scale > 1
    path = replace(cal, shared_bandwidth_bps=None).save(tmp_path / "c.json")
    assert Calibration.load(path).params().shared_bandwidth is None
    # how the streams share it travels too (fcfs where a file predates the key)
    assert cal.params().bandwidth_sharing == "fcfs"
    fair = Calibration.load(replace(cal, bandwidth_sharing="fair").save(tmp_path / "fair.json"))
    assert fair.params().bandwidth_sharing == "fair"
    import json

    data = json.loads(path.read_text())
    data["bandwidth_sharing"] = "round-robin"
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(MegacError, match="bandwidth_sharing 'round-robin' is not fcfs or fair"):
        Calibration.load(tmp_path / "bad.json")

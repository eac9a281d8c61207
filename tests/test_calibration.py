"""The cost model calibrated from a measured step: the recorded H200
timelines of North Mini Code and SmolLM2 (benchmarks/, measured data, not
produced by the code under test) against the calibrated prediction."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from megac.abi import Op
from megac.calibration import Calibration, fit, resolve
from megac.costmodel import simulate
from megac.errors import MegacError
from megac.gpu.profile import chrome_trace, records_from_trace
from megac.passes.order import order_doc
from megac.passes.pipeline import compile_one
from megac.resources import schedules_dir
from megac.spec import load_spec
from megac import geometry

ROOT = Path(__file__).resolve().parents[1]
NMC_TRACE = ROOT / "benchmarks" / "profile-nmc-bs1-8k-2026-12-01.trace.json.gz"
#: the third session's device code (attention in key tiles): another measured step
NMC_TRACE_3 = ROOT / "benchmarks" / "profile-nmc-bs1-8k-2026-12-01-session3.trace.json.gz"
#: the fifth session's device code (tensor-core GEMMs and attention)
NMC_TRACE_5 = ROOT / "benchmarks" / "profile-nmc-bs1-8k-session5.trace.json.gz"
#: the eighth session's device code: the bundled calibrations'
NMC_TRACE_8 = ROOT / "benchmarks" / "profile-nmc-bs1-8k-2026-12-02-h200-session8.trace.json.gz"
SMOL_TRACE_8 = ROOT / "benchmarks" / "profile-smollm2-bs1-1k-2026-12-02-h200-session8.trace.json.gz"
SMOL_TRACE = ROOT / "benchmarks" / "profile-smollm2-bs1-1k-2026-12-01.trace.json.gz"
NMC, SMOL = ("north-mini-code", 8192), ("smollm2-135m", 1024)
GLOBAL_CURSOR = str(schedules_dir() / "experiments" / "tuned-global-cursor.yaml")
#: the tuned order until the sixteenth session: every trace and measured step here ran it
TUNED15 = str(schedules_dir() / "experiments" / "tuned-session15.yaml")
#: tuned as every trace here ran it: until the thirty-sixth session a full MoE layer's claimed
#: attention went before its up claimers at batch 1 too (no moe_routed_full waves)
TUNED35 = str(schedules_dir() / "experiments" / "tuned-session35.yaml")
#: per trace: the (model, context) of its schedule (batch 1, order tuned with
#: the SM cursor of its day: every trace here predates the per-layer cursor)
MODEL = {NMC_TRACE: NMC, NMC_TRACE_3: NMC, NMC_TRACE_5: NMC, NMC_TRACE_8: NMC, SMOL_TRACE_8: SMOL}
#: the sixteenth session's step of today's default order (attention and the O-projection on
#: half the SMs): the bundled North Mini Code calibration's since the seventeenth session;
#: and that order's batch-1 8K kernel time measured on the same machine without the stamps


#: every North Mini Code trace and step here ran O-projection tiles of 64
#: features (128 since the twenty-first session: the geometry's default)
O_PROJ_64 = {"o_proj_bn": 64}


def traced(model: str):
    """``model`` as the recorded traces and steps ran it (64-feature
    O-projection tiles, the plain batch-1 schedule: geometry.PLAIN_TILES; a
    measurement fits only the schedule it ran)."""
    from models import variant

    spec = load_spec(model)
    return variant(spec, spec.name, tiles={
        **(spec.target.tiles or {}), **O_PROJ_64, **geometry.PLAIN_TILES})


#: the expert tiles every trace and step up to the twelfth session ran
#: (128 features a claim; 256 since the thirteenth)
TILES_128 = {"moe_up_bn": 128, "moe_down_bn": 128}


#: every trace and step recorded up to the eighteenth session ran its norms as
#: tasks (the norm folded into its QKV and router readers at batch 1 since the
#: nineteenth: target tile norm_fold)
UNFOLDED = {"norm_fold": 0}


def unfolded(model: str):
    """``model`` as bundled but with its norms as tasks: the schedule every
    recorded step here ran (a measurement fits only the schedule it ran)."""
    from models import variant

    spec = load_spec(model)
    return variant(spec, spec.name, tiles={
        **(spec.target.tiles or {}), **O_PROJ_64, **UNFOLDED, **geometry.PLAIN_TILES})


def whole_heads(model: str, **tiles):
    """``model`` with a QKV tile per whole head (and ``tiles``): what every
    trace and step up to the thirteenth session ran (North Mini Code's QKV
    tiles hold half a head since the fourteenth); a trace fits only the
    schedule it ran."""
    from models import variant

    spec = load_spec(model)
    tiles = {**(spec.target.tiles or {}), "qkv_bn": spec.head_dim, **O_PROJ_64, **UNFOLDED, **geometry.PLAIN_TILES,
             **tiles}
    return variant(spec, spec.name, tiles=tiles)


def tiles128(model: str, **tiles):
    """``model`` with the expert tiles of the traces up to the twelfth
    session (and ``tiles``), whole-head QKV tiles."""
    if not load_spec(model).moe:
        return whole_heads(model, **tiles)
    return whole_heads(model, **TILES_128, **tiles)


def unrouted(model: str):
    """``model`` without routed claims, on 128-feature expert tiles: the MoE
    routing every trace and step measured before the twelfth session ran
    (ROUTER_TOPK, MOE_GATHER, up claims from finalize's queue)."""
    return tiles128(model, routed_claims=0)


@pytest.fixture(scope="module")
def schedule_of():
    cache = {}

    def get(model_ctx):
        if model_ctx not in cache:
            model, ctx = model_ctx
            cache[model_ctx] = compile_one(unrouted(model), order=GLOBAL_CURSOR, rows=1, context=ctx)
        return cache[model_ctx]

    return get


def _measured(trace, schedule_of):
    return records_from_trace(json.load(gzip.open(trace))), schedule_of(MODEL[trace])


@pytest.fixture(scope="module", params=[NMC_TRACE, NMC_TRACE_3, NMC_TRACE_5, NMC_TRACE_8, SMOL_TRACE_8],
                ids=["nmc-session2", "nmc-session3", "nmc-session5", "nmc-session8", "smollm2-session8"])
def measured(request, schedule_of):
    return _measured(request.param, schedule_of)


def test_calibrated_model_predicts_the_measured_step_within_10_percent(measured):
    """Per-opcode costs come from the tasks' own run times; the fixed and
    hand-off costs (and each opcode's work before its waits) from the
    trace's own gaps between tasks (:func:`megac.calibration.trace_timing`);
    the step's span is not fitted, so matching it checks the model's
    dependency structure. The
    uncalibrated model (bandwidth-bound tasks) misses by well over the
    tolerance (0.37-0.77 of the measured step over the sessions and
    models), so the match is the calibration's doing."""
    recs, sched = measured
    cal = fit(recs, sched)
    span = max(r["end_us"] for r in recs)
    assert cal.measured_step_us == span
    predicted = simulate(sched, cal.params()).step_us
    assert abs(predicted / span - 1) < 0.10, (predicted, span)
    assert simulate(sched).step_us < 0.85 * span


#: the eleventh session's device code, dealt by the per-layer SM cursor (the default)
NMC_TRACE_11 = ROOT / "benchmarks" / "profile-nmc-bs1-8k-2026-12-02-h200-session11.trace.json.gz"


def test_a_trace_of_the_per_layer_cursor_calibrates_the_default_order():
    """A step measured under today's default placement (every layer dealt
    from SM 0) fits against the default order's schedule and predicts it
    within 10 %; against the old placement its records are another
    schedule's, a one-line error (fixed costs: the task loop's, session 8)."""
    recs = records_from_trace(json.load(gzip.open(NMC_TRACE_11)))
    sched = compile_one(unrouted("north-mini-code"), order=TUNED15, rows=1, context=8192)
    cal = fit(recs, sched)
    span = max(r["end_us"] for r in recs)
    predicted = simulate(sched, cal.params()).step_us
    assert abs(predicted / span - 1) < 0.10, (predicted, span)
    old = compile_one(unrouted("north-mini-code"), order=GLOBAL_CURSOR, rows=1, context=8192)
    with pytest.raises(MegacError, match="another schedule"):
        fit(recs, old)


#: the twelfth session's device code and default schedule: batch 1 with routed claims
NMC_TRACE_12 = ROOT / "benchmarks" / "profile-nmc-bs1-8k-2026-12-02-h200-session12.trace.json.gz"


def test_a_trace_of_routed_claims_calibrates_the_default_schedule():
    """A step measured with routed claims (the batch-1 default routing: no
    ROUTER_TOPK or MOE_GATHER tasks, the up claimers wait on the router)
    fits against the default schedule and predicts it within 10 %; against
    the schedule without routed claims its records are another schedule's."""
    recs = records_from_trace(json.load(gzip.open(NMC_TRACE_12)))
    sched = compile_one(tiles128("north-mini-code"), order=TUNED15, rows=1, context=8192)
    assert sched.geometry.routed_claims and "ROUTER_TOPK" not in sched.tasks_per_opcode
    cal = fit(recs, sched)
    span = max(r["end_us"] for r in recs)
    predicted = simulate(sched, cal.params()).step_us
    assert abs(predicted / span - 1) < 0.10, (predicted, span)
    with pytest.raises(MegacError, match="another schedule"):
        fit(recs, compile_one(unrouted("north-mini-code"), order=TUNED15, rows=1, context=8192))


def test_a_claimers_own_time_is_not_charged_to_its_claims(schedule_of):
    """SmolLM2's attention queue holds 9 claims a layer and 132 claimers
    reach it: 123 find it drained (~0.9 µs each). That time is the
    claimer's (``claimer_us``, every claimer pays it), not its claims':
    charged to the claims it made each 20 µs against the 8 µs measured, and
    the predicted step 29 % long."""
    recs, sched = _measured(SMOL_TRACE_8, schedule_of)
    cal = fit(recs, sched)
    drain = [r for r in recs if r["op"] == "ATTN_DRAIN"]
    empty = [r["end_us"] - r["waited_us"] for r in drain if r["claims"] == 0]
    busy = [(r["end_us"] - r["waited_us"] - r["claim_wait_us"]) / r["claims"] for r in drain if r["claims"]]
    drained = sum(empty) / len(empty)
    assert cal.claimer_us["ATTN_DRAIN"] == pytest.approx(cal.fixed_us + drained)
    assert cal.notes["ATTN_DRAIN"]["us_per_claim"] == pytest.approx(sum(busy) / len(busy) - drained, abs=0.01)
    sim = simulate(sched, cal.params())
    own = (sim.opcode == Op.ATTN_DRAIN) & ~sim.claimed
    assert own.sum() == len(drain)  # every claimer, claims or not
    # the claimer's dispatch comes before its waits (the model's start), the rest after its claims
    assert (sim.end - sim.start)[own] == pytest.approx(cal.claimer_us["ATTN_DRAIN"] - cal.fixed_us)


#: the traces the bundled calibrations were fitted on (twentieth session: megac bench --profile,
#: which records the step's model, batch, context, schedule bucket and plain and instrumented
#: kernel times in the trace)
BUNDLED_TRACES = {"h200-north-mini-code": ROOT / "benchmarks" / "profile-north-mini-code-bs4-8192-2026-12-03-h200-session20.trace.json.gz",
                  "h200-smollm2-135m": ROOT / "benchmarks" / "profile-smollm2-135m-bs1-1024-2026-12-03-h200-session20.trace.json.gz"}


@pytest.mark.parametrize("name", sorted(BUNDLED_TRACES))
def test_bundled_calibration_loads_and_matches_its_own_measurement(name):
    """Each bundled calibration names the trace it was fitted on, scales the
    traced times by the plain build's step over the instrumented one's (both
    measured in that run) and predicts that run's plain kernel time within
    10 % on today's default schedule."""
    cal = Calibration.load(resolve(name))
    trace = BUNDLED_TRACES[name]
    assert "H200" in cal.source and trace.name in cal.source
    data = json.load(gzip.open(trace))
    meta = data["otherData"]
    assert cal.measured_step_us == max(r["end_us"] for r in records_from_trace(data))
    assert cal.instrumentation_scale == pytest.approx(meta["kernel_ms"] / meta["profiled_ms"], abs=1e-4)
    assert cal.instrumentation_scale < 1.0  # the stamps cost time
    bucket = meta.get("schedule_context") or meta["context"]  # (traces before it was recorded: at 8K and 1K alike)
    sched = compile_one(traced(meta["model"]), order="tuned", rows=meta["batch"], context=bucket)
    pred = simulate(sched, cal.params(context=meta["context"])).step_us
    assert abs(pred / (1e3 * meta["kernel_ms"]) - 1) < 0.10, (pred, meta["kernel_ms"])


def test_a_trace_of_another_schedule_is_refused(measured, schedule_of):
    recs, sched = measured
    other = schedule_of(SMOL if sched is schedule_of(NMC) else NMC)
    with pytest.raises(MegacError, match="another schedule"):
        fit(recs, other)


def test_trace_round_trip():
    recs = records_from_trace(json.load(gzip.open(SMOL_TRACE)))
    assert len(recs) > 1000
    again = records_from_trace(chrome_trace(recs))
    assert again == recs


def test_bad_calibration_inputs(tmp_path):
    with pytest.raises(MegacError, match="no bundled calibration"):
        resolve("h999-nothing")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"us_per_byte": {"NOT_AN_OP": 1.0}, "fixed_us_by_op": {}, "fixed_us": 1,
                               "dependency_latency_us": 1}))
    with pytest.raises(MegacError, match="not a megac calibration"):
        Calibration.load(bad)


def test_schedule_command_predicts_with_a_calibration():
    from click.testing import CliRunner

    from megac.cli import main

    r = CliRunner().invoke(main, ["schedule", "north-mini-code", "--calibration", "h200-north-mini-code", "--json"])
    assert r.exit_code == 0, r.output
    pred = json.loads(r.output)["predicted"]
    # against the kernel time the H200 measured for the default schedule (batch 1, 8K: the
    # attention merged in the O-projection since the twenty-fifth session; its check tiles run,
    # four engines, the median)
    runs = json.loads((ROOT / "benchmarks" / "megakernel-merge-2026-12-04-h200-session25.json").read_text())["runs"]
    got = runs["ab_merge_default_vs_plain_8k"]["tiles"]["result"]
    measured_ms = float(np.median([got[k]["bs1"] for k in ("default", "default#1", "default#2", "default_2")]))
    assert abs(pred["step_us"] / 1e3 / measured_ms - 1) < 0.10 and "H200" in pred["calibration"]
    r = CliRunner().invoke(main, ["schedule", "tiny-moe", "--calibration", "h999-none"])
    assert r.exit_code == 2 and "no bundled calibration" in r.output


def test_bench_picks_the_bundled_calibration_of_this_gpu_and_model_only():
    from megac.calibration import bundled_for

    assert bundled_for("north-mini-code", "NVIDIA H200") == "h200-north-mini-code"
    assert bundled_for("smollm2-135m", "NVIDIA H200 NVL") == "h200-smollm2-135m"
    # measured on another GPU, or for another model: the uncalibrated model
    assert bundled_for("north-mini-code", "NVIDIA H100 80GB HBM3") is None
    assert bundled_for("tiny-moe", "NVIDIA H200") is None
    assert bundled_for("north-mini-code", None) is None


def _steps(files) -> dict:
    """(batch, context) -> (kernel ms, the context of the median timed step: its schedule's bucket)."""
    from megac.decode_bench import timed_context

    out = {}
    for f in files:
        run = json.loads(f.read_text())
        w, n = run["run"]["warmup"], run["run"]["steps"]
        out.update({(r["batch"], r["context"]): (r["kernel_ms"], timed_context(r["context"], w, n)) for r in run["rows"]})
    return out


#: SmolLM2's steps measured in the nineteenth session (same device code as the trace's)
SMOL_STEPS_19 = [ROOT / "benchmarks" / "bench-smollm2-cuda-fold-2026-12-03-h200-session19.json"]


@pytest.mark.parametrize("model, batch, context",
                         [("north-mini-code", b, c) for b in (1, 2, 4, 8) for c in (1024, 8192, 32768, 131072)]
                         + [("smollm2-135m", b, c) for b in (1, 2, 4, 8) for c in (1024, 4096)])
def test_bundled_calibration_predicts_every_measured_step(model, batch, context):
    """Fitted on one traced step (North Mini Code: batch 4 at 8K; SmolLM2:
    batch 1 at 1K) and its attention claims' streaming rate refit to the
    measured steps at 8K and beyond (North Mini Code; SmolLM2's at every
    context), the model stays within 10 % of the H200's kernel time at
    every batch and context measured,
    North Mini Code's 1K steps included (which the refit did not see). Each
    step is simulated on the schedule its timed steps ran: a case at 1024
    tokens decodes at 1029-1058 and runs the 2048 bucket's."""
    files = NMC_STEPS_19 if model == "north-mini-code" else SMOL_STEPS_19
    ms, timed = _steps(files)[(batch, context)]
    sched = compile_one(traced(model), order="tuned", rows=batch, context=timed)
    cal = Calibration.load(resolve(f"h200-{model}"))
    pred_ms = simulate(sched, cal.params(context=context)).step_us / 1e3
    assert abs(pred_ms / ms - 1) < 0.10, (pred_ms, ms)


def test_refit_recovers_the_rate_scale_that_made_the_steps():
    """Steps made by a calibration whose rates are 1.3x the traced ones
    under a shared 4 TB/s: the refit over scales 1.0 / 1.3 / 1.6 finds 1.3
    and divides every µs per byte by it; without a shared limit it refuses."""
    from dataclasses import replace

    from megac.calibration import refit_rate_scale

    cal = replace(Calibration.load(resolve("h200-smollm2-135m")), shared_bandwidth_bps=4e12)
    truth = replace(cal, us_per_byte={k: v / 1.3 for k, v in cal.us_per_byte.items()})
    spec = load_spec("smollm2-135m")
    cases = []
    for rows, ctx in ((1, 1024), (8, 4096)):
        sched = compile_one(spec, order="tuned", rows=rows, context=ctx)
        cases.append((sched, ctx, simulate(sched, truth.params(context=ctx)).step_us / 1e3))
    got, table = refit_rate_scale(cal, cases, scales=(1.0, 1.3, 1.6))
    assert got.rate_scale == 1.3 and got.shared_bandwidth_bps == 4e12
    assert got.us_per_byte == pytest.approx(truth.us_per_byte)
    assert table[1.3] < 1e-9 < min(table[1.0], table[1.6])
    with pytest.raises(MegacError, match="shared bandwidth"):
        refit_rate_scale(replace(cal, shared_bandwidth_bps=None), cases)


def test_refit_recovers_the_claim_rate_that_made_the_steps():
    from dataclasses import replace

    from megac.calibration import refit_claim_stream

    cal = Calibration.load(resolve("h200-north-mini-code"))
    b0 = cal.notes["ATTN_DRAIN"]["bytes_per_claim"]
    u0 = cal.claim_fixed_us.get("ATTN_DRAIN", 0.0) + cal.us_per_byte["ATTN_DRAIN"] * b0
    k = 1e6 / 25e9  # the truth: 25 GB/s per SM, the traced claim's time kept
    truth = replace(cal, us_per_byte={**cal.us_per_byte, "ATTN_DRAIN": k},
                    claim_fixed_us={**cal.claim_fixed_us, "ATTN_DRAIN": u0 - k * b0})
    spec = load_spec("north-mini-code")
    cases = []
    for ctx in (32768, 131072):
        sched = compile_one(spec, order=TUNED15, rows=1, context=ctx)
        cases.append((sched, ctx, simulate(sched, truth.params(context=ctx)).step_us / 1e3))
    got, table = refit_claim_stream(cal, "ATTN_DRAIN", cases, rates_gbs=(10, 25, 40))
    assert got.us_per_byte["ATTN_DRAIN"] == pytest.approx(k)
    assert got.claim_fixed_us["ATTN_DRAIN"] == pytest.approx(u0 - k * b0)
    assert table[25] < 1e-9 < min(table[10], table[40])
    with pytest.raises(MegacError, match="not a calibrated claimer"):
        refit_claim_stream(cal, "QKV_PROJ", cases)


#: the thirteenth session's two profiled steps (same device code, same run of the
#: machine): batch 1, 8K, expert tiles of 128 and of 256 features
NMC_TRACE_13 = {128: ROOT / "benchmarks" / "profile-nmc-bs1-8k-2026-12-02-h200-session13.trace.json.gz",
                256: ROOT / "benchmarks" / "profile-nmc-bs1-8k-tiles256-2026-12-02-h200-session13.trace.json.gz"}
#: what the H200 measured for them (check tiles, median kernel ms at 8K, the same session):
#: 256-feature tiles faster at batch 1 (the traced spans: 3474 -> 3426 us) and at batch 8
#: (10.287 -> 9.720 ms)


def test_the_claims_stamps_split_fixed_from_streaming_time():
    """A claim's stamps say when its first weight stage landed and when its
    last was consumed: the fit charges that span per byte and the rest of
    the claim per claim. Fitted on either tile size's trace, the model then
    predicts the other size's measured step within 11 % and ranks the two
    sizes at batch 8 as the H200 measured them (charging a claim's whole
    time per byte ranked them the wrong way round at batch 8 from the
    128-feature trace, and at batch 1 from both)."""
    def spec_of(bn):
        return tiles128("north-mini-code") if bn == 128 else whole_heads("north-mini-code")

    recs = {bn: records_from_trace(json.load(gzip.open(f))) for bn, f in NMC_TRACE_13.items()}
    sched = {(bn, rows): compile_one(spec_of(bn), order=TUNED15, rows=rows, context=8192)
             for bn in (128, 256) for rows in (1, 8)}
    span = {bn: max(r["end_us"] for r in rs) for bn, rs in recs.items()}
    assert span[256] < span[128]
    for fitted, other in ((128, 256), (256, 128)):
        cal = fit(recs[fitted], sched[(fitted, 1)])
        for op in ("MOE_UPGATE_DRAIN", "MOE_DOWN_DRAIN"):
            note = cal.notes[op]
            assert 0 < note["us_streaming_per_claim"] < note["us_per_claim"]
            assert cal.claim_fixed_us[op] == pytest.approx(note["us_per_claim"] - note["us_streaming_per_claim"],
                                                           abs=0.002)  # the notes are rounded
        predicted = simulate(sched[(other, 1)], cal.params()).step_us
        assert abs(predicted / span[other] - 1) < 0.11, (fitted, predicted, span[other])
        # batch 8: 256-feature tiles 5.5 % faster as measured; batch 1: 1.4 % faster (traced),
        # inside what the model resolves since each down tile waits on its own expert's up
        # tiles (both orders within 2 %), not ranked the wrong way by more
        p128, p256 = (simulate(sched[(bn, 8)], cal.params()).step_us for bn in (128, 256))
        assert p256 < p128, (fitted, 8, p128, p256)
        p128, p256 = (simulate(sched[(bn, 1)], cal.params()).step_us for bn in (128, 256))
        assert p256 < 1.02 * p128, (fitted, 1, p128, p256)


#: the nineteenth session's step of today's default schedule (the norm folded into its QKV and
#: router readers) and the H200's kernel times of that session (megac bench --json, unstamped)
NMC_TRACE_19 = ROOT / "benchmarks" / "profile-nmc-bs1-8k-fold-2026-12-03-h200-session19.trace.json.gz"
NMC_STEPS_19 = [ROOT / "benchmarks" / "bench-nmc-cuda-fold-2026-12-03-h200-session19.json",
                ROOT / "benchmarks" / "bench-nmc-128k-cuda-fold-2026-12-03-h200-session19.json"]


@pytest.fixture(scope="module")
def fold19():
    recs = records_from_trace(json.load(gzip.open(NMC_TRACE_19)))
    return recs, compile_one(traced("north-mini-code"), order=TUNED35, rows=1, context=8192)


def test_the_task_loops_own_costs_come_from_the_trace(fold19):
    """The dispatch and the hand-off are read off the trace (the NOP chain
    measured 0.64 and 0.46 µs on an idle GPU; inside a loaded step they are
    larger). Checked here against the routers alone, computed straight from
    the records: a router of layer L waits on layer L-1's O-projection and
    expert combine (the norm folded into it), and its wait passes a hand-off
    after the later of them ends."""
    from megac.calibration import trace_timing

    recs, sched = fold19
    t = trace_timing(recs, sched)
    last = {}
    for r in recs:
        if r["op"] in ("O_PROJ", "MOE_COMBINE"):
            last[r["layer"]] = max(last.get(r["layer"], 0.0), r["end_us"])
    hand = [r["waited_us"] - last[r["layer"] - 1] for r in recs
            if r["op"] == "ROUTER_GEMM" and r["layer"] - 1 in last and last[r["layer"] - 1] > r["start_us"]]
    assert len(hand) > 100
    assert abs(t.handoff_us - float(np.median(hand))) < 0.3, (t.handoff_us, np.median(hand))
    assert 0.64 < t.handoff_us < 2.0 and 0.2 < t.dispatch_us < 1.5
    # the GEMMs issue their first weight stages before they wait (the prime): measurable
    # where the inputs were there already; the routed up claimers rank the rows first
    assert t.pre_us["O_PROJ"] > 1.0 and t.pre_us["QKV_PROJ"] > 1.0
    assert 2.0 < t.lead_us["MOE_UPGATE_DRAIN"] < 6.0


def test_the_loops_own_costs_are_what_the_fold_trace_needed(fold19):
    """Fitted on the folded step, the model predicts its traced span and the
    H200's unstamped kernel time (a separate run) within 10 %. With the task
    loop as the NOP chain measured it, no work before the waits and the
    ranking charged after the claims, the same per-opcode costs put the
    routed expert claims' hand-off ~5 µs early in each of 48 layers: the
    step came out 12 % short (the nineteenth session's -9.6 .. -11.5 %)."""
    from dataclasses import replace

    recs, sched = fold19
    cal = fit(recs, sched, context=8192)
    span = max(r["end_us"] for r in recs)
    pred = simulate(sched, cal.params(context=8192)).step_us
    assert abs(pred / span - 1) < 0.10, (pred, span)
    assert abs(pred / 1e3 / _steps(NMC_STEPS_19)[(1, 8192)][0] - 1) < 0.10
    old = fit(recs, sched, dispatch_us=0.64, handoff_us=0.46, context=8192)
    old = replace(old, pre_us_by_op={}, claimer_lead_us={},
                  claimer_us={k: v + cal.claimer_lead_us.get(k, 0.0) for k, v in old.claimer_us.items()})
    assert simulate(sched, old.params(context=8192)).step_us < 0.9 * span


def _cli(*args):
    from click.testing import CliRunner

    from megac.cli import main

    return CliRunner().invoke(main, ["calibrate", *map(str, args)])


def test_calibrate_command_fits_a_trace_and_writes_a_calibration(tmp_path, fold19):
    """``megac calibrate`` on a trace that names its step (``otherData``, as
    megac bench --profile writes it now) needs no flags; the calibration it
    writes loads and predicts what the fit did."""
    from megac.gpu.profile import chrome_trace

    recs, sched = fold19
    # the nineteenth session's run: the stamps' step and the plain one's (bench, same code)
    meta = {"model": "north-mini-code", "batch": 1, "context": 8192, "order": "tuned", "kernel_ms": 3.041,
            "profiled_ms": 3.081, "tiles": {**geometry.DEFAULT_TILES, **O_PROJ_64, **geometry.PLAIN_TILES},
            "order_doc": order_doc(TUNED35)}
    trace = tmp_path / "step.json.gz"
    trace.write_bytes(gzip.compress(json.dumps(chrome_trace(recs, meta)).encode()))
    out = tmp_path / "cal.json"
    r = _cli(trace, "-o", out)
    assert r.exit_code == 0, r.output
    assert "predicted step" in r.output and "unstamped kernel" in r.output and "scaled by 0.987" in r.output
    cal = Calibration.load(out)
    assert "north-mini-code batch 1 context 8192" in cal.source and cal.instrumentation_scale == 0.987
    assert abs(simulate(sched, cal.params(context=8192)).step_us / 3041 - 1) < 0.10
    # the same trace without the plain build's time: the times as traced
    meta.pop("profiled_ms")
    trace.write_bytes(gzip.compress(json.dumps(chrome_trace(recs, meta)).encode()))
    r = _cli(trace)
    assert r.exit_code == 0 and "against the traced" in r.output, r.output
    # --shared-bandwidth: the streams share the limit; the step is no shorter for it
    shared = tmp_path / "shared.json"
    r = _cli(trace, "--shared-bandwidth", "4.2", "-o", shared)
    assert r.exit_code == 0 and "share 4.20 TB/s" in r.output, r.output
    with_limit = Calibration.load(shared)
    assert with_limit.shared_bandwidth_bps == pytest.approx(4.2e12)
    assert (simulate(sched, with_limit.params(context=8192)).step_us
            > simulate(sched, with_limit.params(context=8192, shared_bandwidth=None)).step_us)
    assert with_limit.bandwidth_sharing == "fcfs" and "first come, first served" in r.output
    # --sharing fair: the calibration shares it max-min fairly; the step is no shorter than its bytes there
    fair = tmp_path / "fair.json"
    r = _cli(trace, "--shared-bandwidth", "4.2", "--sharing", "fair", "-o", fair)
    assert r.exit_code == 0 and "share 4.20 TB/s max-min fairly" in r.output, r.output
    res = simulate(sched, Calibration.load(fair).params(context=8192))
    assert Calibration.load(fair).bandwidth_sharing == "fair"
    assert res.step_us * 1e-6 >= res.total_bytes / 4.2e12
    r = _cli(trace, "--shared-bandwidth", "4.2", "--sharing", "fifo")
    assert r.exit_code == 2 and "--sharing" in r.output
    r = _cli(trace, "--shared-bandwidth", "0")
    assert r.exit_code == 2 and "--shared-bandwidth" in r.output


def test_calibrate_command_rebuilds_the_traced_tiles(tmp_path, fold19):
    """A trace records the tile settings it ran (``otherData`` ``tiles``):
    after a default tile changed (North Mini Code's O-projection: 64
    features when this step was traced, 128 now), ``megac calibrate`` still
    rebuilds the traced schedule from them; a trace without them is refused
    as another schedule's, one whose tiles are not tile settings in one line."""
    from megac.gpu.profile import chrome_trace

    recs, sched = fold19
    meta = {"model": "north-mini-code", "batch": 1, "context": 8192, "order": "tuned", "schedule_context": 8192,
            "tiles": {**geometry.DEFAULT_TILES, **O_PROJ_64, **geometry.PLAIN_TILES}, "order_doc": order_doc(TUNED35)}
    trace = tmp_path / "step.json.gz"
    trace.write_bytes(gzip.compress(json.dumps(chrome_trace(recs, meta)).encode()))
    r = _cli(trace)
    said = ("compiling with the trace's tiles (lm_bn -1 -> 256, o_proj_bn 128 -> 64, o_proj_merge -1 -> 0, "
            "qkv_combine 1 -> 0, routed_combine_splits 8 -> 0, router_combine 1 -> 0, router_splits 8 -> 4)")
    assert r.exit_code == 0 and said in r.output, r.output
    # recorded under an order whose file now holds other waves (here: the waves of tuned before the
    # thirty-sixth session, tuned-session35, under the name attention-first), the waves the trace
    # recorded rebuild it
    meta_named = {**meta, "order": "attention-first"}
    trace.write_bytes(gzip.compress(json.dumps(chrome_trace(recs, meta_named)).encode()))
    r = _cli(trace)
    assert r.exit_code == 0 and "the order attention-first has changed since the trace" in r.output, r.output
    # without them today's attention-first is another schedule: one line that names the way out
    meta_named.pop("order_doc")
    trace.write_bytes(gzip.compress(json.dumps(chrome_trace(recs, meta_named)).encode()))
    r = _cli(trace)
    assert r.exit_code == 2 and "another schedule" in r.output and "--order" in r.output, r.output
    meta.pop("tiles")
    trace.write_bytes(gzip.compress(json.dumps(chrome_trace(recs, meta)).encode()))
    r = _cli(trace)
    assert r.exit_code == 2 and "another schedule" in r.output, r.output
    meta["tiles"] = {"o_proj_bn": "wide"}
    trace.write_bytes(gzip.compress(json.dumps(chrome_trace(recs, meta)).encode()))
    r = _cli(trace)
    assert r.exit_code == 2 and "not tile settings" in r.output, r.output


def test_calibrate_command_refuses_bad_input(tmp_path):
    """A trace without its step named, a file that is no trace, a missing
    file: one line each, exit 2, nothing written."""
    r = _cli(NMC_TRACE_19)
    assert r.exit_code == 2 and "pass --model, --batch-size, --context" in r.output
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    r = _cli(bad, "--model", "north-mini-code", "--batch-size", "1", "--context", "8192")
    assert r.exit_code == 2 and "not a JSON trace" in r.output
    r = _cli(tmp_path / "nothing.json")
    assert r.exit_code == 2 and "no such file" in r.output
    r = _cli(NMC_TRACE_19, "--model", "smollm2-135m", "--batch-size", "1", "--context", "1024",
             "-o", tmp_path / "x.json")
    assert r.exit_code == 2 and "another schedule" in r.output and not (tmp_path / "x.json").exists()


def test_calibrate_command_refits_to_measured_steps(tmp_path):
    """``--steps``: SmolLM2's traced step and the eight steps the H200 timed;
    the attention claims' rate is refit to the rows at ``--min-context``
    and above, every row is predicted (the others marked held out), and the
    calibration written says what it was refit to. Steps of another model
    are refused."""
    out = tmp_path / "smol.json"
    trace = BUNDLED_TRACES["h200-smollm2-135m"]
    r = _cli(trace, "--steps", SMOL_STEPS_19[0], "--min-context", "4096", "-o", out)
    assert r.exit_code == 0, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()[:1].isdigit()]
    assert len(lines) == 8 and sum("held out" in ln for ln in lines) == 4
    cal = Calibration.load(out)
    assert "ATTN_DRAIN" in cal.claim_fixed_us and SMOL_STEPS_19[0].name in cal.source
    # with a shared limit the rates are refit as uncontended ones too
    shared = tmp_path / "smol-shared.json"
    r = _cli(trace, "--steps", SMOL_STEPS_19[0], "--min-context", "4096", "--shared-bandwidth", "4.23", "-o", shared)
    assert r.exit_code == 0 and "every rate x" in r.output, r.output
    from megac.calibration import RATE_SCALES

    got = Calibration.load(shared)
    assert got.rate_scale in RATE_SCALES and got.shared_bandwidth_bps == pytest.approx(4.23e12)
    r = _cli(trace, "--steps", NMC_STEPS_19[0])
    assert r.exit_code == 2 and "measured north-mini-code, the trace smollm2-135m" in r.output

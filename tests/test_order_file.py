"""``--order FILE.yaml``: a wave order of one's own goes wherever a bundled
one does (schedule, compile, the artifact cache), so orders can be tried on
the CPU under the calibrated cost model; a bad file is a one-line error."""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import yaml

from megac.order_option import ORDERS
from megac.passes.order import ORDERS as PASS_ORDERS
from megac.resources import schedules_dir
from megac.runtime.artifacts import artifact_key
from megac.spec import load_spec
from test_cli import assert_one_line_error, megac


def _waves(res):
    data = json.loads(res.stdout)
    return {kind: [w["wave"] for w in waves] for kind, waves in data["waves"].items()}


def test_the_bundled_names_agree():
    assert ORDERS == PASS_ORDERS
    assert sorted(ORDERS) == sorted(p.stem for p in schedules_dir().glob("*.yaml"))


#: the tuned order until the sixteenth session (every wave dealt over all the SMs)
SESSION15 = schedules_dir() / "experiments" / "tuned-session15.yaml"


def test_an_order_file_schedules_as_its_waves_say(tmp_path):
    same = tmp_path / "mine.yaml"
    shutil.copy(schedules_dir() / "interleaved.yaml", same)
    got = megac("schedule", "tiny-moe", "--order", same, "--json")
    want = megac("schedule", "tiny-moe", "--order", "interleaved", "--json")
    assert got.returncode == 0 == want.returncode, got.stderr
    assert _waves(got) == _waves(want)
    # and an order of its own: O-proj before the expert down projection (from the
    # plain-wave tuned order of the fifteenth session)
    doc = yaml.safe_load(SESSION15.read_text())
    moe = doc["layers"]["moe"]
    moe.remove("o_proj")
    moe.insert(moe.index("moe_down"), "o_proj")
    mine = tmp_path / "oproj-early.yaml"
    mine.write_text(yaml.safe_dump(doc))
    res = megac("schedule", "tiny-moe", "--order", mine, "--json", "--calibration", "h200-north-mini-code")
    assert res.returncode == 0, res.stderr
    kinds = _waves(res)
    waves = kinds[next(k for k in kinds if k.startswith("moe"))]
    assert waves.index("o_proj") < waves.index("moe_down")
    assert json.loads(res.stdout)["predicted"]["step_us"] > 0


def test_a_bad_order_file_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nlayers:\n  moe: [qkv, router]\n")
    assert_one_line_error(megac("schedule", "tiny-moe", "--order", bad), str(bad), "missing")
    res = megac("schedule", "tiny-moe", "--order", tmp_path / "absent.yaml")
    assert res.returncode == 2 and "does not exist" in res.stderr and "Traceback" not in res.stderr
    res = megac("compile", "tiny-moe", "--order", "fastest")
    assert res.returncode == 2 and "neither a bundled order" in res.stderr


def test_the_cache_keys_on_the_file_text(tmp_path):
    spec = load_spec("tiny-moe")
    f = tmp_path / "o.yaml"
    shutil.copy(schedules_dir() / "tuned.yaml", f)
    k1 = artifact_key(spec, str(f), [1])
    assert k1 == artifact_key(spec, str(f), [1]) != artifact_key(spec, "tuned", [1])
    f.write_text(f.read_text().replace("name: tuned", "name: edited"))
    assert artifact_key(spec, str(f), [1]) != k1  # an edit is a new artifact


def test_compile_with_an_order_file(tmp_path):
    f = tmp_path / "o.yaml"
    shutil.copy(schedules_dir() / "attention-first.yaml", f)
    out = tmp_path / "art"
    res = megac("compile", "tiny-moe", "--order", f, "-o", out, "--batch-size", 1, "--no-cubin", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["order"] == str(f.resolve())


def test_the_experiment_orders_compile_and_verify():
    """schedules/experiments/ holds orders the speed work wants measured
    (not bundled): each must stay a valid order the compiler verifies."""
    from megac.passes.pipeline import compile_one

    from models import variant

    files = sorted((schedules_dir() / "experiments").glob("*.yaml"))
    assert files
    moe = load_spec("tiny-moe")
    # their moe_split waves too: tiny-moe with the expert down projection split-K in the up
    # claims at one row (two split-K partials per expert; tests/vm/test_split_down.py)
    split = variant(moe, "tiny-moe-split", moe={"expert_intermediate_size": 64},
                    tiles={"split_down": 1, "moe_up_bn": 64})
    for f in files:
        sched = compile_one(moe, order=str(f), rows=2, context=256)
        assert sched.num_tasks > 0, f
        one = compile_one(split, order=str(f), rows=1, context=256)
        assert one.geometry.split_down and one.num_tasks > 0, f


def _opcodes_per_sm_and_layer(sched):
    """{(sm, layer): tuple of opcodes in run order} of a compiled schedule."""
    from megac import abi

    out = {}
    for s in range(sched.tasks.shape[0]):
        for w in sched.tasks[s, : int(sched.task_counts[s])]:
            out.setdefault((s, int(w[abi.H.LAYER])), []).append(int(w[abi.H.OPCODE]))
    return {k: tuple(v) for k, v in out.items()}


def _op_names(sched, layer: int) -> dict:
    """{sm: [opcode name of each of its tasks of ``layer``, in run order]}."""
    from megac import abi

    per = _opcodes_per_sm_and_layer(sched)
    return {s: [abi.Op(op).name for op in per.get((s, layer), ())] for s in range(sched.num_sms)}


def _assert_one_run_of_consecutive_sms(sms, num_sms: int) -> None:
    sms = sorted(sms)
    gaps = [(b - a) % num_sms for a, b in zip(sms, sms[1:] + sms[:1])]
    assert sorted(gaps)[:-1] == [1] * (len(sms) - 1), "not one run of consecutive SMs"


@functools.lru_cache(maxsize=None)
def _nmc_8k(order: str, rows: int):
    """North Mini Code's plain schedule of ``rows`` at 8K under ``order`` (a
    name or a file path; at batch 1 without the split configuration,
    geometry.PLAIN_TILES: the order files' plain waves), compiled once per
    module (compile_one runs every pass's checks and the verifier; the
    tests only read it)."""
    from megac.geometry import PLAIN_TILES
    from megac.passes.pipeline import compile_one
    from models import variant

    spec = load_spec("north-mini-code")
    plain = variant(spec, spec.name, tiles={**(spec.target.tiles or {}), **PLAIN_TILES})
    return compile_one(plain, order=order, rows=rows, context=8192)


def test_the_layer_cursor_runs_each_layers_tasks_on_the_same_sms():
    """The default cursor (``sm_cursor: layer``) deals every layer from SM 0:
    each SM runs the same opcodes in every layer of a kind (its code stays
    warm), where the global cursor moves them from layer to layer; both
    verify and run the same tasks."""
    tuned = _nmc_8k("tuned", 1)
    glob = _nmc_8k(str(schedules_dir() / "experiments" / "tuned-global-cursor.yaml"), 1)
    assert glob.num_tasks == tuned.num_tasks
    for sched, same in ((tuned, True), (glob, False)):
        ops = _opcodes_per_sm_and_layer(sched)
        # sliding MoE layers 1, 2, 3, 5, 6, 7: one kind, one task list
        differ = [s for s in range(132) for l in (2, 3, 5, 6, 7) if ops.get((s, l)) != ops.get((s, 1))]
        assert (not differ) == same, (same, differ[:5])


def test_a_bad_sm_cursor_is_one_line(tmp_path):
    doc = yaml.safe_load((schedules_dir() / "tuned.yaml").read_text())
    doc["sm_cursor"] = "random"
    bad = tmp_path / "cursor.yaml"
    bad.write_text(yaml.safe_dump(doc))
    assert_one_line_error(megac("schedule", "tiny-moe", "--order", bad), "sm_cursor", "random")


PLACED = schedules_dir() / "experiments" / "oproj-on-attention.yaml"


def _layer_sms(sched, layer: int) -> dict:
    """{opcode name: [SM of each task in run order]} of one layer."""
    from megac import abi

    out: dict = {}
    for s in range(sched.tasks.shape[0]):
        for w in sched.tasks[s, : int(sched.task_counts[s])]:
            if int(w[abi.H.LAYER]) == layer:
                out.setdefault(abi.Op(int(w[abi.H.OPCODE])).name, []).append(s)
    return out


def test_a_placed_wave_runs_on_its_hosts_sms_and_moves_no_cursor():
    """``{wave: o_proj, sms_of: attn}``: every O-projection task of a layer
    runs on an SM that ran one of that layer's attention splits, spread
    evenly over them; every other task but the norm (dealt right after the
    MoE combine now, not after the O-projection) sits on the SM the
    fifteenth session's tuned order gives it; and the schedule verifies
    (compile_one runs every pass's checks)."""
    from collections import Counter

    # the order the placed experiment was written against
    tuned = _nmc_8k(str(SESSION15), 1)
    placed = _nmc_8k(str(PLACED), 1)
    assert placed.num_tasks == tuned.num_tasks
    for layer in (1, 10):  # sliding MoE layers (a full one claims its attention: no host SMs)
        got, want = _layer_sms(placed, layer), _layer_sms(tuned, layer)
        hosts = set(got["ATTN_DECODE"])
        per = Counter(got["O_PROJ"])
        assert set(per) == hosts, layer
        assert max(per.values()) - min(per.values()) <= 1
        assert len(got["O_PROJ"]) == len(want["O_PROJ"])
        for op in set(want) - {"O_PROJ", "ADD_RMSNORM"}:
            assert sorted(got[op]) == sorted(want[op]), (layer, op)
    # the dense layer 0 has no placed wave: as tuned
    assert _layer_sms(placed, 0) == _layer_sms(tuned, 0)
    # a full layer claims its attention on every SM: no host SMs, so the
    # O-projection is dealt by the cursor in its place (before the claims)
    full = _layer_sms(placed, 4)
    n_oproj = 4 * 2048 // 128  # per KV head's split-K slice, the hidden dim in 128-feature tiles
    assert "ATTN_DRAIN" in full and len(set(full["O_PROJ"])) == len(full["O_PROJ"]) == n_oproj
    late = _nmc_8k(str(PLACED).replace(".yaml", "-late.yaml"), 1)
    assert _layer_sms(late, 4) == _layer_sms(tuned, 4)
    assert set(_layer_sms(late, 10)["O_PROJ"]) == set(_layer_sms(late, 10)["ATTN_DECODE"])


@pytest.mark.parametrize("wave,match", [
    ("{wave: o_proj, sms_of: norm}", "placed on 'norm', which is not a wave dealt earlier"),
    ("{wave: o_proj, sms_of: atn}", "placed on 'atn', which is not a wave dealt earlier"),
    ("{wave: o_proj, sms_of: []}", "a placed wave is"),
    ("{wave: o_proj, sms_of: 3}", "a placed wave is"),
    ("{wave: o_proj, on: attn}", "a wave is a node kind"),  # YAML reads `on` as true
])
def test_a_bad_placed_wave_is_one_line(tmp_path, wave, match):
    text = PLACED.read_text().replace("{wave: o_proj, sms_of: attn}", wave)
    bad = tmp_path / "placed.yaml"
    bad.write_text(text)
    res = megac("schedule", "tiny-moe", "--order", bad)
    assert_one_line_error(res, "layers.moe[7]", match)


def test_a_claimer_wave_cannot_be_placed(tmp_path):
    doc = yaml.safe_load(PLACED.read_text())
    moe = doc["layers"]["moe"]
    moe[moe.index("moe_down")] = {"wave": "moe_down", "sms_of": "attn"}
    bad = tmp_path / "claimers.yaml"
    bad.write_text(yaml.safe_dump(doc))
    assert_one_line_error(megac("schedule", "tiny-moe", "--order", bad), "moe_down", "claimer wave")


HALF = schedules_dir() / "experiments" / "attn-half.yaml"


def test_a_wave_on_a_share_of_the_sms_is_dealt_over_that_many():
    """``{wave: attn, share: 0.5}``: at batch 8 a sliding layer's 256 splits
    run on 66 consecutive SMs, 3-4 each; the
    placed combine on those SMs; every SM still holds one claimer of each
    queue; the schedule verifies (compile_one runs every pass's checks) and
    a full layer's claimed attention ignores the share."""
    from collections import Counter

    tuned = _nmc_8k("tuned", 8)
    half = _nmc_8k(str(HALF), 8)
    assert half.num_tasks == tuned.num_tasks
    S = tuned.num_sms
    for layer in (1, 10):
        got, want = _layer_sms(half, layer), _layer_sms(tuned, layer)
        per = Counter(got["ATTN_DECODE"])
        assert len(per) == round(0.5 * S) and len(got["ATTN_DECODE"]) == len(want["ATTN_DECODE"]) == 256
        assert max(per.values()) - min(per.values()) <= 1
        _assert_one_run_of_consecutive_sms(per, S)
        assert set(got["ATTN_COMBINE"]) <= set(per)
        for op in ("MOE_UPGATE_DRAIN", "MOE_DOWN_DRAIN"):
            assert sorted(got[op]) == list(range(S)), op
    # a full layer's attention is claimed by every SM: as tuned
    full = _layer_sms(half, 4)
    assert sorted(full["ATTN_DRAIN"]) == list(range(S))


@pytest.mark.parametrize("share", ["0", "1.5", "-0.2", "half", "true"])
def test_a_bad_share_is_one_line(tmp_path, share):
    bad = tmp_path / "share.yaml"
    bad.write_text(HALF.read_text().replace("share: 0.5", f"share: {share}"))
    assert_one_line_error(megac("schedule", "tiny-moe", "--order", bad), "layers.moe[5]", "0 < f <= 1")


SPLIT = schedules_dir() / "experiments" / "full-attn-half.yaml"


def test_a_split_claimer_wave_claims_on_half_the_sms_first():
    """``{wave: attn, share: 0.5, rest_after: moe_upgate}``: in a full layer
    at batch 8, 66 consecutive SMs hold their attention claimer before their
    expert up claimer (and the attention combines, placed on them), the
    other 66 after it; every SM still holds one claimer of each queue; the
    sliding layers (static splits) are as tuned; the schedule verifies
    (compile_one runs every pass's checks, the deadlock walk included)."""
    tuned = _nmc_8k("tuned", 8)
    split = _nmc_8k(str(SPLIT), 8)
    assert split.num_tasks == tuned.num_tasks
    S = split.num_sms
    for layer in (1, 10):
        assert _layer_sms(split, layer) == _layer_sms(tuned, layer)
    full = _layer_sms(split, 4)
    for op in ("ATTN_DRAIN", "MOE_UPGATE_DRAIN", "MOE_DOWN_DRAIN"):
        assert sorted(full[op]) == list(range(S)), op
    early = []
    for s, ops in _op_names(split, 4).items():
        if ops.index("ATTN_DRAIN") < ops.index("MOE_UPGATE_DRAIN"):
            early.append(s)
        assert "ATTN_COMBINE" not in ops or s in early, s
    assert len(early) == round(0.5 * S)
    _assert_one_run_of_consecutive_sms(early, S)
    assert set(full["ATTN_COMBINE"]) <= set(early)
    # tuned: every SM claims attention before its expert claims
    for ops in _op_names(tuned, 4).values():
        assert ops.index("ATTN_DRAIN") < ops.index("MOE_UPGATE_DRAIN")


@pytest.mark.parametrize("after,match", [
    ("qkv", "not a wave later in this list"),
    ("attn", "not a wave later in this list"),
    ("nowhere", "not a wave later in this list"),
    ("[moe_down]", "rest_after takes one wave name"),
])
def test_a_bad_rest_after_is_one_line(tmp_path, after, match):
    bad = tmp_path / "split.yaml"
    bad.write_text(SPLIT.read_text().replace("rest_after: moe_upgate", f"rest_after: {after}"))
    assert_one_line_error(megac("schedule", "tiny-moe", "--order", bad), "layers.moe[5]", match)


def test_a_waiter_before_every_claimer_of_its_queue_is_refused(tmp_path):
    """The order pass's own check: a wave that waits on a claimed queue's
    counter must follow at least that queue's first claimer (here the
    attention combines before a full layer's attention claimers)."""
    doc = yaml.safe_load(SPLIT.read_text())
    moe = doc["layers"]["moe"]
    moe.remove({"wave": "attn_combine", "sms_of": "attn"})
    moe.insert(moe.index("moe_gather") + 1, "attn_combine")
    bad = tmp_path / "early.yaml"
    bad.write_text(yaml.safe_dump(doc))
    assert_one_line_error(megac("schedule", "tiny-moe", "--order", bad), "not topological", "attn_combine")


def test_the_rest_of_a_split_claimer_wave_after_a_wave_the_graph_leaves_out(tmp_path):
    """``rest_after`` naming a wave the graph has not (the MoE combine inside
    the norm: target tile fused_combine, batch 1): the other claimers take
    that wave's place, after the down claimers, and the schedule verifies."""
    from megac.passes.pipeline import compile_one
    from models import variant

    spec = load_spec("north-mini-code")
    fused = variant(spec, "nmc-fused-combine",
                    tiles={**(spec.target.tiles or {}), "fused_combine": 1})
    doc = yaml.safe_load(SPLIT.read_text())
    doc["layers"]["moe"][5] = {"wave": "attn", "share": 0.5, "rest_after": "moe_combine"}
    f = tmp_path / "after-combine.yaml"
    f.write_text(yaml.safe_dump(doc))
    sched = compile_one(fused, order=str(f), rows=1, context=8192)
    late = 0
    for ops in _op_names(sched, 4).values():
        assert ops.count("ATTN_DRAIN") == 1 and "MOE_COMBINE" not in ops
        late += ops.index("ATTN_DRAIN") > ops.index("MOE_DOWN_DRAIN")
    assert late == sched.num_sms - round(0.5 * sched.num_sms)


def test_full_attention_layers_take_their_own_waves(tmp_path):
    """``moe_full`` (any kind + ``_full``): the waves of that kind's
    full-attention layers; its sliding layers keep the kind's own. Here the
    O-projection before the expert claimer in North Mini Code's full layers
    only (schedules/experiments/split-full-oproj-first.yaml's form)."""
    doc = yaml.safe_load((schedules_dir() / "tuned.yaml").read_text())
    doc["layers"].pop("moe_routed_full", None)  # (an order's batch-1 full layers would take these first)
    moe = list(doc["layers"]["moe"])
    full = [w for w in moe if not (isinstance(w, dict) and w.get("wave") == "o_proj")]
    full.insert(full.index("moe_upgate"), {"wave": "o_proj", "share": 0.25})
    doc["layers"]["moe_full"] = full
    mine = tmp_path / "full-own.yaml"
    mine.write_text(yaml.safe_dump(doc))
    sched = _nmc_8k(str(mine), 1)
    tuned = _nmc_8k("tuned", 1)
    geo = sched.geometry
    full_l = next(l for l in geo.moe_layers if not geo.sliding[l])
    slide_l = next(l for l in geo.moe_layers if geo.sliding[l])
    ops = _op_names(sched, full_l)
    before = [s for s, names in ops.items() if "O_PROJ" in names
              and names.index("O_PROJ") < names.index("MOE_UPGATE_DRAIN")]
    assert len(before) == round(0.25 * geo.num_sms)
    assert _op_names(sched, slide_l) == _op_names(tuned, slide_l)
    assert not any("O_PROJ" in n and n.index("O_PROJ") < n.index("MOE_UPGATE_DRAIN")
                   for n in _op_names(tuned, full_l).values())
    bad = tmp_path / "bad-full.yaml"
    bad.write_text("name: bad\nlayers:\n  moe_sliding: [qkv]\n")
    assert_one_line_error(megac("schedule", "tiny-moe", "--order", bad), "moe_sliding", "unknown layer kind")


def test_split_schedules_take_the_kinds_split_waves():
    """``moe_split`` (any kind + ``_split``): the waves of that kind's layers
    in schedules that split the expert down projection; the plain schedules
    of the same order keep ``moe``'s. The tuned order's: a sliding layer's
    O-projection on its attention SMs, each SM's O-projection before its up
    claimer, the norm on the finalize SM; a full layer (claimed attention,
    no host SMs) deals it by the cursor before the up claims; at batch 1
    the attention merged inside the O-projection (no ATTN_COMBINE)."""
    from megac.passes.order import waves_for
    from megac.passes.pipeline import compile_one
    from models import variant

    spec = load_spec("north-mini-code")
    split = variant(spec, "nmc-split1", tiles={"split_down": -1})
    one = compile_one(split, order="tuned", rows=1, context=8192)
    two = compile_one(split, order="tuned", rows=2, context=8192)
    assert one.geometry.split_down and not two.geometry.split_down
    assert one.geometry.o_proj_merge and not two.geometry.o_proj_merge
    assert "ATTN_COMBINE" not in one.tasks_per_opcode and two.tasks_per_opcode["ATTN_COMBINE"] > 0
    geo = one.geometry
    slide_l = next(l for l in geo.moe_layers if geo.sliding[l])
    full_l = next(l for l in geo.moe_layers if not geo.sliding[l])
    sms = _layer_sms(one, slide_l)
    assert set(sms["O_PROJ"]) == set(sms["ATTN_DECODE"]) and len(sms["O_PROJ"]) == 2048 // 256 * 4
    assert sms["ADD_RMSNORM"] == sms["ROUTE_FINALIZE"]
    ops = _op_names(one, slide_l)
    assert all(n.index("O_PROJ") < n.index("MOE_UPGATE_DRAIN") for n in ops.values() if "O_PROJ" in n)
    full_ops = _op_names(one, full_l)
    assert all(n.index("O_PROJ") < n.index("MOE_UPGATE_DRAIN") for n in full_ops.values() if "O_PROJ" in n)
    # the plain schedule of the same spec and order: moe's waves (the O-projection after the claimers)
    plain = _op_names(two, slide_l)
    assert not any(n.index("O_PROJ") < n.index("MOE_UPGATE_DRAIN") for n in plain.values() if "O_PROJ" in n)
    layers = {"moe": 1, "moe_full": 2, "moe_split": 3}
    assert waves_for(layers, "moe", full=True, split=True) == "moe_split"
    assert waves_for(layers, "moe", full=True, split=False) == "moe_full"
    assert waves_for({**layers, "moe_split_full": 4}, "moe", full=True, split=True) == "moe_split_full"
    assert waves_for({"moe": 1}, "moe", full=False, split=True) == "moe"


def test_routed_claim_schedules_take_the_kinds_routed_waves(tmp_path):
    """``moe_routed_full`` (``KIND_routed``, ``KIND_routed_full``): the waves
    of that kind's layers in schedules whose up claimers route the rows
    themselves (batch 1 of North Mini Code); at batch 2 (no routed claims)
    the same file's layers take ``moe``'s / ``moe_full``'s. Here a full
    layer's up claimer before its attention claimer on every SM
    (schedules/experiments/full-up-first.yaml's form, at batch 1 only)."""
    from megac.passes.order import waves_for

    doc = yaml.safe_load((schedules_dir() / "tuned.yaml").read_text())
    moe = list(doc["layers"]["moe"])
    routed_full = [w for w in moe if w != "moe_upgate"]
    routed_full.insert(routed_full.index({"wave": "attn", "share": 0.5}), "moe_upgate")
    doc["layers"]["moe_routed_full"] = routed_full
    mine = tmp_path / "routed-own.yaml"
    mine.write_text(yaml.safe_dump(doc))
    one, two = _nmc_8k(str(mine), 1), _nmc_8k(str(mine), 2)
    assert one.geometry.routed_claims and not two.geometry.routed_claims
    geo = one.geometry
    full_l = next(l for l in geo.moe_layers if not geo.sliding[l])
    slide_l = next(l for l in geo.moe_layers if geo.sliding[l])
    ops = _op_names(one, full_l)
    assert all(n.index("MOE_UPGATE_DRAIN") < n.index("ATTN_DRAIN") for n in ops.values())
    assert _op_names(one, slide_l) == _op_names(_nmc_8k("tuned", 1), slide_l)
    # batch 2: tuned's waves (the attention claimer first on every SM)
    assert _op_names(two, full_l) == _op_names(_nmc_8k("tuned", 2), full_l)
    assert all(n.index("ATTN_DRAIN") < n.index("MOE_UPGATE_DRAIN") for n in _op_names(two, full_l).values())
    layers = {"moe": 1, "moe_full": 2, "moe_routed": 3, "moe_routed_full": 4, "moe_split": 5}
    assert waves_for(layers, "moe", full=True, split=False, routed=True) == "moe_routed_full"
    assert waves_for(layers, "moe", full=False, split=False, routed=True) == "moe_routed"
    assert waves_for(layers, "moe", full=True, split=True, routed=True) == "moe_split"
    assert waves_for({"moe": 1, "moe_full": 2}, "moe", full=True, split=False, routed=True) == "moe_full"
    bad = tmp_path / "bad-routed.yaml"
    bad.write_text("name: bad\nlayers:\n  moe_routed_sliding: [qkv]\n")
    assert_one_line_error(megac("schedule", "tiny-moe", "--order", bad), "moe_routed_sliding", "unknown layer kind")

"""The lowering passes tile -> select -> depend -> order -> assign -> plan -> encode.

Every pass's ``ensures`` runs inside ``lower(check=True)``; the tests below
check the postconditions again from the outside (on the encoded words and
the counter table), and tamper with the state to show each ``ensures``
catches a broken contract.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from megac import abi
from megac.abi import H, Op
from megac.passes import PassError, assign, depend, encode, order, plan, tile
from megac.passes.order import OrderError, load_order
from megac.passes.pipeline import bucket_groups, compile_one, compile_schedules, lower
from megac.passes.plan import gate_up_rows
from megac.resources import schedules_dir
from megac.spec import load_spec

MODELS = ["tiny-moe", "tiny-llama", "smollm2-135m", "north-mini-code"]
BATCHES = [1, 2, 4, 8]
ORDERS = ["tuned", "interleaved", "attention-first"]

_SPECS: dict = {}
_LOWERED: dict = {}


def spec_of(name):
    if name not in _SPECS:
        _SPECS[name] = load_spec(name)
    return _SPECS[name]


#: the tuned order until the sixteenth session: every wave dealt over all the SMs
PLAIN = str(schedules_dir() / "experiments" / "tuned-session15.yaml")


def lowered(name, rows, order_name="tuned"):
    key = (name, rows, order_name)
    if key not in _LOWERED:
        s = spec_of(name)
        _LOWERED[key] = lower(s, order_name, rows, s.context_bucket(min(8192, s.max_context)))
    return _LOWERED[key]


def fresh(name="tiny-moe", rows=2, order_name="tuned"):
    s = spec_of(name)
    return lower(s, order_name, rows, s.context_bucket(min(8192, s.max_context)))


def live_words(lw):
    return lw.global_words().astype(np.int64)


def F(op, name):
    return abi.field_index(op, name)


# --------------------------------------------------------------------------
# Postconditions on every bundled model at batch 1, 2, 4, 8
# --------------------------------------------------------------------------
@pytest.mark.parametrize("rows", BATCHES)
@pytest.mark.parametrize("model", MODELS)
def test_postconditions(model, rows):
    lw = lowered(model, rows)
    geo = lw.geo
    W = live_words(lw)
    C = len(lw.counters)
    names = [c.name for c in lw.counters]
    assert [c.index for c in lw.counters] == list(range(C))
    assert len(set(names)) == C, "counter names are unique"

    # tile: tiles cover outputs exactly (checked independently for QKV and LM head)
    qkv = lw.by_name["L0.qkv"].fields
    assert np.array_equal(np.sort(qkv["N0"]), np.arange(0, geo.qkv_width, geo.qkv_bn))
    assert (qkv["N_LEN"] == geo.qkv_bn).all() and geo.head_dim % geo.qkv_bn == 0
    per_head = geo.head_dim // geo.qkv_bn  # QKV tiles per head (North Mini Code: 2)
    lm = lw.by_name["lm_head"].fields
    assert lm["N_LEN"].sum() == geo.vocab and lm["N0"][0] == 0
    assert (lm["N0"][1:] == lm["N0"][:-1] + lm["N_LEN"][:-1]).all()

    # select: every task has a valid opcode
    assert set(np.unique(W[:, H.OPCODE]).tolist()) <= {int(o) for o in Op} - {0}

    # depend: at most two waits (WAIT1 only with WAIT0), one signal
    assert not ((W[:, H.WAIT1] >= 0) & (W[:, H.WAIT0] < 0)).any()
    # targets equal the number of signallers
    static_sig = np.bincount(W[:, H.SIGNAL][W[:, H.SIGNAL] >= 0], minlength=C)
    for wc, tc in ((H.WAIT0, H.TARGET0), (H.WAIT1, H.TARGET1)):
        for c, t in zip(W[:, wc], W[:, tc]):
            if c < 0:
                continue
            ctr = lw.counters[c]
            if ctr.count is None:
                assert t == abi.dyn(ctr.count_word), ctr.name
            elif "claimed" in ctr.note:
                assert t == ctr.count
            else:
                assert t == ctr.count == static_sig[c], ctr.name
    for c in lw.counters:
        if c.count is not None and "claimed" not in c.note:
            assert static_sig[c.index] == c.count, c.name

    # attention waits per KV head; combine per (row, kv head)
    for nt in lw.nodes:
        w = nt.words.astype(np.int64)
        l = nt.layer
        if nt.op == Op.ATTN_DECODE:
            for i in range(len(w)):
                kvh = int(nt.fields["KV_HEAD"][i])
                assert names[w[i, H.WAIT0]] == f"qkv[{l}][{kvh}]" and w[i, H.WAIT1] == -1
                assert w[i, H.TARGET0] == (geo.heads_per_kv + 2) * per_head
                assert names[w[i, H.SIGNAL]] == f"combine[{l}][{int(nt.fields['ROW'][i])}][{kvh}]"
        if nt.op == Op.ATTN_DRAIN:
            base = int(w[0, F(Op.ATTN_DRAIN, "TASK_WAIT_BASE")])
            assert [names[base + h] for h in range(geo.kv_heads)] == [f"qkv[{l}][{h}]" for h in range(geo.kv_heads)]
            assert w[0, F(Op.ATTN_DRAIN, "TASK_WAIT_TARGET")] == (geo.heads_per_kv + 2) * per_head
            sb = int(w[0, F(Op.ATTN_DRAIN, "TASK_SIGNAL_BASE")])
            for r in range(geo.rows):
                for h in range(geo.kv_heads):
                    assert names[sb + r * geo.kv_heads + h] == f"combine[{l}][{r}][{h}]"
        if nt.op == Op.ATTN_COMBINE:
            for i in range(len(w)):
                r, h = int(nt.fields["ROW"][i]), int(nt.fields["KV_HEAD"][i])
                assert names[w[i, H.WAIT0]] == f"combine[{l}][{r}][{h}]"
                assert names[w[i, H.SIGNAL]] == f"attn_done[{l}][{h}]"
        # O-proj split s waits only on the attention of KV head s: its combine, or where the
        # O-projection merges the splits itself (one row) the splits' counter, their count
        if nt.op == Op.O_PROJ:
            for i in range(len(w)):
                s = int(nt.fields["SPLIT"][i])
                assert w[i, H.WAIT1] == -1
                if geo.o_proj_merge:
                    assert names[w[i, H.WAIT0]] == f"combine[{l}][0][{s}]"
                    assert w[i, F(Op.O_PROJ, "MERGE_SPLITS")] != 0
                else:
                    assert names[w[i, H.WAIT0]] == f"attn_done[{l}][{s}]" and w[i, H.TARGET0] == geo.rows
                    assert w[i, F(Op.O_PROJ, "MERGE_SPLITS")] == 0
        # the next layer waits norm[l] (target rows), or where it folds that
        # norm (NORM_IN) what the norm task waits on
        if nt.op == Op.QKV_PROJ and l > 0 and geo.qkv_combined(l):
            # it adds the combine itself: the norm's waits with the combine's replaced by the
            # combine's own (the down claims)
            (comb,) = [m for m in lw.nodes if m.kind == "moe_combine" and m.layer == l - 1]
            (norm,) = [m for m in lw.nodes if m.kind == "norm" and m.layer == l - 1]
            pairs = lambda x: {(int(x[c]), int(x[t])) for c, t in ((H.WAIT0, H.TARGET0), (H.WAIT1, H.TARGET1))  # noqa: E731
                               if x[c] >= 0}
            cw, nw = comb.words.astype(np.int64)[0], norm.words.astype(np.int64)[0]
            want = {p for p in pairs(nw) if p[0] != cw[H.SIGNAL]} | pairs(cw)
            assert all(pairs(x) == want for x in w) and len(want) == 2, (pairs(w[0]), want)
        elif nt.op == Op.QKV_PROJ and l > 0 and geo.folded(l):
            (norm,) = [m for m in lw.nodes if m.kind == "norm" and m.layer == l - 1]
            nw = norm.words.astype(np.int64)[0]
            assert (w[:, [H.WAIT0, H.TARGET0, H.WAIT1, H.TARGET1]] == nw[[H.WAIT0, H.TARGET0, H.WAIT1, H.TARGET1]]).all()
        elif nt.op == Op.QKV_PROJ and l > 0:
            assert (w[:, H.WAIT0] == names.index(f"norm[{l - 1}]")).all()
            assert (w[:, H.TARGET0] == geo.rows).all() and (w[:, H.WAIT1] == -1).all()
        if nt.op == Op.MOE_COMBINE and geo.router_combine and geo.rows == 1 and not geo.split_down:
            # one row where the router folds the combine: the down count is the compiler's
            # (the row's top-k experts' tiles), so the combine waits on the down claims alone
            assert names[w[0, H.WAIT0]] == f"moe_down[{l}]" and w[0, H.WAIT1] == -1
            assert w[0, H.TARGET0] == min(geo.num_experts, geo.top_k) * geo.down_tiles
        elif nt.op == Op.MOE_COMBINE:
            assert names[w[0, H.WAIT0]] == f"route[{l}]" and w[0, H.TARGET0] == 1
            # split_down: the up claims write moe_out (no down claims)
            assert names[w[0, H.WAIT1]] == (f"moe_up[{l}]" if geo.split_down else f"moe_down[{l}]")
            assert w[0, H.TARGET1] == abi.dyn(geo.target_words.moe_down_count(l))
        if nt.op == Op.MOE_DOWN_DRAIN or (nt.op == Op.MOE_UPGATE_DRAIN and not geo.routed_claims):
            assert names[w[0, H.WAIT0]] == f"route[{l}]" and w[0, H.TARGET0] == 1
        if nt.op == Op.MOE_UPGATE_DRAIN and geo.routed_claims:
            # routed claims: the claimers rank the rows from the router's partials (every router task)
            # (where the router folds the norm, the claimer waits on the norm task itself too)
            # (where it folds the combine instead (router_combined) the claims wait on that norm
            # themselves, after the ranking: TASK_WAIT_BASE)
            waits = {names[w[0, c]]: w[0, t] for c, t in ((H.WAIT0, H.TARGET0), (H.WAIT1, H.TARGET1)) if w[0, c] >= 0}
            header_norm = geo.folded(l) and not geo.router_combined(l)
            assert set(waits) == ({f"router[{l}]", f"norm[{l - 1}]"} if header_norm else {f"router[{l}]"})
            assert waits[f"router[{l}]"] == geo.router_splits * -(-geo.num_experts // geo.router_bn)
            tw = int(w[0, F(Op.MOE_UPGATE_DRAIN, "TASK_WAIT_BASE")])
            assert (names[tw] == f"norm[{l - 1}]") if geo.router_combined(l) else tw == -1
        if nt.op == Op.MOE_DOWN_DRAIN:
            base = int(w[0, F(Op.MOE_DOWN_DRAIN, "TASK_WAIT_BASE")])
            assert names[base] == f"moe_up[{l}][0]" and names[base + geo.num_experts - 1] == f"moe_up[{l}][{geo.num_experts - 1}]"
            assert w[0, F(Op.MOE_DOWN_DRAIN, "TASK_WAIT_TARGET")] == geo.up_tiles
        if nt.op == Op.FFN_DOWN:
            # split s waits only for the upgate tiles that produce its K range
            splits = nt.fields["SPLIT"]
            assert len({int(x) for x in w[splits == 0, H.WAIT0]} & {int(x) for x in w[splits == 1, H.WAIT0]}) == 0
        if nt.op == Op.LM_HEAD:
            assert (w[:, H.SIGNAL] == -1).all() and (w[:, H.LAYER] == geo.num_layers).all()

    # order: topological (the signallers of every wait come earlier)
    pos = np.arange(len(W))
    last = np.full(C, -1)
    np.maximum.at(last, W[:, H.SIGNAL][W[:, H.SIGNAL] >= 0], pos[W[:, H.SIGNAL] >= 0])
    for wc in (H.WAIT0, H.WAIT1):
        has = W[:, wc] >= 0
        assert (last[W[has, wc]] < pos[has]).all()

    # assign: under an order of plain waves (the fifteenth session's tuned; today's
    # deals a MoE layer's attention and O-projection over half the SMs, checked in
    # tests/test_order_file.py) static task k -> SM (k - its layer's first task) mod
    # num_sms (the default cursor restarts every layer); claimers cover every SM once
    # per node
    plain = lowered(model, rows, PLAIN)
    Wp = live_words(plain)
    posp = np.arange(len(Wp))
    static = plain.g_claimer < 0
    layer = Wp[:, H.LAYER]
    first = {int(l): int(np.flatnonzero(layer == l)[0]) for l in np.unique(layer)}
    start = np.array([first[int(l)] for l in layer])
    assert (plain.sm[static] == (posp[static] - start[static]) % geo.num_sms).all()
    for nt in lw.nodes:
        if nt.claimer:
            assert sorted(lw.sm[lw.g_node == nt.index].tolist()) == list(range(geo.num_sms))

    # encode round-trips
    S, T, _ = lw.tasks.shape
    assert S == geo.num_sms and T == lw.task_counts.max()
    rebuilt = np.concatenate([lw.tasks[s, : lw.task_counts[s]] for s in range(S)])
    per_sm_order = np.lexsort((pos, lw.sm))
    assert np.array_equal(rebuilt, W[per_sm_order].astype(np.int32))
    assert (lw.tasks[np.arange(T)[None, :] >= lw.task_counts[:, None]] == 0).all()


@pytest.mark.parametrize("model", ["tiny-moe", "north-mini-code"])
def test_orders_differ_in_moe_layers(model):
    seqs = {}
    for o in ORDERS:
        lw = lowered(model, 2, o)  # batch 2: every routing wave (batch 1 has routed claims)
        key = "moe:sliding"
        seqs[o] = [name for name, _ in lw.waves[key]]
        # the global list follows the YAML: wave names of the MoE layers
        assert len(seqs[o]) >= 8
    assert len({tuple(v) for v in seqs.values()}) == 3, seqs
    assert seqs["tuned"].index("router") < seqs["tuned"].index("attn")
    assert seqs["attention-first"].index("o_proj") < seqs["attention-first"].index("router")
    assert any(w.startswith("interleave(") for w in seqs["interleaved"])


def test_interleave_alternates_and_claimers_cover_sms():
    lw = lowered("tiny-moe", 2, "interleaved")
    nodes = [lw.nodes[i].kind for i in lw.g_node]
    # layer 1 (sliding, MoE): attention tasks and MoE up claimers alternate
    layer1 = [k for k, n in zip(nodes, lw.g_node) if lw.nodes[n].layer == 1]
    i = layer1.index("attn")
    assert layer1[i + 1] == "moe_upgate" and layer1[i + 2] in ("attn", "moe_upgate")
    for nt in lw.nodes:
        if nt.claimer:
            assert sorted(lw.sm[lw.g_node == nt.index].tolist()) == list(range(lw.geo.num_sms))


# --------------------------------------------------------------------------
# Each ensures catches a broken state
# --------------------------------------------------------------------------
def test_tile_ensures_catches_gap_and_overlap():
    lw = fresh()
    nt = lw.by_name["L0.o_proj"]
    nt.out_hi = nt.out_hi.copy()
    nt.out_hi[0, 1] -= 1  # a gap
    with pytest.raises(PassError, match="tile: L0.o_proj"):
        tile.ensures(lw)
    nt.out_hi[0, 1] += 2  # an overlap
    with pytest.raises(PassError, match="tile: L0.o_proj"):
        tile.ensures(lw)


def test_depend_ensures_catches_wrong_target_and_wrong_split():
    lw = fresh()
    nt = lw.by_name["L1.qkv"]
    nt.words[0, H.TARGET0] += 1
    with pytest.raises(PassError, match="depend: L1.qkv task 0"):
        depend.ensures(lw)
    lw = fresh()
    op = lw.by_name["L1.o_proj"]
    c = op.words[:, H.WAIT0]
    # make split 0 wait on KV head 1's combine counter
    other = int(c[op.fields["SPLIT"] == 1][0])
    op.words[op.fields["SPLIT"] == 0, H.WAIT0] = other
    with pytest.raises(PassError, match="attention of KV head 0"):
        depend.ensures(lw)


def test_order_ensures_catches_non_topological():
    lw = fresh()
    # move the last task (an LM head tile, waits the final norm) to the front
    perm = np.r_[len(lw.g_node) - 1, np.arange(len(lw.g_node) - 1)]
    lw.g_node, lw.g_task, lw.g_claimer = lw.g_node[perm], lw.g_task[perm], lw.g_claimer[perm]
    with pytest.raises(PassError, match=r"not topological: lm_head .* waits norm\[5\]"):
        order.ensures(lw)


def test_assign_and_encode_ensures():
    lw = fresh()
    k = int(np.flatnonzero(lw.g_claimer < 0)[3])
    lw.sm = lw.sm.copy()
    lw.sm[k] = (lw.sm[k] + 1) % lw.geo.num_sms
    with pytest.raises(PassError, match="assign"):
        assign.ensures(lw)
    lw = fresh()
    lw.tasks = lw.tasks.copy()
    lw.tasks[0, 0, H.SIGNAL] += 1
    with pytest.raises(PassError, match="decode back"):
        encode.ensures(lw)


def test_depend_fails_loudly_on_more_than_two_waits(monkeypatch):
    """A consumer that needs three unrelated counters is an error, not a guess."""
    from megac.ops import REGISTRY

    combine = REGISTRY[Op.MOE_COMBINE]
    orig = combine.access

    def patched(accum, w, idx, layer, geo):
        orig(accum, w, idx, layer, geo)
        # also read the O-proj partials: route + moe_down + oproj
        accum.add("o_part", False, idx, (layer, layer + 1), (0, geo.kv_heads), (0, geo.rows), (0, geo.hidden))

    monkeypatch.setattr(combine, "access", patched)
    with pytest.raises(PassError, match=r"depend: L1.moe_combine: a task needs 3 waits \(max 2\): "
                                        r"\['route\[1\]', 'oproj\[1\]', 'moe_down\[1\]'\]"):
        fresh()


# --------------------------------------------------------------------------
# Wave order YAML
# --------------------------------------------------------------------------
def _yaml(tmp_path: Path, moe_waves: str) -> str:
    p = tmp_path / "custom.yaml"
    p.write_text(
        "name: custom\nlayers:\n"
        "  dense: [qkv, ffn_upgate, attn, attn_combine, ffn_down, o_proj, norm]\n"
        f"  moe: {moe_waves}\n"
        "final: [lm_head]\n"
    )
    return str(p)


MOE_OK = "[qkv, router, topk, route_finalize, moe_gather, attn, attn_combine, moe_upgate, moe_down, moe_combine, o_proj, norm]"


@pytest.mark.parametrize("waves,match", [
    (MOE_OK.replace(" o_proj,", ""), r"wave\(s\) o_proj missing"),
    (MOE_OK.replace("topk,", "topk, topk,"), r"wave 'topk' is repeated"),
    (MOE_OK.replace("router,", "routr,"), r"unknown wave 'routr'"),
    ("[qkv, {interleave: [attn]}]", r"interleave takes a list of two"),
])
def test_yaml_rejects_bad_wave_lists(tmp_path, waves, match):
    with pytest.raises(OrderError, match=match) as err:
        load_order(_yaml(tmp_path, waves))
    assert "\n" not in str(err.value)


def test_yaml_custom_order_and_unknown_order(tmp_path):
    path = _yaml(tmp_path, MOE_OK)
    lw = lower(spec_of("tiny-moe"), path, 1, 4096)
    assert [w for w, _ in lw.waves["moe:sliding"]][:2] == ["qkv", "router"]
    with pytest.raises(OrderError, match="unknown wave order 'nope'"):
        load_order("nope")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nlayers:\n  mixture: [qkv]\n")
    with pytest.raises(OrderError, match="unknown layer kind"):
        load_order(str(bad))


def test_order_rejects_topologically_invalid_yaml(tmp_path):
    path = _yaml(tmp_path, MOE_OK.replace("qkv, router, topk", "qkv, topk, router"))
    with pytest.raises(PassError, match=r"not topological: L1.topk .* waits router\[1\]"):
        lower(spec_of("tiny-moe"), path, 2, 4096)  # batch 2: the top-k is a task (not routed claims)


# --------------------------------------------------------------------------
# Plan, pipeline, timing
# --------------------------------------------------------------------------
def test_plan_covers_the_descriptor_and_resets():
    lw = lowered("north-mini-code", 8)
    p = lw.plan
    assert set(p.buffers) == set(abi.DESC_NAMES)
    assert sorted(p.reset) == ["counters", "queue_heads"]
    assert p.buffers["counters"].shape == (len(lw.counters),)
    assert p.buffers["tasks"].shape == lw.tasks.shape
    assert p.buffers["attn_o_part"].shape == (49, lw.geo.max_splits, 8, 32, 128)  # split-major (ABI 4)
    assert p.buffers["moe_x"].shape == (49, 64, 2048)
    assert p.buffers["x_norm"].lifetime == ("L0.norm", "lm_head")
    assert "norm[*]" in p.buffers["x_norm"].guards
    assert "combine[*][*][*]" in p.buffers["attn_o_part"].guards
    assert not p.buffers["x_resid"].reset_per_step
    assert p.weights["w_qkv"].segments[1] == {"part": "k", "rows": [4096, 4608]}
    assert p.weights["w_moe_upgate"].segments[0]["chunk_rows"] == 128  # moe_up_bn / 2 (gate, up)


def test_gate_up_rows():
    perm = gate_up_rows(5, 4)  # chunks of 2 rows: g0 g1 u0 u1 g2 g3 u2 u3 g4 u4
    assert perm.tolist() == [0, 1, 5, 6, 2, 3, 7, 8, 4, 9]
    gate, up = np.arange(5) * 10, np.arange(5) * 10 + 1
    inter = np.concatenate([gate, up])[perm]
    assert inter[:4].tolist() == [0, 10, 1, 11]


def test_bucket_dedupe():
    s = spec_of("north-mini-code")
    groups = bucket_groups(s, 1, s.resolved_context_buckets)
    assert groups == [[1024], [2048], [4096, 8192, 16384, 32768, 65536, 131072, 262144]]
    tm = spec_of("tiny-moe")
    assert bucket_groups(tm, 4, tm.resolved_context_buckets) == [[1024, 2048, 4096]]


def test_compile_one_schedule_fields():
    s = spec_of("tiny-moe")
    sched = compile_one(s, "tuned", rows=2, context=3000, verify=False)
    assert sched.context == 4096 and sched.buckets == [4096]
    assert sched.num_tasks == int(sched.task_counts.sum()) == len(sched.global_order)
    gw = sched.global_words()
    assert np.array_equal(gw[:, H.OPCODE] > 0, np.ones(len(gw), dtype=bool))
    assert sum(sched.tasks_per_opcode.values()) == sched.num_tasks
    assert set(sched.waves) == {"dense:full", "moe:sliding", "moe:full", "final"}
    assert sched.layer_kinds == ["dense:full"] + ["moe:sliding"] * 3 + ["moe:full", "moe:sliding"]
    assert sched.counter_by_name("qkv[1][0]").count == s.heads_per_kv + 2
    assert set(sched.pass_times) >= {"tile", "select", "depend", "order", "assign", "plan", "encode"}
    assert sched.node_names[int(sched.task_node[-1])] == "lm_head"


def test_north_mini_code_all_batch_sizes():
    """Every batch size and bucket of North Mini Code compiles and verifies
    (its compile time is a benchmark, BENCHMARKS.md, not an assertion)."""
    s = spec_of("north-mini-code")
    seen = []
    res = compile_schedules(s, "tuned", progress=seen.append)
    assert len(seen) == len(res.schedules) == 12
    assert set(res.key_map) == {(b, c) for b in BATCHES for c in s.resolved_context_buckets}
    big = res.schedule_for(8, 262144)
    assert big.num_tasks > 30000 and big is res.schedule_for(8, 4096)


def test_parallel_compile_gives_the_same_schedules():
    """``jobs`` > 1 compiles the (batch size, bucket) schedules in worker
    processes; the words, counters and order are those of the sequential run."""
    s = spec_of("tiny-moe")
    one = compile_schedules(s, "tuned", batch_sizes=[1, 2, 4], jobs=1)
    seen = []
    two = compile_schedules(s, "tuned", batch_sizes=[1, 2, 4], jobs=2, progress=seen.append)
    assert one.key_map == two.key_map and len(seen) == len(two.schedules) > 1
    for a, b in zip(one.schedules, two.schedules):
        assert (a.rows, a.context, a.buckets) == (b.rows, b.context, b.buckets)
        assert np.array_equal(a.tasks, b.tasks) and np.array_equal(a.task_counts, b.task_counts)
        assert np.array_equal(a.global_order, b.global_order)
        assert [(c.name, c.producer, c.count, c.count_word) for c in a.counters] == \
               [(c.name, c.producer, c.count, c.count_word) for c in b.counters]
    assert [e["pass"] for e in one.pass_log] == [e["pass"] for e in two.pass_log]


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-moe"])
def test_each_norm_adds_to_the_residual_the_previous_norm_wrote(model):
    """The residual is a chain through the norm slots: per row, in layer
    order (the attention norm before the FFN norm of a sequential layer),
    each ADD_RMSNORM reads the slot the norm before it wrote (the first the
    seeded slot 0) and writes a slot no other norm writes; the last writes
    the final norm's slot, the one LM_HEAD reads."""
    lw = lowered(model, 2)
    geo = lw.geo
    w = live_words(lw)
    norms = w[w[:, H.OPCODE] == Op.ADD_RMSNORM]
    for r in range(geo.rows):
        mine = norms[norms[:, F(Op.ADD_RMSNORM, "ROW")] == r]
        # sequential layers: the attention norm (ADD_ATTN alone) comes first
        seq_first = (mine[:, H.FLAGS] & abi.Flag.ADD_FFN) == 0
        mine = mine[np.lexsort((~seq_first, mine[:, H.LAYER]))]
        assert len(mine) == geo.num_layers * (2 if geo.block == "sequential" else 1)
        slot = 0
        for t in mine:
            assert t[F(Op.ADD_RMSNORM, "RESID_IN")] == slot
            slot = int(t[F(Op.ADD_RMSNORM, "GAMMA")])
        assert slot == geo.final_norm_slot
        assert len(set(mine[:, F(Op.ADD_RMSNORM, "GAMMA")].tolist())) == len(mine)

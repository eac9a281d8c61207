"""Decode graph IR, geometry and the access model."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest

from megac import abi
from megac.abi import H, Op, Queue
from megac.access import (
    Region,
    access_boxes,
    dyn_words,
    group_access,
    logical_shapes,
    queue_subtasks,
    step_inputs,
    subtask_boxes,
    task_access,
)
from megac.geometry import Geometry
from megac.ir import NODE_KINDS, build_graph, check_graph, layer_node_kinds
from megac.spec import load_spec

MODELS = ["tiny-moe", "tiny-llama", "smollm2-135m", "north-mini-code"]


@pytest.fixture(scope="module", params=MODELS)
def spec(request):
    return load_spec(request.param)


# ---------------------------------------------------------------- graph
def test_graph_nodes_edges_and_order(spec):
    g = build_graph(spec)
    check_graph(g)
    L = spec.num_layers
    assert g.graph["order"][-1] == "lm_head"
    assert g.nodes["lm_head"]["layer"] == L
    for l, layer in enumerate(spec.layers):
        kinds = layer_node_kinds(spec.block, layer.ffn)
        for k in kinds:
            n = f"L{l}.{k}"
            assert n in g, n
            assert g.nodes[n]["kind"] == k and g.nodes[n]["layer"] == l
        if layer.ffn == "moe":
            assert f"L{l}.ffn_upgate" not in g and f"L{l}.moe_upgate" in g
        else:
            assert f"L{l}.moe_upgate" not in g and f"L{l}.ffn_down" in g
        assert (f"L{l}.norm_attn" in g) == (spec.block == "sequential")
    n_expected = sum(len(layer_node_kinds(spec.block, layer.ffn)) for layer in spec.layers) + 1
    assert g.number_of_nodes() == n_expected
    for u, v, d in g.edges(data=True):
        assert d["tensor"] in g.nodes[u]["writes"] and d["tensor"] in g.nodes[v]["reads"]


def test_graph_block_structure(spec):
    g = build_graph(spec)
    tensors = g.graph["tensors"]
    assert tensors["w_qkv[0]"].kind == "weight"
    assert tensors["kv_new[0]"].kind == "kv"
    assert tensors["x_resid[0]"].kind == "activation"
    if spec.block == "parallel":
        # attention and FFN both read x_norm[l]; norm adds both
        ffn = "L0.ffn_upgate" if spec.layers[0].ffn == "dense" else "L0.router"
        assert "x_norm[0]" in g.nodes["L0.qkv"]["reads"] and "x_norm[0]" in g.nodes[ffn]["reads"]
        assert g.has_edge("L0.o_proj", "L0.norm")
        assert nx.has_path(g, ffn, "L0.norm") and not nx.has_path(g, "L0.o_proj", ffn)
    else:
        assert nx.has_path(g, "L0.o_proj", "L0.norm_attn")
        assert g.has_edge("L0.norm_attn", "L0.ffn_upgate")
        assert f"x_norm[{spec.num_layers}]" in g.nodes["L0.ffn_upgate"]["reads"]
    # the residual chain: each norm depends on the previous one
    assert g.has_edge(f"L{spec.num_layers - 1}.norm", "lm_head")
    assert set(d["kind"] for _, d in g.nodes(data=True)) <= set(NODE_KINDS)


# ------------------------------------------------------------- geometry
def test_geometry_north_mini_code():
    s = load_spec("north-mini-code")
    g = Geometry.from_spec(s, 8, 262144)
    assert (g.hidden, g.num_heads, g.kv_heads, g.head_dim, g.heads_per_kv) == (2048, 32, 4, 128, 8)
    assert g.q_width == 4096 and g.qkv_width == 4096 + 2 * 512
    assert g.sliding_static_splits == 8  # min(ctx, 4096) / 512
    assert g.max_splits == 32 and g.full_max_splits == 32
    # expert tiles of 256 features: 2 x 768 gate/up rows in 6 tiles, 2048 outputs in 8
    assert g.up_tiles == 6 and g.down_tiles == 8
    assert g.moe_queue_cap == min(128, 8 * 8) * 8
    assert g.attn_queue_cap == 8 * 4 * 32
    assert g.ffn_split_bounds == (0, 1536, 3072)
    assert g.router_split_bounds == tuple(range(0, 2049, 256))  # 8 slices since the thirty-sixth session
    # 262144 vocab rows in 1024-row tiles: 256 tiles, every SM one at least (geometry.auto_lm_bn)
    assert g.lm_bn == 1024 and g.lm_tiles == 256
    assert g.layer_slot[0] == 0 and g.layer_slot[1] == 0 and g.layer_slot[48] == 47
    assert g.full_layers == list(range(0, 49, 4))
    assert g.target_words.total == abi.TargetWords(8, 49).total
    assert g.attn_splits(1) == 1 and g.attn_splits(513) == 2 and g.attn_splits(10**6) == 32
    small = Geometry.from_spec(s, 1, 1024)
    assert small.sliding_static_splits == 2 and small.max_splits == 2
    assert small.split_signature != g.split_signature


def test_geometry_clamps_tiles():
    s = load_spec("tiny-moe")
    g = Geometry.from_spec(s, 2, 4096)
    assert g.router_bn == 8 and g.moe_up_bn == 64 and g.lm_bn == 256
    assert g.o_proj_bn <= g.hidden and g.upgate_bn <= 2 * g.dense_width
    with pytest.raises(ValueError):
        Geometry.from_spec(s, 2, 4096, bogus_bn=3)


def test_dyn_bound():
    s = load_spec("north-mini-code")
    g = Geometry.from_spec(s, 4, 8192)
    tw = g.target_words
    assert g.dyn_bound(tw.attn_splits_full(3)) == g.attn_splits(8192) == 16
    assert g.dyn_bound(tw.attn_splits_sliding(0)) == 8
    assert g.dyn_bound(tw.moe_down_count(5)) == g.moe_queue_cap
    with pytest.raises(ValueError):
        g.dyn_bound(tw.total)


# ---------------------------------------------------------- access model
@pytest.fixture(scope="module")
def nmc_geo():
    return Geometry.from_spec(load_spec("north-mini-code"), 4, 8192)


def _word(op: Op, layer: int, **fields) -> np.ndarray:
    w = np.zeros(abi.TASK_WORDS, dtype=np.int32)
    w[H.OPCODE] = op
    w[H.LAYER] = layer
    w[[H.WAIT0, H.WAIT1, H.SIGNAL]] = -1
    for k, v in fields.items():
        if k in ("WAIT0", "TARGET0", "WAIT1", "TARGET1", "FLAGS"):
            w[H[k]] = v
        else:
            w[abi.field_index(op, k)] = v
    return w


def test_access_qkv_and_attention(nmc_geo):
    g = nmc_geo
    # K head 2 of layer 3 writes kv_new [3, :, K range of head 2]
    acc = task_access(_word(Op.QKV_PROJ, 3, N0=g.q_width + 2 * 128, N_LEN=128, K0=0, K_LEN=2048,
                            PART=1, HEAD=2), g)
    assert acc.reads == [Region("x_norm", ((3, 4), (0, 4), (0, 2048)))]
    assert acc.writes == [Region("kv_new", ((3, 4), (0, 4), (256, 384)))]
    a = task_access(_word(Op.ATTN_DECODE, 1, ROW=2, KV_HEAD=1, SPLIT=5,
                          NUM_SPLITS=abi.dyn(g.target_words.attn_splits_sliding(2)), WINDOW=4096), g)
    reads = {r.buffer: r for r in a.reads}
    assert reads["q"].box == ((1, 2), (2, 3), (1024, 2048))  # query heads 8..15
    word = g.target_words.attn_splits_sliding(2)
    assert Region("target_word", ((word, word + 1),)) in a.reads
    kv = [r.box[2] for r in a.reads if r.buffer == "kv_new"]
    assert sorted(kv) == [(128, 256), (512 + 128, 512 + 256)]
    assert {r.buffer for r in a.writes} == {"attn_o_part", "attn_lse_part"}
    assert all(r.box[1] == (5, 6) and r.box[2] == (2, 3) for r in a.writes)  # split-major: [L, split, row, ...]


def test_access_moe_logical_indexing(nmc_geo):
    g = nmc_geo
    gather = task_access(_word(Op.MOE_GATHER, 5, ROW=1), g)
    assert gather.writes == [Region("moe_x", ((5, 6), (0, 128), (1, 2), (0, 8), (0, 2048)))]
    comb = task_access(_word(Op.MOE_COMBINE, 5, ROW=3, COL0=0, COLS=2048, WAIT0=0, TARGET0=1, WAIT1=1,
                             TARGET1=abi.dyn(g.target_words.moe_down_count(5))), g)
    assert Region("moe_out", ((5, 6), (0, 128), (3, 4), (0, 8), (0, 2048))) in comb.reads
    # a combine task of a feature range reads and writes that range (ABI 10)
    part = task_access(_word(Op.MOE_COMBINE, 5, ROW=3, COL0=512, COLS=256), g)
    assert Region("moe_out", ((5, 6), (0, 128), (3, 4), (0, 8), (512, 768))) in part.reads
    assert part.writes == [Region("ffn_part", ((5, 6), (0, 1), (3, 4), (512, 768)))]
    assert dyn_words(_word(Op.MOE_COMBINE, 5, ROW=3, WAIT0=0, TARGET0=1, WAIT1=1,
                           TARGET1=abi.dyn(g.target_words.moe_down_count(5)))) == \
        [g.target_words.moe_down_count(5)]
    fin = task_access(_word(Op.ROUTE_FINALIZE, 5, UP_COUNT_WORD=g.target_words.moe_up_count(5),
                            DOWN_COUNT_WORD=g.target_words.moe_down_count(5), NUM_ROWS=4), g)
    assert {r.buffer for r in fin.writes} == {"route_slot", "moe_up_queue", "moe_down_queue", "target_word"}


def test_subtasks_and_group_access(nmc_geo):
    g = nmc_geo
    up = queue_subtasks(Queue.MOE_UP, 7, g)
    assert len(up) == g.num_experts * g.up_tiles
    merged = queue_subtasks(Queue.MOE_UP, 7, g, merged=True)
    assert len(merged) == g.num_experts
    # merging keeps the regions: the union of the tiles' writes
    w = [b for b in subtask_boxes(up, g) if b.write][0]
    wm = [b for b in subtask_boxes(merged, g) if b.write][0]
    assert (np.prod(w.hi - w.lo, axis=1).sum()) == (np.prod(wm.hi - wm.lo, axis=1).sum())
    claimer = _word(Op.MOE_DOWN_DRAIN, 7, QUEUE=int(Queue.MOE_DOWN), TASK_WAIT_BASE=100, TASK_WAIT_TARGET=12,
                    TASK_SIGNAL_BASE=900)
    ga = group_access(Queue.MOE_DOWN, 7, g, claimer)
    assert ga.waits == [(100 + e, 12) for e in range(g.num_experts)]
    assert ga.signals == [(900, None)]
    assert ga.reads == [Region("moe_act", ((7, 8), (0, 128), (0, 4), (0, 8), (0, 768)))]
    att = queue_subtasks(Queue.ATTN, 4, g)
    assert len(att) == 4 * 4 * g.full_max_splits
    assert set(att.signal_offset.tolist()) == set(range(16))


def test_access_vectorised_equals_scalar(nmc_geo):
    g = nmc_geo
    words = np.stack([
        _word(Op.O_PROJ, 2, N0=64, N_LEN=64, K0=1024, K_LEN=1024, SPLIT=1),
        _word(Op.ADD_RMSNORM, 2, ROW=3, ATTN_SPLITS=4, FFN_SPLITS=1, GAMMA=3,
              FLAGS=int(abi.Flag.ADD_ATTN | abi.Flag.ADD_FFN)),
        _word(Op.LM_HEAD, 49, N0=2048, N_LEN=1024, K0=0, K_LEN=2048),
        _word(Op.O_PROJ, 5, N0=0, N_LEN=128, K0=0, K_LEN=1024, SPLIT=0),  # same opcode as words[0]: no mix-up
    ])
    boxes = access_boxes(words, g)
    for i in range(len(words)):
        single = task_access(words[i], g)
        # the same regions (buffer, box, read or write), not just as many
        batched = sorted((b.buffer, tuple((int(lo), int(hi)) for lo, hi in zip(b.lo[j], b.hi[j])), b.write)
                         for b in boxes for j in np.flatnonzero(b.task == i))
        alone = sorted([(r.buffer, r.box, False) for r in single.reads] + [(r.buffer, r.box, True) for r in single.writes])
        assert batched == alone, i
        assert len(alone) > 1
    norm = task_access(words[1], g)
    assert Region("o_part", ((2, 3), (0, 4), (3, 4), (0, 2048))) in norm.reads
    assert Region("x_norm", ((3, 4), (3, 4), (0, 2048))) in norm.writes
    lm = task_access(words[2], g)
    assert Region("argmax_part", ((0, 4), (2, 3))) in lm.writes


def test_shapes_and_step_inputs(nmc_geo):
    shapes = logical_shapes(nmc_geo)
    for f in ("x_resid", "x_norm", "q", "attn_o_part", "o_part", "ffn_part", "moe_x", "logits"):
        assert f in shapes and f in abi.DESC_NAMES
    ins = {r.buffer for r in step_inputs(nmc_geo)}
    assert ins == {"x_resid", "x_norm", "target_word", "attn_queue"}


def test_lm_head_tiles_are_automatic_unless_named():
    """lm_bn -1 (the default): the largest of 1024 and 512 vocab rows whose
    tiles still cover every SM, else 256; a named lm_bn wins; split_down
    models keep 256 (their split claims' staged X leaves no room for a
    1024-row tile's output in shared memory)."""
    from megac.geometry import auto_lm_bn
    from models import variant

    assert auto_lm_bn(262144, 132) == 1024  # North Mini Code: 256 tiles
    assert auto_lm_bn(128256, 132) == 512  # 126 tiles of 1024 would leave 6 SMs without one
    assert auto_lm_bn(49152, 132) == 256  # SmolLM2: 96 tiles of 512 would leave 36
    assert auto_lm_bn(49152, 48) == 1024
    smol = load_spec("smollm2-135m")
    assert Geometry.from_spec(smol, 1, 1024).lm_bn == 256
    nmc = load_spec("north-mini-code")
    named = variant(nmc, "nmc-lm", tiles={"lm_bn": 512})
    assert Geometry.from_spec(named, 1, 1024).lm_bn == 512
    split = variant(nmc, "nmc-split", tiles={"split_down": 8, "moe_up_bn": 128})
    assert Geometry.from_spec(split, 8, 1024).lm_bn == 256
    with pytest.raises(ValueError, match="lm_bn"):
        variant(nmc, "nmc-bad", tiles={"lm_bn": -2})

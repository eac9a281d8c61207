"""The bytes a decode step must move (megac.sol_bytes), checked against what
transformers' own models hold, against North Mini Code's dimensions spelled
out by hand, and against a simulation of the routing."""

from __future__ import annotations

import numpy as np
import pytest

from megac.sol_bytes import expected_distinct_experts, step_bytes
from megac.spec import load_spec
from models import hf_model


def _hf_weight_bytes(model, batch_experts: float, num_experts: int) -> float:
    """bf16 bytes of transformers' parameters one step reads: all of them
    (a tied embedding is the LM head, counted once), less the experts no
    row routes to."""
    total = expert = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if ".experts." in name:
            expert += p.numel()
    return 2.0 * (total - expert * (1 - batch_experts / num_experts))


def _hf_kv_bytes(config, batch: int, context: int) -> float:
    """bf16 K and V that every layer of transformers' config attends to."""
    out = 0
    for kind in config.layer_types:
        tokens = min(context, config.sliding_window) if kind == "sliding_attention" else context
        out += batch * tokens * 2 * config.num_key_value_heads * config.head_dim * 2
    return float(out)


@pytest.mark.parametrize("batch,context", [(1, 5), (1, 40), (4, 40)])
def test_moe_model_matches_what_transformers_holds(batch, context):
    spec = load_spec("tiny-moe")
    model = hf_model(spec)
    assert model.config.tie_word_embeddings
    got = step_bytes(spec, batch, context)
    E, k = spec.moe.num_experts, spec.moe.top_k
    assert got.active_experts == pytest.approx(E * (1 - (1 - k / E) ** batch))
    assert got.weights == pytest.approx(_hf_weight_bytes(model, got.active_experts, E))
    assert got.kv == pytest.approx(_hf_kv_bytes(model.config, batch, context))
    assert got.total == got.weights + got.kv


def test_dense_model_matches_what_transformers_holds():
    spec = load_spec("tiny-llama")
    model = hf_model(spec)
    got = step_bytes(spec, 2, 33)
    embed = 0 if spec.tie_embeddings else 2 * (spec.vocab_size - 2) * spec.hidden_size  # 2 rows read of the table
    assert got.weights == pytest.approx(_hf_weight_bytes(model, 0, 1) - embed)
    per_layer = 2 * 33 * 2 * model.config.num_key_value_heads * (model.config.hidden_size // model.config.num_attention_heads) * 2
    assert got.kv == pytest.approx(model.config.num_hidden_layers * per_layer)


def test_north_mini_code_by_hand():
    # the model card's dimensions: hidden 2048, 49 layers (layer 0 dense, 3072 wide), Q 4096 wide,
    # 4 KV heads of 128, 128 experts of 768 top-8, vocabulary 262144 tied, full attention at 0, 4, ..., 48
    # and a 4096-token window on the other 36
    d = 2048
    attn = d * (4096 + 2 * 4 * 128) + 4096 * d + d  # QKV, O, the layer's norm
    weights = 262144 * d + d + 49 * attn + 3 * d * 3072 + 48 * (128 * d + 8 * 3 * d * 768)
    kv = 2 * 4 * 128 * 2 * (13 * 8192 + 36 * 4096)
    got = step_bytes(load_spec("north-mini-code"), 1, 8192)
    assert got.weights == 2 * weights
    assert got.kv == kv
    assert round(got.total / 1e9, 3) == 7.131


def test_distinct_experts_match_a_simulated_routing():
    rng = np.random.default_rng(7)
    E, k, rows, trials = 128, 8, 8, 4000
    counts = [len({int(e) for _ in range(rows) for e in rng.choice(E, k, replace=False)}) for _ in range(trials)]
    # mean of 4000 draws; its standard error is ~0.05
    assert expected_distinct_experts(E, k, rows) == pytest.approx(np.mean(counts), abs=0.25)
    # skewed chances: each row picks expert e with chance p_e (independent draws of k distinct experts
    # weighted by p are not exactly that, so test the formula's own model: independent Bernoulli per expert)
    p = rng.dirichlet(np.ones(E)) * k
    p = np.clip(p, 0, 1)
    hits = rng.random((trials, rows, E)) < p
    assert expected_distinct_experts(E, k, rows, p) == pytest.approx(hits.any(axis=1).sum(axis=1).mean(), abs=0.25)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="positive"):
        step_bytes(load_spec("tiny-moe"), 0, 8)


def test_cost_model_reads_a_sliding_layer_s_whole_window():
    # the cost model (which times partials and activations too) once took a sliding layer's split count from
    # the context (16 at 8K) instead of its 4096-token window (8), so it read half of that layer's KV
    from megac.abi import Op
    from megac.costmodel import CostParams, simulate
    from megac.passes.pipeline import compile_one

    sched = compile_one(load_spec("north-mini-code"), order="tuned", rows=1, context=8192)
    sim = simulate(sched, CostParams(context=8192))
    kv = 4096 * 128 * 2 * 2  # one KV head's window of K and V
    per_split = 8 * 128 * 2 + 8 * (128 + 1) * 4  # its 8 query heads in, their partial outputs and LSEs out
    want = 36 * 4 * (kv + 8 * per_split)  # 36 sliding layers x 4 KV heads, 8 splits each
    assert sim.nbytes[sim.opcode == int(Op.ATTN_DECODE)].sum() == want

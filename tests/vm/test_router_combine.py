"""The router folding the MoE combine (target tile ``router_combine: 1``,
schedules of one row where the norm folds: ROUTER_GEMM flag COMBINE_IN).
A folded layer's router tile adds its K range of the new residual itself
(the residual slot, the O-projection partials, the previous layer's expert
outputs score-weighted in k order) and multiplies bf16(gamma * x), not
normalised; its waits are the O-projection's and the down claims', not the
combine's. The ranking is the normalised logits' (1 / rms > 0), and
ROUTE_FINALIZE (flagged COMBINE_IN) scales the selected logits by 1 / rms
of the norm task's residual for the weights. Other roundings than the
folded norm's (bf16(gamma * x) against bf16(gamma * bf16(x / rms))), so the
check is against transformers' fp32 model and the default schedule's
tokens, in the VM's fast mode and in its checked mode (every read against
the counters' happens-before order: the router must wait for every down
claim and O-projection tile it reads)."""

from __future__ import annotations

import pytest
import torch

from engines import run
from megac.abi import Flag, H, Op, field_index
from megac.passes.pipeline import compile_one, compile_schedules
from megac.spec import load_spec
from megac.weights import random_weights
from models import assert_steps_match_hf, hf_model, tasks_of, variant


def _spec(on: int, top_k: int | None = None):
    moe = load_spec("tiny-moe")
    over = {"top_k": top_k} if top_k else None
    return variant(moe, f"rc-{on}-{top_k}", moe=over, tie_embeddings=False,
                   tiles={"router_combine": on})


def test_folded_routers_carry_the_combine_and_wait_on_its_producers():
    base, comb = compile_one(_spec(0), "tuned", 1, 1024), compile_one(_spec(1), "tuned", 1, 1024)
    assert comb.tasks_per_opcode == base.tasks_per_opcode  # the combine and the norm still run
    geo = comb.geometry
    combine_signals = {int(w[H.SIGNAL]) for w in tasks_of(comb, Op.MOE_COMBINE)}
    norm_signals = {int(w[H.SIGNAL]) for w in tasks_of(comb, Op.ADD_RMSNORM)}
    routers = tasks_of(comb, Op.ROUTER_GEMM)
    seen = set()
    for w in routers:
        layer = int(w[H.LAYER])
        on = geo.folded(layer)
        assert geo.router_combined(layer) == on
        # every router of the model is unnormalised; the folded ones fold the combine
        assert w[H.FLAGS] & Flag.COMBINE_IN and not w[H.FLAGS] & Flag.NORM_IN, layer
        f = lambda n: int(w[field_index(Op.ROUTER_GEMM, n)])  # noqa: E731
        if not on:  # the residual form: the slot the norm writing its x_norm slot writes
            assert f("NORM_LAYER") == -1 and f("NORM_ATTN_SPLITS") == 0
            assert f("NORM_RESID_IN") == f("X_SLOT") == geo.norm_input_slot(layer)
            continue
        seen.add(layer)
        assert f("NORM_LAYER") == layer - 1 and f("NORM_FFN_SPLITS") == 0
        assert f("NORM_ATTN_SPLITS") == geo.kv_heads
        # the down claims and the O-projection, never the combine or a norm task
        waits = {int(w[H.WAIT0]), int(w[H.WAIT1])} - {-1}
        assert len(waits) == 2 and not waits & (combine_signals | norm_signals), layer
    assert seen and seen == {l for l in geo.moe_layers if geo.folded(l)}
    # the up claims of such a layer wait on the norm writing their rows themselves (after the
    # ranking), the claimer's header on the router alone: the norm ends after the router now
    for w in tasks_of(comb, Op.MOE_UPGATE_DRAIN):
        layer = int(w[H.LAYER])
        tw = int(w[field_index(Op.MOE_UPGATE_DRAIN, "TASK_WAIT_BASE")])
        header = {int(w[H.WAIT0]), int(w[H.WAIT1])} - {-1}
        if layer in seen:
            assert tw in norm_signals and not header & norm_signals, layer
        else:
            assert tw == -1, layer
    for w in tasks_of(comb, Op.ROUTE_FINALIZE):  # every ranking finalize scales (the residual of the norm
        layer = int(w[H.LAYER])                   # writing the layer's input)
        assert w[H.FLAGS] & Flag.COMBINE_IN
        assert int(w[field_index(Op.ROUTE_FINALIZE, "RESID_SLOT")]) == geo.norm_input_slot(layer)
    # the default's routers fold the norm; two rows fold nothing, but stay unnormalised, and
    # their top-k tasks scale the weights
    assert not (tasks_of(base, Op.ROUTER_GEMM)[:, H.FLAGS] & int(Flag.COMBINE_IN)).any()
    two = compile_one(_spec(1), "tuned", 2, 1024)
    assert two.geometry.router_combine and not any(two.geometry.router_combined(l) for l in two.geometry.moe_layers)
    r2 = tasks_of(two, Op.ROUTER_GEMM)
    assert (r2[:, H.FLAGS] & int(Flag.COMBINE_IN)).all()
    assert (r2[:, field_index(Op.ROUTER_GEMM, "NORM_LAYER")] == -1).all()
    t2 = tasks_of(two, Op.ROUTER_TOPK)
    assert len(t2) and (t2[:, H.FLAGS] & int(Flag.COMBINE_IN)).all()


def test_router_combine_is_batch_invariant():
    """A row alone (the one-row schedule, which folds the combine) and the
    same row in ragged batches (the residual form): the same tokens and
    bit-identical logits, in fast and checked mode. The folded router's x is
    the norm task's residual bit for bit, and both rank and scale alike."""
    spec = _spec(1)
    w = random_weights(spec, seed=29)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for n in (3, 14, 9)]
    scheds = compile_schedules(spec, batch_sizes=[1, 2, 4], buckets=[1024])
    for mode in ("fast", "checked"):
        batch = run(spec, w, scheds, prompts, max_tokens=6, eos_token_ids=[], return_logits=True, mode=mode)
        for p, b in zip(prompts, batch):
            alone = run(spec, w, scheds, [p], max_tokens=6, eos_token_ids=[], return_logits=True, mode=mode)[0]
            assert alone.tokens == b.tokens, mode
            assert all(torch.equal(x, y) for x, y in zip(alone.logits, b.logits)), mode


@pytest.mark.parametrize("top_k", [None, 3])
def test_router_combine_matches_transformers_and_the_default_tokens(top_k):
    """One row (COMBINE_IN) and two (the fold as before) through one engine:
    every step's logits within assert_steps_match_hf's tolerance of
    transformers' fp32 model, and the default schedule's greedy tokens."""
    spec, base = _spec(1, top_k), _spec(0, top_k)
    w = random_weights(spec, seed=17)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for n in (9, 6)]
    model = hf_model(spec, w)
    want = [o.tokens for o in run(base, w, compile_schedules(base, batch_sizes=[1, 2], buckets=[1024]), prompts,
                                  max_tokens=5, eos_token_ids=[])]
    scheds = compile_schedules(spec, batch_sizes=[1, 2], buckets=[1024])
    for mode in ("fast", "checked"):
        for n in (1, 2):
            out = run(spec, w, scheds, prompts[:n], max_tokens=5, eos_token_ids=[], return_logits=True, mode=mode)
            for p, o, ref in zip(prompts, out, want):
                assert o.tokens == ref, (mode, n)
                assert_steps_match_hf(model, p, o, (mode, n))


def test_router_combine_logits_differ_from_the_fold_only_in_rounding():
    """The two schedules differ (another rounding of the router input, and
    the weights' 1 / rms from another sum order), by little: a test that
    passed because COMBINE_IN were ignored would see identical logits."""
    spec, base = _spec(1), _spec(0)
    w = random_weights(spec, seed=23)
    prompt = [torch.randint(0, spec.vocab_size, (8,), generator=torch.Generator().manual_seed(2)).tolist()]
    a = run(base, w, compile_schedules(base, batch_sizes=[1], buckets=[1024]), prompt, max_tokens=3,
            eos_token_ids=[], return_logits=True)[0]
    b = run(spec, w, compile_schedules(spec, batch_sizes=[1], buckets=[1024]), prompt, max_tokens=3,
            eos_token_ids=[], return_logits=True)[0]
    diffs = [float((x - y).abs().max() / x.abs().max()) for x, y in zip(a.logits, b.logits)]
    assert max(diffs) > 0 and max(diffs) < 2e-2, diffs


def test_router_combine_is_zero_or_one():
    moe = load_spec("tiny-moe")
    with pytest.raises(ValueError, match="router_combine"):
        variant(moe, "bad", tiles={"router_combine": 2})

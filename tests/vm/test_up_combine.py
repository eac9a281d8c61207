"""The routed up claims' fold of the norm with the MoE combine (target tile
``up_combine: 1``; schedules of one row where the router folds the combine:
MOE_UPGATE_DRAIN flagged NORM_IN and ADD_MOE). A claimed up tile of such a
layer stages the norm that writes its rows itself: the residual, the
O-projection partials and the previous layer's expert outputs
score-weighted in k order, then normalised, as the norm task computes
x_norm, so the same bits. It waits on nothing: the router's counter (the
claimer's header wait) already orders every plane that norm adds, because
the router's tiles add them too. No task reads that layer's x_norm slot
any more, so its norm writes the residual alone (RESID_ONLY). The logits
must equal the default schedule's exactly, in the VM's fast mode and in its
checked mode (every read against the counters' happens-before order). A VM
that read x_norm would read a slot nothing wrote; one that ignored ADD_MOE
would leave the experts out of the expert input."""

from __future__ import annotations

import pytest
import torch

from engines import assert_same_bits_as, edited_step
from megac.abi import Flag, H, Op, field_index
from megac.errors import BadTaskError
from megac.passes.pipeline import compile_one
from megac.spec import load_spec
from megac.weights import random_weights
from models import tasks_of, variant


def _spec(on: int, router: int = 1, qkv: int = 1):
    moe = load_spec("tiny-moe")
    tiles = {"up_combine": on, "router_combine": router, "qkv_combine": qkv}
    return variant(moe, f"uc-{on}-{router}-{qkv}", tie_embeddings=False, tiles=tiles)


def test_folding_claimers_carry_the_norm_and_their_claims_wait_on_nothing():
    base, comb = compile_one(_spec(0), "tuned", 1, 1024), compile_one(_spec(1), "tuned", 1, 1024)
    assert comb.tasks_per_opcode == base.tasks_per_opcode  # the norm still runs (the residual)
    geo = comb.geometry
    seen = set()
    for w, b in zip(tasks_of(comb, Op.MOE_UPGATE_DRAIN), tasks_of(base, Op.MOE_UPGATE_DRAIN)):
        layer = int(w[H.LAYER])
        f = lambda n: int(w[field_index(Op.MOE_UPGATE_DRAIN, n)])  # noqa: E731
        if not geo.up_combined(layer):
            assert not w[H.FLAGS] & Flag.NORM_IN and f("NORM_LAYER") == 0, layer
            continue
        seen.add(layer)
        assert w[H.FLAGS] & Flag.NORM_IN and w[H.FLAGS] & Flag.ADD_MOE, layer
        assert (f("NORM_LAYER"), f("NORM_FFN_SPLITS"), f("NORM_ATTN_SPLITS")) == (layer - 1, 0, geo.kv_heads)
        # the default's claims waited on the norm that writes their rows; these on nothing
        assert b[field_index(Op.MOE_UPGATE_DRAIN, "TASK_WAIT_BASE")] >= 0, layer
        assert f("TASK_WAIT_BASE") == -1, layer
        # the same header waits (the router)
        assert (w[H.WAIT0], w[H.WAIT1]) == (b[H.WAIT0], b[H.WAIT1]), layer
    assert seen and seen == {l for l in geo.moe_layers if geo.router_combined(l)}
    # the norms whose x_norm slot those claims fold write the residual alone
    for w in tasks_of(comb, Op.ADD_RMSNORM):
        nxt = int(w[H.LAYER]) + 1
        assert bool(w[H.FLAGS] & Flag.RESID_ONLY) == (nxt < geo.num_layers and geo.up_combined(nxt)), nxt - 1
    assert not any(w[H.FLAGS] & Flag.RESID_ONLY for w in tasks_of(base, Op.ADD_RMSNORM))


def test_up_combine_needs_the_router_fold_and_one_row():
    """Without router_combine nothing orders the norm's planes before the
    claims (they would need two waits): no layer folds; at two rows the
    claims' rows are not the norm's rows 0..: none either, the same tasks
    as the default's."""
    geo = compile_one(_spec(1, router=0), "tuned", 1, 1024).geometry
    assert not any(geo.up_combined(l) for l in geo.moe_layers)
    two, two_base = compile_one(_spec(1), "tuned", 2, 1024), compile_one(_spec(0), "tuned", 2, 1024)
    assert not any(two.geometry.up_combined(l) for l in two.geometry.moe_layers)
    assert (two.tasks == two_base.tasks).all()


@pytest.mark.parametrize("qkv", [0, 1])
def test_up_combine_gives_the_default_logits_bit_for_bit(qkv):
    """One row (the fold) and ragged batches through one engine, fast and
    checked: every step's logits equal the schedule's without the fold
    exactly (the claims' x is the norm task's x_norm, bit for bit)."""
    spec, base = _spec(1, qkv=qkv), _spec(0, qkv=qkv)
    w = random_weights(spec, seed=41)
    g = torch.Generator().manual_seed(17)
    prompts = [torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for n in (9, 5, 11)]
    for ps in ([prompts[0]], prompts):
        assert_same_bits_as(base, spec, w, ps, (qkv, len(ps)))


def test_a_folding_claimer_without_add_moe_is_refused():
    """NORM_IN without ADD_MOE on a claimer (the combine's partial would be
    needed, which nothing orders before the claims) is a clear error naming
    the task, not a run."""
    def edit(tasks):
        u = (tasks[..., H.OPCODE] == int(Op.MOE_UPGATE_DRAIN)) & ((tasks[..., H.FLAGS] & int(Flag.NORM_IN)) != 0)
        assert u.any()
        tasks[..., H.FLAGS][u] &= ~int(Flag.ADD_MOE)

    with pytest.raises(BadTaskError, match="MOE_UPGATE_DRAIN: NORM_IN on a routed claimer needs ADD_MOE"):
        edited_step(_spec(1), edit, seed=5, prompt=[2, 7, 1, 8, 2])()


def test_add_moe_on_a_claimer_needs_no_ffn_partial():
    def edit(tasks):
        u = (tasks[..., H.OPCODE] == int(Op.MOE_UPGATE_DRAIN)) & ((tasks[..., H.FLAGS] & int(Flag.NORM_IN)) != 0)
        tasks[..., field_index(Op.MOE_UPGATE_DRAIN, "NORM_FFN_SPLITS")][u] = 1

    with pytest.raises(BadTaskError, match="MOE_UPGATE_DRAIN.*NORM_FFN_SPLITS 0"):
        edited_step(_spec(1), edit, seed=5, prompt=[2, 7, 1, 8, 2])()


def test_up_combine_is_zero_or_one():
    moe = load_spec("tiny-moe")
    with pytest.raises(ValueError, match="up_combine"):
        variant(moe, "bad", tiles={"up_combine": 2})

"""The QKV tiles' fold adding the MoE combine (target tile ``qkv_combine:
1``, schedules of one row where the norm folds: QKV_PROJ flagged NORM_IN
and ADD_MOE). A folded layer's QKV tile adds the previous layer's expert
outputs, score-weighted in k order, to the residual and the O-projection
partials itself, as ADD_RMSNORM with ADD_MOE adds them (MOE_COMBINE's sum,
added last as the norm adds that task's partial), then normalises: the
norm task's x_norm bit for bit. So its waits are the down claims' and the
O-projection's, not the combine's, and nothing else changes: the logits
must equal the default schedule's exactly, in the VM's fast mode and in
its checked mode (every read against the counters' happens-before order:
the QKV tile must wait for every down claim it reads). A VM that ignored
ADD_MOE would leave the experts out of the attention's input."""

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


def _spec(on: int, router: int = 0, fused: int = 0):
    moe = load_spec("tiny-moe")
    tiles = {"qkv_combine": on, "router_combine": router, "fused_combine": fused}
    return variant(moe, f"qc-{on}-{router}-{fused}", tie_embeddings=False, tiles=tiles)


@pytest.mark.parametrize("router", [0, 1])
def test_folded_qkv_tiles_add_the_combine_and_wait_on_its_producers(router):
    base, comb = compile_one(_spec(0, router), "tuned", 1, 1024), compile_one(_spec(1, router), "tuned", 1, 1024)
    assert comb.tasks_per_opcode == base.tasks_per_opcode  # the combine still runs (the norm reads it)
    geo = comb.geometry
    combine_signals = {int(w[H.SIGNAL]) for w in tasks_of(comb, Op.MOE_COMBINE)}
    norm_signals = {int(w[H.SIGNAL]) for w in tasks_of(comb, Op.ADD_RMSNORM)}
    seen = set()
    for w, b in zip(tasks_of(comb, Op.QKV_PROJ), tasks_of(base, Op.QKV_PROJ)):
        layer = int(w[H.LAYER])
        f = lambda n: int(w[field_index(Op.QKV_PROJ, n)])  # noqa: E731
        if not geo.qkv_combined(layer):
            assert not w[H.FLAGS] & Flag.ADD_MOE, layer
            assert (w[H.FLAGS], w[H.WAIT0], w[H.WAIT1]) == (b[H.FLAGS], b[H.WAIT0], b[H.WAIT1]), layer
            continue
        seen.add(layer)
        assert w[H.FLAGS] & Flag.NORM_IN and w[H.FLAGS] & Flag.ADD_MOE, layer
        assert f("NORM_LAYER") == layer - 1 and f("NORM_FFN_SPLITS") == 0
        assert f("NORM_ATTN_SPLITS") == geo.kv_heads
        # the down claims and the O-projection, never the combine or a norm task
        waits = {int(w[H.WAIT0]), int(w[H.WAIT1])} - {-1}
        assert len(waits) == 2 and not waits & (combine_signals | norm_signals), layer
        # the default's tile of that layer waited on the combine
        assert {int(b[H.WAIT0]), int(b[H.WAIT1])} & combine_signals, layer
    assert seen and seen == {l for l in geo.moe_layers if geo.folded(l)}
    # two rows fold nothing: the same tasks as the default's
    two, two_base = compile_one(_spec(1, router), "tuned", 2, 1024), compile_one(_spec(0, router), "tuned", 2, 1024)
    assert not any(two.geometry.qkv_combined(l) for l in two.geometry.moe_layers)
    assert (two.tasks == two_base.tasks).all()


@pytest.mark.parametrize("router", [0, 1])
def test_qkv_combine_gives_the_default_logits_bit_for_bit(router):
    """One row (NORM_IN with ADD_MOE) and ragged batches through one engine,
    fast and checked: every step's logits equal the default schedule's
    exactly (the fold's x is the norm task's residual, normalised alike)."""
    spec, base = _spec(1, router), _spec(0, router)
    w = random_weights(spec, seed=31)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for n in (7, 12, 4)]
    for ps in ([prompts[0]], prompts):
        assert_same_bits_as(base, spec, w, ps, (router, len(ps)))


def test_with_both_folds_the_norm_sums_the_experts_and_no_combine_runs():
    """With the router and the QKV tiles both adding the experts themselves,
    the combine inside the norm (fused_combine) leaves nothing to read
    MOE_COMBINE's partial at one row: the norm still folds, no MOE_COMBINE
    task runs, the norm adds the experts (ADD_MOE), and the logits equal the
    schedules' with the combine task bit for bit (checked mode: the norm
    waits on the down claims). Without qkv_combine the norm does not fold
    (a fold would find no combine partial)."""
    on, off = _spec(1, 1, 1), _spec(1, 1, 0)
    one = compile_one(on, "tuned", 1, 1024)
    geo = one.geometry
    assert geo.fused_combine and geo.norm_fold and "MOE_COMBINE" not in one.tasks_per_opcode
    norms = tasks_of(one, Op.ADD_RMSNORM)
    assert sum(bool(w[H.FLAGS] & Flag.ADD_MOE) for w in norms) == len(geo.moe_layers)
    assert any(geo.qkv_combined(l) and geo.router_combined(l) for l in geo.moe_layers)
    assert not compile_one(_spec(0, 1, 1), "tuned", 1, 1024).geometry.norm_fold
    w = random_weights(on, seed=37)
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, on.vocab_size, (n,), generator=g).tolist() for n in (6, 10, 3)]
    for ps in ([prompts[0]], prompts):
        assert_same_bits_as(off, on, w, ps, len(ps))


def test_add_moe_on_a_qkv_tile_needs_no_ffn_partial():
    """A QKV tile flagged ADD_MOE whose NORM_FFN_SPLITS is not 0 (the
    combine added twice) is refused with a clear error naming the task, not
    run."""
    def edit(tasks):
        q = (tasks[..., H.OPCODE] == int(Op.QKV_PROJ)) & ((tasks[..., H.FLAGS] & int(Flag.ADD_MOE)) != 0)
        assert q.any()
        tasks[..., field_index(Op.QKV_PROJ, "NORM_FFN_SPLITS")][q] = 1

    step = edited_step(_spec(1), edit, seed=3, prompt=[3, 1, 4, 1, 5])
    with pytest.raises(BadTaskError, match="QKV_PROJ.*NORM_FFN_SPLITS 0"):
        step()


def test_qkv_combine_is_zero_or_one():
    moe = load_spec("tiny-moe")
    with pytest.raises(ValueError, match="qkv_combine"):
        variant(moe, "bad", tiles={"qkv_combine": 2})

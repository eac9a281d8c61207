"""The norm folded into its GEMM readers (target tile ``norm_fold: N``,
schedules of at most N rows with routed claims, parallel blocks): the QKV
and router tiles of a MoE layer after a MoE layer carry ``NORM_IN`` and the
parameters of the norm that writes their x_norm slot; they read that norm's
inputs (its residual slot, the O-projection partials, the combine's plane)
and wait on their producers, not on the norm task. The VM computes the
same norm from the same planes in the same order, so the logits must
equal the default schedule's bit for bit, in fast mode and in checked mode
(which checks every read against the counters' happens-before order)."""

from __future__ import annotations

import pytest
import torch

from engines import assert_same_bits_as
from megac.abi import Flag, H, Op, field_index
from megac.passes.pipeline import compile_one
from megac.spec import load_spec
from megac.weights import random_weights
from models import tasks_of, variant


def _spec(fold: int, top_k: int | None = None, **tiles):
    moe = load_spec("tiny-moe")
    over = {"top_k": top_k} if top_k else None
    return variant(moe, f"nf-{fold}-{top_k}-{len(tiles)}", moe=over, tie_embeddings=False,
                   tiles={"norm_fold": fold, **tiles})


def test_the_qkv_and_router_tiles_carry_their_norm():
    # the tiles folding the norm, not the combine (router_combine's and qkv_combine's own tests
    # hold those forms)
    base, fold = (compile_one(_spec(f, router_combine=0, qkv_combine=0), "tuned", 1, 1024) for f in (0, 1))
    assert fold.num_tasks == base.num_tasks
    geo = fold.geometry
    norms = tasks_of(fold, Op.ADD_RMSNORM)
    by_slot = {int(w[field_index(Op.ADD_RMSNORM, "GAMMA")]): w for w in norms}
    norm_signals = {int(w[H.SIGNAL]) for w in norms}
    for op in (Op.QKV_PROJ, Op.ROUTER_GEMM):
        for w in tasks_of(fold, op):
            layer = int(w[H.LAYER])
            # layer 0 reads the seed, layer 1 the norm after the dense layer 0
            folded = layer >= 2 and geo.ffn[layer] == "moe" and geo.ffn[layer - 1] == "moe"
            assert bool(w[H.FLAGS] & Flag.NORM_IN) == folded, (op, layer)
            waits = {int(w[H.WAIT0]), int(w[H.WAIT1])} - {-1}
            if not folded:
                continue
            n = by_slot[geo.norm_input_slot(layer)]  # the norm it folds: the same parameters
            assert int(w[field_index(op, "NORM_LAYER")]) == int(n[H.LAYER]) == layer - 1
            for mine, its in (("NORM_ATTN_SPLITS", "ATTN_SPLITS"), ("NORM_FFN_SPLITS", "FFN_SPLITS"),
                              ("NORM_RESID_IN", "RESID_IN")):
                assert w[field_index(op, mine)] == n[field_index(Op.ADD_RMSNORM, its)], (op, layer, mine)
            # it waits on the norm's producers, never on a norm task
            assert waits and not waits & norm_signals, (op, layer)
            assert waits == {int(n[H.WAIT0]), int(n[H.WAIT1])} - {-1}, (op, layer)
    assert not (tasks_of(base, Op.QKV_PROJ)[:, H.FLAGS] & int(Flag.NORM_IN)).any()
    # more rows than the bound (and than routed claims cover): no fold
    two = compile_one(_spec(1, router_combine=0, qkv_combine=0), "tuned", 2, 1024)
    assert not (tasks_of(two, Op.ROUTER_GEMM)[:, H.FLAGS] & int(Flag.NORM_IN)).any()


@pytest.mark.parametrize("top_k", [None, 3])
def test_the_fold_gives_the_default_schedules_bits(top_k):
    base, fold = _spec(0, top_k), _spec(8, top_k)
    w = random_weights(base, seed=5)
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, base.vocab_size, (17,), generator=g).tolist()]  # one row folds
    assert_same_bits_as(base, fold, w, prompts, top_k)
    if top_k is None:  # and rows past the routed claims' bound (no fold) beside it
        prompts += [torch.randint(0, base.vocab_size, (n,), generator=g).tolist() for n in (4, 9)]
        assert_same_bits_as(base, fold, w, prompts, (top_k, 3))


def test_norm_fold_is_a_row_bound():
    moe = load_spec("tiny-moe")
    with pytest.raises(ValueError, match="norm_fold"):
        variant(moe, "bad", tiles={"norm_fold": -1})

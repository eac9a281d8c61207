"""The MoE combine inside the layer's ADD_RMSNORM (target tile
``fused_combine: 1``, schedules of one row): no MOE_COMBINE tasks; each MoE layer's norm carries
``ADD_MOE`` instead of ``ADD_FFN`` and sums the row's expert outputs,
score-weighted in k order, itself, waiting on the expert down claims
directly (a hop less at the end of every MoE layer). The VM adds the same
planes in the same order either way (the residual, the O-projection
partials, then the combine's sum), so the logits must equal the default
schedule's bit for bit, in fast mode and in checked mode (which verifies
every read against the happens-before order the counters give)."""

from __future__ import annotations

import pytest
import torch

from engines import assert_same_bits_as
from megac.abi import TASK_WORDS, Flag, H, Op, field_index
from megac.passes.pipeline import compile_one
from megac.spec import load_spec
from megac.weights import random_weights
from models import variant


def _spec(fused: bool, top_k: int | None = None, routed: int | None = None, block: str | None = None):
    moe = load_spec("tiny-moe")
    tiles = {**({"fused_combine": 1} if fused else {}), **({} if routed is None else {"routed_claims": routed})}
    over = {"top_k": top_k} if top_k else None
    extra = {"block": block} if block else {}
    return variant(moe, f"fc-{int(fused)}-{top_k}-{routed}-{block}", moe=over, tie_embeddings=False,
                   tiles=tiles, **extra)


def test_the_schedule_has_no_combine_tasks_and_the_norm_adds_the_experts():
    base, fused = compile_one(_spec(False), "tuned", 1, 1024), compile_one(_spec(True), "tuned", 1, 1024)
    assert base.tasks_per_opcode["MOE_COMBINE"] > 0 and "MOE_COMBINE" not in fused.tasks_per_opcode
    assert fused.tasks_per_opcode["ADD_RMSNORM"] == base.tasks_per_opcode["ADD_RMSNORM"]
    geo = fused.geometry
    t = fused.tasks.reshape(-1, TASK_WORDS)
    norms = t[t[:, H.OPCODE] == int(Op.ADD_RMSNORM)]
    moe_layer = [geo.ffn[int(l)] == "moe" for l in norms[:, H.LAYER]]
    for w, moe in zip(norms, moe_layer):
        assert bool(w[H.FLAGS] & Flag.ADD_MOE) == moe
        assert bool(w[H.FLAGS] & Flag.ADD_FFN) == (not moe)
        assert (w[field_index(Op.ADD_RMSNORM, "FFN_SPLITS")] == 0) == moe
    b = base.tasks.reshape(-1, TASK_WORDS)
    assert not (b[b[:, H.OPCODE] == int(Op.ADD_RMSNORM)][:, H.FLAGS] & int(Flag.ADD_MOE)).any()
    # one counter less per MoE layer: the norm waits on the down claims themselves, whose
    # count is known at one row (K experts x down tiles): its two waits are the O-projection's
    # and the down claims'
    assert fused.num_counters < base.num_counters
    assert (norms[moe_layer][:, H.WAIT1] >= 0).all()
    # more rows: the down queue's length is a target word, the combine stays a task
    three = compile_one(_spec(True), "tuned", 3, 1024)
    assert three.tasks_per_opcode["MOE_COMBINE"] == base_three(3)


def base_three(rows):
    return compile_one(_spec(False), "tuned", rows, 1024).tasks_per_opcode["MOE_COMBINE"]


@pytest.mark.parametrize("top_k, routed", [(None, None), (None, 0), (3, None)])
def test_fused_combine_gives_the_default_schedules_bits(top_k, routed):
    base, fused = _spec(False, top_k, routed), _spec(True, top_k, routed)
    w = random_weights(base, seed=7)
    g = torch.Generator().manual_seed(11)
    one = [torch.randint(0, base.vocab_size, (19,), generator=g).tolist()]  # the one-row schedules fuse
    assert_same_bits_as(base, fused, w, one, (top_k, routed))
    if top_k is None and routed is None:  # and more rows (the combine a task again) beside them
        prompts = one + [torch.randint(0, base.vocab_size, (n,), generator=g).tolist() for n in (5, 11)]
        assert_same_bits_as(base, fused, w, prompts, (top_k, routed, 3))


def test_fused_combine_is_zero_or_one():
    moe = load_spec("tiny-moe")
    with pytest.raises(ValueError, match="fused_combine"):
        variant(moe, "bad", tiles={"fused_combine": 2})

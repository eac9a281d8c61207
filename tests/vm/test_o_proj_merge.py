"""The attention merge inside the O-projection (target tile ``o_proj_merge:
1``, schedules of one row): no ATTN_COMBINE tasks; every O_PROJ tile carries
MERGE_SPLITS (the row's split count word) and waits on its KV head's
attention splits themselves, merging their partials into its input with
ATTN_COMBINE's arithmetic. The logits must equal the default schedule's bit
for bit, in the VM's fast mode and in its checked mode (every read checked
against the happens-before order the counters give), for a MoE model with
sliding (static splits) and full (claimed splits) layers and for a dense
sequential one; batch sizes above one keep the combine tasks."""

from __future__ import annotations

import pytest
import torch

from engines import assert_same_bits_as
from megac import abi
from megac.abi import H, Op, field_index
from megac.passes.pipeline import compile_one
from megac.spec import load_spec
from megac.weights import random_weights
from models import tasks_of, variant


def _spec(name: str, merge: bool, **tiles):
    base = load_spec(name)
    t = {**({"o_proj_merge": 1} if merge else {}), **tiles}
    return variant(base, f"opm-{name}-{int(merge)}-{sorted(t.items())}", tie_embeddings=False, tiles=t)


def test_one_row_has_no_combine_tasks_and_each_o_proj_tile_waits_on_its_heads_splits():
    base, merged = compile_one(_spec("tiny-moe", False), "tuned", 1, 1024), compile_one(
        _spec("tiny-moe", True), "tuned", 1, 1024)
    assert base.tasks_per_opcode["ATTN_COMBINE"] > 0 and "ATTN_COMBINE" not in merged.tasks_per_opcode
    assert merged.tasks_per_opcode["O_PROJ"] == base.tasks_per_opcode["O_PROJ"]
    geo = merged.geometry
    tw = geo.target_words
    ms = field_index(Op.O_PROJ, "MERGE_SPLITS")
    o = tasks_of(merged, Op.O_PROJ)
    for w in o:
        layer = int(w[H.LAYER])
        word = tw.attn_splits_sliding(0) if geo.sliding[layer] else tw.attn_splits_full(0)
        assert w[ms] == abi.dyn(word)
        # one wait: the counter its KV head's splits signal
        assert w[H.WAIT0] >= 0 and w[H.WAIT1] < 0
        name = merged.counters[int(w[H.WAIT0])].name
        split = int(w[field_index(Op.O_PROJ, "SPLIT")])
        assert name.startswith("combine[") and name.endswith(f"[0][{split}]"), name
    assert (tasks_of(base, Op.O_PROJ)[:, ms] == 0).all()
    # more rows: the splits' counters are per (row, KV head), the combine stays a task
    two = compile_one(_spec("tiny-moe", True), "tuned", 2, 1024)
    assert two.tasks_per_opcode["ATTN_COMBINE"] > 0
    assert (tasks_of(two, Op.O_PROJ)[:, ms] == 0).all()


@pytest.mark.parametrize("name, tiles", [("tiny-moe", {}), ("tiny-moe", {"split_down": 1}), ("tiny-llama", {})])
def test_merging_o_projection_gives_the_default_schedules_bits(name, tiles):
    base, merged = _spec(name, False, **tiles), _spec(name, True, **tiles)
    w = random_weights(base, seed=5)
    g = torch.Generator().manual_seed(13)
    # long enough that the sliding layers' window (8) and several splits are in play
    one = [torch.randint(0, base.vocab_size, (21,), generator=g).tolist()]
    assert_same_bits_as(base, merged, w, one, (name, tiles), batch_sizes=(1,))
    if not tiles and name == "tiny-moe":  # and more rows (the combine a task again) beside them
        prompts = one + [torch.randint(0, base.vocab_size, (n,), generator=g).tolist() for n in (5, 11)]
        assert_same_bits_as(base, merged, w, prompts, (name, 3))


def test_o_proj_merge_is_zero_or_one():
    moe = load_spec("tiny-moe")
    with pytest.raises(ValueError, match="o_proj_merge"):
        variant(moe, "bad", tiles={"o_proj_merge": 2})

"""A row's MOE_COMBINE spread over feature ranges without split_down (target
tile ``combine_splits``): the tasks tile the row, the norm waits for all of
them, and the step's bits are the one-task combine's (each feature's sum over
the row's slots runs in k order either way)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engines import assert_same_bits_as
from megac.abi import TASK_WORDS, H, Op, field_index
from megac.passes.pipeline import compile_one
from megac.spec import load_spec
from megac.weights import random_weights
from models import variant


def _spec(splits: int | None, routed: int | None = 0):
    """tiny-moe with ``combine_splits`` (None: the default), and in its
    routed-claim (batch-1) schedules ``routed_combine_splits`` (0: the same;
    None: the default, 8)."""
    moe = load_spec("tiny-moe")
    tiles = {} if splits is None else {"combine_splits": splits}
    if routed is not None:
        tiles["routed_combine_splits"] = routed
    return variant(moe, f"cs-{splits}-{routed}", tiles=tiles)


def _combines(sched):
    t = sched.tasks.reshape(-1, TASK_WORDS)
    return t[t[:, H.OPCODE] == int(Op.MOE_COMBINE)]


def test_the_combine_is_one_task_a_row_by_default():
    s = compile_one(_spec(None), "tuned", 2, 1024)
    assert s.geometry.combine_splits == 1
    assert len(_combines(s)) == 2 * len(s.geometry.moe_layers)


def test_routed_claim_schedules_take_their_own_combine_splits():
    """Batch 1 (routed claims) spreads the combine over routed_combine_splits
    ranges where set (8 by default since the thirty-sixth session; 0:
    combine_splits rules there too); the other schedules keep combine_splits."""
    eight = _spec(None, 8)
    one, two = (compile_one(eight, "tuned", r, 1024) for r in (1, 2))
    assert one.geometry.routed_claims and not two.geometry.routed_claims
    assert (one.geometry.combine_splits, two.geometry.combine_splits) == (8, 1)
    assert len(_combines(one)) == 8 * len(one.geometry.moe_layers)
    assert compile_one(_spec(None, None), "tuned", 1, 1024).geometry.combine_splits == 8
    assert compile_one(_spec(None, None), "tuned", 2, 1024).geometry.combine_splits == 1
    assert compile_one(_spec(None, 0), "tuned", 1, 1024).geometry.combine_splits == 1
    assert compile_one(_spec(3, 5), "tuned", 1, 1024).geometry.combine_splits == 5
    assert compile_one(_spec(3, 5), "tuned", 2, 1024).geometry.combine_splits == 3


@pytest.mark.parametrize("rows", [1, 2])
def test_combine_splits_tile_each_row(rows):
    s = compile_one(_spec(4), "tuned", rows, 1024)
    comb, D = _combines(s), s.geometry.hidden
    assert s.geometry.combine_splits == 4 and not s.geometry.split_down
    assert len(comb) == rows * 4 * len(s.geometry.moe_layers)
    col0, cols, row = (field_index(Op.MOE_COMBINE, f) for f in ("COL0", "COLS", "ROW"))
    for layer, r in {(int(w[H.LAYER]), int(w[row])) for w in comb}:
        mine = comb[(comb[:, H.LAYER] == layer) & (comb[:, row] == r)]
        mine = mine[np.argsort(mine[:, col0])]
        c0, n = mine[:, col0], mine[:, cols]
        assert c0[0] == 0 and (c0[1:] == (c0 + n)[:-1]).all() and c0[-1] + n[-1] == D
        assert (c0 % 4 == 0).all() and (n % 4 == 0).all()


def test_combine_splits_give_the_one_task_bits():
    """Greedy decoding, fast and checked VM modes (the checked mode fails a
    norm that reads a range before its combine task signalled)."""
    g = torch.Generator().manual_seed(11)
    base = _spec(None)
    w = random_weights(base, seed=5)
    prompts = [torch.randint(0, base.vocab_size, (n,), generator=g).tolist() for n in (6, 9, 3)]
    assert_same_bits_as(base, _spec(4), w, prompts, "combine_splits 4")


def test_combine_splits_is_checked():
    moe = load_spec("tiny-moe")
    for bad in (0, -2):
        with pytest.raises(ValueError, match="combine_splits"):
            variant(moe, "bad", tiles={"combine_splits": bad})
    with pytest.raises(ValueError, match="routed_combine_splits is 0..65536"):
        variant(moe, "bad", tiles={"routed_combine_splits": -1})

"""The top-k inside ROUTE_FINALIZE (target tile ``fused_topk: 1``): no
ROUTER_TOPK tasks, each finalize task ranks its layer's rows from the
router's split-K partials and keeps the ids to itself; the gather inside
it (``fused_gather: 1``): no MOE_GATHER tasks, the finalize task copies the
rows to their slots. The VM runs the same
sums in the same order either way, so the logits must equal the default
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


def _spec(router: str, fused: bool, gather: bool = False):
    moe = load_spec("tiny-moe")
    over = {"sigmoid": {}, "renorm": {"renormalize": True},
            "softmax": {"router": "softmax", "renormalize": False, "top_k": 3}}[router]
    tiles = {**({"fused_topk": 1} if fused else {}), **({"fused_gather": 1} if gather else {})}
    return variant(moe, f"fused-{router}-{int(fused)}{int(gather)}", moe=over or None, tie_embeddings=False,
                   tiles=tiles)


def test_the_schedule_has_no_topk_tasks_and_finalize_ranks_every_row():
    base, fused = compile_one(_spec("softmax", False), "tuned", 3, 1024), compile_one(_spec("softmax", True),
                                                                                      "tuned", 3, 1024)
    assert base.tasks_per_opcode["ROUTER_TOPK"] > 0 and "ROUTER_TOPK" not in fused.tasks_per_opcode
    assert fused.tasks_per_opcode["ROUTE_FINALIZE"] == base.tasks_per_opcode["ROUTE_FINALIZE"]
    t = fused.tasks.reshape(-1, TASK_WORDS)  # every SM's list (NOP padding: opcode 0)
    fin = t[t[:, H.OPCODE] == int(Op.ROUTE_FINALIZE)]
    assert (fin[:, field_index(Op.ROUTE_FINALIZE, "TOPK_SPLITS")] == fused.geometry.router_splits).all()
    assert (fin[:, field_index(Op.ROUTE_FINALIZE, "NUM_ROWS")] == 3).all()
    assert (fin[:, H.FLAGS] & int(Flag.SOFTMAX_ROUTER)).all()
    b = base.tasks.reshape(-1, TASK_WORDS)
    assert (b[b[:, H.OPCODE] == int(Op.ROUTE_FINALIZE)][:, field_index(Op.ROUTE_FINALIZE, "TOPK_SPLITS")] == 0).all()
    # one counter hop less per MoE layer: finalize waits on the router GEMM itself
    assert fused.num_counters < base.num_counters


def test_fused_gather_drops_the_gather_tasks_and_finalize_reads_the_norm_slot():
    base, both = compile_one(_spec("sigmoid", False), "tuned", 2, 1024), compile_one(_spec("sigmoid", True, True),
                                                                                     "tuned", 2, 1024)
    assert base.tasks_per_opcode["MOE_GATHER"] > 0
    assert "MOE_GATHER" not in both.tasks_per_opcode and "ROUTER_TOPK" not in both.tasks_per_opcode
    t = both.tasks.reshape(-1, TASK_WORDS)
    fin = t[t[:, H.OPCODE] == int(Op.ROUTE_FINALIZE)]
    geo = both.geometry
    assert sorted(fin[:, field_index(Op.ROUTE_FINALIZE, "X_SLOT")]) == sorted(
        geo.norm_input_slot(int(l)) for l in fin[:, H.LAYER])
    b = base.tasks.reshape(-1, TASK_WORDS)
    assert (b[b[:, H.OPCODE] == int(Op.ROUTE_FINALIZE)][:, field_index(Op.ROUTE_FINALIZE, "X_SLOT")] == -1).all()
    assert both.num_counters < base.num_counters


@pytest.mark.parametrize("router, fused, gather", [
    ("sigmoid", True, False), ("renorm", True, False), ("softmax", True, False),
    ("sigmoid", False, True), ("softmax", True, True)])
def test_fused_routing_gives_the_default_schedules_bits(router, fused, gather):
    base, fused = _spec(router, False), _spec(router, fused, gather)
    w = random_weights(base, seed={"sigmoid": 1, "renorm": 2, "softmax": 3}[router])
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, base.vocab_size, (n,), generator=g).tolist() for n in (5, 19, 11)]
    assert_same_bits_as(base, fused, w, prompts, (router, gather))


@pytest.mark.parametrize("value", [2, -1])
def test_fused_topk_is_zero_or_one(value):
    moe = load_spec("tiny-moe")
    with pytest.raises(ValueError, match="fused_topk"):
        variant(moe, "bad", tiles={"fused_topk": value})

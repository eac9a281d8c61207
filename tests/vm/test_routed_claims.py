"""Routed claims (target tile ``routed_claims: N``): in schedules of at most
N rows every expert up claimer ranks the rows itself from the router
partials, derives the up queue's records and reads its rows from x_norm;
no ROUTER_TOPK, no MOE_GATHER, and the claimers wait on the router GEMM
alone. The VM runs the same sums in the same order, so the logits must
equal the default schedule's bit for bit, in fast mode and in checked mode
(which checks every read, the claimers' ranking of the router partials and
the claimed tiles' x_norm rows included, against the counters'
happens-before order)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engines import assert_same_bits_as
from megac.abi import TASK_WORDS, H, Op, field_index
from megac.passes.pipeline import compile_one, compile_schedules
from megac.spec import load_spec
from megac.weights import random_weights
from models import variant


def _spec(router: str, bound: int):
    moe = load_spec("tiny-moe")
    over = {"sigmoid": {}, "renorm": {"renormalize": True},
            "softmax": {"router": "softmax", "renormalize": False, "top_k": 3}}[router]
    tiles = {"routed_claims": bound} if bound else {}
    return variant(moe, f"routed-{router}-{bound}", moe=over or None, tie_embeddings=False,
                   tiles=tiles)


def _ops(sched) -> np.ndarray:
    t = sched.tasks.reshape(-1, TASK_WORDS)
    return t[t[:, H.OPCODE] != int(Op.NOP)]


def test_routed_up_claimers_wait_on_the_router_and_carry_the_routing_fields():
    spec = _spec("softmax", 2)
    base, routed = compile_one(_spec("softmax", 0), "tuned", 2, 1024), compile_one(spec, "tuned", 2, 1024)
    assert routed.geometry.routed_claims and not base.geometry.routed_claims
    for name in ("ROUTER_TOPK", "MOE_GATHER"):
        assert base.tasks_per_opcode[name] > 0 and name not in routed.tasks_per_opcode
    t = _ops(routed)
    geo = routed.geometry
    up = t[t[:, H.OPCODE] == int(Op.MOE_UPGATE_DRAIN)]
    f = lambda name: up[:, field_index(Op.MOE_UPGATE_DRAIN, name)]  # noqa: E731
    assert (f("ROUTE_SPLITS") == geo.router_splits).all() and (f("NUM_ROWS") == 2).all()
    assert (f("UP_TILES") == geo.up_tiles).all() and (f("TASK_WAIT_BASE") == -1).all()
    assert sorted(f("X_SLOT")) == sorted(geo.norm_input_slot(int(l)) for l in up[:, H.LAYER])
    # each up claimer's one header wait is its layer's router GEMM counter: the counter its
    # router tasks signal, waited for all of them
    router = t[t[:, H.OPCODE] == int(Op.ROUTER_GEMM)]
    for l in np.unique(up[:, H.LAYER]):
        sig = np.unique(router[router[:, H.LAYER] == l][:, H.SIGNAL])
        waits = up[up[:, H.LAYER] == l]
        assert len(sig) == 1 and (waits[:, H.WAIT0] == sig[0]).all() and (waits[:, H.WAIT1] == -1).all()
        assert (waits[:, H.TARGET0] == (router[:, H.LAYER] == l).sum()).all()
    # the finalize task still ranks (for the down claims and the combine), off the up claims' path
    fin = t[t[:, H.OPCODE] == int(Op.ROUTE_FINALIZE)]
    assert (fin[:, field_index(Op.ROUTE_FINALIZE, "TOPK_SPLITS")] == geo.router_splits).all()
    assert (fin[:, field_index(Op.ROUTE_FINALIZE, "X_SLOT")] == -1).all()


def test_routed_claims_only_up_to_the_row_bound():
    res = compile_schedules(_spec("sigmoid", 2), batch_sizes=[1, 2, 4], buckets=[1024])
    got = {s.rows: s.geometry.routed_claims for s in res.schedules}
    assert got == {1: True, 2: True, 4: False}
    for s in res.schedules:
        assert ("ROUTER_TOPK" in s.tasks_per_opcode) == (s.rows == 4)


@pytest.mark.parametrize("router", ["sigmoid", "renorm", "softmax"])
def test_routed_claims_give_the_default_schedules_bits(router):
    base, routed = _spec(router, 0), _spec(router, 4)
    w = random_weights(base, seed={"sigmoid": 11, "renorm": 12, "softmax": 13}[router])
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, base.vocab_size, (n,), generator=g).tolist() for n in (6, 17, 9)]
    assert_same_bits_as(base, routed, w, prompts, router)


@pytest.mark.parametrize("value", [-1, 65537])
def test_routed_claims_is_a_row_bound(value):
    moe = load_spec("tiny-moe")
    with pytest.raises(ValueError, match="routed_claims"):
        variant(moe, "bad", tiles={"routed_claims": value})

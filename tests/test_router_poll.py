"""What MEGAC_ROUTER_POLL (opcodes/common.cuh) relies on, proved on the
compiled batch-1 schedules, where its claimers run.

A one-row routed up claimer of that build leaves its header wait unread and
polls the router's partials until no word holds abi.UNLANDED_F32; layer L's
ROUTE_FINALIZE writes layer L - 1's partials back to unlanded. So:

- the wait it skips is the router's counter and nothing else: its one header
  wait, signalled by that layer's router tiles alone, their count its target
  (a wait that also ordered other data would be lost);
- the claimed up tiles still wait on the norm that writes their rows;
- every reader of layer L - 1's partials happens before layer L's finalize:
  its finalize, its ranking tasks and every claimed up tile (a claimer that
  claims nothing leaves its poll by its stop(); the device's, not here).
Happens-before is the verifier's engine (megac/passes/hb.py), not a
re-derivation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from megac import abi
from megac.abi import Op, Queue
from megac.codegen.megakernel import model_constants
from megac.passes.hb import HappensBefore, counter_closure, part_wait_sets
from megac.passes.pipeline import compile_schedules
from megac.passes.program import Program, build_groups
from megac.passes.violations import Sink
from megac.spec import load_spec

F = abi.field_index
ROOT = Path(__file__).resolve().parents[1]


def _program(name: str, tiles: dict | None = None, order: str = "tuned"):
    spec = load_spec(name)
    if tiles:
        from models import variant

        spec = variant(spec, f"{name}-{'-'.join(tiles)}", tiles={**(spec.target.tiles or {}), **tiles})
    sched = compile_schedules(spec, order=order, batch_sizes=[1]).schedules[0]
    p = Program.from_schedule(sched)
    out = Sink()
    build_groups(p, out)
    assert not out.items, out.items
    cl, prow, _ = counter_closure(p, part_wait_sets(p))
    return spec, sched, p, HappensBefore(p, cl, prow)


def _polling(p: Program) -> np.ndarray:
    """The claimers mk_core.cuh router_polls() picks (its conditions, word by word)."""
    w, op = p.words, Op.MOE_UPGATE_DRAIN
    return np.flatnonzero((p.op == int(op)) & (w[:, F(op, "ROUTE_SPLITS")] > 0) & (w[:, F(op, "NUM_ROWS")] == 1)
                          & (w[:, F(op, "TASK_WAIT_BASE")] >= 0) & ((w[:, abi.H.FLAGS] & int(abi.Flag.NORM_IN)) == 0)
                          & (p.w1 < 0))


def _up_parts(p: Program, layer: int) -> np.ndarray:
    """The happens-before nodes of layer ``layer``'s claimed up tiles (parts follow the live tasks)."""
    g = [(grp.layer, grp.queue) for grp in p.groups]
    mine = np.array([g[int(i)] == (layer, int(Queue.MOE_UP)) for i in p.part_group], dtype=bool)
    return p.n + np.flatnonzero(mine)


# fused_combine: the norm sums the experts itself (no MOE_COMBINE at batch 1), so the claims' wait on it
# is one hop after the down claims (TILES rpfc / rpfcu: router_poll beside it); and with the norm on the
# finalize SM (TILES rpfcun)
@pytest.fixture(scope="module", params=[("north-mini-code", None), ("tiny-moe", None),
                                        ("north-mini-code", {"fused_combine": 1}),
                                        ("north-mini-code", {"fused_combine": 1},
                                         str(ROOT / "schedules/experiments/routed-norm-on-finalize.yaml"))],
                ids=["nmc", "tiny-moe", "nmc-fused-combine", "nmc-fused-combine-norm-on-finalize"])
def compiled(request):
    return _program(*request.param)


def test_the_skipped_wait_is_the_routers_alone(compiled):
    _, _, p, _ = compiled
    polling = _polling(p)
    # the default batch-1 tiles have them: the claimers of every layer whose router folds the combine
    # poll under the switch (the first MoE layer's router follows a dense layer: its claims wait as before)
    combined = {layer for layer in p.geo.moe_layers if p.geo.router_combined(layer)}
    assert len(combined) >= len(p.geo.moe_layers) - 1 >= 1
    assert {int(p.layer[i]) for i in polling} == combined
    for i in polling:
        layer = int(p.layer[i])
        signallers = np.flatnonzero(p.sig == p.w0[i])
        assert len(signallers) and (p.op[signallers] == int(Op.ROUTER_GEMM)).all(), p.where(i)
        assert (p.layer[signallers] == layer).all(), p.where(i)
        routers = np.flatnonzero((p.op == int(Op.ROUTER_GEMM)) & (p.layer == layer))
        assert int(p.t0[i]) == len(routers) == len(signallers), p.where(i)
        # its claims wait on the norm that writes their rows, not on the router
        twb = int(p.words[i, F(Op.MOE_UPGATE_DRAIN, "TASK_WAIT_BASE")])
        norm = np.flatnonzero(p.sig == twb)
        assert len(norm) and (p.op[norm] == int(Op.ADD_RMSNORM)).all(), p.where(i)


def test_every_reader_of_a_layers_partials_precedes_the_next_finalize(compiled):
    _, _, p, hb = compiled
    moe = p.geo.moe_layers
    checked = 0
    for prev, layer in zip(moe, moe[1:]):
        fin = np.flatnonzero((p.op == int(Op.ROUTE_FINALIZE)) & (p.layer == layer))
        assert len(fin), f"no ROUTE_FINALIZE in layer {layer}"
        readers = np.flatnonzero(np.isin(p.op, [int(Op.ROUTE_FINALIZE), int(Op.ROUTER_TOPK)]) & (p.layer == prev))
        ups = _up_parts(p, prev)
        assert len(readers) and len(ups), f"layer {prev}: no finalize or claimed up tiles"
        for a in np.concatenate([readers, ups]):
            ok = hb(np.full(len(fin), a), fin)
            assert ok.all(), f"{p.where(int(a))} is not ordered before {p.where(int(fin[0]))}"
            checked += 1
    assert checked > 2 * (len(moe) - 1)


def test_a_finalize_does_not_precede_the_claims_it_would_unland():
    """The check above can fail: layer L's own claimed up tiles (which read
    layer L's partials, not L - 1's) are not ordered before layer L's
    finalize (it runs beside them), so the same query on them says no."""
    _, _, p, hb = _program("north-mini-code")
    layer = p.geo.moe_layers[1]
    fin = np.flatnonzero((p.op == int(Op.ROUTE_FINALIZE)) & (p.layer == layer))
    ups = _up_parts(p, layer)
    assert len(ups) and not hb(ups, np.full(len(ups), fin[0])).any()


def test_the_moe_span_constants():
    spec = load_spec("north-mini-code")
    sched = compile_schedules(spec, batch_sizes=[1]).schedules
    consts = dict(model_constants(spec, sched))
    geo = sched[0].geometry
    assert (consts["FIRST_MOE_LAYER"], consts["LAST_MOE_LAYER"]) == (geo.moe_layers[0], geo.moe_layers[-1]) == (1, 48)
    assert consts["MOE_LAYERS_CONTIGUOUS"] == 1
    dense = load_spec("tiny-llama")
    consts = dict(model_constants(dense, compile_schedules(dense, batch_sizes=[1]).schedules))
    assert (consts["FIRST_MOE_LAYER"], consts["LAST_MOE_LAYER"], consts["MOE_LAYERS_CONTIGUOUS"]) == (-1, -1, 1)

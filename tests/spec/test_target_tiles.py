"""target.tiles: per-target tile sizes reach the geometry and the schedule;
bad entries are refused with one line naming the tile."""

import pytest

from megac.errors import MegacError
from megac.geometry import DEFAULT_TILES, Geometry
from megac.passes.pipeline import compile_one
from megac.spec import load_spec
from models import variant


def _with_tiles(tiles):
    spec = load_spec("tiny-moe")
    return variant(spec, "tiny-moe-tiles", tiles=tiles)


def test_tiles_reach_the_geometry_and_the_task_count():
    spec = load_spec("tiny-moe")
    base = Geometry.from_spec(spec, 1, 1024)
    tuned = Geometry.from_spec(_with_tiles({"router_splits": 2, "moe_down_bn": 16}), 1, 1024)
    assert base.router_splits == min(DEFAULT_TILES["router_splits"], spec.hidden_size // 8)
    assert tuned.router_splits == 2 and tuned.moe_down_bn == 16
    assert base.o_proj_bn == tuned.o_proj_bn  # unnamed tiles keep their defaults
    # the router GEMM of every MoE layer has exactly router_splits x ceil(E / router_bn) tasks
    sched = compile_one(_with_tiles({"router_splits": 2}), "tuned", 1, 1024)

    n_moe = sum(1 for ls in spec.layers if ls.ffn == "moe")
    tiles_e = -(-spec.moe.num_experts // tuned.router_bn)
    assert sched.tasks_per_opcode["ROUTER_GEMM"] == n_moe * 2 * tiles_e


@pytest.mark.parametrize("tiles, words", [
    ({"moe_up_bm": 64}, ["unknown tile", "moe_up_bm"]),
    ({"moe_up_bn": 95}, ["moe_up_bn", "even"]),
    ({"router_splits": 0}, ["router_splits", "1..65536"]),
])
def test_bad_tiles_are_refused_naming_the_tile(tiles, words):
    with pytest.raises((MegacError, ValueError)) as e:
        _with_tiles(tiles)
    msg = str(e.value)
    for w in words:
        assert w in msg

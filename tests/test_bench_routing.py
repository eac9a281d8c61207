"""``megac bench --routing skewed`` and ``--order all`` on the CPU: the skewed
router concentrates the experts the real routing math picks (counted here with
torch.topk), uniform changes nothing, the bytes per step count the experts
skewed routing touches (checked against a Monte Carlo count of distinct
experts), a dense model is refused, and ``--order all`` runs and ranks every
order."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from megac import decode_bench as db
from megac.bench_cli import ORDERS, bench_cmd
from megac.errors import MegacError
from megac.passes.pipeline import compile_one
from megac.routing import topk
from megac.routing_skew import selection_probs, skew_router
from megac.weights import random_weights
from models import variant

ROWS = 8192


@pytest.fixture(scope="module")
def wide():
    """tiny-moe with North Mini Code's 128 experts and top-8 (hidden stays 64)."""
    spec = variant("tiny-moe", "tiny-moe-128", moe={"num_experts": 128, "top_k": 8})
    w = random_weights(spec, seed=0)
    return spec, w, skew_router(spec, w, "skewed")


def _counts(router: torch.Tensor, x: torch.Tensor, k: int) -> np.ndarray:
    """Selections per expert, counted with torch.topk (not megac.routing)."""
    ids = torch.topk(x @ router.T, k).indices
    return np.bincount(ids.reshape(-1).numpy(), minlength=router.shape[0])


def test_skewed_router_concentrates_the_real_routing(wide):
    spec, w, sk = wide
    E, k = 128, 8
    x = torch.randn(ROWS, spec.hidden_size, generator=torch.Generator().manual_seed(7))
    layer = spec.moe_layers[0]
    # the routing the VM and the device run picks the same experts as torch.topk
    ids, _ = topk(x @ sk.layers[layer].router.T, k, softmax=False, renormalize=False)
    assert torch.equal(ids.sort(-1).values, torch.topk(x @ sk.layers[layer].router.T, k).indices.sort(-1).values)
    c_skew = _counts(sk.layers[layer].router, x, k)
    c_unif = _counts(w.layers[layer].router, x, k)
    top16 = lambda c: np.sort(c)[::-1][:16].sum() / c.sum()  # noqa: E731
    assert top16(c_unif) < 0.2  # uniform: 16/128 = 12.5 %
    assert 0.4 < top16(c_skew) < 0.6  # clearly skewed ...
    assert (c_skew > 0).all()  # ... but every expert still routed to
    # the run's estimate of each expert's routing chance agrees with the count
    p = selection_probs(sk, k)
    assert p.sum() == pytest.approx(k)
    counted = np.mean([np.sort(_counts(sk.layers[i].router, x, k))[::-1] / ROWS for i in spec.moe_layers], axis=0)
    assert np.abs(p - counted).max() < 0.03


def test_uniform_leaves_the_weights_bit_identical(wide):
    spec, w, sk = wide
    fresh = random_weights(spec, seed=0)
    assert skew_router(spec, w, "uniform") is w
    for (name, a), (_, b), (_, c) in zip(w.tensors(), fresh.tensors(), sk.tensors()):
        assert torch.equal(a, b), name  # skewing did not write into its input
        if name.endswith(".router"):
            assert not torch.equal(a, c), name
        else:
            assert torch.equal(a, c), name  # only the routers change


def test_skewed_bytes_count_fewer_experts_at_batch_8_and_k_at_batch_1(wide):
    spec, _, sk = wide
    E, k, width, d = 128, 8, spec.moe.expert_intermediate_size, spec.hidden_size
    p = selection_probs(sk, k)
    per_expert = 3 * width * d * 2 * len(spec.moe_layers)  # gate, up, down in bf16, every MoE layer
    for rows in (1, 8):
        sched = compile_one(spec, rows=rows, context=64)
        uni, _ = db.step_bytes(sched, 64)
        skw, _ = db.step_bytes(sched, 64, expert_probs=p)
        if rows == 1:
            assert skw == uni  # one row touches exactly k experts either way
            continue
        # distinct experts of batches of 8 random rows, counted
        x = torch.randn(rows * 2000, d, generator=torch.Generator().manual_seed(3))
        seen = []
        for i in spec.moe_layers:
            ids = torch.topk(x @ sk.layers[i].router.T, k).indices.reshape(2000, rows * k)
            seen += [len(set(r.tolist())) for r in ids]
        uniform_active = round(E * (1 - (1 - k / E) ** rows))
        assert skw < uni
        assert uni - skw == (uniform_active - round(np.mean(seen))) * per_expert


def test_dense_model_with_skewed_routing_is_one_line_error():
    r = CliRunner().invoke(bench_cmd, ["tiny-llama", "--backend", "cpu", "--random-weights", "--routing", "skewed"])
    assert isinstance(r.exception, MegacError)
    msg = str(r.exception)
    assert "dense" in msg and "--routing skewed" in msg and "\n" not in msg
    assert "drawing random weights" not in r.output  # refused before the draw


def test_order_all_runs_and_ranks_every_order(tmp_path):
    out = tmp_path / "b.json"
    r = CliRunner().invoke(bench_cmd, ["tiny-moe", "--backend", "cpu", "--random-weights", "--order", "all",
                                       "--routing", "skewed", "--batch-size", "1,2", "--context", "40",
                                       "--steps", "2", "--warmup", "1", "--json", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["run"]["routing"] == "skewed" and data["run"]["orders"] == list(ORDERS)
    rows = data["rows"]
    assert sorted((x["order"], x["batch"]) for x in rows) == sorted((o, b) for o in ORDERS for b in (1, 2))
    assert all(x["routing"] == "skewed" for x in rows)
    header = next(line for line in r.output.splitlines() if "ms/step" in line)
    assert "order" in header and "routing" in header
    for o in ORDERS:
        assert sum(line.strip().startswith(o) for line in r.output.splitlines()) == 2  # a table row per batch
    # one ranking line per case, orders by the JSON's kernel_ms, fastest first
    for b in (1, 2):
        line = next(line for line in r.output.splitlines() if line.startswith(f"batch {b}, context 40:"))
        named = re.findall(r"([a-z-]+) [0-9.]+ ms \(([0-9.]+)x\)", line)
        want = sorted((x for x in rows if x["batch"] == b), key=lambda x: x["kernel_ms"])
        assert [n for n, _ in named] == [x["order"] for x in want]
        assert named[0][1] == "1.00"
        assert float(named[-1][1]) == pytest.approx(want[-1]["kernel_ms"] / want[0]["kernel_ms"], abs=0.006)


def test_one_uniform_order_keeps_the_table_as_it_was(tmp_path):
    out = tmp_path / "b.json"
    r = CliRunner().invoke(bench_cmd, ["tiny-moe", "--backend", "cpu", "--random-weights", "--context", "40",
                                       "--steps", "1", "--warmup", "0", "--json", str(out)])
    assert r.exit_code == 0, r.output
    row = json.loads(out.read_text())["rows"][0]
    assert row["order"] == "tuned" and row["routing"] == "uniform"
    header = next(line for line in r.output.splitlines() if "ms/step" in line)
    assert "order" not in header and "routing" not in header and "fastest first" not in r.output

"""Placement tuning's choice (megac.gpu.placement.tune) on a stand-in
backend: the timer is a function of where the task lists and buffers live
(as the megakernel's step is of their physical pages), so the test knows
which placement is fastest without the code under test telling it. The
GPU half (every step's bits the same, the kept placement's time holding)
is the GPU check ``placement``."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from megac.errors import MegacError
from megac.gpu.placement import PlacementReport, placement_of, tune


def _backend():
    words = torch.arange(64, dtype=torch.int32)
    be = SimpleNamespace(
        _words=words,
        buf={"counters": words[:16], "targets": words[16:32],  # views of the uploaded words: never moved
             "x": torch.randn(8, 32), "moe_out": torch.randn(4, 32)},
        tasks={1: (torch.arange(96, dtype=torch.int32).view(3, 32), torch.tensor([1, 1, 1], dtype=torch.int32))},
        _desc_cache={"key": b"descriptor"}, _step_graphs={"key": "graph"})
    return be


def test_tuning_keeps_the_fastest_placement_with_the_same_contents():
    be = _backend()
    x0, tasks0, words0 = be.buf["x"].clone(), be.tasks[1][0].clone(), be.buf["counters"]
    rng = random.Random(5)
    cost = {}  # what each placement (its task list's address) costs: drawn once, as a page's would be

    def timer():
        be._desc_cache["key"] = b"rebuilt"  # a step rebuilds what the placement cleared
        key = (be.tasks[1][0].data_ptr(), be.buf["x"].data_ptr())
        return cost.setdefault(key, rng.uniform(2.9, 3.1))

    seen = []

    def timed():
        ms = timer()
        seen.append((ms, be.tasks[1][0].data_ptr(), be.buf["x"].data_ptr()))
        return ms

    ms, chosen = tune(be, timed, trials=6, free_bytes=lambda: 1 << 40)  # losers kept: no address reused
    assert len(ms) == 7 and ms == [s[0] for s in seen]
    assert chosen == min(range(7), key=ms.__getitem__)
    kept = seen[chosen]
    assert (be.tasks[1][0].data_ptr(), be.buf["x"].data_ptr()) == kept[1:]  # the fastest one is what it holds
    assert len({s[1] for s in seen}) == 7  # every trial was a new placement
    assert torch.equal(be.buf["x"], x0) and torch.equal(be.tasks[1][0], tasks0)
    assert be.buf["counters"] is words0  # the uploaded words stay where they are
    assert be._step_graphs == {} and (chosen == 6 or be._desc_cache == {})


def test_no_trial_keeps_the_first_and_a_negative_count_is_refused():
    be = _backend()
    first = placement_of(be)
    ms, chosen = tune(be, lambda: 3.0, trials=0)
    assert (ms, chosen) == ([3.0], 0)
    assert be.tasks[1][0] is first["tasks"][1][0]
    with pytest.raises(MegacError, match="--placement-trials -1: must be >= 0"):
        tune(be, lambda: 3.0, trials=-1)


def test_ties_keep_the_first_placement():
    """A trial must be faster, not as fast, to replace the one held."""
    be = _backend()
    first = be.tasks[1][0]
    ms, chosen = tune(be, lambda: 3.0, trials=3)
    assert chosen == 0 and be.tasks[1][0] is first


def test_the_report_line_names_the_spread_and_the_kept_one():
    r = PlacementReport(ms=[3.06, 2.96, 3.1], chosen=1, batch=1, context=8192)
    assert r.line() == ("placement: 3 tried at batch 1, 8192 tokens (2.9600-3.1000 ms); kept #1 2.9600 ms "
                        "(+3.3 % against the first)")
    assert r.to_json() == {"ms": [3.06, 2.96, 3.1], "chosen": 1, "batch": 1, "context": 8192, "gain": 0.0327}

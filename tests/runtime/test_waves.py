"""The waves baseline's task lists (runtime.waves.split_waves): every SM's
list cut into one list per launch, in order, and no launch waits on a
counter that only it or a later launch signals."""

import dataclasses

import numpy as np
import pytest
from click.testing import CliRunner

from megac import abi
from megac.abi import H
from megac.errors import MegacError
from megac.passes.pipeline import compile_one
from megac.runtime.waves import split_waves
from megac.spec import load_spec


@pytest.fixture(scope="module", params=[("tiny-moe", "tuned", 4), ("tiny-moe", "interleaved", 2),
                                        ("tiny-llama", "attention-first", 1), ("smollm2-135m", "tuned", 2)])
def sched(request):
    name, order, rows = request.param
    return compile_one(load_spec(name), order, rows, 1024)


def test_waves_partition_every_sm_list_in_order(sched):
    waves = split_waves(sched)
    for s in range(sched.num_sms):
        joined = np.concatenate([w.tasks[s, : w.counts[s]] for w in waves])
        assert np.array_equal(joined, sched.tasks[s, : sched.task_counts[s]])
    assert waves[-1].name == "lm_head"


def test_static_waits_are_met_by_earlier_waves(sched):
    """Replays the header signals wave by wave (from the task words alone):
    every static header wait is met before its wave starts."""
    signals = np.zeros(sched.num_counters, dtype=np.int64)
    checked = 0
    for w in split_waves(sched):
        live = [w.tasks[s, k] for s in range(sched.num_sms) for k in range(w.counts[s])]
        for t in live:
            for c, tgt in ((t[H.WAIT0], t[H.TARGET0]), (t[H.WAIT1], t[H.TARGET1])):
                if c >= 0 and not abi.is_dyn(int(tgt)):
                    assert signals[c] >= tgt, (w.name, int(c), int(signals[c]), int(tgt))
                    checked += 1
        for t in live:
            if t[H.SIGNAL] >= 0:
                signals[t[H.SIGNAL]] += 1
    assert checked > 0


def test_out_of_order_lists_and_forward_waits_are_refused():
    s = compile_one(load_spec("tiny-moe"), "tuned", 1, 1024)
    sm = int(np.argmax(s.task_counts))
    n = int(s.task_counts[sm])
    # the SM's first and last static tasks swapped (a claimer joins its wave's
    # launch wherever it stands, so claimers would not do)
    static = np.flatnonzero(~np.isin(s.tasks[sm, :n, H.OPCODE], [int(op) for op in abi.CLAIMERS]))
    a, b = int(static[0]), int(static[-1])
    assert b > a and s.tasks[sm, a, H.LAYER] < s.tasks[sm, b, H.LAYER]
    tasks = s.tasks.copy()
    tasks[sm, [a, b]] = tasks[sm, [b, a]]
    order = s.global_order.copy()
    pick = [np.flatnonzero((order[:, 0] == sm) & (order[:, 1] == k))[0] for k in (a, b)]
    order[pick[0], 1], order[pick[1], 1] = b, a
    with pytest.raises(MegacError, match="not in wave order"):
        split_waves(dataclasses.replace(s, tasks=tasks, global_order=order))
    # a first-wave task waiting on the LM head's inputs (the last norm's counter)
    last_norm = max(i for i, c in enumerate(s.counters) if c.producer.endswith(".norm"))
    tasks = s.tasks.copy()
    first = np.flatnonzero(s.task_counts)[0]
    tasks[first, 0, H.WAIT1] = last_norm
    tasks[first, 0, H.TARGET1] = 1
    with pytest.raises(MegacError, match="own or a later wave"):
        split_waves(dataclasses.replace(s, tasks=tasks))


def test_bench_waves_without_a_gpu_is_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the waves backend would run")
    from megac.bench_cli import bench_cmd

    r = CliRunner().invoke(bench_cmd, ["tiny-moe", "--backend", "waves", "--random-weights"])
    assert isinstance(r.exception, MegacError) and "--backend waves: no CUDA device visible" in str(r.exception)
    assert "drawing random weights" not in r.output


def test_a_schedule_loaded_from_an_artifact_splits_the_same(tmp_path):
    """The GPU backend gets its schedules from the artifact (load_or_compile),
    so the artifact must keep each task's op node: the first GPU run of the
    waves baseline found a loaded schedule with no node names."""
    from megac.artifact import load_artifact, write_artifact

    s = compile_one(load_spec("tiny-moe"), "interleaved", 2, 1024)
    write_artifact(tmp_path / "art", load_spec("tiny-moe"), [s], order="interleaved")
    (loaded,) = load_artifact(tmp_path / "art").to_schedules()
    assert loaded.node_names == s.node_names
    got, want = split_waves(loaded), split_waves(s)
    assert [w.name for w in got] == [w.name for w in want]
    for a, b in zip(got, want):
        assert np.array_equal(a.counts, b.counts) and np.array_equal(a.tasks, b.tasks)


def test_a_split_claimer_wave_launches_its_claimers_together():
    """``{wave: attn, share: 0.5, rest_after: moe_upgate}``: the attention
    claimers that follow an SM's expert claimer in its list join the
    attention wave's launch (every claimer of the queue in one launch); the
    static tasks keep their order and every header wait is met by earlier
    launches."""
    from megac.resources import schedules_dir

    s = compile_one(load_spec("tiny-moe"), str(schedules_dir() / "experiments" / "full-attn-half.yaml"), 4, 1024)
    waves = split_waves(s)
    drain = int(abi.Op.ATTN_DRAIN)
    moved = 0
    for sm in range(s.num_sms):
        listed = s.tasks[sm, : s.task_counts[sm]]
        joined = np.concatenate([w.tasks[sm, : w.counts[sm]] for w in waves])
        assert sorted(map(tuple, joined)) == sorted(map(tuple, listed))
        static = listed[:, H.OPCODE] != drain
        assert np.array_equal(joined[joined[:, H.OPCODE] != drain], listed[static])
        moved += not np.array_equal(joined, listed)
    assert moved > 0, "no SM holds an attention claimer after its expert claimer"
    for w in waves:
        ops = {int(o) for sm in range(s.num_sms) for o in w.tasks[sm, : w.counts[sm], H.OPCODE]}
        if drain in ops:  # one launch per full layer holds every SM's attention claimer
            assert sum(int((w.tasks[sm, : w.counts[sm], H.OPCODE] == drain).sum()) for sm in range(s.num_sms)) \
                == s.num_sms, w.name

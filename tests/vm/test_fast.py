"""Fast mode's vectorised runs: executing a run's tasks together, in any
order, writes the same bits as executing them one at a time (what checked
mode does), for every run of a step of every opcode.

Each run is replayed from one snapshot of a real step's state (fresh random
weights, prompts and a permutation of the run's tasks): all together in a
shuffled order, then task by task in schedule order. Shuffling makes row
sets non-contiguous and task groups unordered (index-tensor paths instead of
slices); ragged rows with different split counts give the attention and the
combine several key-length groups, empty splits and masked splits."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from megac.kv import PagedKVCache
from megac.passes.pipeline import compile_one
from megac.prefill import prefill
from megac.spec import load_spec
from megac.vm import DecodeStep, DeviceState, VMWeights
from megac.weights import random_weights

SEED = 20261201


def _step_state(name: str, order: str, lengths, seed: int):
    """A fast step of ``name`` at batch 4 (one row inactive) after prefilling
    random prompts of ``lengths``: the step object and its cache."""
    spec = load_spec(name, target_overrides={"num_sms": 8})
    w = random_weights(spec, seed=seed)
    sched = compile_one(spec, order, rows=4, context=128)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for n in lengths]
    kv = PagedKVCache(spec, max_rows=len(prompts), num_blocks=300, dtype=torch.float32)
    kv_rows, lg = prefill(w, spec, kv, prompts)
    step = DecodeStep(DeviceState(sched, VMWeights.from_weights(w, spec, sched.geometry)), mode="fast")
    step(kv, kv_rows, lg.argmax(-1).tolist())
    return step, kv


def _buffers(step) -> dict[str, torch.Tensor]:
    """Every buffer a task may write: scratch, queues, KV pools."""
    st = step.st
    names = st.scratch + ["moe_up_queue", "moe_down_queue", "targets", "k_pool", "v_pool"]
    return {n: st[n] for n in names}


def _replay(step, snap: dict, words: np.ndarray) -> dict[str, torch.Tensor]:
    """``words`` executed from ``snap`` (tasks of one call); the buffers after."""
    vm = step.interp.ops
    for n, t in _buffers(step).items():
        t.copy_(snap[n])
    vm.st.queue_heads[...] = 0
    vm.begin_step()
    for w in words:
        vm.run(w)
    return {n: t.clone() for n, t in _buffers(step).items()}


@pytest.mark.parametrize("name,order", [("tiny-moe", "tuned"), ("tiny-llama", "interleaved")])
def test_runs_together_in_any_order_equal_task_by_task(name, order):
    rng = np.random.default_rng(SEED)
    step, _ = _step_state(name, order, (5, 70, 23), seed=int(rng.integers(1 << 30)))
    snap = {n: t.clone() for n, t in _buffers(step).items()}
    runs = step.interp.fast_program()
    assert len({d.name for d, _, _ in runs}) >= 7  # every opcode family of the model is replayed
    for d, words, _ in runs:
        perm = rng.permutation(len(words))
        together = _replay(step, snap, [words[perm]])
        one_by_one = _replay(step, snap, [words[i:i + 1] for i in range(len(words))])
        for n in together:
            assert torch.equal(together[n].nan_to_num(7.0), one_by_one[n].nan_to_num(7.0)), (d.name, n)


def test_attention_groups_cover_empty_and_masked_splits():
    """The replayed step really has several key lengths, empty splits and
    rows with fewer splits than others (so the tests above cover them)."""
    step, kv = _step_state("tiny-llama", "interleaved", (5, 70, 23), seed=SEED)
    st, geo = step.st, step.st.geo
    tw = geo.target_words
    splits = [int(st.np["targets"][tw.attn_splits_full(r)]) for r in range(geo.rows)]
    assert len(set(splits[:3])) >= 2 and max(splits) >= 3
    assert st.np["row_active"].tolist() == [1, 1, 1, 0]

"""Test support: generation through the one engine over compiled schedules."""

from __future__ import annotations

from megac.engine.build import EngineOptions, build_engine
from megac.engine.generate import generate


def vm_engine(spec, weights, schedules, *, max_batch_size: int = 8, max_model_len: int | None = None,
              mode: str = "fast", policy: str = "round_robin", seed: int = 0, num_kv_blocks: int | None = None,
              backend: str = "cpu"):
    """An engine over ``schedules`` (the VM in ``mode``) for ``weights`` (its dtype is the VM's)."""
    opts = EngineOptions(backend=backend, max_batch_size=max_batch_size, max_model_len=max_model_len, mode=mode,
                         policy=policy, seed=seed, num_kv_blocks=num_kv_blocks)
    return build_engine(spec, weights, opts, schedules=schedules)


def run(spec, weights, schedules, prompts, *, mode: str = "fast", policy: str = "round_robin", vm_seed: int = 0,
        **gen):
    """``generate`` over a fresh engine sized for ``prompts``."""
    max_len = max(len(p) for p in prompts) + gen.get("max_tokens", 32)
    eng = vm_engine(spec, weights, schedules, max_batch_size=len(prompts), max_model_len=max_len, mode=mode,
                    policy=policy, seed=vm_seed)
    return generate(eng, prompts, **gen)


def assert_same_bits_as(base, other, weights, prompts, label, *, batch_sizes=(1, 2, 4), buckets=(1024,),
                        max_tokens: int = 5) -> None:
    """Greedy decoding of ``prompts`` with ``other``'s schedules gives
    ``base``'s tokens and logits bit for bit, in the VM's fast mode and in its
    checked mode (every read checked against the counters' happens-before
    order). ``label`` names the case in a failure."""
    import torch

    from megac.passes.pipeline import compile_schedules

    def compiled(spec):
        return compile_schedules(spec, batch_sizes=list(batch_sizes), buckets=list(buckets))

    ref = run(base, weights, compiled(base), prompts, max_tokens=max_tokens, eos_token_ids=[], return_logits=True)
    for mode in ("fast", "checked"):
        got = run(other, weights, compiled(other), prompts, max_tokens=max_tokens, eos_token_ids=[],
                  return_logits=True, mode=mode)
        for a, b in zip(ref, got):
            assert a.tokens == b.tokens, (label, mode)
            assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits)), (label, mode)


def edited_step(spec, edit, *, seed: int, prompt: list[int]):
    """One VM decode step of ``spec``'s one-row schedule (random weights of
    ``seed``, after ``prompt``'s prefill) whose task words ``edit`` changed
    in place first; returns a callable that runs it (a bad word's error
    raises there)."""
    import dataclasses

    import torch

    from megac.kv import PagedKVCache
    from megac.passes.pipeline import compile_one
    from megac.prefill import prefill
    from megac.vm import DecodeStep, DeviceState, VMWeights
    from megac.weights import random_weights

    w = random_weights(spec, seed=seed)
    sched = compile_one(spec, "tuned", 1, 128)
    kv = PagedKVCache(spec, max_rows=1, num_blocks=64, dtype=torch.float32)
    kv_rows, lg = prefill(w, spec, kv, [prompt])
    tasks = sched.tasks.copy()
    edit(tasks)
    step = DecodeStep(DeviceState(dataclasses.replace(sched, tasks=tasks),
                                  VMWeights.from_weights(w, spec, sched.geometry)))
    return lambda: step(kv, kv_rows, lg.argmax(-1).tolist())

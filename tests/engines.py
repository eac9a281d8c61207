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

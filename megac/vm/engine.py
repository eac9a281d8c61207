"""A small generation loop over the CPU VM.

::

    from megac.passes.pipeline import compile_schedules
    from megac.vm import Engine

    compiled = compile_schedules(spec, order="tuned", batch_sizes=[1, 2, 4])
    eng = Engine(spec, weights, compiled, dtype=torch.float32, mode="fast")
    outs = eng.generate([[1, 2, 3], [4, 5]], max_tokens=32, temperature=0.0)
    outs[0].tokens, outs[0].finish_reason            # "stop" (EOS) or "length"

    eng = Engine.build(spec, weights, order="tuned")  # compiles for spec.target.batch_sizes

    spec, schedules = schedules_from_artifact("out/north-mini-code")  # `megac compile` output
    eng = Engine(spec, weights, schedules)                # runs the artifact's exact task words

Each prompt is prefilled with :func:`megac.prefill.prefill` (plain PyTorch,
one row at a time) into its own row of a fresh :class:`PagedKVCache`; the
first token is sampled from the prefill logits, every further token from a
decode step through the VM. Each step uses the schedule of the smallest
compiled batch size >= the live rows (unused schedule rows are inactive) and
the smallest context bucket that holds the longest live row; rows leave the
batch on EOS (``spec.eos_token_ids`` unless given; the EOS token is not
returned) or after ``max_tokens`` tokens. More prompts than the largest
batch size run in consecutive groups.

Sampling per row over the fp32 logits (times ``logit_scale``) is
:func:`megac.sampling.sample_row`, the sampler the server uses too, with a
generator seeded per prompt (``seed`` int: prompt i uses ``seed + i``; a list
gives each prompt its own seed, so a request's tokens do not depend on its
batch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from megac.engine.backend import TorchPrefillMixin
from megac.errors import MegacError
from megac.kv.paged import PagedKVCache, blocks_for_tokens
from megac.prefill import prefill
from megac.sampling import SamplingParams, make_generator, sample_row
from megac.vm.state import DeviceState, VMWeights, act_dtype_of
from megac.vm.step import DecodeStep


@dataclass
class Completion:
    tokens: list[int]
    finish_reason: str  # "stop" | "length"
    #: fp32 logits [vocab] each token was sampled from (return_logits=True)
    logits: list[torch.Tensor] | None = None
    prompt_tokens: int = 0


@dataclass
class EngineStats:
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    prefill_s: float = 0.0
    schedules_used: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0


def schedules_from_artifact(artifact) -> tuple:
    """``(spec, [Schedule])`` of a compiled artifact directory (or a loaded
    :class:`megac.artifact.Artifact`): the artifact's exact task words, task
    counts, global order, counter table and buffer plan (hash-checked by
    ``load_artifact``), with the geometry of each (batch size, context) key."""
    from megac.artifact import Artifact, load_artifact
    from megac.geometry import Geometry
    from megac.schedule import BufferPlan, BufferSpec, Counter, Schedule

    art = artifact if isinstance(artifact, Artifact) else load_artifact(artifact)
    spec = art.spec()
    out = []
    for ls in art.schedules.values():
        m = ls.meta
        plan = m["plan"]
        buffers = {name: BufferSpec(name, b["dtype"], tuple(b["shape"]), int(b["nbytes"]), b["kind"],
                                    tuple(b["lifetime"]) if b["lifetime"] else None, list(b["guards"]),
                                    bool(b["reset_per_step"]))
                   for name, b in plan["buffers"].items()}
        counters = [Counter(int(c[0]), c[1], c[2], -1, c[3], c[4]) for c in m["counters"]]
        geo = Geometry.from_spec(spec, int(m["batch_size"]), int(m["context"]))
        out.append(Schedule(
            spec_name=spec.name, rows=int(m["batch_size"]), context=int(m["context"]), buckets=list(m["buckets"]),
            order=art.manifest.get("order", "?"), num_sms=int(m["num_sms"]), tasks=ls.tasks,
            task_counts=ls.task_counts, counters=counters, num_counters=int(m["num_counters"]),
            waves={k: [tuple(w) for w in v] for k, v in m["waves"].items()}, layer_kinds=list(m["layer_kinds"]),
            tasks_per_opcode=dict(m["tasks_per_opcode"]), tasks_per_sm=dict(m["tasks_per_sm"]),
            plan=BufferPlan(buffers, {}, list(plan["reset"])), geometry=geo, global_order=ls.global_order,
            task_node=np.zeros(len(ls.global_order), dtype=np.int32), node_names=[]))
    return spec, out


def _schedules_of(schedules) -> list:
    if hasattr(schedules, "schedules"):
        return list(schedules.schedules)
    if isinstance(schedules, (list, tuple)):
        return list(schedules)
    return [schedules]


class ScheduleSet:
    """Compiled schedules of one model and their VM states (lazily built):
    picks the schedule for a live batch and context."""

    def __init__(self, schedules, vm_weights: VMWeights, *, mode: str = "fast", policy: str = "round_robin",
                 seed: int = 0) -> None:
        self.schedules = _schedules_of(schedules)
        if not self.schedules:
            raise MegacError("vm: no compiled schedule")
        self.vm_weights = vm_weights
        self.mode, self.policy, self.seed = mode, policy, seed
        self._steps: dict[int, DecodeStep] = {}

    @property
    def max_rows(self) -> int:
        return max(s.rows for s in self.schedules)

    @property
    def max_context(self) -> int:
        return max(s.context for s in self.schedules)

    def pick(self, rows: int, context: int):
        """The schedule of the smallest batch size >= rows, then the smallest
        context bucket >= context."""
        fit = [s for s in self.schedules if s.rows >= rows and s.context >= context]
        if not fit:
            raise MegacError(f"vm: no compiled schedule for {rows} rows at context {context} "
                             f"(batch sizes {sorted({s.rows for s in self.schedules})}, contexts up to "
                             f"{self.max_context})")
        return min(fit, key=lambda s: (s.rows, s.context))

    def decode_step(self, schedule) -> DecodeStep:
        step = self._steps.get(id(schedule))
        if step is None:
            step = DecodeStep(DeviceState(schedule, self.vm_weights), mode=self.mode, policy=self.policy,
                              seed=self.seed)
            self._steps[id(schedule)] = step
        return step

    def step_for(self, kv, rows: Sequence[int]) -> DecodeStep:
        ctx = max(int(kv.seq_pos[r]) for r in rows) + 1
        return self.decode_step(self.pick(len(rows), ctx))


class VMBackend(TorchPrefillMixin):
    """The CPU VM as a :class:`megac.engine.backend.Backend` (``name = "vm"``):
    ``decode(rows, token_ids)`` runs one step of the schedule picked for
    ``len(rows)`` and the longest row over ``kv`` (the engine's cache, whose
    dtype must be the VM's); ``prefill`` is the shared PyTorch path."""

    name = "vm"

    def __init__(self, spec, weights, kv, schedules, *, dtype: torch.dtype | None = None, mode: str = "fast",
                 policy: str = "round_robin", seed: int = 0, vm_weights: VMWeights | None = None) -> None:
        self.spec, self.kv = spec, kv
        self.dtype = act_dtype_of(dtype or weights.dtype)
        self.weights = weights.to(self.dtype)
        scheds = _schedules_of(schedules)
        if not scheds:
            raise MegacError("vm: no compiled schedule")
        vmw = vm_weights or VMWeights.from_weights(self.weights, spec, scheds[0].geometry, dtype=self.dtype)
        self.schedules = ScheduleSet(scheds, vmw, mode=mode, policy=policy, seed=seed)
        self.max_batch_size = self.schedules.max_rows

    @torch.no_grad()
    def decode(self, rows: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor:
        rows = [int(r) for r in rows]
        return self.schedules.step_for(self.kv, rows)(self.kv, rows, token_ids)



class Engine:
    """Generation over the CPU VM (see the module docstring)."""

    def __init__(self, spec, weights, schedules, *, dtype: torch.dtype | None = None, mode: str = "fast",
                 policy: str = "round_robin", seed: int = 0, vm_weights: VMWeights | None = None) -> None:
        self.spec = spec
        scheds = _schedules_of(schedules)
        if not scheds:
            raise MegacError("vm: no compiled schedule")
        self.dtype = act_dtype_of(dtype or weights.dtype)
        self.weights = weights.to(self.dtype)
        self.vm_weights = vm_weights or VMWeights.from_weights(self.weights, spec, scheds[0].geometry,
                                                               dtype=self.dtype)
        self.sets = ScheduleSet(scheds, self.vm_weights, mode=mode, policy=policy, seed=seed)
        self.schedules = self.sets.schedules
        self.stats = EngineStats()

    @classmethod
    def build(cls, spec, weights, *, order: str = "tuned", batch_sizes: Sequence[int] | None = None,
              buckets: Sequence[int] | None = None, **kw) -> "Engine":
        """Compile the schedules (``compile_schedules``) and build an engine."""
        from megac.passes.pipeline import compile_schedules

        compiled = compile_schedules(spec, order=order, batch_sizes=list(batch_sizes) if batch_sizes else None,
                                     buckets=list(buckets) if buckets else None)
        return cls(spec, weights, compiled, **kw)

    # ------------------------------------------------------------------ schedules
    @property
    def max_rows(self) -> int:
        return self.sets.max_rows

    @property
    def max_context(self) -> int:
        return self.sets.max_context

    def pick(self, rows: int, context: int):
        """The schedule of the smallest batch size >= rows, then the smallest
        context bucket >= context."""
        return self.sets.pick(rows, context)

    def decode_step(self, schedule) -> DecodeStep:
        """The (cached) :class:`DecodeStep` of ``schedule``."""
        return self.sets.decode_step(schedule)

    # ------------------------------------------------------------------ generation
    def new_cache(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> PagedKVCache:
        bs = self.spec.target.kv_block_size
        need = sum(blocks_for_tokens(self.spec, len(p) + max_tokens, bs) for p in prompts)
        return PagedKVCache(self.spec, max_rows=len(prompts), num_blocks=need + self.spec.num_layers * len(prompts),
                            max_context=self.spec.max_context, dtype=self.dtype)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], *, max_tokens: int = 32, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | Sequence[int] = 0,
                 eos_token_ids: Sequence[int] | None = None, return_logits: bool = False) -> list[Completion]:
        prompts = [[int(t) for t in p] for p in prompts]
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise MegacError("vm: empty prompt")
        if max_tokens < 1:
            raise MegacError(f"vm: max_tokens must be >= 1 (got {max_tokens})")
        seeds = [int(seed) + i for i in range(len(prompts))] if isinstance(seed, int) else [int(s) for s in seed]
        if len(seeds) != len(prompts):
            raise MegacError(f"vm: {len(seeds)} seeds for {len(prompts)} prompts")
        eos = set(self.spec.eos_token_ids if eos_token_ids is None else eos_token_ids)
        out: list[Completion] = []
        group = self.max_rows
        for g0 in range(0, len(prompts), group):
            out += self._generate_group(prompts[g0:g0 + group], seeds[g0:g0 + group], max_tokens, temperature,
                                        top_p, top_k, eos, return_logits)
        return out

    def _generate_group(self, prompts, seeds, max_tokens, temperature, top_p, top_k, eos, return_logits):
        import time

        n = len(prompts)
        for p in prompts:
            if len(p) + max_tokens > self.max_context + 1:
                raise MegacError(f"vm: a prompt of {len(p)} tokens + {max_tokens} new ones exceeds the compiled "
                                 f"context ({self.max_context})")
        kv = self.new_cache(prompts, max_tokens)
        t0 = time.perf_counter()
        pre = prefill(self.weights, self.spec, kv, prompts)
        self.stats.prefill_s += time.perf_counter() - t0
        rows = pre.rows
        gens = [make_generator(s) for s in seeds]
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
        comps = [Completion([], "length", [] if return_logits else None, len(p)) for p in prompts]
        live = list(range(n))
        logits = {i: pre.logits[i] for i in range(n)}
        while live:
            still = []
            for i in live:
                lg = logits[i]
                tok = sample_row(lg, params, gens[i])
                c = comps[i]
                if return_logits:
                    c.logits.append(lg)
                if tok in eos:
                    c.finish_reason = "stop"
                    continue
                c.tokens.append(tok)
                if len(c.tokens) >= max_tokens:
                    c.finish_reason = "length"
                    continue
                still.append(i)
            live = still
            if not live:
                break
            ctx = max(int(kv.seq_pos[rows[i]]) for i in live) + 1
            sched = self.pick(len(live), ctx)
            step = self.decode_step(sched)
            t0 = time.perf_counter()
            lg = step(kv, [rows[i] for i in live], [comps[i].tokens[-1] for i in live])
            self.stats.decode_s += time.perf_counter() - t0
            self.stats.decode_steps += 1
            self.stats.decode_tokens += len(live)
            key = (sched.rows, sched.context)
            self.stats.schedules_used[key] = self.stats.schedules_used.get(key, 0) + 1
            logits = {i: lg[j] for j, i in enumerate(live)}
        for r in rows:
            kv.free_row(r)
        return comps


__all__ = ["Completion", "Engine", "EngineStats", "ScheduleSet", "VMBackend",
           "schedules_from_artifact"]

"""The CPU VM as a backend: one decode step of a schedule's task words over
a :class:`~megac.vm.state.DeviceState`, the host side of the step being
:mod:`megac.runtime.step` (the same for every backend).

::

    step = DecodeStep(state, mode="fast")            # or mode="checked", policy=..., seed=...
    logits = step(kv, kv_rows, tokens)                # fp32 [len(kv_rows), vocab] * logit_scale

    be = VMBackend(spec, weights, kv, schedules)      # megac.runtime.backend.Backend, name "vm"

A step: rows and KV tables (``runtime.step.load_rows``), in checked mode
NaN into every scratch buffer and the current token's K/V slots, the seed,
the reset of ``plan.reset``, the host target words and attention queue, the
schedule (fast: global order; checked: interleaved SM queues with
happens-before tracking), then the logits and ``advance``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from megac.errors import MegacError
from megac.runtime import step as host
from megac.runtime.backend import TorchPrefillMixin
from megac.runtime.schedules import ScheduleSet
from megac.vm.interp import Interpreter
from megac.vm.state import DeviceState, VMWeights, act_dtype_of


class DecodeStep:
    """One decode step of ``state.schedule`` (see the module docstring)."""

    def __init__(self, state: DeviceState, *, mode: str = "fast", policy: str = "round_robin",
                 seed: int = 0, check_order: bool = False) -> None:
        if mode not in ("fast", "checked"):
            raise MegacError(f"vm: mode must be 'fast' or 'checked' (got {mode!r})")
        self.st = state
        self.mode = mode
        self.policy = policy
        self.seed = seed
        self.check_order = check_order
        self.interp = Interpreter(state)
        self.last_run = None
        self.steps = 0

    @property
    def schedule(self):
        return self.st.schedule

    # ------------------------------------------------------------------ parts
    def load_rows(self, kv, kv_rows: Sequence[int]) -> list[int]:
        """Reserve the current slot of every row and fill the KV tables."""
        st = self.st
        st.bind_kv(kv)
        return host.load_rows(kv, kv_rows, st.geo, st.np["page_table"], st.np["seq_pos"], st.np["row_active"])

    def poison_kv_slots(self, kv, positions: Sequence[int]) -> None:
        """NaN into the current token's K/V slot of every active row and layer
        (QKV_PROJ writes them this step; a read before that shows)."""
        st, geo = self.st, self.st.geo
        pt, bs = st.np["page_table"], st.block_size
        for i, p in enumerate(positions):
            for layer in range(geo.num_layers):
                blk = int(pt[layer, i, p // bs])
                if blk >= 0:
                    kv.k_pool[blk, p % bs] = float("nan")
                    kv.v_pool[blk, p % bs] = float("nan")

    def seed_rows(self, tokens: Sequence[int]) -> None:
        """Embedding gather into x_resid[0] and the first RMSNorm into x_norm[0]."""
        st = self.st
        x, xn = host.seed_rows(tokens, st.geo, st["w_embed"], st["w_norm"][0], self.interp.ops.eps, st.act)
        st["x_resid"][0] = x
        st["x_norm"][0] = xn

    def host_words(self, positions: Sequence[int]) -> int:
        """Per-row split counts and the attention queue; returns its length."""
        return host.host_words(self.st.geo, positions, self.st.np["targets"], self.st.np["attn_queue"])

    # ------------------------------------------------------------------ call
    @torch.no_grad()
    def __call__(self, kv, kv_rows: Sequence[int], tokens: Sequence[int], *, policy: str | None = None,
                 seed: int | None = None) -> torch.Tensor:
        kv_rows = [int(r) for r in kv_rows]
        if len(tokens) != len(kv_rows):
            raise MegacError(f"vm: {len(tokens)} tokens for {len(kv_rows)} rows")
        st = self.st
        positions = self.load_rows(kv, kv_rows)
        if self.mode == "checked":
            st.poison()
            self.poison_kv_slots(kv, positions)
        self.seed_rows(tokens)
        st.reset()
        self.host_words(positions)
        if self.mode == "fast":
            self.interp.run_fast(check_order=self.check_order)
        else:
            s = self.seed + self.steps if seed is None else seed
            self.last_run = self.interp.run_checked(policy=policy or self.policy, seed=s)
        self.steps += 1
        return host.finish_rows(kv, kv_rows, st["logits"], float(st.spec.logit_scale))


class VMBackend(TorchPrefillMixin):
    """The CPU VM as a :class:`megac.runtime.backend.Backend` (``name = "vm"``):
    ``decode(rows, token_ids)`` runs one step of the schedule picked for
    ``len(rows)`` and the longest row over ``kv`` (the engine's cache, whose
    dtype must be the VM's); ``prefill`` is the shared PyTorch path."""

    name = "vm"

    def __init__(self, spec, weights, kv, schedules, *, dtype: torch.dtype | None = None, mode: str = "fast",
                 policy: str = "round_robin", seed: int = 0, vm_weights: VMWeights | None = None) -> None:
        self.spec, self.kv = spec, kv
        self.dtype = act_dtype_of(dtype or weights.dtype)
        self.weights = weights.to(self.dtype)
        self.schedules = ScheduleSet(schedules)
        self.vm_weights = vm_weights or VMWeights.from_weights(self.weights, spec, self.schedules.schedules[0].geometry,
                                                               dtype=self.dtype)
        self.mode, self.policy, self.seed = mode, policy, seed
        self.max_batch_size = self.schedules.max_rows
        self._steps: dict[int, DecodeStep] = {}
        #: steps run per (batch size, context) schedule key
        self.schedules_used: dict[tuple[int, int], int] = {}

    def decode_step(self, schedule) -> DecodeStep:
        """The (cached) :class:`DecodeStep` of ``schedule``."""
        step = self._steps.get(id(schedule))
        if step is None:
            step = DecodeStep(DeviceState(schedule, self.vm_weights), mode=self.mode, policy=self.policy,
                              seed=self.seed)
            self._steps[id(schedule)] = step
        return step

    @torch.no_grad()
    def decode(self, rows: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor:
        rows = [int(r) for r in rows]
        sched = self.schedules.for_rows(self.kv, rows)
        key = (sched.rows, sched.context)
        self.schedules_used[key] = self.schedules_used.get(key, 0) + 1
        return self.decode_step(sched)(self.kv, rows, token_ids)


__all__ = ["DecodeStep", "VMBackend"]

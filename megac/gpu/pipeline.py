"""The bookkeeping of a pipelined greedy run on the GPU, shared by the
megakernel (:meth:`megac.gpu.backend.CudaBackend.decode_greedy_run`) and the
``graphs`` baseline (:meth:`megac.baselines.graphs.GraphsBackend.decode_greedy_run`).

A backend queues step i+1 (its host words, the device-side copy of step i's
tokens into its input, its launch, the greedy tokens and a copy of them to
pinned memory) before the host reads step i's tokens, so the host part of a
step runs while the previous kernel does. Two result slots alternate: step
i's slot is read while step i+1 fills the other.

::

    pipe = GreedyPipeline(n, token_dtype, kernel_ms, progress)
    for i in range(steps):
        ...                                   # host words, upload
        slot = pipe.slot(i)
        slot.start.record(); launch(); slot.end.record()
        slot.tok.copy_(fed, non_blocking=True)  # and any status copy
        slot.done.record()
        pipe.queued(slot, check)              # reads step i-1's tokens
    tokens, walls = pipe.finish()
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Slot:
    start: object
    end: object
    done: object
    tok: object  # pinned [n]
    extra: dict = field(default_factory=dict)  # e.g. a pinned status copy


class GreedyPipeline:
    """See the module docstring. ``kernel_ms``: the backend's list of device
    times (each step's start-to-end events); ``progress(k, tokens)`` after
    the k-th step's tokens reached the host (the next step already queued)."""

    def __init__(self, n: int, token_dtype, kernel_ms: list, progress: Callable[[int, list], None] | None = None,
                 extra: Callable[[], dict] | None = None) -> None:
        import torch

        self.slots = [Slot(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True),
                           torch.cuda.Event(), torch.zeros(n, dtype=token_dtype).pin_memory(),
                           extra() if extra else {}) for _ in range(2)]
        self.kernel_ms, self.progress = kernel_ms, progress
        self.tokens: list[list[int]] = []
        self.walls: list[float] = []
        self._pending: tuple[Slot, Callable[[Slot], None] | None] | None = None
        self._t = time.perf_counter()

    def slot(self, i: int) -> Slot:
        return self.slots[i % 2]

    def queued(self, slot: Slot, check: Callable[[Slot], None] | None = None) -> None:
        """Step ``slot`` is queued: read the step before it. ``check(slot)``
        runs once its copies landed, before its tokens count (a watchdog
        abort raises there)."""
        self.flush()
        self._pending = (slot, check)

    def flush(self) -> None:
        """Read the queued step, if any (its tokens, time and wall)."""
        if self._pending is None:
            return
        slot, check = self._pending
        self._pending = None
        slot.done.synchronize()
        if check is not None:
            check(slot)
        self.kernel_ms.append(slot.start.elapsed_time(slot.end))
        self.tokens.append([int(t) for t in slot.tok.tolist()])
        now = time.perf_counter()
        self.walls.append((now - self._t) * 1e3)
        self._t = now
        if self.progress is not None:
            self.progress(len(self.tokens), self.tokens[-1])

    def finish(self) -> tuple[list[list[int]], list[float]]:
        self.flush()
        return self.tokens, self.walls


__all__ = ["GreedyPipeline", "Slot"]

"""Placement tuning (an experiment, off everywhere): try placements of the
step's task lists and step buffers at engine start and keep the fastest.

Why it was built: the megakernel's step time follows the physical pages its
task lists and step buffers land on (thirty-ninth session, H100, North Mini
Code bs1 8K, checks ``modes`` and ``kvorder``): one engine timed again and
again keeps its time to ~0.3 % while nothing moves; moving nothing (only
rebuilding descriptors and step graphs), the uploaded words, or the timed
row's KV block order (ascending, descending, shuffled) changes nothing;
moving the task lists (48 MB) or the other step buffers (0.3 GB) to fresh
allocations moves it between ~2.96 and ~3.07 ms and it stays there, every
step's logits bit-identical. Engines of one spec at the same virtual
addresses fell in two modes ~4 % apart on the H200 since the thirty-second
session: same virtual addresses, other physical pages.

What it measured (check ``placement``, 8 engines): the placements tried
inside the tuning loop spread as widely (2.94-3.07 ms), but the kept one
did not hold: the engines re-timed after tuning ran as before it (median
3.006 against 3.0025 ms at bs1, 10.839 against 10.838 at bs8), one engine
that kept its own first placement included (tuned 2.935, re-timed 3.007),
and ``megac bench`` on a tuned engine (kept 2.959) measured 3.072. Check
``tunehold`` (one engine, the loop timed exactly as the re-timing) says
why: re-timing the placement the engine holds repeats to ~0.3 %, but a
placement put back after a later trial lost does not run as it did when
it was new (kept at 2.984, 3.049 once restored; at 2.981, 3.035), with
the losers freed at once or held to the end alike. So the time is not a
function of these tensors' pages alone: it follows the allocation history
(every move allocates, copies and frees), a state this module cannot
pick and keep. Nothing turns it on:
EngineOptions.placement_trials defaults to 0 and no CLI sets it; the GPU
checks do with MEGAC_PLACEMENT_TRIALS.

How: time ``steps`` decode steps as placed, then ``trials`` times move both
groups to fresh allocations (each new one made while the old still holds
its pages, so they cannot be the same) and time again, keeping the fastest
placement seen; the others are freed. Contents are copied, so every step's
bits are the same whichever placement wins (check ``placement``: equal on
all 8 engines).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Callable

from megac.errors import MegacError

#: placements tried after the first by check placement
DEFAULT_TRIALS = 8
#: decode steps timed per placement (after 3 warm-up steps): a placement's
#: median is repeatable to ~0.2 %, its spread across placements ~4 %
DEFAULT_STEPS = 12
#: where a losing placement's allocations are kept until tuning ends (so the
#: next trial cannot be handed the same pages again) while this much GPU
#: memory stays free; below it they are freed at once
KEEP_FREE_BYTES = 4 << 30


@dataclasses.dataclass
class PlacementReport:
    """What tuning measured: median kernel ms of each placement (the first is
    the engine's own), which one was kept, at what batch and context."""

    ms: list[float]
    chosen: int
    batch: int
    context: int

    @property
    def gain(self) -> float:
        """Fraction of the first placement's time the kept one saves."""
        return 1.0 - self.ms[self.chosen] / self.ms[0]

    def line(self) -> str:
        spread = f"{min(self.ms):.4f}-{max(self.ms):.4f}"
        return (f"placement: {len(self.ms)} tried at batch {self.batch}, {self.context} tokens "
                f"({spread} ms); kept #{self.chosen} {self.ms[self.chosen]:.4f} ms "
                f"({100 * self.gain:+.1f} % against the first)")

    def to_json(self) -> dict:
        return {"ms": self.ms, "chosen": self.chosen, "batch": self.batch, "context": self.context,
                "gain": round(self.gain, 4)}


def _fresh(t):
    new = t.new_empty(t.shape)
    new.copy_(t)
    return new


def placement_of(backend) -> dict:
    """The tensors of the two groups as the backend holds them now."""
    words = backend._words.untyped_storage().data_ptr()
    return {"tasks": dict(backend.tasks),
            "buf": {n: t for n, t in backend.buf.items() if t.untyped_storage().data_ptr() != words}}


def place(backend, placement: dict) -> None:
    """Make ``placement`` (placement_of's) the backend's: descriptors and step
    graphs hold the old addresses, so they are rebuilt."""
    backend.tasks = dict(placement["tasks"])
    backend.buf.update(placement["buf"])
    backend._desc_cache.clear()
    backend._step_graphs = {}


def moved(backend) -> dict:
    """A new placement: the task lists and the step buffers other than the
    uploaded words (zeroed and restaged every step, and measured to make no
    difference) copied to fresh allocations, made while the current ones
    still hold their pages. The backend keeps the current placement."""
    now = placement_of(backend)
    return {"tasks": {k: (_fresh(a), _fresh(b)) for k, (a, b) in now["tasks"].items()},
            "buf": {n: _fresh(t) for n, t in now["buf"].items()}}


def tune(backend, time_placement: Callable[[], float], trials: int = DEFAULT_TRIALS,
         free_bytes: Callable[[], int] | None = None, synchronize: Callable[[], None] | None = None):
    """Try ``trials`` placements besides the backend's own and keep the
    fastest by ``time_placement()`` (median kernel ms of the placement the
    backend holds). Returns (the ms of each, the index kept). ``free_bytes``:
    free GPU memory now (losers are kept while KEEP_FREE_BYTES stay free)."""
    if trials < 0:
        raise MegacError(f"--placement-trials {trials}: must be >= 0")
    best = placement_of(backend)
    ms = [time_placement()]
    chosen, graveyard = 0, []
    for i in range(1, trials + 1):
        trial = moved(backend)
        place(backend, trial)
        ms.append(time_placement())
        if ms[i] < ms[chosen]:
            loser, best, chosen = best, trial, i
        else:
            loser = trial
            place(backend, best)
        if free_bytes is not None and free_bytes() > KEEP_FREE_BYTES:
            graveyard.append(loser)
        del loser, trial
    if synchronize is not None:
        synchronize()  # no step still reads a loser when it is freed
    graveyard.clear()
    return ms, chosen


def tune_engine(engine, trials: int = DEFAULT_TRIALS, batch: int = 1, context: int = 8192,
                steps: int = DEFAULT_STEPS, progress=None) -> PlacementReport | None:
    """:func:`tune` on a cuda engine before it serves: ``batch`` rows reserved
    at ``context`` tokens (shortened to what the engine holds), decoded and
    freed after each placement. None where the backend is not the
    megakernel's, ``trials`` is 0, or a fault is injected (its steps count
    from the engine's first) or the buffers are poisoned."""
    import torch

    be, kv = engine.backend, engine.kv
    if trials == 0 or getattr(be, "name", None) != "cuda":
        return None
    if be.fault_steps or be.poison:  # an injected hang counts steps from 0; poison is for debugging
        return None
    from megac.decode_bench import rows_at

    batch = max(1, min(batch, engine.config.max_batch_size))
    context = max(2, min(context, engine.config.max_model_len - steps - 8))

    def time_placement() -> float:
        """Fresh rows each time, so every placement decodes the same positions."""
        rows = rows_at(kv, batch, context)
        try:
            be.kernel_ms.clear()
            for i in range(steps + 3):
                for r in rows:
                    kv.append_slot(r)
                be.decode(rows, [(11 * i + r) % 1000 for r in rows])
            torch.cuda.synchronize()
            return round(statistics.median(be.kernel_ms[3:]), 4)
        finally:
            for r in rows:
                kv.free_row(r)
            be.kernel_ms.clear()

    steps_before = be.steps
    try:
        ms, chosen = tune(be, time_placement, trials, free_bytes=lambda: torch.cuda.mem_get_info()[0],
                          synchronize=torch.cuda.synchronize)
    finally:
        be.steps = steps_before  # tuning steps are not the engine's
    torch.cuda.empty_cache()
    report = PlacementReport(ms=ms, chosen=chosen, batch=batch, context=context)
    if progress is not None:
        progress(report.line())
    return report


__all__ = ["DEFAULT_STEPS", "DEFAULT_TRIALS", "KEEP_FREE_BYTES", "PlacementReport", "moved", "place",
           "placement_of", "tune", "tune_engine"]

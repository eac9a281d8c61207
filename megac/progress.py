"""Start-up progress: one line per phase with its seconds, and a bar over the
steps of a long phase while stderr is a terminal (a log file gets the lines
only).

Why: ``megac serve`` once printed nothing for half a minute while it loaded,
and a user could not tell a slow start from a hung one.

::

    with phase(say, "de-quantised 272 tensors"), bar(272, "de-quantising") as b:
        ...; b.update()
    # say("de-quantised 272 tensors in 1.6 s")
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator

Say = Callable[[str], None]


@contextmanager
def phase(say: Say | None, done: str | Callable[[], str]) -> Iterator[None]:
    """Runs the body, then says ``done`` (a string, or a function giving one
    from what the body found) with the seconds it took."""
    t0 = time.perf_counter()
    yield
    if say is not None:
        say(f"{done() if callable(done) else done} in {time.perf_counter() - t0:.1f} s")


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass


def bar(total: int, what: str, unit: str = "tensor"):
    """A context manager giving an object with ``update(n=1)``: a tqdm bar on
    stderr while it is a terminal, otherwise nothing drawn."""
    if not sys.stderr.isatty():
        return nullcontext(_NoBar())
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm comes with transformers; without it, the phase lines remain
        return nullcontext(_NoBar())
    return tqdm(total=total, desc=what, unit=unit, leave=False, file=sys.stderr, dynamic_ncols=True)


__all__ = ["Say", "bar", "phase"]

"""``ScheduleSet``: the compiled schedules of one model, and which one runs
a step: the smallest batch size that holds the live rows, then the
smallest context bucket that holds the longest row."""

from __future__ import annotations

from megac.errors import MegacError


class ScheduleSet:
    """Schedules (``megac.schedule.Schedule``) of one model."""

    def __init__(self, schedules) -> None:
        self.schedules = list(schedules.schedules if hasattr(schedules, "schedules") else schedules)
        if not self.schedules:
            raise MegacError("runtime: no compiled schedule")

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
            raise MegacError(f"runtime: no compiled schedule for {rows} rows at context {context} "
                             f"(batch sizes {sorted({s.rows for s in self.schedules})}, contexts up to "
                             f"{self.max_context})")
        return min(fit, key=lambda s: (s.rows, s.context))

    def for_rows(self, kv, rows) -> object:
        """The schedule of a step over KV rows ``rows`` (their current tokens included)."""
        ctx = max(int(kv.seq_pos[r]) for r in rows) + 1
        return self.pick(len(rows), ctx)


__all__ = ["ScheduleSet"]

"""Violations of a schedule's safety proof: the kinds, grouped by the check
class that finds them, the error ``verify`` raises, and the sink that
collects them (``MAX_PER_KIND`` messages per kind)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

from megac.errors import MegacError

# --------------------------------------------------------------------------
# Violation kinds, grouped by the check class that finds them.
# --------------------------------------------------------------------------
CHECK_ORDER = ("structure", "targets", "dynamic", "deadlock", "hazards")

KINDS: dict[str, str] = {
    # structure
    "opcode": "structure",
    "nop_in_body": "structure",
    "padding": "structure",
    "counter_range": "structure",
    "target_range": "structure",
    "dyn_range": "structure",
    "field_range": "structure",
    "claimer_mismatch": "structure",
    "region_range": "structure",  # a task's region leaves its buffer's logical shape
    "field_mismatch": "structure",  # two fields that must agree do not
    # targets
    "target_high": "targets",  # target > signals: can never be satisfied
    "target_low": "targets",  # target < signals: fires before all producers
    "target_dyn_mismatch": "targets",  # static vs dynamic count disagree
    "counter_table": "targets",  # Schedule.counters disagrees with the words
    # dynamic target words
    "dyn_unwritten": "dynamic",
    "dyn_multi_writer": "dynamic",
    "dyn_order": "dynamic",
    # deadlock
    "claimer_rule": "deadlock",
    "deadlock": "deadlock",
    # hazards
    "raw": "hazards",  # read not ordered after its writer
    "war": "hazards",  # overwrite not ordered after a reader of the old data
    "waw": "hazards",  # two writes of one region unordered
    "unwritten_read": "hazards",  # read of data no task writes, not a step input
    "dead_write": "hazards",  # write nobody reads, not a step output
}

#: Buffers whose final contents leave the step (read by the sampler or the
#: next step's seed), so a write nobody in the step reads is expected there.
STEP_OUTPUTS = ("logits", "argmax_part", "x_resid")

#: Messages kept per kind; the rest are counted (a broken schedule can yield
#: tens of thousands of identical complaints).
MAX_PER_KIND = 20


@dataclass(frozen=True)
class Violation:
    kind: str
    message: str

    @property
    def check(self) -> str:
        return KINDS[self.kind]

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


class VerifyError(MegacError):
    """The schedule is unsafe. ``str(err)`` is one line naming SM, slot,
    opcode, layer and counter of the first violation; ``err.violations``
    holds every violation of that check class."""

    def __init__(self, violations: Sequence[Violation], dropped: int = 0) -> None:
        first = violations[0]
        more = len(violations) - 1 + dropped
        suffix = f" (+{more} more {first.check} violations)" if more else ""
        label = first.check if first.kind == first.check else f"{first.check}: {first.kind}"
        super().__init__(f"verify: {label}: {first.message}{suffix}")
        self.violations = list(violations)
        self.kind = first.kind


@dataclass
class VerifyReport:
    tasks: int = 0
    claimers: int = 0
    groups: int = 0
    counters: int = 0
    counters_used: int = 0
    checked_pairs: int = 0
    sim_rounds: int = 0
    critical_path: int = 0
    elapsed_ms: float = 0.0
    check_ms: dict[str, float] = field(default_factory=dict)

    def summary(self) -> str:
        return (
            f"{self.tasks} tasks ({self.claimers} claimers, {self.groups} queues), "
            f"{self.counters_used}/{self.counters} counters, {self.checked_pairs} region pairs, "
            f"{self.sim_rounds} sim rounds, critical path {self.critical_path} tasks, "
            f"{self.elapsed_ms:.0f} ms"
        )

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class Sink:
    """Collects violations, keeping MAX_PER_KIND messages per kind."""

    def __init__(self) -> None:
        self.items: list[Violation] = []
        self.dropped: dict[str, int] = defaultdict(int)
        self._per: dict[str, int] = defaultdict(int)

    def add(self, kind: str, message: str) -> None:
        assert kind in KINDS, kind
        if self._per[kind] >= MAX_PER_KIND:
            self.dropped[kind] += 1
            return
        self._per[kind] += 1
        self.items.append(Violation(kind, message))

    def of(self, check: str) -> list[Violation]:
        return [v for v in self.items if v.check == check]




__all__ = ["CHECK_ORDER", "KINDS", "MAX_PER_KIND", "STEP_OUTPUTS", "Sink", "Violation", "VerifyError", "VerifyReport"]

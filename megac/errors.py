"""User-facing errors.

A :class:`MegacError` carries ONE line that names the problem (and, where there
is one, the file and field it comes from). The CLI prints ``error: <message>``
and exits with status 2; it never prints a traceback for these.
"""

from __future__ import annotations


class MegacError(Exception):
    """An error the user can act on; ``str(err)`` is a single line."""

    def __init__(self, message: str) -> None:
        # Keep the promise of one line even if a caller passes a multi-line text.
        message = " ".join(str(message).split("\n")).strip()
        super().__init__(message)

    @property
    def message(self) -> str:
        return self.args[0]


class SpecError(MegacError):
    """A model spec (model.yaml, bundled spec, HF config.json) is invalid or
    outside the supported envelope."""


class VMError(MegacError):
    """A task that cannot execute or a schedule that cannot run (raised by the
    opcode semantics and the executors). Attributes name where: ``sm``,
    ``slot``, ``opcode``, ``layer``, ``counter``, ``buffer`` (None when not
    applicable)."""

    def __init__(self, message: str, *, sm=None, slot=None, opcode=None, layer=None, counter=None,
                 buffer=None) -> None:
        super().__init__(message)
        self.sm, self.slot, self.opcode, self.layer = sm, slot, opcode, layer
        self.counter, self.buffer = counter, buffer


class BadTaskError(VMError):
    """A descriptor field the semantics cannot honour (range, layout, unmapped KV page)."""


class QueueOverflowError(VMError):
    """ROUTE_FINALIZE (or the host) would write past a queue's capacity."""


__all__ = ["BadTaskError", "MegacError", "QueueOverflowError", "SpecError", "VMError"]

"""The CPU VM: a Python interpreter over the exact task words of a compiled
schedule (``megac.schedule.Schedule``), each opcode run through its
definition (``megac.ops``), in a fast mode (global order, coalesced runs)
and a checked mode (SM queues interleaved by the one walker, counters
simulated, happens-before checked per buffer element).

* :mod:`megac.vm.state` -- ``VMWeights`` (kernel-layout weights), ``DeviceState``
  (every launch-descriptor buffer, allocated from the buffer plan)
* :mod:`megac.vm.machine` -- ``VM``: runs any opcode through its definition,
  with the shared GEMM products, caches and claim cursor
* :mod:`megac.vm.interp` -- ``Interpreter.run_fast`` / ``run_checked`` and the errors
* :mod:`megac.vm.backend` -- ``DecodeStep`` (one step, the host side from
  :mod:`megac.runtime.step`) and ``VMBackend`` (the VM behind
  :class:`megac.runtime.backend.Backend`)
* :mod:`megac.vm.bench` -- ``python -m megac.vm.bench``: where a SmolLM2
  decode step spends its time (per opcode, and the GEMM floor)
"""

from megac.errors import BadTaskError, QueueOverflowError, VMError
from megac.vm.backend import DecodeStep, VMBackend
from megac.vm.interp import (
    DeadlockError,
    EarlyReadError,
    HazardError,
    Interpreter,
    OverwriteError,
    coalesced_runs,
)
from megac.vm.machine import VM
from megac.vm.state import DeviceState, VMWeights

__all__ = [
    "BadTaskError",
    "DeadlockError",
    "DecodeStep",
    "DeviceState",
    "EarlyReadError",
    "HazardError",
    "Interpreter",
    "OverwriteError",
    "QueueOverflowError",
    "VM",
    "VMBackend",
    "VMError",
    "VMWeights",
    "coalesced_runs",
]

"""The CPU VM: a Python interpreter over the exact task words of a compiled
schedule (``megac.schedule.Schedule``), one method per opcode (``ops``), in a
fast mode (global order, coalesced runs) and a checked mode (SM queues
interleaved, counters simulated, happens-before tracked per buffer element).

* :mod:`megac.vm.state` -- ``VMWeights`` (kernel-layout weights), ``DeviceState``
  (every launch-descriptor buffer, allocated from the buffer plan)
* :mod:`megac.vm.machine` -- ``VM``: runs any opcode through its definition
  (``megac.ops``), with the shared GEMM products, caches and claim cursor
* :mod:`megac.vm.interp` -- ``Interpreter.run_fast`` / ``run_checked`` and the errors
* :mod:`megac.vm.step` -- ``DecodeStep``: the host side of one step
* :mod:`megac.vm.engine` -- ``Engine``: prefill + decode loop, sampling;
  ``VMBackend``: the VM behind ``megac.engine.backend.Backend``
"""

from megac.vm.engine import (
    Completion,
    Engine,
    EngineStats,
    ScheduleSet,
    VMBackend,
    schedules_from_artifact,
)
from megac.vm.interp import (
    DeadlockError,
    EarlyReadError,
    HazardError,
    Interpreter,
    OverwriteError,
    coalesced_runs,
)
from megac.errors import BadTaskError, QueueOverflowError, VMError
from megac.vm.machine import VM
from megac.vm.state import DeviceState, VMWeights
from megac.vm.step import DecodeStep

__all__ = [
    "BadTaskError",
    "Completion",
    "DeadlockError",
    "DecodeStep",
    "DeviceState",
    "EarlyReadError",
    "Engine",
    "EngineStats",
    "HazardError",
    "Interpreter",
    "VM",
    "OverwriteError",
    "QueueOverflowError",
    "ScheduleSet",
    "VMBackend",
    "VMError",
    "VMWeights",
    "coalesced_runs",
    "schedules_from_artifact",
]

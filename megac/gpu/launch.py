"""Load cubins and launch their kernels through cupy (the CUDA driver API).

No torch C++ extension: torch differs between machines. torch tensors are
passed to kernels by ``data_ptr()``; every other argument must carry its C
type (numpy.int32, numpy.uint64, ...), because a bare Python int would be
passed as 64 bits whatever the kernel expects.

Persistent kernels launch one CTA per SM, cooperatively, after checking
that the grid can be co-resident; a kernel built for a different SM count
is refused (``expect_sms``).

The device status buffer (watchdog / error record, opcodes/common.cuh) is
decoded here: ``check_status`` raises DeviceAbortError naming the CTA, task,
opcode and counter of the first wait that gave up.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from megac import abi

# --- status buffer layout: defined once in megac/abi.py ----------------------
STATUS_WORDS = abi.STATUS_WORDS
STATUS_ABORT = abi.STATUS_ABORT
STATUS_CLAIM = abi.STATUS_CLAIM
STATUS_TIMEOUTS = abi.STATUS_TIMEOUTS
STATUS_DONE = abi.STATUS_DONE
STATUS_RECORD = abi.STATUS_RECORD
# Python-side names of the record words (abi.ERROR_FIELDS, in order).
RECORD_FIELDS = ("sm", "task", "opcode", "counter", "seen", "target", "layer", "kind")
assert len(RECORD_FIELDS) == abi.ERROR_WORDS
ERROR_KINDS = {int(k): k.name.lower().replace("_", " ") for k in abi.ErrorKind}
DEFAULT_WATCHDOG_NS = abi.DEFAULT_WATCHDOG_NS
SMEM_DEFAULT_LIMIT = 48 * 1024


class LaunchError(RuntimeError):
    """The launch could not be made as asked (co-residency, SM count, args)."""


class DeviceAbortError(RuntimeError):
    """A kernel's watchdog fired: ``record`` is the first error it wrote."""

    def __init__(self, record: dict[str, int], timeouts: int, detail: str = ""):
        self.record = record
        self.timeouts = timeouts
        kind = ERROR_KINDS.get(record.get("kind", -1), f"kind {record.get('kind')}")
        what = "counter" if record.get("kind") == 1 else "stage/counter"
        msg = (
            f"device aborted: {kind} on CTA {record['sm']} task {record['task']} "
            f"(opcode {record['opcode']}, layer {record['layer']}): {what} {record['counter']} "
            f"saw {record['seen']}, waited for {record['target']}; "
            f"{timeouts} wait(s) timed out on their own"
        )
        if detail:
            msg += "\n" + detail
        super().__init__(msg)


def _cupy():
    import cupy  # noqa: PLC0415  (the CPU machine has no cupy)

    return cupy


# --- modules ----------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _load(path: str, mtime_ns: int):
    return _cupy().RawModule(path=path)


def load_module(cubin_path: Path | str):
    """A cupy RawModule for a cubin (cached per path and modification time)."""
    p = Path(cubin_path).resolve()
    if not p.is_file():
        raise LaunchError(f"no cubin at {p}")
    return _load(str(p), p.stat().st_mtime_ns)


# --- device facts ---------------------------------------------------------------


def sm_count(device: int | None = None) -> int:
    cp = _cupy()
    dev = cp.cuda.Device(device) if device is not None else cp.cuda.Device()
    return int(dev.attributes["MultiProcessorCount"])


def persistent_grid(device: int | None = None) -> tuple[int, int, int]:
    """One CTA per SM."""
    return (sm_count(device), 1, 1)


def expect_sms(n: int, device: int | None = None) -> None:
    """Refuse a device whose SM count differs from what the artifact was built for."""
    have = sm_count(device)
    if have != n:
        raise LaunchError(
            f"device has {have} SMs but the kernel's schedule was built for {n}: "
            f"recompile for this device"
        )


# --- arguments --------------------------------------------------------------------


def _as_arg(a: Any):
    cp = _cupy()
    if a is None:
        return np.uint64(0)
    if hasattr(a, "data_ptr") and callable(a.data_ptr):  # torch.Tensor
        if getattr(a, "device", None) is not None and a.device.type != "cuda":
            raise LaunchError(f"tensor on {a.device} passed to a kernel")
        return np.uint64(a.data_ptr())
    if isinstance(a, cp.ndarray):
        return a
    if isinstance(a, np.generic):
        return a
    if isinstance(a, (bool, int, float)):
        raise LaunchError(
            f"bare Python {type(a).__name__} {a!r} as a kernel argument: wrap it in its C type "
            f"(numpy.int32, numpy.uint64, numpy.float32, ...)"
        )
    raise LaunchError(f"cannot pass {type(a).__name__} to a kernel")


def _dims(d: int | Sequence[int]) -> tuple[int, int, int]:
    if isinstance(d, int):
        return (d, 1, 1)
    d = tuple(int(x) for x in d)
    return (d + (1, 1, 1))[:3]  # type: ignore[return-value]


# --- occupancy ----------------------------------------------------------------------


def _function(func):
    """The driver-level cupy Function behind a RawKernel (get_function returns either)."""
    return getattr(func, "kernel", func)


def set_dynamic_smem(func, shared_mem: int) -> None:
    """Raise the kernel's dynamic shared memory limit when it needs > 48 KB."""
    if shared_mem > SMEM_DEFAULT_LIMIT and func.max_dynamic_shared_size_bytes < shared_mem:
        func.max_dynamic_shared_size_bytes = int(shared_mem)


def max_active_blocks_per_sm(func, threads: int, shared_mem: int = 0) -> int:
    cp = _cupy()
    set_dynamic_smem(func, shared_mem)
    return int(
        cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
            _function(func).ptr, int(threads), int(shared_mem)
        )
    )


def check_coresident(func, grid, block, shared_mem: int = 0, name: str = "kernel") -> int:
    """Raise LaunchError unless every CTA of ``grid`` can be resident at once."""
    g, b = _dims(grid), _dims(block)
    ctas = g[0] * g[1] * g[2]
    threads = b[0] * b[1] * b[2]
    per_sm = max_active_blocks_per_sm(func, threads, shared_mem)
    sms = sm_count()
    if per_sm < 1 or per_sm * sms < ctas:
        raise LaunchError(
            f"{name}: {ctas} CTAs of {threads} threads with {shared_mem} B dynamic smem cannot be "
            f"co-resident: the occupancy API allows {per_sm} per SM x {sms} SMs "
            f"(registers {_function(func).num_regs}/thread, "
            f"static smem {_function(func).shared_size_bytes} B)"
        )
    return per_sm


# --- launch ------------------------------------------------------------------------------


class Prepared:
    """A kernel resolved, its shared-memory limit raised and (cooperative)
    its co-residency checked once, for launches on the hot path: a decode
    step launches the same megakernel every time, and the occupancy query
    and function lookup cost tens of microseconds per launch."""

    def __init__(self, module, name: str, grid, block, shared_mem: int = 0, cooperative: bool = False) -> None:
        func = module.get_function(name)
        set_dynamic_smem(func, shared_mem)
        self.grid, self.block = _dims(grid), _dims(block)
        if cooperative:
            check_coresident(func, self.grid, self.block, shared_mem, name)
        self.func = _function(func)
        self.kwargs = {"shared_mem": int(shared_mem)}
        if cooperative:
            self.kwargs["enable_cooperative_groups"] = True

    def __call__(self, args: Sequence[Any], stream=None) -> None:
        """Launch on ``stream`` (default: the current stream). Asynchronous."""
        kw = self.kwargs if stream is None else {**self.kwargs, "stream": stream}
        self.func(self.grid, self.block, tuple(_as_arg(a) for a in args), **kw)


def launch(
    module,
    name: str,
    grid,
    block,
    args: Sequence[Any],
    shared_mem: int = 0,
    cooperative: bool = False,
    stream=None,
) -> None:
    """Launch ``name`` from ``module``. Asynchronous, like any CUDA launch.

    cooperative=True checks co-residency first and launches with
    cuLaunchCooperativeKernel, so a grid that could not all be resident
    fails loudly instead of deadlocking on its counters.
    """
    func = module.get_function(name)
    set_dynamic_smem(func, shared_mem)
    g, b = _dims(grid), _dims(block)
    if cooperative:
        check_coresident(func, g, b, shared_mem, name)
    conv = tuple(_as_arg(a) for a in args)
    kwargs = {"shared_mem": int(shared_mem)}
    if stream is not None:
        kwargs["stream"] = stream
    if cooperative:
        kwargs["enable_cooperative_groups"] = True
    # The driver-level Function: a RawKernel's own __call__ passes its
    # constructor's cooperative flag and would clash with ours.
    _function(func)(g, b, conv, **kwargs)


# --- status buffer ---------------------------------------------------------------------------


def new_status(device: str = "cuda"):
    """A zeroed int32[STATUS_WORDS] status buffer (torch)."""
    import torch  # noqa: PLC0415

    return torch.zeros(STATUS_WORDS, dtype=torch.int32, device=device)


def decode_status(words: Sequence[int]) -> dict[str, Any]:
    words = [int(w) for w in words]
    rec = dict(zip(RECORD_FIELDS, words[STATUS_RECORD : STATUS_RECORD + 8]))
    return {
        "abort": words[STATUS_ABORT],
        "claimed": words[STATUS_CLAIM],
        "timeouts": words[STATUS_TIMEOUTS],
        "record_complete": words[STATUS_DONE],
        "record": rec,
    }


def check_status(status, counters=None, names: dict[int, str] | None = None) -> None:
    """Raise DeviceAbortError if the launch that used ``status`` aborted.

    ``counters`` (optional, any array-like) is dumped in the message, with
    ``names`` mapping counter indices to readable names.
    """
    words = status.tolist() if hasattr(status, "tolist") else list(status)
    st = decode_status(words)
    if st["abort"] == 0:
        return
    detail = ""
    if counters is not None:
        vals = counters.tolist() if hasattr(counters, "tolist") else list(counters)
        idx = st["record"]["counter"]
        if 0 <= idx < len(vals):
            label = (names or {}).get(idx, f"counter[{idx}]")
            detail = f"{label} = {vals[idx]} at exit; "
        nz = [(i, v) for i, v in enumerate(vals) if v]
        detail += f"{len(nz)} of {len(vals)} counters nonzero: " + ", ".join(
            f"{(names or {}).get(i, i)}={v}" for i, v in nz[:32]
        ) + (" ..." if len(nz) > 32 else "")
    raise DeviceAbortError(st["record"], st["timeouts"], detail)

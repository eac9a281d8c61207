"""``make_backend``: the backend for ``--backend KIND``.

* ``cpu``: the CPU VM over the compiled task words (:class:`megac.vm.VMBackend`),
  so the server runs exactly what the megakernel will run;
* ``reference``: plain PyTorch (:class:`~megac.runtime.backend.ReferenceBackend`),
  for debugging;
* ``cuda``: not built yet (one-line :class:`MegacError`);
* ``auto``: ``cuda`` when a GPU is visible and a CUDA backend exists,
  otherwise ``cpu`` (today: always ``cpu``).
"""

from __future__ import annotations

from megac.errors import MegacError
from megac.runtime.backend import BACKEND_KINDS, Backend, ReferenceBackend
from megac.vm.backend import VMBackend


def needs_schedules(kind: str) -> bool:
    """Whether the backend runs compiled task words."""
    return kind in ("cpu", "auto", "cuda")


def check_kind(kind: str) -> None:
    if kind not in BACKEND_KINDS:
        raise MegacError(f"--backend {kind}: choose one of {', '.join(BACKEND_KINDS)}")
    if kind == "cuda":
        raise MegacError("--backend cuda: no CUDA backend yet (use --backend cpu)")


def make_backend(kind: str, spec, weights, kv, *, schedules=None, max_batch_size: int = 64, mode: str = "fast",
                 policy: str = "round_robin", seed: int = 0) -> Backend:
    """The backend ``kind`` over the engine's cache ``kv``; ``schedules``
    (``megac.runtime.artifacts.load_or_compile``) for those that run task
    words."""
    check_kind(kind)
    if kind == "reference":
        return ReferenceBackend(spec, weights, kv, max_batch_size=max_batch_size)
    if schedules is None:
        raise MegacError(f"--backend {kind}: needs compiled schedules")
    return VMBackend(spec, weights, kv, schedules, dtype=weights.dtype, mode=mode, policy=policy, seed=seed)


__all__ = ["check_kind", "make_backend", "needs_schedules"]

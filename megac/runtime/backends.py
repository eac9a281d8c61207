"""``make_backend``: the backend for ``--backend KIND``.

* ``cpu``: the CPU VM over the compiled task words (:class:`megac.vm.VMBackend`),
  so the server runs exactly what the megakernel will run;
* ``reference``: plain PyTorch (:class:`~megac.runtime.backend.ReferenceBackend`),
  for debugging;
* ``cuda``: the generated megakernel on the GPU
  (:class:`megac.gpu.backend.CudaBackend`), bf16 weights and KV;
* ``graphs``: the model as per-op kernels in CUDA graphs
  (:class:`megac.baselines.graphs.GraphsBackend`; eager PyTorch on the CPU),
  the baseline ``megac bench`` compares against;
* ``waves``: the megakernel's opcodes launched one kernel per wave in a
  CUDA graph (:class:`megac.gpu.waves.WavesBackend`): what the persistent
  schedule gains;
* ``auto``: ``cuda`` when a CUDA device is visible, otherwise ``cpu``.
"""

from __future__ import annotations

from megac.errors import MegacError
from megac.runtime.backend import BACKEND_KINDS, Backend, ReferenceBackend
from megac.vm.backend import VMBackend


def needs_schedules(kind: str) -> bool:
    """Whether the backend runs compiled task words."""
    return kind in ("cpu", "auto", "cuda", "waves")


def cuda_visible() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 -- no usable torch: no GPU path
        return False


def resolve_kind(kind: str) -> str:
    """``auto`` -> ``cuda`` or ``cpu``; every other kind checked and returned."""
    check_kind(kind)
    if kind == "auto":
        return "cuda" if cuda_visible() else "cpu"
    return kind


def runs_on_gpu(kind: str) -> bool:
    """Whether backend ``kind`` keeps its weights on the GPU (bf16): cuda and
    waves always, graphs where a GPU is visible, ``auto`` where it picks cuda."""
    kind = resolve_kind(kind)
    return kind in ("cuda", "waves") or (kind == "graphs" and cuda_visible())


def random_weights_placement(kind: str, dtype):
    """``(dtype, device)`` to draw ``--random-weights`` in for backend ``kind``:
    a GPU backend's in bf16 on the GPU, where it would convert them anyway
    (North Mini Code's 30B parameters drawn on the host in fp32 would take
    120 GB and minutes); else ``dtype`` on the CPU."""
    if runs_on_gpu(kind):
        import torch

        return torch.bfloat16, "cuda"
    return dtype, "cpu"


def check_kind(kind: str) -> None:
    if kind not in BACKEND_KINDS:
        raise MegacError(f"--backend {kind}: choose one of {', '.join(BACKEND_KINDS)}")
    if kind in ("cuda", "waves") and not cuda_visible():
        raise MegacError(f"--backend {kind}: no CUDA device visible (use --backend cpu)")


def make_backend(kind: str, spec, weights, kv, *, schedules=None, artifact_dir=None, max_batch_size: int = 64,
                 mode: str = "fast", policy: str = "round_robin", seed: int = 0,
                 decode_only: bool = False) -> Backend:
    """The backend ``kind`` over the engine's cache ``kv``; ``schedules``
    (``megac.runtime.artifacts.load_or_compile``) for those that run task
    words, and the artifact directory they came from (its megakernel) for
    ``cuda``. ``decode_only``: the cuda and waves backends consume the
    canonical weights into their kernel layout (see EngineOptions)."""
    kind = resolve_kind(kind)
    if kind != "cuda" and not hasattr(weights, "layers"):  # megac.weights.layout.LaidOutWeights
        raise MegacError(f"--backend {kind}: needs the model's weights; another engine's laid-out weights "
                         "are for the cuda backend only")
    if kind == "reference":
        return ReferenceBackend(spec, weights, kv, max_batch_size=max_batch_size)
    if kind == "graphs":
        from megac.baselines.graphs import GraphsBackend

        return GraphsBackend(spec, weights, kv, max_batch_size=max_batch_size)
    if schedules is None:
        raise MegacError(f"--backend {kind}: needs compiled schedules")
    if kind in ("cuda", "waves"):
        if artifact_dir is None:
            raise MegacError(f"--backend {kind}: needs the artifact directory (its megakernel)")
        if kind == "waves":
            from megac.gpu.waves import WavesBackend

            return WavesBackend(spec, weights, kv, schedules, artifact_dir, decode_only=decode_only)
        from megac.gpu.backend import CudaBackend

        return CudaBackend(spec, weights, kv, schedules, artifact_dir, decode_only=decode_only)
    return VMBackend(spec, weights, kv, schedules, dtype=weights.dtype, mode=mode, policy=policy, seed=seed)


__all__ = ["check_kind", "cuda_visible", "make_backend", "needs_schedules", "random_weights_placement", "resolve_kind",
           "runs_on_gpu"]

"""Triton, when it is there: ``triton`` / ``tl`` are None otherwise (this
machine's CPU-only torch has none), and every op of :mod:`megac.baselines`
then takes its plain-PyTorch path. ``TRITON_INTERPRET=1`` runs the kernels on
CPU tensors (the tests use it where triton is installed)."""

from __future__ import annotations

import os

try:  # pragma: no cover - depends on the machine
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(device) -> bool:
    """Run the Triton kernels for tensors on ``device``: on CUDA, or on the
    CPU under the Triton interpreter."""
    if triton is None:
        return False
    import torch

    return torch.device(device).type == "cuda" or interpreting()


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


__all__ = ["interpreting", "next_pow2", "tl", "triton", "use_triton"]

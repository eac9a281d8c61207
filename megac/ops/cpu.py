"""Index and tensor helpers the opcodes' CPU semantics share (numpy / torch).

Nothing here knows an opcode; the VM (``megac.vm.machine``) supplies the
state, the tracker and the per-step caches.
"""

from __future__ import annotations

import numpy as np
import torch


def idx(a) -> torch.Tensor:
    """int64 tensor of ``a``."""
    return torch.as_tensor(np.asarray(a, dtype=np.int64))


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, skipping the call when ``t`` already is ``dtype`` (it
    then returns ``t`` itself either way; the call costs more than the check)."""
    return t if t.dtype == dtype else t.to(dtype)


def cols(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(s, s + n)`` for every (s, n)."""
    starts = np.asarray(starts, dtype=np.int64)
    lens = np.asarray(lens, dtype=np.int64)
    if len(starts) == 1:
        return np.arange(starts[0], starts[0] + lens[0], dtype=np.int64)
    tot = int(lens.sum())
    off = np.repeat(starts - (np.cumsum(lens) - lens), lens)
    return off + np.arange(tot, dtype=np.int64)


def ranges(sorted_idx: np.ndarray) -> list[tuple[int, int]]:
    """Maximal ``[a, b)`` runs of consecutive integers in a sorted array."""
    if len(sorted_idx) == 0:
        return []
    brk = np.flatnonzero(np.diff(sorted_idx) != 1) + 1
    starts = np.concatenate([[0], brk])
    ends = np.concatenate([brk, [len(sorted_idx)]])
    return [(int(sorted_idx[a]), int(sorted_idx[b - 1]) + 1) for a, b in zip(starts, ends)]


def as_slice(c: np.ndarray):
    """A slice when ``c`` is one contiguous ascending range, else a tensor."""
    if len(c) and c[-1] - c[0] + 1 == len(c) and (len(c) < 3 or (np.diff(c) == 1).all()):
        return slice(int(c[0]), int(c[-1]) + 1)
    return idx(c)


def group_rows(key: np.ndarray):
    """``(tuple(key row), indices)`` per distinct row of ``key [n, k]``, in
    order of first appearance."""
    n = len(key)
    if n == 1 or (key == key[0]).all():
        return [(tuple(int(v) for v in key[0]), np.arange(n, dtype=np.int64))]
    groups: dict[tuple, list[int]] = {}
    for i, row in enumerate(map(tuple, key.tolist())):
        groups.setdefault(row, []).append(i)
    return [(k, np.asarray(v, dtype=np.int64)) for k, v in groups.items()]


def rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, half: bool) -> torch.Tensor:
    """Rotate the pairs of ``x [..., hd]`` by cos ``c`` / sin ``s``: pairs
    ``(2k, 2k+1)`` (interleaved) or ``(k, k + hd/2)`` (half)."""
    hd = x.shape[-1]
    if half:
        a, b = x[..., : hd // 2], x[..., hd // 2:]
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)


def rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, half: bool) -> torch.Tensor:
    """Rotate fp32 heads ``x [R, m, hd]`` by positions ``pos [R]``: angle
    ``pos * inv_freq[k]`` in fp32; ``(a, b) -> (a cos - b sin, b cos + a sin)``."""
    ang = pos.to(torch.float32)[:, None] * inv_freq[None, :]  # [R, hd/2]
    return rotate(x, ang.cos()[:, None, :], ang.sin()[:, None, :], half)


__all__ = ["as_slice", "cast", "cols", "group_rows", "idx", "ranges", "rope", "rotate"]

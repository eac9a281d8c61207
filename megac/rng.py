"""The counter-based hash every random stream of megac is drawn from.

Element ``i`` of a stream keyed ``key`` is lowbias32(``i * golden + key``):
a bijection of ``i`` below 2^32, computed with int32 tensor operations that
wrap the same way on every device. So the CPU and a GPU draw the same bits,
and any slice of a stream can be regenerated without drawing what precedes
it. Users: :mod:`megac.weights.random` (random weights, drawn on the GPU for
North Mini Code) and :mod:`megac.sampling` (the per-row sampling noise,
drawn where the logits are).
"""

from __future__ import annotations

import hashlib

import torch


def stream_key(*parts) -> int:
    """A 32-bit stream key from ``parts`` (their ``str`` joined by ``:``)."""
    h = hashlib.blake2b(":".join(str(p) for p in parts).encode(), digest_size=4).digest()
    return int.from_bytes(h, "little")


def i32(u: int) -> int:
    """A uint32 constant as the int32 with the same bits."""
    return u - (1 << 32) if u >= 1 << 31 else u


_GOLDEN = i32(0x9E3779B9)
_MIX = (i32(0x7FEB352D), i32(0x846CA68B))


def hash24(start: int, n: int, key: int, device) -> torch.Tensor:
    """int32 [n]: the top 24 bits of lowbias32(i * golden + key) for
    counters i = start .. start+n-1, in place on int32 tensors (32-bit
    arithmetic wraps the same on every device; arithmetic shifts are masked
    to logical ones). 24 bits: exactly what an fp32 in [0, 1) can hold."""
    z = torch.arange(start, start + n, dtype=torch.int32, device=device)
    z.mul_(_GOLDEN).add_(i32(key))
    t = torch.empty_like(z)
    for k, m in ((16, _MIX[0]), (15, _MIX[1]), (16, None)):
        torch.bitwise_right_shift(z, k, out=t)
        t.bitwise_and_((1 << (32 - k)) - 1)
        z.bitwise_xor_(t)
        if m is not None:
            z.mul_(m)
    return z.bitwise_right_shift_(8).bitwise_and_(0xFFFFFF)


__all__ = ["hash24", "i32", "stream_key"]

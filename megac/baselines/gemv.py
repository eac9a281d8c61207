"""Decode-sized linear layers: cuBLAS or a Triton GEMV, whichever is faster
for that layer's shape at that batch size, measured once on the GPU.

At batch 1-8 a projection is a matrix-vector product bound by reading the
weights; cuBLAS picks tiles (and split-K with a separate reduction) made
for larger M and reaches ~2.3-2.7 TB/s on the H200 for North Mini Code's
Q/K/V and O. The Triton kernel streams ``BN`` weight rows per program over
the whole reduction (the rows padded to one 16-row MMA tile).

:class:`LinearPicker` times every candidate on the first call of a (role,
batch) -- e.g. ``("qkv", 1)`` -- over *all* the role's weight matrices in
turn (cold in L2, as in a real step: one layer's matrix would stay in the
60 MB L2 and flatter every candidate), in a CUDA graph (Python's launch
cost would decide otherwise), keeps the fastest, and from then on
runs it; a CUDA graph captures the chosen kernel (the first call happens in
the eager warm-up before the capture). Off the GPU it is ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megac.baselines._triton import next_pow2, tl, triton

#: Triton candidates: (weight rows per program, reduction step, pipeline stages)
CONFIGS = ((16, 256, 4), (16, 512, 3), (32, 128, 4), (32, 256, 3))
MAX_ROWS = 16


def triton_linear(x: torch.Tensor, w: torch.Tensor, cfg) -> torch.Tensor:
    BN, BK, stages = cfg
    B, K = x.shape
    N = w.shape[0]
    x = x.contiguous()
    y = torch.empty((B, N), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, BN),)](x, w, y, B, N, K=K, BLOCK_M=max(16, next_pow2(B)), BN=BN, BK=min(BK, K),
                                        num_warps=4, num_stages=stages)
    return y


def _fits(x: torch.Tensor, w: torch.Tensor, cfg) -> bool:
    K = x.shape[1]
    bk = min(cfg[1], K)
    return x.shape[0] <= MAX_ROWS and w.is_contiguous() and K % bk == 0 and bk == next_pow2(bk) and K >= 16


class LinearPicker:
    """See the module docstring. ``weights[role]``: every matrix of the role
    (same shape), for timing."""

    def __init__(self, triton_ok: bool, weights: dict[str, list[torch.Tensor]]) -> None:
        self.triton_ok = triton_ok
        self.weights = weights
        self.choice: dict[tuple[str, int], object] = {}  # (role, batch) -> None (cuBLAS) or a config
        self.timings: dict[tuple[str, int], dict[str, float]] = {}

    def __call__(self, role: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if not self.triton_ok or x.shape[0] > MAX_ROWS:
            return F.linear(x, w)
        key = (role, x.shape[0])
        if key not in self.choice:
            if torch.cuda.is_current_stream_capturing():  # no timing inside a capture
                return F.linear(x, w)
            self.choice[key] = self._pick(key, x)
        cfg = self.choice[key]
        return F.linear(x, w) if cfg is None else triton_linear(x, w, cfg)

    def _pick(self, key, x: torch.Tensor):
        mats = self.weights[key[0]]
        cands = {"cublas": None, **{f"triton{c}": c for c in CONFIGS if _fits(x, mats[0], c)}}
        times = {}
        for name, cfg in cands.items():
            run = (lambda m: F.linear(x, m)) if cfg is None else (lambda m, cfg=cfg: triton_linear(x, m, cfg))
            times[name] = time_graph(lambda: [run(m) for m in mats]) * 1e3 / len(mats)  # us per matrix
        best = min(times, key=times.get)
        self.timings[key] = {k: round(v, 2) for k, v in times.items()}
        return cands[best]


def time_graph(fn, replays: int = 3) -> float:
    """ms per call of ``fn`` captured in a CUDA graph (kernel time without
    Python's launch cost, which would otherwise decide between candidates)."""
    fn()  # compile, set up
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(replays):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / replays


if triton is not None:

    @triton.jit
    def _gemv_kernel(X, W, Y, B, N, K: tl.constexpr, BLOCK_M: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        m = tl.arange(0, BLOCK_M)
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        kk = tl.arange(0, BK)
        mv = m < B
        nv = n < N
        wp = W + n[:, None].to(tl.int64) * K + kk[None, :]
        acc = tl.zeros([BLOCK_M, BN], tl.float32)
        for k0 in range(0, K, BK):
            x = tl.load(X + m[:, None] * K + k0 + kk[None, :], mask=mv[:, None], other=0.0)
            acc = tl.dot(x, tl.trans(tl.load(wp + k0, mask=nv[:, None], other=0.0)), acc)
        tl.store(Y + m[:, None] * N + n[None, :], acc.to(Y.dtype.element_ty), mask=mv[:, None] & nv[None, :])


__all__ = ["CONFIGS", "LinearPicker", "time_graph", "triton_linear"]

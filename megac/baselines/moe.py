"""The routed-expert FFN of a decode step as grouped GEMMs, with static
shapes (no host synchronisation, so a CUDA graph can hold it).

::

    r = route(h, router, moe)             # top-k, weights, pairs sorted by expert
    z = experts(h, r, gate_up, down)      # [rows*k, hidden], sorted pair order
    out = combine(z, r)                   # [rows, hidden]: sum_k w_k * z

:func:`route` turns the router's choices into the grouped-GEMM layout: the
``rows*k`` (row, expert) pairs sorted by expert (rows ascending within an
expert: a stable sort), ``offs[e]`` the end of expert ``e``'s group,
``src[p]`` the row of sorted pair ``p`` and ``dest[row, j]`` where pair
``(row, j)`` went. On CUDA one Triton program does the top-k, the weights
and the counting sort; elsewhere :func:`megac.reference.route` plus a
stable ``torch.sort``. The GEMMs are ``torch._grouped_mm`` over the stacked
expert weights (transposed views: no copy), empty experts cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from megac.baselines._triton import next_pow2, tl, triton
from megac.baselines.elementwise import silu_mul
from megac.reference import route as reference_route

if TYPE_CHECKING:
    from megac.spec.model import MoESpec


@dataclass
class Routing:
    offs: torch.Tensor  # int32 [E]: end of each expert's group in the sorted pairs
    src: torch.Tensor  # int64 [rows*k]: the row of each sorted pair
    dest: torch.Tensor  # int64 [rows, k]: the sorted position of pair (row, j)
    weights: torch.Tensor  # [rows, k] in h's dtype


def route(h: torch.Tensor, router: torch.Tensor, moe: "MoESpec", triton_ok: bool) -> Routing:
    B, E, K = h.shape[0], router.shape[0], moe.top_k
    if not triton_ok:
        ids, w = reference_route(h, router, moe)
        sorted_ids, order = torch.sort(ids.flatten(), stable=True)
        experts = torch.arange(E, device=h.device, dtype=sorted_ids.dtype)
        offs = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)
        dest = torch.empty_like(order).scatter_(0, order, torch.arange(B * K, device=h.device))
        return Routing(offs, order // K, dest.view(B, K), w)
    logits = F.linear(h, router).contiguous()
    offs = torch.empty(E, dtype=torch.int32, device=h.device)
    src = torch.empty(B * K, dtype=torch.int64, device=h.device)
    dest = torch.empty((B, K), dtype=torch.int64, device=h.device)
    w = torch.empty((B, K), dtype=h.dtype, device=h.device)
    B_PAD, E_PAD = max(2, next_pow2(B)), max(2, next_pow2(E))
    _route_kernel[(1,)](logits, offs, src, dest, w, B, E, K=K, B_PAD=B_PAD, E_PAD=E_PAD,
                        SOFTMAX=moe.router == "softmax", RENORM=bool(moe.renormalize),
                        num_warps=4 if B_PAD * E_PAD <= 2048 else 8)
    return Routing(offs, src, dest, w)


def grouped_mm(x: torch.Tensor, w_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x[group rows] @ w_t[e]`` per expert group (``w_t`` ``[E, K, N]``)."""
    if hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(x, w_t, offs=offs)
    # torch without grouped GEMMs: one GEMM per expert (host sync; eager only)
    out = x.new_empty((x.shape[0], w_t.shape[2]))
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ w_t[e]
        start = end
    return out


def experts(h: torch.Tensor, r: Routing, gate_up: torch.Tensor, down: torch.Tensor, triton_ok: bool) -> torch.Tensor:
    """Every pair's expert output ``[rows*k, hidden]`` in sorted order (not
    yet weighted). ``gate_up`` ``[E, 2w, hidden]`` (gate rows first),
    ``down`` ``[E, hidden, w]``."""
    xs = h.index_select(0, r.src)
    y = grouped_mm(xs, gate_up.transpose(1, 2), r.offs)
    return grouped_mm(silu_mul(y, triton_ok), down.transpose(1, 2), r.offs)


def combine(z: torch.Tensor, r: Routing, triton_ok: bool) -> torch.Tensor:
    """``out[row] = sum_j weights[row, j] * z[dest[row, j]]`` (fp32 sum)."""
    B, K = r.dest.shape
    D = z.shape[1]
    if not triton_ok:
        zz = z[r.dest.flatten()].view(B, K, D).float()
        return (zz * r.weights.float()[..., None]).sum(1).to(z.dtype)
    out = torch.empty((B, D), dtype=z.dtype, device=z.device)
    BLOCK = min(1024, next_pow2(D))
    _combine_kernel[(B, triton.cdiv(D, BLOCK))](z, r.dest, r.weights, out, D, K=K, BLOCK=BLOCK, num_warps=4)
    return out


def moe_ffn(h: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, moe: "MoESpec",
            triton_ok: bool) -> torch.Tensor:
    r = route(h, router, moe, triton_ok)
    return combine(experts(h, r, gate_up, down, triton_ok), r, triton_ok)


if triton is not None:

    @triton.jit
    def _route_kernel(LOG, OFFS, SRC, DEST, W, B, E, K: tl.constexpr, B_PAD: tl.constexpr, E_PAD: tl.constexpr,
                      SOFTMAX: tl.constexpr, RENORM: tl.constexpr):
        """One program: top-k per row (largest logit first, lower id on
        ties, as the reference's stable sort), the weights, and a counting
        sort of the (row, expert) pairs by expert."""
        rb = tl.arange(0, B_PAD)
        ce = tl.arange(0, E_PAD)
        rows_ok = rb < B
        lg = tl.load(LOG + rb[:, None] * E + ce[None, :], mask=rows_ok[:, None] & (ce[None, :] < E),
                     other=float("-inf")).to(tl.float32)
        # pass 1: the selection mask and the weights' normaliser
        work = lg
        sel = tl.zeros([B_PAD, E_PAD], tl.int32)
        top = tl.max(lg, 1)
        norm = tl.zeros([B_PAD], tl.float32)
        for _j in tl.static_range(K):
            mx = tl.max(work, 1)
            idx = tl.min(tl.where(work == mx[:, None], ce[None, :], E_PAD), 1)
            hit = (ce[None, :] == idx[:, None]) & rows_ok[:, None]
            sel += hit.to(tl.int32)
            work = tl.where(hit, float("-inf"), work)
            if SOFTMAX:
                norm += tl.exp(mx - top)
            else:
                norm += 1.0 / (1.0 + tl.exp(-mx))
        counts = tl.sum(sel, 0)
        ends = tl.cumsum(counts, 0)
        tl.store(OFFS + ce, ends, mask=ce < E)
        base = (ends - counts)[None, :] + tl.cumsum(sel, 0) - sel  # sorted slot of (row, expert)
        # pass 2: the same choices again, now placed
        work = lg
        for j in tl.static_range(K):
            mx = tl.max(work, 1)
            idx = tl.min(tl.where(work == mx[:, None], ce[None, :], E_PAD), 1)
            hit = ce[None, :] == idx[:, None]
            work = tl.where(hit, float("-inf"), work)
            d = tl.sum(tl.where(hit, base, 0), 1)
            if SOFTMAX:
                w = tl.exp(mx - top) / norm
            else:
                w = 1.0 / (1.0 + tl.exp(-mx))
                if RENORM:
                    w = w / norm
            tl.store(DEST + rb * K + j, d.to(tl.int64), mask=rows_ok)
            tl.store(SRC + d, rb.to(tl.int64), mask=rows_ok)
            tl.store(W + rb * K + j, w.to(W.dtype.element_ty), mask=rows_ok)

    @triton.jit
    def _combine_kernel(Z, DEST, Wt, Out, D, K: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < D
        acc = tl.zeros([BLOCK], tl.float32)
        for j in tl.static_range(K):
            p = tl.load(DEST + b * K + j)
            w = tl.load(Wt + b * K + j).to(tl.float32)
            acc += w * tl.load(Z + p * D + c, mask=m, other=0.0).to(tl.float32)
        tl.store(Out + b * D + c, acc.to(Out.dtype.element_ty), mask=m)


__all__ = ["Routing", "combine", "experts", "grouped_mm", "moe_ffn", "route"]

"""The routed-expert FFN of a decode step as grouped GEMMs, with static
shapes (no host synchronisation, so a CUDA graph can hold it).

::

    r = route(h, router, moe)             # top-k, weights, pairs sorted by expert
    z = experts(h, r, gate_up, down)      # [rows*k, hidden], sorted pair order
    WeightedRows(z, r.dest, r.weights)    # out[row] = sum_j w[row, j] * z[dest[row, j]], summed
                                          # by the next residual RMSNorm

:func:`route` turns the router's choices into the grouped-GEMM layout: the
``rows*k`` (row, expert) pairs sorted by expert (rows ascending within an
expert: a stable sort), ``offs[e]`` the end of expert ``e``'s group,
``src[p]`` the row of sorted pair ``p`` and ``dest[row, j]`` where pair
``(row, j)`` went. On CUDA one Triton launch computes the router logits
(a program per 16 experts) and the last program to finish does the top-k,
the weights and the counting sort; elsewhere :func:`megac.reference.route`
plus a stable ``torch.sort``. The GEMMs are ``torch._grouped_mm`` over the stacked
expert weights (:func:`grouped_linear`; transposed views: no copy), empty experts cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from megac.baselines._triton import next_pow2, tl, triton
from megac.baselines.elementwise import WeightedRows, silu_mul
from megac.reference import route as reference_route

if TYPE_CHECKING:
    from megac.spec.model import MoESpec


@dataclass
class Routing:
    offs: torch.Tensor  # int32 [E]: end of each expert's group in the sorted pairs
    src: torch.Tensor  # int64 [rows*k]: the row of each sorted pair
    dest: torch.Tensor  # int64 [rows, k]: the sorted position of pair (row, j)
    weights: torch.Tensor  # [rows, k] in h's dtype
    expert: torch.Tensor  # int32 [rows*k]: the expert of each sorted pair


def route(h: torch.Tensor, router: torch.Tensor, moe: "MoESpec", triton_ok: bool,
          sem: torch.Tensor | None = None) -> Routing:
    """The Triton path computes the router logits and routes in one launch
    (``sem``: an int32 zero the kernel leaves at zero, reusable across
    launches on one stream); the PyTorch path routes exactly as the
    reference."""
    B, E, K = h.shape[0], router.shape[0], moe.top_k
    D = h.shape[1]
    BK = min(256, D)
    if not triton_ok or D % BK or BK != next_pow2(BK) or B > 64:
        ids, w = reference_route(h, router, moe)
        sorted_ids, order = torch.sort(ids.flatten(), stable=True)
        experts = torch.arange(E, device=h.device, dtype=sorted_ids.dtype)
        offs = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)
        dest = torch.empty_like(order).scatter_(0, order, torch.arange(B * K, device=h.device))
        return Routing(offs, order // K, dest.view(B, K), w, sorted_ids.to(torch.int32))
    dev = h.device
    h = h.contiguous()
    logits = torch.empty((B, E), dtype=torch.float32, device=dev)
    sem = torch.zeros(1, dtype=torch.int32, device=dev) if sem is None else sem
    offs = torch.empty(E, dtype=torch.int32, device=dev)
    src = torch.empty(B * K, dtype=torch.int64, device=dev)
    dest = torch.empty((B, K), dtype=torch.int64, device=dev)
    w = torch.empty((B, K), dtype=h.dtype, device=dev)
    expert = torch.empty(B * K, dtype=torch.int32, device=dev)
    BE = 16  # router rows per program (the MMA's smallest N)
    B_PAD, E_PAD = max(2, next_pow2(B)), max(2, next_pow2(E))
    _router_route_kernel[(triton.cdiv(E, BE),)](
        h, router, logits, sem, offs, src, dest, w, expert, B, E, D=D, K=K,
        B_PAD=B_PAD, E_PAD=E_PAD, K_PAD=max(2, next_pow2(K)), BE=BE, BK=BK, BM=max(16, next_pow2(B)), SOFTMAX=moe.router == "softmax", RENORM=bool(moe.renormalize),
        num_warps=4)
    return Routing(offs, src, dest, w, expert)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``F.linear(x[group e], w[e])`` for every group of consecutive rows
    (``offs[e]``: the end of group ``e``; ``w`` ``[E, out, in]``, read through
    a transposed view: no copy): one grouped GEMM where torch has one for
    these tensors (CUDA bf16, CPU fp32), else one GEMM per non-empty group
    (a host synchronisation: eager only)."""
    if hasattr(torch, "_grouped_mm") and (x.dtype == torch.bfloat16 if x.is_cuda else x.dtype == torch.float32):
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
    out = x.new_empty((x.shape[0], w.shape[1]))
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = F.linear(x[start:end], w[e])
        start = end
    return out


def experts(h: torch.Tensor, r: Routing, gate_up: torch.Tensor, down: torch.Tensor, triton_ok: bool) -> torch.Tensor:
    """Every pair's expert output ``[rows*k, hidden]`` in sorted order (not
    yet weighted). ``gate_up`` ``[E, 2w, hidden]`` (gate rows first),
    ``down`` ``[E, hidden, w]``."""
    if triton_ok and _kernels_fit(h, gate_up, down):
        return _triton_experts(h, r, gate_up, down)
    xs = h.index_select(0, r.src)
    y = grouped_linear(xs, gate_up, r.offs)
    return grouped_linear(silu_mul(y, triton_ok), down, r.offs)


#: the expert kernels' tiles (weight rows per program, reduction step, warps, pipeline stages); an
#: expert's group of rows is padded to one MMA tile (16 or more). Measured on the H200 (tests/gpu/graphs_check.py)
UP_CFG, DOWN_CFG = (32, 128, 4, 4), (32, 128, 4, 4)
_MAX_ROWS = 64


def _kernels_fit(h, gate_up, down, up_cfg=None, down_cfg=None) -> bool:
    D, W = h.shape[1], down.shape[2]
    (ubn, ubk, *_), (dbn, dbk, *_) = up_cfg or UP_CFG, down_cfg or DOWN_CFG
    step_ok = lambda n, bk: n % min(bk, n) == 0 and min(bk, n) == next_pow2(min(bk, n))  # noqa: E731
    return (h.shape[0] <= _MAX_ROWS and gate_up.is_contiguous() and down.is_contiguous()
            and W % ubn == 0 and D % dbn == 0 and step_ok(D, ubk) and step_ok(W, dbk))


def _triton_experts(h, r: Routing, gate_up, down, up_cfg=None, down_cfg=None):
    """Decode-sized grouped GEMMs: a program per (sorted pair, tile of
    weight rows) that works only when its pair starts an expert's group
    (an expert has at most one pair per row, so a group is at most ``rows``
    pairs: one MMA tile); it reads its rows of ``h`` directly (no gather)
    and streams the expert's weight rows once."""
    B, D = h.shape
    P, W = r.src.shape[0], down.shape[2]
    BM = max(16, next_pow2(B))
    (ubn, ubk, uw, us), (dbn, dbk, dw, ds) = up_cfg or UP_CFG, down_cfg or DOWN_CFG
    h = h.contiguous()
    act = torch.empty((P, W), dtype=h.dtype, device=h.device)
    _moe_up_kernel[(P, W // ubn)](h, gate_up, r.expert, r.offs, r.src, act, D=D, WID=W, BLOCK_M=BM, BN=ubn,
                                  BK=min(ubk, D), num_warps=uw, num_stages=us)
    z = torch.empty((P, D), dtype=h.dtype, device=h.device)
    _moe_down_kernel[(P, D // dbn)](act, down, r.expert, r.offs, z, D=D, WID=W, BLOCK_M=BM, BN=dbn,
                                    BK=min(dbk, W), num_warps=dw, num_stages=ds)
    return z


def moe_ffn(h: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, moe: "MoESpec",
            triton_ok: bool, sem: torch.Tensor | None = None) -> WeightedRows:
    """The routed FFN of ``h``, as the rows still to be weighed and summed
    (the next residual RMSNorm does that: one kernel fewer)."""
    r = route(h, router, moe, triton_ok, sem)
    return WeightedRows(experts(h, r, gate_up, down, triton_ok), r.dest, r.weights)


if triton is not None:

    @triton.jit
    def _router_route_kernel(Hx, R, LOG, SEM, OFFS, SRC, DEST, W, EXP, B, E, D: tl.constexpr, K: tl.constexpr,
                             B_PAD: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, BE: tl.constexpr,
                             BK: tl.constexpr, BM: tl.constexpr, SOFTMAX: tl.constexpr, RENORM: tl.constexpr):
        """Each program: the router logits of BE experts for every row; the
        last program to finish (an arrival counter) routes all rows."""
        m = tl.arange(0, BM)
        mv = m < B
        ee = tl.program_id(0) * BE + tl.arange(0, BE)
        ev = ee < E
        kk = tl.arange(0, BK)
        acc = tl.zeros([BM, BE], tl.float32)
        for k0 in range(0, D, BK):
            x = tl.load(Hx + m[:, None] * D + k0 + kk[None, :], mask=mv[:, None], other=0.0)
            r = tl.load(R + ee[:, None] * D + k0 + kk[None, :], mask=ev[:, None], other=0.0)
            acc = tl.dot(x, tl.trans(r), acc)
        # rounded to h's dtype, as F.linear returns them: the reference's choices
        tl.store(LOG + m[:, None] * E + ee[None, :], acc.to(Hx.dtype.element_ty).to(tl.float32),
                 mask=mv[:, None] & ev[None, :])
        tl.debug_barrier()  # the whole program's logits are written before it arrives
        arrived = tl.atomic_add(SEM, 1)  # acq_rel at GPU scope: the last to arrive sees every program's logits
        if arrived == tl.num_programs(0) - 1:
            tl.atomic_xchg(SEM, 0)  # ready for the next launch
            _route_rows(LOG, OFFS, SRC, DEST, W, EXP, B, E, K, B_PAD, E_PAD, K_PAD, SOFTMAX, RENORM)

    @triton.jit
    def _route_rows(LOG, OFFS, SRC, DEST, W, EXP, B, E, K: tl.constexpr, B_PAD: tl.constexpr, E_PAD: tl.constexpr,
                    K_PAD: tl.constexpr, SOFTMAX: tl.constexpr, RENORM: tl.constexpr):
        """Top-k of every row of the logits (largest first, lower id on
        ties, as the reference's stable sort), the weights, and a counting
        sort of the (row, expert) pairs by expert (rows ascending). (Ranking
        by all-pairs comparison instead of k selection steps measured slower
        on the H200: 11.8 against 9.1 us per layer with the router GEMV.)"""
        rb = tl.arange(0, B_PAD)
        ce = tl.arange(0, E_PAD)
        kc = tl.arange(0, K_PAD)
        rows_ok = rb < B
        lg = tl.load(LOG + rb[:, None] * E + ce[None, :], mask=rows_ok[:, None] & (ce[None, :] < E),
                     other=float("-inf"), cache_modifier=".cg")
        work = lg
        sel = tl.zeros([B_PAD, E_PAD], tl.int32)
        ids = tl.zeros([B_PAD, K_PAD], tl.int32)
        vals = tl.full([B_PAD, K_PAD], float("-inf"), tl.float32)
        for j in tl.static_range(K):
            mx = tl.max(work, 1)
            idx = tl.min(tl.where(work == mx[:, None], ce[None, :], E_PAD), 1)
            hit = ce[None, :] == idx[:, None]
            sel += (hit & rows_ok[:, None]).to(tl.int32)
            work = tl.where(hit, float("-inf"), work)
            ids = tl.where(kc[None, :] == j, idx[:, None], ids)
            vals = tl.where(kc[None, :] == j, mx[:, None], vals)
        kv = kc < K
        if SOFTMAX:
            ex = tl.where(kv[None, :], tl.exp(vals - tl.max(vals, 1)[:, None]), 0.0)
            w = ex / tl.sum(ex, 1)[:, None]
        else:
            w = tl.where(kv[None, :], 1.0 / (1.0 + tl.exp(-vals)), 0.0)
            if RENORM:
                w = w / tl.sum(w, 1)[:, None]
        counts = tl.sum(sel, 0)
        ends = tl.cumsum(counts, 0)
        tl.store(OFFS + ce, ends, mask=ce < E)
        base = (ends - counts)[None, :] + tl.cumsum(sel, 0) - sel  # sorted slot of (row, expert)
        d = tl.sum(tl.where(ce[None, None, :] == ids[:, :, None], base[:, None, :], 0), 2)  # [B_PAD, K_PAD]
        ok = rows_ok[:, None] & kv[None, :]
        tl.store(DEST + rb[:, None] * K + kc[None, :], d.to(tl.int64), mask=ok)
        tl.store(SRC + d, (rb[:, None] + 0 * kc[None, :]).to(tl.int64), mask=ok)
        tl.store(EXP + d, ids, mask=ok)
        tl.store(W + rb[:, None] * K + kc[None, :], w.to(W.dtype.element_ty), mask=ok)

    @triton.jit
    def _group_rows(EXP, OFFS, s, BLOCK_M: tl.constexpr):
        """(starts a group, the expert, which of the BLOCK_M rows from ``s`` are its pairs)."""
        e = tl.load(EXP + s)
        prev = tl.load(EXP + s - 1, mask=s > 0, other=-1)
        count = tl.load(OFFS + e) - s
        return (s == 0) | (prev != e), e.to(tl.int64), tl.arange(0, BLOCK_M) < count

    @triton.jit
    def _moe_up_kernel(Hx, Wgu, EXP, OFFS, SRC, ACT, D: tl.constexpr, WID: tl.constexpr, BLOCK_M: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr):
        """act = silu(x @ gate[e].T) * (x @ up[e].T) for one group's rows, BN columns."""
        s = tl.program_id(0)
        first, e, mv = _group_rows(EXP, OFFS, s, BLOCK_M)
        if first:
            m = tl.arange(0, BLOCK_M)
            n = tl.program_id(1) * BN + tl.arange(0, BN)
            kk = tl.arange(0, BK)
            tok = tl.load(SRC + s + m, mask=mv, other=0)
            wg = Wgu + e * (2 * WID * D) + n[:, None] * D + kk[None, :]
            acc_g = tl.zeros([BLOCK_M, BN], tl.float32)
            acc_u = tl.zeros([BLOCK_M, BN], tl.float32)
            for k0 in range(0, D, BK):
                x = tl.load(Hx + tok[:, None] * D + k0 + kk[None, :], mask=mv[:, None], other=0.0)
                acc_g = tl.dot(x, tl.trans(tl.load(wg + k0)), acc_g)
                acc_u = tl.dot(x, tl.trans(tl.load(wg + WID * D + k0)), acc_u)
            dt = ACT.dtype.element_ty
            g = acc_g.to(dt).to(tl.float32)  # rounded as the reference's separate GEMMs
            a = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * acc_u.to(dt).to(tl.float32)
            tl.store(ACT + (s + m)[:, None] * WID + n[None, :], a.to(dt), mask=mv[:, None])

    @triton.jit
    def _moe_down_kernel(ACT, Wd, EXP, OFFS, Z, D: tl.constexpr, WID: tl.constexpr, BLOCK_M: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr):
        """z = act @ down[e].T for one group's rows, BN output columns."""
        s = tl.program_id(0)
        first, e, mv = _group_rows(EXP, OFFS, s, BLOCK_M)
        if first:
            m = tl.arange(0, BLOCK_M)
            n = tl.program_id(1) * BN + tl.arange(0, BN)
            kk = tl.arange(0, BK)
            wd = Wd + e * (D * WID) + n[:, None] * WID + kk[None, :]
            acc = tl.zeros([BLOCK_M, BN], tl.float32)
            for k0 in range(0, WID, BK):
                a = tl.load(ACT + (s + m)[:, None] * WID + k0 + kk[None, :], mask=mv[:, None], other=0.0)
                acc = tl.dot(a, tl.trans(tl.load(wd + k0)), acc)
            tl.store(Z + (s + m)[:, None] * D + n[None, :], acc.to(Z.dtype.element_ty), mask=mv[:, None])


__all__ = ["Routing", "experts", "grouped_linear", "moe_ffn", "route"]

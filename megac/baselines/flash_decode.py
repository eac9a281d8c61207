"""Paged flash-decode: one query token per row against its K/V pages.

::

    out = paged_decode_attention(q, k_pool, v_pool, table, pos, window=w, scale=s, num_splits=n)

``q`` ``[B, H, hd]`` (RoPE applied), ``k_pool``/``v_pool`` the engine's
pools ``[blocks, block_size, KVH, hd]``, ``table`` int32 ``[B, pages]`` (one
layer's page table rows, ``-1`` unmapped), ``pos`` int64 ``[B]`` the current
token's position, whose K/V is already stored. A row sees keys
``lo <= j <= pos``, ``lo = max(0, pos - window + 1)`` for a sliding layer
(``window`` 0: full attention). Returns ``[B, H*hd]`` in q's dtype.

Triton (split-K): program ``(row, kv head, split)`` walks its share of the
row's pages, a page per iteration, all ``H/KVH`` query heads of the group
at once (one ``tl.dot`` over the page's keys, so the K/V of a page is read
once per group), online softmax in fp32, and writes a partial output and
its log-sum-exp; a merge program per ``(row, head)`` combines the splits.
The split count is fixed when the CUDA graph is captured, the pages per
split are computed from ``pos`` in the kernel, so one graph serves every
context up to its page count. Empty splits write ``lse = -inf``.

The PyTorch fallback gathers the pages and follows
:func:`megac.reference.attention`'s precision (scores in the dtype, softmax
in fp32): the CPU path, and the yardstick of the kernel's tests.
"""

from __future__ import annotations

import torch

from megac.baselines._triton import interpreting, next_pow2, tl, triton, use_triton


#: programs per SM the split count aims at (all rows and KV heads together)
PROGRAMS_PER_SM = 2


def splits_for(rows: int, kv_heads: int, pages: int, sms: int) -> int:
    """Splits per (row, kv head): :data:`PROGRAMS_PER_SM` programs per SM in
    all, at least one page each."""
    want = -(-int(PROGRAMS_PER_SM * sms) // max(1, rows * kv_heads))
    return max(1, min(want, pages))


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                           pos: torch.Tensor, *, window: int, scale: float, num_splits: int,
                           triton_ok: bool | None = None) -> torch.Tensor:
    if triton_ok is None:
        triton_ok = use_triton(q.device)
    if triton_ok and _kernel_fits(q, k_pool):
        return _triton_attention(q, k_pool, v_pool, table, pos, window, scale, num_splits)
    return torch_attention(q, k_pool, v_pool, table, pos, window=window, scale=scale)


def _kernel_fits(q: torch.Tensor, k_pool: torch.Tensor) -> bool:
    hd, bs = q.shape[-1], k_pool.shape[1]
    pow2 = lambda n: n & (n - 1) == 0  # noqa: E731
    return pow2(hd) and hd >= 16 and pow2(bs) and bs >= 16 and k_pool.stride(-1) == 1


def torch_attention(q, k_pool, v_pool, table, pos, *, window: int, scale: float) -> torch.Tensor:
    """Every page of ``table`` gathered, keys outside ``[lo, pos]`` masked."""
    B, H, hd = q.shape
    kvh = k_pool.shape[2]
    pages = table.long().clamp(min=0)  # unmapped pages are masked below
    k = k_pool[pages].reshape(B, -1, kvh, hd).to(q.dtype).repeat_interleave(H // kvh, dim=2)
    v = v_pool[pages].reshape(B, -1, kvh, hd).to(q.dtype).repeat_interleave(H // kvh, dim=2)
    t = torch.arange(k.shape[1], device=q.device)
    lo = (pos - window + 1).clamp(min=0) if window else torch.zeros_like(pos)
    ok = (t[None, :] <= pos[:, None]) & (t[None, :] >= lo[:, None])  # [B, T]
    scores = torch.einsum("bhd,bthd->bht", q, k) * scale
    scores = scores.masked_fill(~ok[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("bht,bthd->bhd", probs, v).reshape(B, H * hd)


def _triton_attention(q, k_pool, v_pool, table, pos, window, scale, num_splits):
    B, H, hd = q.shape
    kvh = k_pool.shape[2]
    group = H // kvh
    q = q.contiguous()
    part = torch.empty((B, H, num_splits, hd), dtype=torch.float32, device=q.device)
    lse = torch.empty((B, H, num_splits), dtype=torch.float32, device=q.device)
    out = torch.empty((B, H * hd), dtype=q.dtype, device=q.device)
    _split_kernel[(B, kvh, num_splits)](
        q, k_pool, v_pool, table, pos, part, lse,
        q.stride(0), q.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        table.stride(0),
        part.stride(0), part.stride(1), part.stride(2),
        lse.stride(0), lse.stride(1),
        int(window), float(scale), int(num_splits),
        GROUP=group, GROUP_PAD=max(16, next_pow2(group)), HD=hd, BS=k_pool.shape[1], INTERPRET=interpreting(),
        num_warps=4,
    )
    _merge_kernel[(B, H)](
        part, lse, out,
        part.stride(0), part.stride(1), part.stride(2),
        lse.stride(0), lse.stride(1), out.stride(0),
        int(num_splits), HD=hd, S_PAD=max(2, next_pow2(num_splits)),
        num_warps=4,
    )
    return out


if triton is not None:

    @triton.jit
    def _page(q, K, V, T, b, g, p, lo, pos, m, l, acc, stride_kb, stride_kt, stride_kh, stride_tb, scale,
              HD: tl.constexpr, BS: tl.constexpr):
        """One page of keys into the running (max, sum, output) of the group's heads."""
        dcol = tl.arange(0, HD)
        tcol = tl.arange(0, BS)
        blk = tl.load(T + b * stride_tb + p).to(tl.int64)
        off = blk * stride_kb + tcol[:, None] * stride_kt + g * stride_kh + dcol[None, :]
        k = tl.load(K + off)
        v = tl.load(V + off)
        sc = tl.dot(q, tl.trans(k)) * scale  # [GROUP_PAD, BS], fp32
        tok = p * BS + tcol
        ok = (tok >= lo) & (tok <= pos)
        sc = tl.where(ok[None, :], sc, float("-inf"))
        # every page in [first, last] holds a visible key: m_new is finite
        m_new = tl.maximum(m, tl.max(sc, 1))
        alpha = tl.exp(m - m_new)
        pr = tl.exp(sc - m_new[:, None])
        l = l * alpha + tl.sum(pr, 1)
        acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
        return m_new, l, acc

    @triton.jit
    def _split_kernel(Q, K, V, T, P, O, L,
                      stride_qb, stride_qh,
                      stride_kb, stride_kt, stride_kh,
                      stride_tb,
                      stride_ob, stride_oh, stride_os,
                      stride_lb, stride_lh,
                      window, scale, num_splits,
                      GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr,
                      INTERPRET: tl.constexpr):
        b = tl.program_id(0)
        g = tl.program_id(1)
        s = tl.program_id(2)
        pos = tl.load(P + b).to(tl.int32)
        lo = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)
        first = lo // BS
        last = pos // BS
        per = (last - first + num_splits) // num_splits  # ceil(pages / splits)
        p0 = first + s * per
        p1 = tl.minimum(p0 + per, last + 1)

        rows = tl.arange(0, GROUP_PAD)
        dcol = tl.arange(0, HD)
        hmask = rows < GROUP
        heads = g * GROUP + rows
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + dcol[None, :], mask=hmask[:, None], other=0.0)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HD], tl.float32)
        if INTERPRET:  # the interpreter cannot run a for loop over loaded bounds
            p = p0
            while p < p1:
                m, l, acc = _page(q, K, V, T, b, g, p, lo, pos, m, l, acc, stride_kb, stride_kt, stride_kh,
                                  stride_tb, scale, HD, BS)
                p += 1
        else:
            for p in range(p0, p1):
                m, l, acc = _page(q, K, V, T, b, g, p, lo, pos, m, l, acc, stride_kb, stride_kt, stride_kh,
                                  stride_tb, scale, HD, BS)
        nonempty = l > 0
        l_safe = tl.where(nonempty, l, 1.0)
        out = acc / l_safe[:, None]
        lse = tl.where(nonempty, m + tl.log(l_safe), float("-inf"))
        tl.store(O + b * stride_ob + heads[:, None] * stride_oh + s * stride_os + dcol[None, :], out,
                 mask=hmask[:, None])
        tl.store(L + b * stride_lb + heads * stride_lh + s, lse, mask=hmask)

    @triton.jit
    def _merge_kernel(O, L, Out,
                      stride_ob, stride_oh, stride_os,
                      stride_lb, stride_lh, stride_outb,
                      num_splits, HD: tl.constexpr, S_PAD: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        sidx = tl.arange(0, S_PAD)
        dcol = tl.arange(0, HD)
        smask = sidx < num_splits
        lse = tl.load(L + b * stride_lb + h * stride_lh + sidx, mask=smask, other=float("-inf"))
        m = tl.max(lse, 0)  # finite: the split holding pos is never empty
        w = tl.exp(lse - m)  # 0 for empty splits
        o = tl.load(O + b * stride_ob + h * stride_oh + sidx[:, None] * stride_os + dcol[None, :],
                    mask=smask[:, None], other=0.0)
        out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
        tl.store(Out + b * stride_outb + h * HD + dcol, out.to(Out.dtype.element_ty))


__all__ = ["paged_decode_attention", "splits_for", "torch_attention"]

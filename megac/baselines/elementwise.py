"""The small fused kernels between the GEMMs of one decode step, each with
the plain-PyTorch path it replaces (the CPU path and the tests' yardstick):

* :func:`residual_rms_norm`: ``x + a + b`` (the residual stream) and the
  RMSNorm of the sum, one kernel instead of ~8; a delta may be the routed
  experts' outputs still to be weighed and summed (:class:`WeightedRows`),
  so the MoE combine costs no kernel of its own;
* :func:`rope_store`: split the fused QKV projection, rotate Q and K, store
  K and V into the paged pools at the current token's slot; returns Q;
* :func:`silu_mul`: ``silu(gate) * up`` of a fused ``[.., 2w]`` projection.

Rounding follows :mod:`megac.reference` where it is cheap to (RMSNorm
statistics in fp32, normalised value rounded before gamma; cos/sin rounded
to the dtype); the kernels keep fp32 where the reference rounds in between
(the residual sum, Llama's rotation), a last-bit difference in bf16 only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megac.baselines._triton import next_pow2, tl, triton
from megac.reference import apply_rope, hf_rms_norm


@dataclass
class WeightedRows:
    """A residual delta still to be gathered: ``delta[b] = sum_j weights[b, j]
    * z[dest[b, j]]`` (the routed experts' outputs, in sorted pair order)."""

    z: torch.Tensor  # [pairs, hidden]
    dest: torch.Tensor  # int64 [rows, k]
    weights: torch.Tensor  # [rows, k]

    def sum(self) -> torch.Tensor:
        """The delta itself (summed in k order in fp32, or wider for wider z)."""
        B, K = self.dest.shape
        acc = torch.promote_types(self.z.dtype, torch.float32)
        zz = self.z[self.dest.flatten()].view(B, K, -1).to(acc)
        return (zz * self.weights.to(acc)[..., None]).sum(1).to(self.z.dtype)


def residual_rms_norm(x: torch.Tensor, deltas: list, gamma: torch.Tensor, eps: float,
                      triton_ok: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + sum(deltas), rms_norm(x + sum(deltas)) * gamma)``: at most two
    tensors and one :class:`WeightedRows`, which comes last."""
    if not triton_ok:
        for d in deltas:
            x = x + (d.sum() if isinstance(d, WeightedRows) else d)
        return x, hf_rms_norm(x, gamma, eps)
    dense = [d.contiguous() for d in deltas if not isinstance(d, WeightedRows)]
    rows = [d for d in deltas if isinstance(d, WeightedRows)]
    assert len(dense) <= 2 and len(rows) <= 1 and (not rows or deltas[-1] is rows[0])
    B, D = x.shape
    x = x.contiguous()
    a = dense[0] if dense else x
    b = dense[1] if len(dense) > 1 else x
    r = rows[0] if rows else WeightedRows(x, x, x)  # unused pointers when absent
    x_new = torch.empty_like(x) if deltas else x
    h = torch.empty_like(x)
    _residual_norm_kernel[(B,)](x, a, b, r.z, r.dest, r.weights, gamma, x_new, h, D, float(eps),
                                HAS_A=len(dense) > 0, HAS_B=len(dense) > 1, HAS_R=bool(rows),
                                K=r.dest.shape[1] if rows else 1, BLOCK=next_pow2(D),
                                num_warps=4 if D <= 4096 else 8)
    return x_new, h


def rope_cos_sin_dev(pos: torch.Tensor, inv_freq: torch.Tensor, style: str, dtype: torch.dtype):
    """:func:`megac.reference.rope_cos_sin` from a device-resident ``inv_freq``
    (the reference builds it on the host, which a CUDA graph cannot capture)."""
    freqs = pos.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.repeat_interleave(freqs, 2, dim=-1) if style == "interleaved" else torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_store(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, *, rotate: bool, style: str,
               pos: torch.Tensor, inv_freq: torch.Tensor, cos_sin, k_pool: torch.Tensor, v_pool: torch.Tensor,
               blk: torch.Tensor, off: torch.Tensor, triton_ok: bool) -> torch.Tensor:
    """Q ``[B, H, hd]`` (rotated when ``rotate``) of the fused projection
    ``qkv`` ``[B, (H + 2 KVH) hd]``; K (rotated) and V stored at
    ``(blk[b], off[b])`` of the pools. ``cos_sin``: the torch path's
    :func:`rope_cos_sin_dev`, computed once per step (None: here; the kernel
    computes its own)."""
    B = qkv.shape[0]
    H, KVH, hd = heads, kv_heads, head_dim
    if not triton_ok or hd != next_pow2(hd) or qkv.dtype != k_pool.dtype:  # the kernel's shapes and pointers
        q = qkv[:, : H * hd].view(B, H, hd)
        k = qkv[:, H * hd: (H + KVH) * hd].view(B, KVH, hd)
        v = qkv[:, (H + KVH) * hd:].view(B, KVH, hd)
        if rotate:
            cos, sin = cos_sin or rope_cos_sin_dev(pos, inv_freq, style, qkv.dtype)
            q, k = apply_rope(q, cos, sin, style), apply_rope(k, cos, sin, style)
        k_pool[blk, off] = k.to(k_pool.dtype)
        v_pool[blk, off] = v.to(v_pool.dtype)
        return q.contiguous()
    qkv = qkv.contiguous()
    q = torch.empty((B, H, hd), dtype=qkv.dtype, device=qkv.device)
    _rope_store_kernel[(B, H + KVH)](
        qkv, q, k_pool, v_pool, pos, inv_freq, blk, off,
        qkv.stride(0), q.stride(0), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        H=H, HD=hd, KVH=KVH, ROTATE=bool(rotate), INTERLEAVED=style == "interleaved", num_warps=1,
    )
    return q


def silu_mul(y: torch.Tensor, triton_ok: bool) -> torch.Tensor:
    """``silu(y[:, :w]) * y[:, w:]`` for ``y`` ``[n, 2w]`` (gate rows first)."""
    w = y.shape[1] // 2
    if not triton_ok:
        return F.silu(y[:, :w]) * y[:, w:]
    y = y.contiguous()
    out = torch.empty((y.shape[0], w), dtype=y.dtype, device=y.device)
    BLOCK = min(1024, next_pow2(w))
    _silu_mul_kernel[(y.shape[0], triton.cdiv(w, BLOCK))](y, out, w, BLOCK=BLOCK, num_warps=4)
    return out


if triton is not None:

    @triton.jit
    def _residual_norm_kernel(X, A, Bd, Z, DEST, WT, G, Xout, Hout, D, eps,
                              HAS_A: tl.constexpr, HAS_B: tl.constexpr, HAS_R: tl.constexpr, K: tl.constexpr,
                              BLOCK: tl.constexpr):
        r = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        m = c < D
        x = tl.load(X + r * D + c, mask=m, other=0.0).to(tl.float32)
        if HAS_A:
            x += tl.load(A + r * D + c, mask=m, other=0.0).to(tl.float32)
        if HAS_B:
            x += tl.load(Bd + r * D + c, mask=m, other=0.0).to(tl.float32)
        if HAS_R:  # the routed experts' outputs, weighed and summed in fp32
            f = tl.zeros([BLOCK], tl.float32)
            for j in tl.static_range(K):
                p = tl.load(DEST + r * K + j)
                f += tl.load(WT + r * K + j).to(tl.float32) * tl.load(Z + p * D + c, mask=m, other=0.0).to(tl.float32)
            x += f.to(Xout.dtype.element_ty).to(tl.float32)  # the FFN output is rounded, as the reference's
        xo = x.to(Xout.dtype.element_ty)  # the residual stream lives in the dtype
        if HAS_A or HAS_R:
            tl.store(Xout + r * D + c, xo, mask=m)
        xf = xo.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / D + eps)
        y = (xf * rstd).to(Xout.dtype.element_ty).to(tl.float32)  # rounded before gamma, as transformers
        g = tl.load(G + c, mask=m, other=0.0).to(tl.float32)
        tl.store(Hout + r * D + c, (y * g).to(Hout.dtype.element_ty), mask=m)

    @triton.jit
    def _rope_store_kernel(QKV, Q, Kp, Vp, P, INV, BLK, OFF,
                           stride_x, stride_q, stride_kb, stride_kt, stride_kh,
                           H: tl.constexpr, HD: tl.constexpr, KVH: tl.constexpr,
                           ROTATE: tl.constexpr, INTERLEAVED: tl.constexpr):
        b = tl.program_id(0)
        j = tl.program_id(1)
        HALF: tl.constexpr = HD // 2
        i = tl.arange(0, HALF)
        if INTERLEAVED:  # pairs (2i, 2i+1)
            ia = 2 * i
            ib = 2 * i + 1
        else:  # pairs (i, i + hd/2)
            ia = i
            ib = i + HALF
        ang = tl.load(P + b).to(tl.float32) * tl.load(INV + i)
        c = tl.cos(ang).to(Q.dtype.element_ty).to(tl.float32)  # rounded as the reference's cos/sin
        s = tl.sin(ang).to(Q.dtype.element_ty).to(tl.float32)
        if j < H:
            src = QKV + b * stride_x + j * HD
            dst = Q + b * stride_q + j * HD
        else:
            g = j - H
            src = QKV + b * stride_x + (H + g) * HD
            dst = Kp + tl.load(BLK + b).to(tl.int64) * stride_kb + tl.load(OFF + b).to(tl.int64) * stride_kt \
                + g * stride_kh
        xa = tl.load(src + ia).to(tl.float32)
        xb = tl.load(src + ib).to(tl.float32)
        if ROTATE:
            ya = xa * c - xb * s
            yb = xb * c + xa * s
        else:
            ya = xa
            yb = xb
        tl.store(dst + ia, ya.to(dst.dtype.element_ty))
        tl.store(dst + ib, yb.to(dst.dtype.element_ty))
        if j >= H:  # V: copied as it is
            g = j - H
            d = tl.arange(0, HD)
            vsrc = QKV + b * stride_x + (H + KVH + g) * HD
            vdst = Vp + tl.load(BLK + b).to(tl.int64) * stride_kb + tl.load(OFF + b).to(tl.int64) * stride_kt \
                + g * stride_kh
            tl.store(vdst + d, tl.load(vsrc + d).to(Vp.dtype.element_ty))

    @triton.jit
    def _silu_mul_kernel(Y, Out, W, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < W
        g = tl.load(Y + r * 2 * W + c, mask=m, other=0.0).to(tl.float32)
        u = tl.load(Y + r * 2 * W + W + c, mask=m, other=0.0).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(Out.dtype.element_ty).to(tl.float32)  # silu rounded, as F.silu
        tl.store(Out + r * W + c, (a * u).to(Out.dtype.element_ty), mask=m)


__all__ = ["WeightedRows", "residual_rms_norm", "rope_cos_sin_dev", "rope_store", "silu_mul"]

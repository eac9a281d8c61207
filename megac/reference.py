"""The reference decode step: plain PyTorch over the paged KV cache.

``decode_step(weights, spec, kv, token_ids, rows)`` runs one token per row
through the whole model, exactly as the spec docstring (``megac.spec.model``)
states the semantics, and returns fp32 logits ``[rows, vocab]`` (times
``logit_scale``). It is the straightforward implementation the CPU VM and the
CUDA megakernel are compared against, and the sampler input when no compiled
artifact is used. The ops below are shared with :mod:`megac.prefill`.

Precision follows transformers (``Cohere2MoeForCausalLM`` /
``LlamaForCausalLM``) in the weights' dtype: matmuls in that dtype, RMSNorm
statistics in fp32 (rounded back, then times gamma), RoPE angles in fp32 with
cos/sin rounded to the dtype (Cohere rotates in fp32, Llama in the dtype),
attention softmax in fp32, the residual stream in the dtype, the router as
``MoESpec`` describes, expert outputs accumulated in increasing expert id
order. In fp32 it agrees with transformers to ~1e-6.

Rows are computed one at a time, so a row's result never depends on the
others (batch invariance).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F

from megac.errors import MegacError
from megac.weights.canonical import LayerWeights, ModelWeights
from megac.weights.layout import rope_inv_freq

if TYPE_CHECKING:
    from megac.kv.paged import PagedKVCache
    from megac.spec.model import ModelSpec, MoESpec


# ------------------------------------------------------------------ ops


def hf_rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """``gamma * (x * rsqrt(mean(x^2) + eps))``, statistics in fp32, rounded as
    transformers' LlamaRMSNorm does (the yardstick; the kernels' own rounding
    is ``megac.ops.norm.rms_norm``)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return gamma * y.to(x.dtype)


def rope_cos_sin(spec: "ModelSpec", positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[n, head_dim]`` for ``positions`` (fp32 angles, rounded to
    ``dtype``), laid out for ``spec.rope_style``."""
    freqs = positions.to(torch.float32)[:, None] * rope_inv_freq(spec).to(positions.device)[None, :]
    if spec.rope_style == "interleaved":
        emb = torch.repeat_interleave(freqs, 2, dim=-1)
    else:
        emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """Rotate ``x`` ``[n, heads, head_dim]`` (cos/sin ``[n, head_dim]``).
    ``interleaved``: pairs (2k, 2k+1), computed in fp32 (Cohere2);
    ``half``: pairs (k, k+hd/2), computed in x's dtype (Llama)."""
    c, s = cos[:, None, :], sin[:, None, :]
    if style == "interleaved":
        xf = x.float()
        rot = torch.stack([-xf[..., 1::2], xf[..., ::2]], dim=-1).flatten(-2)
        return (xf * c + rot * s).to(x.dtype)
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * c + rot * s


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """``[n, m]`` bool, True where the query at ``q_pos[i]`` sees the key at
    ``k_pos[j]``: causal, and for a sliding layer only ``q - window < j <= q``."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    return allowed


def kv_per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Keys or values ``[m, KVH, hd]`` repeated for each query head of their
    group (GQA) and laid out ``[heads, m, hd]``."""
    return t.repeat_interleave(heads // t.shape[1], dim=1).transpose(0, 1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
              window: int | None, scale: float) -> torch.Tensor:
    """GQA attention of queries ``q`` ``[n, H, hd]`` at positions ``q_pos``
    over keys/values ``[m, KVH, hd]`` at ``k_pos``: causal, and for a sliding
    layer only keys ``q - window < j <= q``. Scores in the dtype, softmax in
    fp32. Returns ``[n, H*hd]``."""
    n, H, hd = q.shape
    kk, vv = kv_per_head(k, H), kv_per_head(v, H)  # [H, m, hd]
    scores = torch.matmul(q.transpose(0, 1), kk.transpose(1, 2)) * scale  # [H, n, m]
    allowed = attention_mask(q_pos, k_pos, window)
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, vv)  # [H, n, hd]
    return out.transpose(0, 1).reshape(n, H * hd)


def dense_ffn(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """SwiGLU: ``down(silu(gate(h)) * up(h))``."""
    return F.linear(F.silu(F.linear(h, gate)) * F.linear(h, up), down)


def route(h: torch.Tensor, router: torch.Tensor, moe: "MoESpec") -> tuple[torch.Tensor, torch.Tensor]:
    """``(expert ids [n, k], weights [n, k] in h's dtype)`` per the
    ``MoESpec`` rule: top-k by raw logit (ties: lower id first), then sigmoid
    (optionally renormalised) or softmax over the selected logits (fp32)."""
    logits = F.linear(h, router)
    order = torch.sort(logits, dim=-1, descending=True, stable=True)
    sel_logits = order.values[:, : moe.top_k]
    ids = order.indices[:, : moe.top_k]
    if moe.router == "softmax":
        w = torch.softmax(sel_logits, dim=-1, dtype=torch.float32)
    else:
        w = torch.sigmoid(sel_logits)
        if moe.renormalize:
            w = w / w.sum(dim=-1, keepdim=True)
    return ids, w.to(h.dtype)


def moe_ffn(h: torch.Tensor, lw: LayerWeights, moe: "MoESpec") -> torch.Tensor:
    """Routed experts over ``h`` ``[n, hidden]``: ``sum_k w_k expert_k(h)``,
    accumulated per expert in increasing id order (transformers' order)."""
    ids, w = route(h, lw.router, moe)
    out = torch.zeros_like(h)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        y = dense_ffn(h[tok], lw.experts_gate[e], lw.experts_up[e], lw.experts_down[e])
        out.index_add_(0, tok, y * w[tok, slot, None])
    return out


def ffn(h: torch.Tensor, lw: LayerWeights, spec: "ModelSpec") -> torch.Tensor:
    if lw.is_moe:
        assert spec.moe is not None
        return moe_ffn(h, lw, spec.moe)
    return dense_ffn(h, lw.gate, lw.up, lw.down)


def lm_logits(h: torch.Tensor, weights: ModelWeights, spec: "ModelSpec") -> torch.Tensor:
    """Final norm, LM head, ``* logit_scale`` (in the dtype); fp32 out."""
    hn = hf_rms_norm(h, weights.final_norm, spec.norm_eps)
    logits = F.linear(hn, weights.lm_head_weight)
    if spec.logit_scale != 1.0:
        logits = logits * spec.logit_scale
    return logits.float()


def layer_forward(x: torch.Tensor, lw: LayerWeights, spec: "ModelSpec", layer: int,
                  attend, ffn_fn=None) -> torch.Tensor:
    """One decoder layer over ``x`` ``[n, hidden]``. ``attend(q, k, v)`` (q
    ``[n, H, hd]``, k/v ``[n, KVH, hd]`` of the new tokens, RoPE applied)
    stores K/V and returns the attention output ``[n, q_width]``.
    ``ffn_fn(h, lw, spec)``: the FFN (default :func:`ffn`; the prefill runs
    its experts as grouped GEMMs)."""
    ffn_fn = ffn_fn or ffn
    n = x.shape[0]
    H, KVH, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    h = hf_rms_norm(x, lw.input_norm, spec.norm_eps)
    q = F.linear(h, lw.q).view(n, H, hd)
    k = F.linear(h, lw.k).view(n, KVH, hd)
    v = F.linear(h, lw.v).view(n, KVH, hd)
    a = F.linear(attend(q, k, v), lw.o)
    if spec.block == "parallel":
        return x + a + ffn_fn(h, lw, spec)
    x = x + a
    return x + ffn_fn(hf_rms_norm(x, lw.post_attn_norm, spec.norm_eps), lw, spec)


# ------------------------------------------------------------------ decode


def _check_token(t: int, spec: "ModelSpec") -> int:
    t = int(t)
    if not 0 <= t < spec.vocab_size:
        raise MegacError(f"token id {t} outside the vocabulary (0..{spec.vocab_size - 1})")
    return t


def decode_row(weights: ModelWeights, spec: "ModelSpec", kv: "PagedKVCache", row: int, token: int) -> torch.Tensor:
    """One decode step of one row: reserve its slot, write K/V of every
    layer into the cache, attend over the cache (read back from the pages),
    advance. Returns fp32 logits ``[vocab]``."""
    dtype = weights.dtype
    dev = weights.embed.device
    pos = kv.append_slot(row)
    x = weights.embed[_check_token(token, spec)].view(1, -1)
    positions = torch.tensor([pos], dtype=torch.int64, device=dev)
    cos, sin = rope_cos_sin(spec, positions, dtype)
    scale = spec.head_dim ** -0.5
    for i, (ls, lw) in enumerate(zip(spec.layers, weights.layers)):

        def attend(q, k, v, i=i, ls=ls):
            if ls.rope:
                q, k = apply_rope(q, cos, sin, spec.rope_style), apply_rope(k, cos, sin, spec.rope_style)
            kv.write(i, row, pos, k, v)
            start = kv.window_start(i, pos)
            kc, vc = kv.gather(i, row, start, pos + 1)
            k_pos = torch.arange(start, pos + 1, device=dev)
            return attention(q, kc.to(dtype), vc.to(dtype), positions, k_pos, ls.window, scale)

        x = layer_forward(x, lw, spec, i, attend)
    logits = lm_logits(x, weights, spec)[0]
    kv.advance(row, 1)
    return logits


@torch.no_grad()
def decode_step(weights: ModelWeights, spec: "ModelSpec", kv: "PagedKVCache", token_ids: Sequence[int] | torch.Tensor,
                rows: Sequence[int] | None = None) -> torch.Tensor:
    """One decode step: ``token_ids[i]`` is the current token of row
    ``rows[i]`` (default: rows ``0..len-1``). Each row's K/V is appended at its
    ``seq_pos`` and ``seq_pos`` advances. Returns fp32 logits ``[len, vocab]``."""
    tokens = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
    rows = list(range(len(tokens))) if rows is None else list(rows)
    if len(rows) != len(tokens):
        raise MegacError(f"decode_step: {len(tokens)} tokens for {len(rows)} rows")
    out = [decode_row(weights, spec, kv, r, t) for r, t in zip(rows, tokens)]
    return torch.stack(out) if out else torch.empty((0, spec.vocab_size))


__all__ = [
    "apply_rope",
    "attention",
    "attention_mask",
    "decode_row",
    "decode_step",
    "dense_ffn",
    "ffn",
    "layer_forward",
    "lm_logits",
    "moe_ffn",
    "hf_rms_norm",
    "kv_per_head",
    "rope_cos_sin",
    "route",
]

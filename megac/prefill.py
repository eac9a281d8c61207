"""Prefill: a plain PyTorch forward of whole prompts that fills the paged KV
cache and returns each row's last-position logits.

``prefill(weights, spec, kv, prompts, rows=None)`` runs each prompt (ragged
lengths; one row at a time, so rows never influence each other) through every
layer with the ops and precision of :mod:`megac.reference` (the routed experts
as grouped GEMMs: :func:`grouped_moe_ffn`), writes every
layer's K/V of the new tokens into the row's pages, advances ``seq_pos`` and
returns ``Prefilled(rows, logits)``: fp32 logits ``[len(prompts), vocab]``
(times ``logit_scale``) of each prompt's last token.

``rows=None`` allocates a fresh row per prompt. A given row may already hold
tokens (a continuation, e.g. a chunked prefill or a shared prefix from
``fork_row``): the new tokens attend to the cached ones (read from the pages,
within each layer's window) and to each other. Sliding layers store only the
positions a later query can still see (see :mod:`megac.kv.paged`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, NamedTuple, Sequence

import torch

from megac.errors import MegacError
import torch.nn.functional as F

from megac.reference import (apply_rope, attention, attention_mask, dense_ffn, kv_per_head, layer_forward,
                             lm_logits, rope_cos_sin)
from megac.weights.canonical import ModelWeights

if TYPE_CHECKING:
    from megac.kv.paged import PagedKVCache
    from megac.spec.model import ModelSpec


class Prefilled(NamedTuple):
    rows: list[int]
    logits: torch.Tensor  # fp32 [len(rows), vocab]


def grouped_moe_ffn(h: torch.Tensor, lw, moe) -> torch.Tensor:
    """The routed experts of a prefill chunk as three grouped GEMMs over the
    (token, expert) pairs sorted by expert (the reference's per-expert loop
    issues ~10 small operations per active expert and layer: a 256-token
    chunk of North Mini Code prefilled at ~130 tokens/s on the H200). The
    reference's routing; each token's k expert outputs weighed and summed
    in k order in fp32 or wider (deterministic: no atomics, no dependence on the
    other tokens' routing)."""
    from megac.baselines.elementwise import WeightedRows
    from megac.baselines.moe import grouped_linear, route as sorted_route

    r = sorted_route(h, lw.router, moe, triton_ok=False)  # the reference's choices, pairs sorted by expert
    xs = h.index_select(0, r.src)
    act = F.silu(grouped_linear(xs, lw.experts_gate, r.offs)) * grouped_linear(xs, lw.experts_up, r.offs)
    return WeightedRows(grouped_linear(act, lw.experts_down, r.offs), r.dest, r.weights).sum()


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                    window: int | None, scale: float) -> torch.Tensor:
    """:func:`megac.reference.attention`'s result (same masks: causal, and
    for a sliding layer only keys ``q - window < j <= q``; GQA) through
    ``F.scaled_dot_product_attention``, whose fused kernels on the GPU never
    materialise the ``[heads, n, m]`` scores: the reference writes and reads
    them ~5 times in the dtype and fp32, ~2 GB per layer for a 1024-token
    chunk over 4K keys, and it grows with the history (quadratic over a long
    prompt). Scores and softmax are accumulated in fp32 inside the kernel,
    so the result is at least as close to fp32 as the reference's; each
    output depends only on its own query (deterministic forward), so a
    prompt's chunks give the same bits whether or not a cached prefix
    replaced the earlier ones."""
    n, H, hd = q.shape
    kk, vv = kv_per_head(k, H)[None], kv_per_head(v, H)[None]  # [1, H, m, hd]
    allowed = attention_mask(q_pos, k_pos, window)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kk, vv, attn_mask=allowed[None, None], scale=scale)
    return out[0].transpose(0, 1).reshape(n, H * hd)


#: the GPU prefill's attention fused (:func:`fused_attention`): on by
#: default since measured on the H200 (gpu.prefill_profile --tokens 16384
#: --attention fused,reference: North Mini Code 1.6x the prefill tok/s in
#: 1024-token chunks, 3.2x in 4096; the checks nmc_slice, smollm2 and
#: prefix_turns10 pass with it); MEGAC_PREFILL_FUSED_ATTENTION=0 gives the
#: reference's attention back
FUSED_ATTENTION_ON_GPU = os.environ.get("MEGAC_PREFILL_FUSED_ATTENTION", "1") == "1"


def prefill_attention(q, k, v, q_pos, k_pos, window, scale) -> torch.Tensor:
    """The prefill's attention: fused on the GPU where
    :data:`FUSED_ATTENTION_ON_GPU` (the default; ``MEGAC_PREFILL_FUSED_ATTENTION=0``: not), the
    reference's otherwise (the CPU paths always keep the reference's bits)."""
    fn = fused_attention if q.is_cuda and FUSED_ATTENTION_ON_GPU else attention
    return fn(q, k, v, q_pos, k_pos, window, scale)


def prefill_ffn(h: torch.Tensor, lw, spec: "ModelSpec") -> torch.Tensor:
    """The prefill's FFN: grouped experts on MoE layers, SwiGLU elsewhere."""
    if lw.is_moe:
        return grouped_moe_ffn(h, lw, spec.moe)
    return dense_ffn(h, lw.gate, lw.up, lw.down)


def prefill_row(weights: ModelWeights, spec: "ModelSpec", kv: "PagedKVCache", row: int,
                tokens: Sequence[int]) -> torch.Tensor:
    """Prefill ``tokens`` into ``row`` (appended at its ``seq_pos``); fp32
    logits ``[vocab]`` of the last token."""
    n = len(tokens)
    if n == 0:
        raise MegacError(f"prefill: empty prompt for row {row}")
    ids = torch.tensor([int(t) for t in tokens], dtype=torch.int64)
    if int(ids.min()) < 0 or int(ids.max()) >= spec.vocab_size:
        bad = next(int(t) for t in ids if not 0 <= int(t) < spec.vocab_size)
        raise MegacError(f"prefill: token id {bad} outside the vocabulary (0..{spec.vocab_size - 1})")
    dtype = weights.dtype
    dev = weights.embed.device
    ids = ids.to(dev)
    p0 = int(kv.seq_pos[row])
    L = spec.num_layers
    # Cached keys the new tokens can see, read before the reservation (which
    # may release sliding blocks the first new token still needs). Every
    # layer's pool slots go up in one copy (each upload waits for the GPU).
    starts = [max(kv.first_held(i, row), kv.window_start(i, p0)) if p0 else 0 for i in range(L)]
    old = kv.slots(row, [(i, starts[i], p0) for i in range(L)])
    cached = [(starts[i], *(t.to(dtype) for t in kv.read_slots(old[i]))) for i in range(L)]
    kv.reserve(row, n)
    # where each layer stores the new tokens (a sliding layer skips those no
    # later query sees): again one upload for every layer
    skips = [kv.write_skip(i, row, p0, n) for i in range(L)]
    new = kv.slots(row, [(i, p0 + skips[i], p0 + n) for i in range(L)], write=True)

    positions = torch.arange(p0, p0 + n, dtype=torch.int64, device=dev)
    cos, sin = rope_cos_sin(spec, positions, dtype)
    scale = spec.head_dim ** -0.5
    x = weights.embed[ids]
    for i, (ls, lw) in enumerate(zip(spec.layers, weights.layers)):

        def attend(q, k, v, i=i, ls=ls):
            if ls.rope:
                q, k = apply_rope(q, cos, sin, spec.rope_style), apply_rope(k, cos, sin, spec.rope_style)
            if skips[i] < n:
                kv.write_slots(new[i], k[skips[i]:], v[skips[i]:])
            start, k_old, v_old = cached[i]
            keys = torch.cat([k_old, k], dim=0)
            vals = torch.cat([v_old, v], dim=0)
            k_pos = torch.cat([torch.arange(start, p0, device=dev), positions])
            return prefill_attention(q, keys, vals, positions, k_pos, ls.window, scale)

        x = layer_forward(x, lw, spec, i, attend, ffn_fn=prefill_ffn)
    logits = lm_logits(x[-1:], weights, spec)[0]
    kv.advance(row, n)
    return logits


@torch.no_grad()
def prefill(weights: ModelWeights, spec: "ModelSpec", kv: "PagedKVCache",
            prompts: Sequence[Sequence[int]], rows: Sequence[int] | None = None) -> Prefilled:
    """Prefill a batch of ragged prompts (see the module docstring)."""
    prompts = [p.tolist() if isinstance(p, torch.Tensor) else list(p) for p in prompts]
    if rows is None:
        rows = [kv.allocate_row() for _ in prompts]
    rows = list(rows)
    if len(rows) != len(prompts):
        raise MegacError(f"prefill: {len(prompts)} prompts for {len(rows)} rows")
    out = [prefill_row(weights, spec, kv, r, p) for r, p in zip(rows, prompts)]
    logits = torch.stack(out) if out else torch.empty((0, spec.vocab_size))
    return Prefilled(rows, logits)


__all__ = ["Prefilled", "fused_attention", "grouped_moe_ffn", "prefill", "prefill_attention", "prefill_row"]

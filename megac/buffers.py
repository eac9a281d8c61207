"""Buffer layouts in one place: the shape and dtype of every activation and
scratch buffer of one schedule key, from its geometry.

The plan pass (``passes.plan``) records them for the launch descriptor (and
``megac compile`` renders them into the artifact's C++ layout header); the
access model (``megac.access.logical_shapes``) indexes the same buffers,
with every empty dimension clamped to 1 so that region boxes stay valid
(and a logical view of the MoE buffers, whose physical slot is a
device-chosen permutation).

``bf16`` means the activation dtype (fp32 in the VM's fp32 mode);
``argmax`` is ``abi.ARGMAX_RECORD`` (8 bytes).
"""

from __future__ import annotations


def step_buffers(geo) -> dict[str, tuple[str, tuple[int, ...], str, str]]:
    """name -> (dtype, shape, kind, doc) of the buffers a step writes."""
    L, R, D = geo.num_layers, geo.rows, geo.hidden
    RK = R * max(geo.top_k, 0)
    return {
        "x_resid": ("fp32", (geo.norm_slots, R, D), "activation", "slot 0 seeded before launch; slot = GAMMA"),
        "x_norm": ("bf16", (geo.norm_slots, R, D), "activation", "slot 0 seeded before launch"),
        "q": ("bf16", (L, R, geo.q_width), "scratch", ""),
        "attn_o_part": ("fp32", (L, geo.max_splits, R, geo.num_heads, geo.head_dim), "scratch", "split-major"),
        "attn_lse_part": ("fp32", (L, geo.max_splits, R, geo.num_heads), "scratch", "split-major"),
        "attn_out": ("bf16", (L, R, geo.q_width), "scratch", ""),
        "o_part": ("fp32", (L, geo.kv_heads, R, D), "scratch", ""),
        "ffn_act": ("bf16", (L, R, geo.dense_width), "scratch", ""),
        "ffn_part": ("fp32", (L, geo.ffn_splits, R, D), "scratch", ""),
        "router_part": ("fp32", (L, geo.router_splits if geo.num_experts else 0, R, geo.num_experts), "scratch", ""),
        "topk_ids": ("int32", (L, R, geo.top_k), "scratch", ""),
        "topk_w": ("fp32", (L, R, geo.top_k), "scratch", ""),
        "route_slot": ("int32", (L, R, geo.top_k), "scratch", ""),
        "moe_x": ("bf16", (L, RK, D), "scratch", "slot of (row, k) chosen by ROUTE_FINALIZE"),
        "moe_act": ("bf16", (L, RK, geo.expert_width), "scratch", ""),
        # a tile axis folded into the features where the down projection runs split-K
        "moe_out": ("bf16" if geo.moe_out_bf16 else "fp32", (L, RK, geo.moe_out_tiles * D),
                    "scratch", "bf16 where the tiles ask (moe_out_bf16)"),
        "logits": ("fp32", (R, geo.vocab), "scratch", "read by the sampler"),
        "argmax_part": ("argmax", (R, geo.lm_tiles), "scratch", "abi.ARGMAX_RECORD per LM tile"),
    }


def strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides in elements."""
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= max(int(d), 1)
    return tuple(reversed(out))


__all__ = ["step_buffers", "strides"]

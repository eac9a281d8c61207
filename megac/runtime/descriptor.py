"""The launch descriptor's scalars for one schedule, the same for every
backend (``abi.LAUNCH_DESC`` fields of C type i32 / f32 / u64)."""

from __future__ import annotations

import math

from megac import abi
from megac.errors import MegacError


def scalar_values(schedule, spec, *, watchdog_ns: int = abi.DEFAULT_WATCHDOG_NS) -> dict[str, int | float]:
    """Every scalar of the descriptor for ``schedule`` (its rows, its task
    array and counters; sizes from its geometry)."""
    geo = schedule.geometry
    return {
        "max_tasks": schedule.max_tasks,
        "num_sms": schedule.num_sms,
        "num_counters": schedule.num_counters,
        "moe_queue_cap": geo.moe_queue_cap,
        "watchdog_ns": int(watchdog_ns),
        "kv_block_size": spec.target.kv_block_size,
        "max_blocks_per_seq": math.ceil(geo.context / spec.target.kv_block_size),
        "rows": geo.rows,
        "num_layers": geo.num_layers,
        "hidden": geo.hidden,
        "num_heads": geo.num_heads,
        "kv_heads": geo.kv_heads,
        "head_dim": geo.head_dim,
        "vocab": geo.vocab,
        "top_k": geo.top_k,
        "num_experts": geo.num_experts,
        "expert_width": geo.expert_width,
        "dense_width": geo.dense_width,
        "max_splits": geo.max_splits,
        "norm_eps": float(spec.norm_eps),
        "attn_scale": 1.0 / math.sqrt(geo.head_dim),
    }


def scalar(values: dict, name: str, ctype: str):
    if name not in values:
        raise MegacError(f"launch descriptor: no value for scalar {name}")
    v = values[name]
    return float(v) if ctype == "f32" else int(v)


__all__ = ["scalar", "scalar_values"]

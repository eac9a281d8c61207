"""Size limits of a model spec.

megac compiles a model for one GPU. Every pass sizes tiles, task tables and
buffers from the spec, so without limits a typo such as ``hidden_size:
100000000000`` reaches the passes, which then allocate until the kernel
kills the process. A spec beyond these limits is refused when it is
validated, with one line naming the field, before anything is sized from
it; every command that loads a spec (``compile``, ``schedule``,
``generate``, ``serve``) validates it first.

The limits sit far above every real model (the largest open models of 2025
are noted beside each) and far below what would exhaust a host:

* each dimension in :data:`DIMENSION_LIMITS`;
* MoE expert instances (``num_layers`` x ``moe.num_experts``) up to
  :data:`MAX_EXPERT_INSTANCES` (their queues and weight stacks grow with it);
* weights up to :data:`MAX_WEIGHT_BYTES` in bf16 (4 TB; no GPU holds a tenth
  of that, but a schedule of the largest open models, 1-2 TB, may still be
  compiled and studied);
* one decode step's page table (``num_layers`` x the largest batch x
  ``max_context / target.kv_block_size`` entries) up to
  :data:`MAX_PAGE_TABLE_ENTRIES`.
"""

from __future__ import annotations

from typing import Any, Iterator

#: a megac.spec.model.ModelSpec (not imported: model.py imports this module)
ModelSpec = Any

#: field -> largest value accepted (the largest real value we know in the comment)
DIMENSION_LIMITS: dict[str, int] = {
    "hidden_size": 65536,  # 16384 (Llama 3.1 405B)
    "num_layers": 1024,  # 126 (Llama 3.1 405B)
    "num_heads": 1024,  # 128 (DeepSeek V3)
    "num_kv_heads": 1024,  # 128 (DeepSeek V3)
    "head_dim": 1024,  # 256 (Gemma 2)
    "q_width": 65536,  # 24576 (DeepSeek V3, 128 x 192)
    "dense_intermediate_size": 262144,  # 53248 (Llama 3.1 405B)
    "vocab_size": 4194304,  # 262144 (Gemma 3, North Mini Code)
    "max_context": 16777216,  # 10485760 (Llama 4 Scout)
    "moe.num_experts": 4096,  # 384 (Kimi K2)
    "moe.top_k": 256,  # 8 (DeepSeek V3, North Mini Code)
    "moe.expert_intermediate_size": 65536,  # 2048 (DeepSeek V3)
    "target.num_sms": 1024,  # 148 (B200)
    "target.kv_block_size": 65536,  # 64 here
    "target.attn_split_tokens": 16777216,  # 512 here
    "target.attn_max_splits": 1024,  # 32 here
}

#: num_layers x moe.num_experts; 58 x 256 = 14848 in DeepSeek V3
MAX_EXPERT_INSTANCES = 262144

#: bytes of bf16 weights; DeepSeek V3 has 1.3 TB, Kimi K2 2 TB
MAX_WEIGHT_BYTES = 4 * 10**12

#: page-table entries of one decode step (1 GiB of int32)
MAX_PAGE_TABLE_ENTRIES = 2**28

_WHY = "megac's limit for one GPU"


def _value(spec: ModelSpec, field: str) -> int | None:
    obj = spec
    for part in field.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def num_layers_problem(num_layers: int) -> str | None:
    """What is wrong with ``num_layers``, without the field name (checked on
    its own before a compact ``layers:`` mapping or a config.json expands
    into one entry per layer)."""
    limit = DIMENSION_LIMITS["num_layers"]
    if num_layers > limit:
        return f"{num_layers} is over {_WHY} ({limit})"
    return None


def _weight_shares(spec: ModelSpec) -> dict[str, int]:
    """Parameters by the field that scales them, to name the culprit."""
    d = spec.hidden_size
    shares = {"vocab_size": spec.vocab_size * d * (1 if spec.tie_embeddings else 2),
              "num_layers": spec.num_layers * (d * spec.qkv_width + spec.q_width * d + 2 * d),
              "dense_intermediate_size": len(spec.dense_layers) * 3 * d * (spec.dense_intermediate_size or 0)}
    if spec.moe is not None:
        m = spec.moe
        shares["moe.num_experts"] = len(spec.moe_layers) * m.num_experts * (3 * d * m.expert_intermediate_size + d)
    return shares


def dimension_problems(spec: ModelSpec) -> Iterator[str]:
    """Yield each dimension over its limit, naming the field."""
    for field, limit in DIMENSION_LIMITS.items():
        v = _value(spec, field)
        if v is not None and v > limit:
            yield f"{field}: {v} is over {_WHY} ({limit})"


def product_problems(spec: ModelSpec) -> Iterator[str]:
    """Yield each product limit the spec passes (expert instances, weight
    bytes, page table), naming the field that weighs most. Only for a spec
    whose dimensions are within limits and consistent (it reads
    ``num_params``)."""
    if spec.moe is not None:
        instances = len(spec.moe_layers) * spec.moe.num_experts
        if instances > MAX_EXPERT_INSTANCES:
            yield (f"moe.num_experts: {len(spec.moe_layers)} MoE layers x {spec.moe.num_experts} experts = "
                   f"{instances} expert instances, over {_WHY} ({MAX_EXPERT_INSTANCES})")
    weight_bytes = 2 * spec.num_params
    if weight_bytes > MAX_WEIGHT_BYTES:
        shares = _weight_shares(spec)
        field = max(shares, key=shares.__getitem__)
        yield (f"{field}: the weights would take {weight_bytes / 1e12:.1f} TB in bf16 (mostly from {field}), "
               f"over {_WHY} ({MAX_WEIGHT_BYTES / 1e12:.0f} TB)")
    t = spec.target
    entries = spec.num_layers * max(t.batch_sizes) * -(-spec.max_context // t.kv_block_size)
    if entries > MAX_PAGE_TABLE_ENTRIES:
        yield (f"max_context: a decode step's page table would hold {entries} entries (num_layers x largest batch "
               f"x max_context / target.kv_block_size), over {_WHY} ({MAX_PAGE_TABLE_ENTRIES}); lower max_context "
               f"or raise target.kv_block_size")


__all__ = ["DIMENSION_LIMITS", "MAX_EXPERT_INSTANCES", "MAX_PAGE_TABLE_ENTRIES", "MAX_WEIGHT_BYTES",
           "dimension_problems", "num_layers_problem", "product_problems"]

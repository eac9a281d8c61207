"""The bytes a decode step must move: what ``megac bench``'s speed-of-light
figures divide by.

The weights the step touches plus the KV it reads, and nothing else:

* every layer's attention projections and norms; its dense FFN, or its
  router and the experts at least one row routes to (the expected number
  of distinct experts over the batch's rows: ``sum_e 1 - (1 - p_e) ** B``,
  uniform routing ``p_e = k / E``, or the skewed chances ``megac bench
  --routing skewed`` draws);
* the final norm and the LM head (a tied embedding's rows are inside it);
  an untied embedding's rows, one per row;
* each row's keys and values within its layer's window, at the context.

Activations, attention partials, routing words and counters are what an
implementation adds on top: they stay in L2 and a better kernel moves fewer
of them, so counting them would let a kernel raise its own figure by moving
more. The cost model (``megac.costmodel``) counts them too, for timing;
before the fortieth session the bench divided by the cost model's bytes,
which also took a sliding layer's split count from the full context and so
read half of its KV (at North Mini Code bs1 8K: 7.251 GB counted against
7.130 GB here).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

#: bytes per weight and per KV element in the kernel's layout (bf16)
WEIGHT_BYTES = 2
KV_BYTES = 2


@dataclasses.dataclass(frozen=True)
class StepBytes:
    weights: float
    kv: float
    active_experts: float  # expected distinct experts per MoE layer (0 without MoE)

    @property
    def total(self) -> float:
        return self.weights + self.kv


def expected_distinct_experts(num_experts: int, top_k: int, rows: int,
                              expert_probs: Sequence[float] | None = None) -> float:
    """Expected number of experts at least one of ``rows`` independent rows
    routes to (each row picks ``top_k`` of ``num_experts``; expert e with
    chance ``expert_probs[e]``, uniform ``top_k / num_experts``)."""
    if expert_probs is None:
        return num_experts * (1.0 - (1.0 - top_k / num_experts) ** rows)
    return float(np.sum(1.0 - (1.0 - np.asarray(expert_probs, dtype=np.float64)) ** rows))


def step_bytes(spec, batch: int, context: int, expert_probs: Sequence[float] | None = None) -> StepBytes:
    """What one decode step of ``batch`` rows at ``context`` tokens each must
    move for ``spec`` (a ModelSpec)."""
    if batch < 1 or context < 1:
        raise ValueError(f"batch and context must be positive, got {batch} and {context}")
    active = 0.0
    if spec.moe is not None:
        active = expected_distinct_experts(spec.moe.num_experts, spec.moe.top_k, batch, expert_probs)
    weights = spec.params_read(active)
    if not spec.tie_embeddings:
        weights += batch * spec.hidden_size  # the rows' embedding rows
    per_row_kv = 2 * spec.num_kv_heads * spec.head_dim * KV_BYTES  # K and V of one token
    kv = 0.0
    for layer in spec.layers:
        span = min(context, layer.window) if layer.attention == "sliding" and layer.window else context
        kv += batch * span * per_row_kv
    return StepBytes(weights=float(weights * WEIGHT_BYTES), kv=float(kv), active_experts=active)


__all__ = ["KV_BYTES", "StepBytes", "WEIGHT_BYTES", "expected_distinct_experts", "step_bytes"]

"""Skewed MoE routing for ``megac bench --routing skewed``.

Random routers route nearly uniformly: every expert's logit is ~N(0, 1) per
row, so at batch B a layer touches ``E * (1 - (1 - k/E) ** B)`` experts (52
of North Mini Code's 128 at batch 8). Real traffic concentrates on few
experts, which touches fewer expert weights per step. To benchmark that
without real traffic, :func:`skew_router` rescales the router BEFORE the
engine is built (so the megakernel, the graphs baseline and the CPU VM all
route the same way): row ``e`` of each MoE layer's router is multiplied by

    s_e = (1 + rank_e) ** -ALPHA

where ``rank_e`` is ``e``'s place in a fixed random permutation of the
experts (seeded per layer, so each layer has its own hot experts). The
logit of expert ``e`` is then ~N(0, s_e^2): top-k picks the widest
distributions most often, a Zipf-like popularity that falls with the rank.
The factors are at most 1 (no logit grows, nothing overflows in bf16).

ALPHA = 0.5, measured on the CPU at the North Mini Code shape (hidden 2048,
128 experts, top-8; the random routers of layers 1 and 2 scaled by
:func:`skew_factors`, 16384 unit-Gaussian rows through
:func:`megac.routing.topk`, selections counted per expert): the 16 most
chosen experts take 49.7 / 50.0 % of the selections (unscaled: 13.4 %), the
most chosen 5.0 %, the least 0.05 % (every expert still chosen); expected
distinct experts per layer 8 / 39.3 / 92.9 at batch 1 / 8 / 64 against the
unscaled 8 / 51.6 / 125.9. Other exponents (layer 1, same rows): 0.3 gives
the top 16 36 %, 1.0 gives 67 % and leaves 10 experts never chosen.

The bench's bytes per step follow the skew through :func:`selection_probs`:
``P(expert e in a row's top-k)``, ESTIMATED by sampling 4096 unit-Gaussian
rows against every skewed router on the CPU (once per run, seeded; 2.5 s on
one thread for North Mini Code's 48 MoE layers, giving 49.8 % to the top 16
and 39.3 experts at batch 8), which the cost model turns into expected
distinct experts at batch B, ``sum_e 1 - (1 - p_e) ** B``
(``CostParams.expert_probs``; exact for independent rows).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from megac.errors import MegacError
from megac.runtime.kinds import ROUTINGS  # defined torch-free for the command line's help

#: the Zipf-like exponent of the router row scales (see the module docstring)
ALPHA = 0.5


def skew_factors(num_experts: int, layer: int, *, alpha: float = ALPHA, seed: int = 0) -> torch.Tensor:
    """fp32 ``[E]`` scale of each expert's router row in MoE layer ``layer``:
    ``(1 + rank) ** -alpha`` with ranks from a permutation seeded by (seed, layer)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + layer)
    rank = torch.empty(num_experts, dtype=torch.float64)
    rank[torch.randperm(num_experts, generator=g)] = torch.arange(num_experts, dtype=torch.float64)
    return ((1.0 + rank) ** -alpha).to(torch.float32)


def check_routing(spec, routing: str) -> None:
    """A one-line MegacError unless ``routing`` applies to ``spec``."""
    if routing not in ROUTINGS:
        raise MegacError(f"--routing {routing!r}: expected one of {', '.join(ROUTINGS)}")
    if routing == "skewed" and (spec.moe is None or not spec.moe_layers):
        raise MegacError(f"--routing skewed: {spec.name} is a dense model (no MoE router to skew)")


def skew_router(spec, weights, routing: str, *, alpha: float = ALPHA, seed: int = 0):
    """``weights`` with every MoE router row scaled by :func:`skew_factors`
    (``routing == "skewed"``), or ``weights`` itself (``"uniform"``). The input
    is not modified: the scaled routers are new tensors."""
    check_routing(spec, routing)
    if routing == "uniform":
        return weights
    layers = []
    for i, lw in enumerate(weights.layers):
        if lw.is_moe and lw.router.numel():  # empty: a layer a partial draw left out
            s = skew_factors(lw.router.shape[0], i, alpha=alpha, seed=seed).to(lw.router.device)
            lw = replace(lw, router=(lw.router.float() * s[:, None]).to(lw.router.dtype))
        layers.append(lw)
    return replace(weights, layers=layers)


@torch.no_grad()
def selection_probs(weights, top_k: int, *, samples: int = 4096, seed: int = 0) -> np.ndarray:
    """``[E]`` probability that a row's top-k holds each expert (sums to
    ``top_k``), estimated from ``samples`` unit-Gaussian rows against every MoE
    router of ``weights`` on the CPU. Each layer's probabilities are sorted
    (descending) before they are averaged over layers: the expected distinct
    experts at a batch size does not depend on which expert is which."""
    from megac.routing import topk

    routers = [lw.router for lw in weights.layers if lw.is_moe and lw.router.numel()]
    if not routers:
        raise MegacError("selection_probs: the weights hold no MoE router")
    E, d = routers[0].shape
    x = torch.randn(samples, d, generator=torch.Generator().manual_seed(seed))
    acc = np.zeros(E)
    for w in routers:
        ids, _ = topk(x @ w.float().cpu().T, top_k, softmax=False, renormalize=False)
        p = np.bincount(ids.reshape(-1).numpy(), minlength=E) / samples
        acc += np.sort(p)[::-1]
    return acc / len(routers)


__all__ = ["ALPHA", "ROUTINGS", "check_routing", "selection_probs", "skew_factors", "skew_router"]

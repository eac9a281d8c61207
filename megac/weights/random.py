"""Deterministic random weights for any spec (tests, benchmarks, the North Mini
Code shape without its checkpoint).

Every tensor is drawn in fp32 from its **own** CPU ``torch.Generator``, seeded
from ``(seed, canonical name)`` (``blake2b``), then cast to ``dtype``. So every
backend and machine gets bit-identical weights, a tensor does not depend on
the shapes or order of the others, and a subset (``layers=``) reproduces the
same tensors as the whole model.

Scales keep activations O(1) through many layers:

* ``embed`` ~ N(0, 1): the residual stream starts at RMS 1.
* projections reading the normed stream (q, k, v, dense/expert gate and up,
  untied ``lm_head``) ~ N(0, 1/fan_in): outputs have RMS ~1.
* projections writing the residual (o, dense/expert down) ~ N(0, 1/(fan_in *
  2 * num_layers)): the 2L residual contributions together add O(1).
* norm gammas ~ 1 + 0.1 N(0, 1): not all ones (a missing gamma shows).
* router ~ N(0, 1/hidden): logits ~ N(0, 1) per expert, so the top-k set is
  decided by clear gaps (no systematic ties) and sigmoid weights vary.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Iterable

import torch

from megac.weights.canonical import LayerWeights, ModelWeights

if TYPE_CHECKING:
    from megac.spec.model import ModelSpec


def _seed_of(seed: int, name: str) -> int:
    h = hashlib.blake2b(f"{int(seed)}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def draw(seed: int, name: str, shape: tuple[int, ...], std: float = 1.0, mean: float = 0.0,
         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``mean + std * N(0, 1)`` of ``shape``, from the generator of ``(seed, name)``."""
    g = torch.Generator(device="cpu")
    g.manual_seed(_seed_of(seed, name))
    t = torch.randn(shape, generator=g, dtype=torch.float32)
    if std != 1.0:
        t.mul_(std)
    if mean != 0.0:
        t.add_(mean)
    return t.to(dtype) if dtype != torch.float32 else t


def random_weights(spec: "ModelSpec", seed: int = 0, dtype: torch.dtype = torch.float32, *,
                   layers: Iterable[int] | None = None) -> ModelWeights:
    """Random :class:`ModelWeights` for ``spec`` (see the module docstring).

    ``layers``: draw only these layer indices (the others get empty
    placeholders of shape ``[0]``; for generating slices of a huge model --
    the result then does not ``validate``)."""
    d = spec.hidden_size
    L = spec.num_layers
    resid = (2.0 * L) ** -0.5

    def w(name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
        return draw(seed, name, shape, std=std, mean=mean, dtype=dtype)

    def norm(name: str) -> torch.Tensor:
        return w(name, (d,), 0.1, 1.0)

    wanted = set(range(L)) if layers is None else set(layers)
    out_layers: list[LayerWeights] = []
    for i, ls in enumerate(spec.layers):
        p = f"layers.{i}."
        if i not in wanted:
            empty = torch.empty(0, dtype=dtype)
            out_layers.append(LayerWeights(input_norm=empty, q=empty, k=empty, v=empty, o=empty))
            continue
        lw = LayerWeights(
            input_norm=norm(p + "input_norm"),
            q=w(p + "q", (spec.q_width, d), d ** -0.5),
            k=w(p + "k", (spec.kv_width, d), d ** -0.5),
            v=w(p + "v", (spec.kv_width, d), d ** -0.5),
            o=w(p + "o", (d, spec.q_width), spec.q_width ** -0.5 * resid),
            post_attn_norm=norm(p + "post_attn_norm") if spec.block == "sequential" else None,
        )
        if ls.ffn == "dense":
            width = spec.dense_intermediate_size
            assert width is not None
            lw.gate = w(p + "gate", (width, d), d ** -0.5)
            lw.up = w(p + "up", (width, d), d ** -0.5)
            lw.down = w(p + "down", (d, width), width ** -0.5 * resid)
        else:
            assert spec.moe is not None
            E, width = spec.moe.num_experts, spec.moe.expert_intermediate_size
            lw.router = w(p + "router", (E, d), d ** -0.5)
            lw.experts_gate = w(p + "experts_gate", (E, width, d), d ** -0.5)
            lw.experts_up = w(p + "experts_up", (E, width, d), d ** -0.5)
            lw.experts_down = w(p + "experts_down", (E, d, width), width ** -0.5 * resid)
        out_layers.append(lw)

    return ModelWeights(
        embed=w("embed", (spec.vocab_size, d), 1.0),
        final_norm=norm("final_norm"),
        layers=out_layers,
        lm_head=None if spec.tie_embeddings else w("lm_head", (spec.vocab_size, d), d ** -0.5),
    )


__all__ = ["draw", "random_weights"]

"""Deterministic random weights for any spec (tests, benchmarks, the North Mini
Code shape without its checkpoint).

Every tensor comes from a **counter-based** generator: element ``i`` of the
tensor named ``name`` is a 32-bit hash (lowbias32) of ``i * golden +
key(seed, name)`` (a bijection of ``i``: no two elements of a tensor share
a counter below 2^32 elements), turned into a uniform value in ``[-sqrt 3, sqrt 3)`` (variance 1)
with fp32 operations that round the same way everywhere (a 24-bit integer
scaled by 2^-24, one multiply, one subtract, then the scale and offset), then
cast to ``dtype``. So the weights are bit-identical on the CPU and on a GPU
(``device=``): the 61 GB of North Mini Code are drawn on the GPU, and the CPU
can regenerate any slice (``layers=``) bit for bit. A tensor does not depend
on the shapes or order of the others.

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

from typing import TYPE_CHECKING, Iterable

import torch

from megac.rng import hash24, stream_key
from megac.weights.canonical import LayerWeights, ModelWeights

if TYPE_CHECKING:
    from megac.spec.model import ModelSpec


def _key(seed: int, name: str) -> int:
    return stream_key(int(seed), name)


_SQRT3 = 3.0 ** 0.5
#: elements hashed per pass (bounds the temporaries)
_CHUNK = 1 << 24


def _uniform_unit(start: int, n: int, key: int, device) -> torch.Tensor:
    """fp32 uniform in [-sqrt 3, sqrt 3) for counters start .. start+n-1."""
    f32 = dict(dtype=torch.float32, device=device)
    u = hash24(start, n, key, device).to(torch.float32)
    u.mul_(torch.tensor(2.0 ** -24, **f32)).mul_(torch.tensor(2 * _SQRT3, **f32))
    return u.sub_(torch.tensor(_SQRT3, **f32))


def draw(seed: int, name: str, shape: tuple[int, ...], std: float = 1.0, mean: float = 0.0,
         dtype: torch.dtype = torch.float32, device="cpu") -> torch.Tensor:
    """``mean + std * U`` of ``shape`` (U: variance 1) from the counters of
    ``(seed, name)``, the same bits on every device."""
    n = 1
    for d in shape:
        n *= int(d)
    if n >= 1 << 31:
        raise ValueError(f"random weights: {name} has {n} elements; the generator counts below 2^31")
    key = _key(seed, name)
    out = torch.empty(n, dtype=dtype, device=device)
    s = torch.tensor(std, dtype=torch.float32, device=device)
    m = torch.tensor(mean, dtype=torch.float32, device=device)
    for a in range(0, n, _CHUNK):
        b = min(n, a + _CHUNK)
        v = _uniform_unit(a, b - a, key, device)
        if std != 1.0:
            v.mul_(s)
        if mean != 0.0:
            v.add_(m)
        out[a:b] = v.to(dtype)
    return out.view(tuple(int(d) for d in shape))


def random_weights(spec: "ModelSpec", seed: int = 0, dtype: torch.dtype = torch.float32, *,
                   layers: Iterable[int] | None = None, device="cpu") -> ModelWeights:
    """Random :class:`ModelWeights` for ``spec`` (see the module docstring).

    ``layers``: draw only these layer indices (the others get empty
    placeholders of shape ``[0]``; for generating slices of a huge model --
    the result then does not ``validate``)."""
    d = spec.hidden_size
    L = spec.num_layers
    resid = (2.0 * L) ** -0.5

    def w(name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
        return draw(seed, name, shape, std=std, mean=mean, dtype=dtype, device=device)

    def norm(name: str) -> torch.Tensor:
        return w(name, (d,), 0.1, 1.0)

    wanted = set(range(L)) if layers is None else set(layers)
    out_layers: list[LayerWeights] = []
    for i, ls in enumerate(spec.layers):
        p = f"layers.{i}."
        if i not in wanted:
            empty = torch.empty(0, dtype=dtype, device=device)
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

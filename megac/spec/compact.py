"""The compact ``layers:`` format of model.yaml (one pattern instead of a
list of every layer) and its expansion to explicit layers."""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

# ----------------------------------------------------------- compact layer format


class CompactLayers(BaseModel):
    """The compact ``layers:`` mapping (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    attention_pattern: Union[Literal["full", "sliding"], list[Literal["full", "sliding"]]]
    sliding_window: int | None = Field(default=None, ge=1)
    rope: Union[Literal["all", "none", "sliding", "sliding_and_dense_prefix"], list[int]]
    dense_prefix: int | None = Field(default=None, ge=0)


def expand_layers(compact: dict, *, num_layers: int, has_moe: bool) -> list[dict]:
    """Expand a compact ``layers:`` mapping into a list of LayerSpec dicts.

    Raises ValueError naming the ``layers.*`` field, or ValidationError."""
    c = CompactLayers.model_validate(compact)
    pattern = [c.attention_pattern] if isinstance(c.attention_pattern, str) else list(c.attention_pattern)
    if not pattern:
        raise ValueError("layers.attention_pattern: must not be empty")
    has_sliding = "sliding" in pattern[: max(1, min(len(pattern), num_layers))]
    if has_sliding and c.sliding_window is None:
        raise ValueError("layers.sliding_window: required (attention_pattern has sliding layers)")
    if not has_sliding and c.sliding_window is not None:
        raise ValueError("layers.sliding_window: given but no layer is sliding")

    if has_moe:
        dense_prefix = 0 if c.dense_prefix is None else c.dense_prefix
        if dense_prefix > num_layers:
            raise ValueError(f"layers.dense_prefix: {dense_prefix} > num_layers ({num_layers})")
    else:
        if c.dense_prefix is not None and c.dense_prefix != num_layers:
            raise ValueError(
                f"layers.dense_prefix: {c.dense_prefix} < num_layers ({num_layers}) needs a moe: block "
                f"for the layers after it (omit dense_prefix for an all-dense model)"
            )
        dense_prefix = num_layers

    attn = [pattern[i % len(pattern)] for i in range(num_layers)]
    if isinstance(c.rope, list):
        for idx in c.rope:
            if not 0 <= idx < num_layers:
                raise ValueError(f"layers.rope: layer index {idx} out of range (num_layers {num_layers})")
        rope_set = set(c.rope)
        rope = [i in rope_set for i in range(num_layers)]
    elif c.rope == "all":
        rope = [True] * num_layers
    elif c.rope == "none":
        rope = [False] * num_layers
    elif c.rope == "sliding":
        rope = [a == "sliding" for a in attn]
    else:  # sliding_and_dense_prefix
        rope = [a == "sliding" or i < dense_prefix for i, a in enumerate(attn)]

    return [
        {
            "attention": attn[i],
            "window": c.sliding_window if attn[i] == "sliding" else None,
            "rope": rope[i],
            "ffn": "dense" if i < dense_prefix else "moe",
        }
        for i in range(num_layers)
    ]


__all__ = ["CompactLayers", "expand_layers"]

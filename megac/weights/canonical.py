"""Canonical model weights: one tensor per HF parameter, in HF semantics.

Every loader (:mod:`megac.weights.hf`, :mod:`megac.weights.gguf`,
:mod:`megac.weights.random`) produces a :class:`ModelWeights`; every consumer
(prefill, the reference decode step, the CPU VM through
:mod:`megac.weights.layout`, the CUDA launch glue) reads one. Shapes follow
``torch.nn.Linear`` (``[out_features, in_features]``), exactly as transformers
stores them, so ``y = x @ W.T``:

=================  =============================  ==================================
field              shape                          HF parameter (layer ``i``)
=================  =============================  ==================================
embed              ``[vocab, hidden]``            ``model.embed_tokens.weight``
lm_head            ``[vocab, hidden]`` or None    ``lm_head.weight`` (None when tied)
final_norm         ``[hidden]``                   ``model.norm.weight``
input_norm         ``[hidden]``                   ``...input_layernorm.weight``
post_attn_norm     ``[hidden]`` or None           ``...post_attention_layernorm.weight``
                                                  (sequential block only)
q                  ``[q_width, hidden]``          ``...self_attn.q_proj.weight``
k, v               ``[kv_width, hidden]``         ``...self_attn.{k,v}_proj.weight``
o                  ``[hidden, q_width]``          ``...self_attn.o_proj.weight``
gate, up           ``[dense_width, hidden]``      ``...mlp.{gate,up}_proj.weight`` (dense)
down               ``[hidden, dense_width]``      ``...mlp.down_proj.weight`` (dense)
router             ``[experts, hidden]``          ``...mlp.gate.weight`` (MoE)
experts_gate/up    ``[experts, width, hidden]``   ``...mlp.experts.gate_up_proj``
                                                  rows ``[:width]`` / ``[width:]``
experts_down       ``[experts, hidden, width]``   ``...mlp.experts.down_proj``
=================  =============================  ==================================

All tensors share one dtype (:attr:`ModelWeights.dtype`); norm gammas are
stored as they are (HF's ``weight``, multiplied after normalisation, not
``1 + weight``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Iterator

import torch

from megac.errors import MegacError

if TYPE_CHECKING:  # pydantic stays optional at import time (GPU machine)
    from megac.spec.model import ModelSpec

_LAYER_TENSORS = (
    "input_norm", "post_attn_norm", "q", "k", "v", "o", "gate", "up", "down",
    "router", "experts_gate", "experts_up", "experts_down",
)


@dataclass
class LayerWeights:
    """One decoder layer. Dense layers have ``gate/up/down``; MoE layers have
    ``router`` and ``experts_*``; the others are None."""

    input_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    post_attn_norm: torch.Tensor | None = None
    gate: torch.Tensor | None = None
    up: torch.Tensor | None = None
    down: torch.Tensor | None = None
    router: torch.Tensor | None = None
    experts_gate: torch.Tensor | None = None
    experts_up: torch.Tensor | None = None
    experts_down: torch.Tensor | None = None

    @property
    def is_moe(self) -> bool:
        return self.router is not None

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in _LAYER_TENSORS:
            t = getattr(self, name)
            if t is not None:
                yield name, t

    def map(self, fn) -> "LayerWeights":
        return replace(self, **{n: fn(t) for n, t in self.tensors()})


def _same_device(want: str | torch.device, have: torch.device) -> bool:
    """``want`` names ``have`` (an index-less ``cuda`` means the current device)."""
    want = torch.device(want)
    if want.type != have.type:
        return False
    if want.index is None:
        return want.type != "cuda" or have.index == torch.cuda.current_device()
    return want.index == have.index


@dataclass
class ModelWeights:
    """All weights of one model (see the module docstring for shapes)."""

    embed: torch.Tensor
    final_norm: torch.Tensor
    layers: list[LayerWeights] = field(default_factory=list)
    lm_head: torch.Tensor | None = None

    # ------------------------------------------------------------ accessors

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def tied(self) -> bool:
        return self.lm_head is None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The LM head matrix ``[vocab, hidden]`` (the embedding when tied)."""
        return self.embed if self.lm_head is None else self.lm_head

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for every tensor, names like ``layers.3.q``."""
        yield "embed", self.embed
        if self.lm_head is not None:
            yield "lm_head", self.lm_head
        yield "final_norm", self.final_norm
        for i, layer in enumerate(self.layers):
            for name, t in layer.tensors():
                yield f"layers.{i}.{name}", t

    def num_params(self) -> int:
        """Parameters stored (a tied LM head counted once)."""
        return sum(t.numel() for _, t in self.tensors())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors())

    # ------------------------------------------------------------ transforms

    def map(self, fn) -> "ModelWeights":
        return ModelWeights(
            embed=fn(self.embed),
            final_norm=fn(self.final_norm),
            layers=[layer.map(fn) for layer in self.layers],
            lm_head=None if self.lm_head is None else fn(self.lm_head),
        )

    def to(self, dtype: torch.dtype | None = None, device: str | torch.device | None = None) -> "ModelWeights":
        """A copy in ``dtype`` (and/or on ``device``); self when nothing changes
        (``"cuda"`` names the current device: weights on ``cuda:0`` moved
        "to cuda" are the same object, so whoever consumes them frees them)."""
        if (dtype is None or dtype == self.dtype) and (device is None or _same_device(device, self.embed.device)):
            return self
        return self.map(lambda t: t.to(device=device, dtype=dtype))

    # ------------------------------------------------------------ checks

    def validate(self, spec: "ModelSpec") -> "ModelWeights":
        """Check every shape and the dtype against ``spec``; a one-line
        :class:`MegacError` naming the first offending tensor. Returns self."""
        d, v = spec.hidden_size, spec.vocab_size
        expect: dict[str, tuple[int, ...] | None] = {
            "embed": (v, d),
            "lm_head": None if spec.tie_embeddings else (v, d),
            "final_norm": (d,),
        }
        if len(self.layers) != spec.num_layers:
            raise MegacError(f"weights: {len(self.layers)} layers but the spec has {spec.num_layers}")
        for i, ls in enumerate(spec.layers):
            p = f"layers.{i}."
            expect[p + "input_norm"] = (d,)
            expect[p + "post_attn_norm"] = (d,) if spec.block == "sequential" else None
            expect[p + "q"] = (spec.q_width, d)
            expect[p + "k"] = (spec.kv_width, d)
            expect[p + "v"] = (spec.kv_width, d)
            expect[p + "o"] = (d, spec.q_width)
            dense = ls.ffn == "dense"
            w = spec.dense_intermediate_size
            expect[p + "gate"] = (w, d) if dense else None
            expect[p + "up"] = (w, d) if dense else None
            expect[p + "down"] = (d, w) if dense else None
            if not dense:
                assert spec.moe is not None
                e, ew = spec.moe.num_experts, spec.moe.expert_intermediate_size
            expect[p + "router"] = None if dense else (e, d)
            expect[p + "experts_gate"] = None if dense else (e, ew, d)
            expect[p + "experts_up"] = None if dense else (e, ew, d)
            expect[p + "experts_down"] = None if dense else (e, d, ew)
        have = dict(self.tensors())
        for name, shape in expect.items():
            t = have.pop(name, None)
            if shape is None:
                if t is not None:
                    raise MegacError(f"weights: {name}: unexpected for this model (spec {spec.name})")
                continue
            if t is None:
                raise MegacError(f"weights: {name}: missing (expected shape {list(shape)})")
            if tuple(t.shape) != shape:
                raise MegacError(f"weights: {name}: shape {list(t.shape)}, expected {list(shape)}")
            if t.dtype != self.dtype:
                raise MegacError(f"weights: {name}: dtype {t.dtype}, expected {self.dtype} (one dtype for all)")
        if have:  # pragma: no cover - tensors() only yields known names
            raise MegacError(f"weights: {next(iter(have))}: unexpected tensor")
        return self


def layer_field_names() -> tuple[str, ...]:
    return _LAYER_TENSORS


__all__ = ["LayerWeights", "ModelWeights", "layer_field_names"]

assert {f.name for f in fields(LayerWeights)} == set(_LAYER_TENSORS)

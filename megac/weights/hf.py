"""Load a Hugging Face checkpoint directory (config.json + safetensors) into
:class:`~megac.weights.canonical.ModelWeights`, and go back (for reference
models in tests).

Files: ``model.safetensors.index.json`` (sharded; its ``weight_map`` names the
file of every tensor) when present, else every ``*.safetensors`` file of the
directory. Only safetensors are read (no pickled ``.bin``).

Tensor names accepted (found by ``save_pretrained`` of transformers 5.24's
``LlamaForCausalLM`` / ``Cohere2MoeForCausalLM`` and by reading its loading
code, ``conversion_mapping.py``; ``P = model.layers.{i}.``):

* ``model.embed_tokens.weight``, ``model.norm.weight``; ``lm_head.weight``
  (required when untied; when tied, transformers does not write it and we
  accept it only if it equals the embedding)
* ``P input_layernorm.weight``; ``P post_attention_layernorm.weight``
  (llama only: the Cohere2 block has one norm)
* ``P self_attn.{q,k,v,o}_proj.weight``
* dense FFN: ``P mlp.{gate,up,down}_proj.weight``
* MoE FFN (cohere2_moe): router ``P mlp.gate.weight`` ``[E, hidden]``, and the
  experts either **per expert** -- what ``save_pretrained`` writes by default
  (``save_original_format=True``): ``P mlp.experts.{e}.{gate,up,down}_proj.weight``
  (``[width, hidden]``, ``[width, hidden]``, ``[hidden, width]``) -- or
  **fused** -- the in-memory parameter names, written with
  ``save_original_format=False``: ``P mlp.experts.gate_up_proj``
  ``[E, 2*width, hidden]`` (gate rows first, then up: transformers'
  ``MergeModulelist(dim=0)`` + ``Concatenate(dim=1)`` and ``.chunk(2)`` in the
  forward) and ``P mlp.experts.down_proj`` ``[E, hidden, width]``.
* ignored: ``*rotary_emb.inv_freq`` (a non-persistent buffer old Llama
  checkpoints carry; derived from the config).

Anything else (biases, unknown modules, layers past ``num_hidden_layers``, a
dense tensor on a MoE layer, ...) raises a one-line :class:`MegacError` naming
the tensor; a missing tensor likewise. Nothing is silently dropped.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping

import torch

from megac.errors import MegacError
from megac.weights.canonical import LayerWeights, ModelWeights

if TYPE_CHECKING:
    from megac.spec.model import ModelSpec

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_LAYER_SIMPLE = {
    "input_layernorm.weight": "input_norm",
    "post_attention_layernorm.weight": "post_attn_norm",
    "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o",
    "mlp.gate_proj.weight": "gate",
    "mlp.up_proj.weight": "up",
    "mlp.down_proj.weight": "down",
    "mlp.gate.weight": "router",
    "mlp.experts.gate_up_proj": "experts_gate_up",
    "mlp.experts.down_proj": "experts_down",
}
_DENSE_ONLY = {"gate", "up", "down"}
_MOE_ONLY = {"router", "experts_gate_up", "experts_down"}

#: A tensor source: name -> a zero-argument loader (lazy, so huge checkpoints
#: are read one tensor at a time).
TensorSource = Mapping[str, Callable[[], torch.Tensor]]


# ------------------------------------------------------------------ files


def _safetensors_source(directory: Path) -> dict[str, Callable[[], torch.Tensor]]:
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            wmap = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise MegacError(f"{index}: not a safetensors index (no weight_map): {e}") from None
        files = sorted(set(wmap.values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
        wmap = None
    if not files:
        raise MegacError(f"{directory}: no *.safetensors files (only safetensors checkpoints are supported)")
    source: dict[str, Callable[[], torch.Tensor]] = {}
    for fname in files:
        path = directory / fname
        if not path.is_file():
            raise MegacError(f"{path}: listed in model.safetensors.index.json but missing")
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as e:  # safetensors raises its own error types
            raise MegacError(f"{path}: cannot open as safetensors: {e}") from None
        for name in handle.keys():
            if wmap is not None and wmap.get(name) != fname:
                if name in wmap:
                    continue  # the index names another shard as its home
                raise MegacError(f"{path}: tensor {name} is not in model.safetensors.index.json")
            if name in source:
                raise MegacError(f"{path}: tensor {name} appears in more than one file")
            source[name] = (lambda h=handle, n=name: h.get_tensor(n))
    if wmap is not None:
        for name, fname in wmap.items():
            if name not in source:
                raise MegacError(f"{directory / fname}: tensor {name} (from the index) not found in the file")
    return source


# ------------------------------------------------------------------ mapping


def weights_from_source(source: TensorSource, spec: "ModelSpec", *, dtype: torch.dtype | None = None,
                        origin: str = "checkpoint") -> ModelWeights:
    """Map HF tensor names (see the module docstring) to ModelWeights for
    ``spec``. ``dtype``: convert every tensor to it (default: the dtype of the
    embedding). ``origin`` prefixes error messages (a path)."""
    if "model.embed_tokens.weight" not in source:
        raise MegacError(f"{origin}: tensor model.embed_tokens.weight: missing")
    embed = source["model.embed_tokens.weight"]()
    if dtype is None:
        dtype = embed.dtype if embed.dtype.is_floating_point else torch.float32

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.dtype != dtype else t

    def fail(name: str, msg: str) -> MegacError:
        return MegacError(f"{origin}: tensor {name}: {msg}")

    top: dict[str, torch.Tensor] = {"embed": cast(embed)}
    per_layer: list[dict[str, torch.Tensor]] = [{} for _ in range(spec.num_layers)]
    experts: list[dict[tuple[str, int], tuple[str, torch.Tensor]]] = [{} for _ in range(spec.num_layers)]
    names: list[list[str]] = [[] for _ in range(spec.num_layers)]

    for name in sorted(source):
        if name == "model.embed_tokens.weight":
            continue
        if name == "model.norm.weight":
            top["final_norm"] = cast(source[name]())
            continue
        if name == "lm_head.weight":
            top["lm_head"] = cast(source[name]())
            continue
        if name.endswith("rotary_emb.inv_freq"):
            continue  # derived buffer of old checkpoints
        m = _LAYER_RE.match(name)
        if not m:
            raise fail(name, "unknown tensor name (not part of a supported model)")
        i, rest = int(m.group(1)), m.group(2)
        if i >= spec.num_layers:
            raise fail(name, f"layer {i} >= num_layers ({spec.num_layers})")
        layer = spec.layers[i]
        em = _EXPERT_RE.match(rest)
        if em:
            if layer.ffn != "moe":
                raise fail(name, f"expert weight in layer {i}, which is a dense layer")
            assert spec.moe is not None
            e = int(em.group(1))
            if e >= spec.moe.num_experts:
                raise fail(name, f"expert {e} >= num_experts ({spec.moe.num_experts})")
            experts[i][(em.group(2), e)] = (name, source[name]())
            continue
        key = _LAYER_SIMPLE.get(rest)
        if key is None:
            raise fail(name, "unknown tensor name (not part of a supported model)")
        if key in _DENSE_ONLY and layer.ffn != "dense":
            raise fail(name, f"dense FFN weight in layer {i}, which is a MoE layer")
        if key in _MOE_ONLY and layer.ffn != "moe":
            raise fail(name, f"MoE weight in layer {i}, which is a dense layer")
        if key == "post_attn_norm" and spec.block != "sequential":
            raise fail(name, f"a post-attention norm, but the {spec.family} block has one norm per layer")
        per_layer[i][key] = source[name]()
        names[i].append(name)

    layers: list[LayerWeights] = []
    for i, ls in enumerate(spec.layers):
        p = f"model.layers.{i}."
        t = per_layer[i]
        required = {"input_norm": "input_layernorm.weight", "q": "self_attn.q_proj.weight",
                    "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
                    "o": "self_attn.o_proj.weight"}
        if spec.block == "sequential":
            required["post_attn_norm"] = "post_attention_layernorm.weight"
        if ls.ffn == "dense":
            required.update(gate="mlp.gate_proj.weight", up="mlp.up_proj.weight", down="mlp.down_proj.weight")
        else:
            required["router"] = "mlp.gate.weight"
        for key, hf in required.items():
            if key not in t:
                raise fail(p + hf, "missing")
        lw = LayerWeights(**{k: cast(t[k]) for k in required})
        if ls.ffn == "moe":
            assert spec.moe is not None
            E, w = spec.moe.num_experts, spec.moe.expert_intermediate_size
            ex = experts[i]
            fused = "experts_gate_up" in t or "experts_down" in t
            if fused and ex:
                first = sorted(n for n, _ in ex.values())[0]
                raise fail(first, "per-expert weight next to the fused mlp.experts tensors of the same layer")
            if fused:
                for key, hf in (("experts_gate_up", "mlp.experts.gate_up_proj"), ("experts_down", "mlp.experts.down_proj")):
                    if key not in t:
                        raise fail(p + hf, "missing")
                gu = t["experts_gate_up"]
                if tuple(gu.shape) != (E, 2 * w, spec.hidden_size):
                    raise fail(p + "mlp.experts.gate_up_proj",
                               f"shape {list(gu.shape)}, expected {[E, 2 * w, spec.hidden_size]}")
                lw.experts_gate = cast(gu[:, :w].contiguous())
                lw.experts_up = cast(gu[:, w:].contiguous())
                lw.experts_down = cast(t["experts_down"])
            else:
                stacks = {}
                for proj, shape in (("gate", (w, spec.hidden_size)), ("up", (w, spec.hidden_size)),
                                    ("down", (spec.hidden_size, w))):
                    parts = []
                    for e in range(E):
                        hf = f"{p}mlp.experts.{e}.{proj}_proj.weight"
                        if (proj, e) not in ex:
                            raise fail(hf, "missing")
                        tensor = ex[(proj, e)][1]
                        if tuple(tensor.shape) != shape:
                            raise fail(hf, f"shape {list(tensor.shape)}, expected {list(shape)}")
                        parts.append(cast(tensor))
                    stacks[proj] = torch.stack(parts)
                lw.experts_gate, lw.experts_up, lw.experts_down = stacks["gate"], stacks["up"], stacks["down"]
        layers.append(lw)

    if "final_norm" not in top:
        raise fail("model.norm.weight", "missing")
    lm_head = top.get("lm_head")
    if spec.tie_embeddings:
        if lm_head is not None:
            if lm_head.shape != top["embed"].shape or not torch.equal(lm_head, top["embed"]):
                raise fail("lm_head.weight", "present and different from the embedding, but the "
                           "embeddings are tied (tie_word_embeddings: true)")
            lm_head = None
    elif lm_head is None:
        raise fail("lm_head.weight", "missing (tie_word_embeddings is false)")

    weights = ModelWeights(embed=top["embed"], final_norm=top["final_norm"], layers=layers, lm_head=lm_head)
    try:
        weights.validate(spec)
    except MegacError as e:
        raise MegacError(f"{origin}: {e.message}") from None
    return weights


# ------------------------------------------------------------------ entry points


def load_hf_weights(path: str | os.PathLike, spec: "ModelSpec | None" = None, *,
                    dtype: torch.dtype | None = None) -> ModelWeights:
    """Weights of the checkpoint directory ``path`` (spec: from its config.json
    when not given)."""
    directory = Path(path)
    if not directory.is_dir():
        raise MegacError(f"{path}: not a directory (expected a Hugging Face checkpoint)")
    if spec is None:
        from megac.spec.hf import spec_from_hf

        spec = spec_from_hf(directory)
    return weights_from_source(_safetensors_source(directory), spec, dtype=dtype, origin=str(directory))


def load_hf(path: str | os.PathLike, *, dtype: torch.dtype | None = None) -> tuple["ModelSpec", ModelWeights]:
    """``(spec, weights)`` of a checkpoint directory."""
    from megac.spec.hf import spec_from_hf

    spec = spec_from_hf(path)
    return spec, load_hf_weights(path, spec, dtype=dtype)


# ------------------------------------------------------------------ back to HF


def to_hf_state_dict(weights: ModelWeights, spec: "ModelSpec") -> dict[str, torch.Tensor]:
    """The state dict of transformers' model for ``spec`` holding ``weights``
    (in-memory parameter names: fused ``mlp.experts.gate_up_proj`` /
    ``down_proj``; ``lm_head.weight`` is the embedding when tied)."""
    sd: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": weights.embed,
        "model.norm.weight": weights.final_norm,
        "lm_head.weight": weights.lm_head_weight,
    }
    for i, lw in enumerate(weights.layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = lw.input_norm
        if lw.post_attn_norm is not None:
            sd[p + "post_attention_layernorm.weight"] = lw.post_attn_norm
        for proj in "qkvo":
            sd[f"{p}self_attn.{proj}_proj.weight"] = getattr(lw, proj)
        if lw.is_moe:
            sd[p + "mlp.gate.weight"] = lw.router
            sd[p + "mlp.experts.gate_up_proj"] = torch.cat([lw.experts_gate, lw.experts_up], dim=1)
            sd[p + "mlp.experts.down_proj"] = lw.experts_down
        else:
            sd[p + "mlp.gate_proj.weight"] = lw.gate
            sd[p + "mlp.up_proj.weight"] = lw.up
            sd[p + "mlp.down_proj.weight"] = lw.down
    return sd


def build_hf_model(weights: ModelWeights, spec: "ModelSpec", *, attn_implementation: str = "eager"):
    """transformers' reference model (``Cohere2MoeForCausalLM`` /
    ``LlamaForCausalLM``) for ``spec`` holding ``weights`` (tests and
    reference runs; imports transformers). Eval mode, weights' dtype."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from megac.spec.hf import to_transformers_config

    config = to_transformers_config(spec)
    config._attn_implementation = attn_implementation
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=weights.dtype,
                                                 attn_implementation=attn_implementation)
    sd = to_hf_state_dict(weights, spec)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("inv_freq")]
    if missing or unexpected:
        raise MegacError(f"build_hf_model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if spec.tie_embeddings:
        model.tie_weights()
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval()


__all__ = [
    "TensorSource",
    "build_hf_model",
    "load_hf",
    "load_hf_weights",
    "to_hf_state_dict",
    "weights_from_source",
]

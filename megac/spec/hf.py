"""Hugging Face ``config.json`` → :class:`ModelSpec`, field by field (and back).

Reads the JSON directly (transformers is not needed at compile time) and
reproduces the defaults and derivations of the transformers version we test
against (5.24: ``Cohere2MoeConfig``, ``LlamaConfig``). Anything outside the
supported envelope is refused with a :class:`SpecError` naming the config field,
never mapped approximately.

cohere2_moe (``Cohere2MoeForCausalLM``)
    * ``layer_types``: given, or derived like ``Cohere2MoeConfig.__post_init__``
      from ``first_k_dense_replace`` (k, default 0),
      ``prefix_dense_sliding_window_pattern`` (p, default 1) and
      ``sliding_window_pattern`` (s, default 4): layer ``i < k`` is full iff
      ``(i+1) % p == 0``; layer ``i >= k`` is full iff ``(i-k+1) % s == 0``.
      (NMC: k=1, p=1, s=4 → full at 0, 4, 8, ..., 48.)
    * ``mlp_layer_types``: given, or ``dense`` for ``i < k`` else ``sparse``.
    * **RoPE rule** (``Cohere2MoeAttention``): a layer applies RoPE iff it is
      ``sliding_attention`` (and ``sliding_window`` is set) **or** it is a dense
      layer (``mlp_layer_types[i] == "dense"``, any position) and
      ``prefix_dense_sliding_window_pattern == 1`` (``force_rope``). Other full
      layers are NoPE.
    * Dense FFN width: ``prefix_dense_intermediate_size``, or
      ``intermediate_size`` when that is null. Expert width:
      ``intermediate_size``.
    * Router: ``expert_selection_fn`` (softmax | sigmoid), ``norm_topk_prob``
      (only used with sigmoid), ``num_experts``, ``num_experts_per_tok``; see
      :class:`~megac.spec.model.MoESpec` for the exact rule.
    * ``rms_norm_eps``: null selects ``Cohere2MoeLayerNorm`` (mean-subtracting,
      ``layer_norm_eps``): refused. ``head_dim`` defaults to 128 (not
      hidden/heads). ``logit_scale`` defaults to 0.0625.
    * RoPE theta: ``rope_parameters["rope_theta"]`` when present (transformers
      5 writes both it and the legacy top-level ``rope_theta``), else
      ``rope_theta``, else 10000. Note: transformers 5.24 keeps cohere2_moe's
      ``rope_scaling`` as a separate field the model never reads; we refuse a
      non-default one anyway (the checkpoint asked for a scaling).
llama (``LlamaForCausalLM``)
    Sequential block, RoPE ``half`` on every layer, all full attention,
    ``head_dim`` default hidden/heads, theta from ``rope_parameters`` /
    ``rope_theta`` (legacy ``rope_scaling`` is folded into ``rope_parameters``
    by transformers; both are checked), no logit scale.

Both: ``eos_token_id`` (int, list or null) merged with
``generation_config.json``'s when the checkpoint has one; ids outside the
vocabulary (e.g. a tiny test config keeping the default 255001) are dropped, as
are such a ``bos_token_id``. ``max_context`` is ``max_position_embeddings``;
a sliding window larger than it is clamped to it (identical attention).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from megac.errors import SpecError
from megac.spec.limits import num_layers_problem
from megac.spec.messages import read_text_file, validation_error_line
from megac.spec.model import ModelSpec

SUPPORTED_MODEL_TYPES = ("cohere2_moe", "llama")

_MISSING = object()


class _Cfg:
    """Typed accessors over a config.json dict that raise field-named errors."""

    def __init__(self, data: dict, source: str) -> None:
        self.d = data
        self.source = source

    def fail(self, field: str, msg: str) -> SpecError:
        return SpecError(f"{self.source}: {field}: {msg}")

    def raw(self, key: str, default: Any = None) -> Any:
        return self.d.get(key, default)

    def int(self, key: str, default: Any = _MISSING, *, nullable: bool = False, minimum: int | None = 1):
        v = self.d.get(key, _MISSING)
        if v is _MISSING or (v is None and not nullable and default is not _MISSING):
            if default is _MISSING:
                raise self.fail(key, "missing")
            v = default
        if v is None:
            if nullable:
                return None
            raise self.fail(key, "must not be null")
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(key, f"expected an integer (got {v!r})")
        if minimum is not None and v < minimum:
            raise self.fail(key, f"must be >= {minimum} (got {v})")
        return v

    def layer_count(self, default: int) -> int:
        """``num_hidden_layers``, refused over the limit before anything loops over the layers."""
        n = self.int("num_hidden_layers", default)
        too_many = num_layers_problem(n)
        if too_many:
            raise self.fail("num_hidden_layers", too_many)
        return n

    def float(self, key: str, default: Any = _MISSING, *, nullable: bool = False):
        v = self.d.get(key, _MISSING)
        if v is _MISSING:
            if default is _MISSING:
                raise self.fail(key, "missing")
            v = default
        if v is None:
            if nullable:
                return None
            raise self.fail(key, "must not be null")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.fail(key, f"expected a number (got {v!r})")
        return float(v)

    def bool(self, key: str, default: bool) -> bool:
        v = self.d.get(key, default)
        if v is None:
            v = default
        if not isinstance(v, bool):
            raise self.fail(key, f"expected true or false (got {v!r})")
        return v

    def str(self, key: str, default: str) -> str:
        v = self.d.get(key, default)
        if v is None:
            v = default
        if not isinstance(v, str):
            raise self.fail(key, f"expected a string (got {v!r})")
        return v

    def token_ids(self, key: str, default: Any) -> list[int]:
        v = self.d.get(key, default)
        if v is None:
            return []
        vals = v if isinstance(v, list) else [v]
        out = []
        for t in vals:
            if isinstance(t, bool) or not isinstance(t, int):
                raise self.fail(key, f"expected an integer or a list of integers (got {v!r})")
            out.append(t)
        return out


# ------------------------------------------------------------------ refusals


def _refuse_true(c: _Cfg, key: str, what: str) -> None:
    if c.raw(key):
        raise c.fail(key, f"{what} is not supported (got {c.raw(key)!r})")


def _check_common(c: _Cfg) -> None:
    act = c.str("hidden_act", "silu")
    if act != "silu":
        raise c.fail("hidden_act", f"only silu (SwiGLU) is supported (got {act!r})")
    _refuse_true(c, "attention_bias", "an attention bias")
    _refuse_true(c, "mlp_bias", "an MLP bias")
    _refuse_true(c, "use_qk_norm", "QK-norm")
    _refuse_true(c, "qk_layernorm", "QK-norm")
    prf = c.raw("partial_rotary_factor")
    if prf is not None and prf != 1 and prf != 1.0:
        raise c.fail("partial_rotary_factor", f"partial RoPE is not supported (got {prf!r})")


def _check_rope_dict(c: _Cfg, key: str, d: Any) -> None:
    if d is None:
        return
    if not isinstance(d, dict):
        raise c.fail(key, f"expected a mapping or null (got {d!r})")
    if d and all(isinstance(v, dict) or v is None for v in d.values()):
        raise c.fail(key, "per-layer-type RoPE parameters are not supported")
    rope_type = d.get("rope_type", d.get("type", "default"))
    if rope_type != "default":
        raise c.fail(key, f"rope_type {rope_type!r} is not supported (only default RoPE)")
    prf = d.get("partial_rotary_factor")
    if prf is not None and prf != 1 and prf != 1.0:
        raise c.fail(f"{key}.partial_rotary_factor", f"partial RoPE is not supported (got {prf!r})")


def _rope_theta(c: _Cfg, default: float) -> float:
    _check_rope_dict(c, "rope_scaling", c.raw("rope_scaling"))
    rp = c.raw("rope_parameters")
    _check_rope_dict(c, "rope_parameters", rp)
    if isinstance(rp, dict) and rp.get("rope_theta") is not None:
        v = rp["rope_theta"]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise c.fail("rope_parameters.rope_theta", f"expected a number (got {v!r})")
        return float(v)
    return c.float("rope_theta", default)


def _eos(c: _Cfg, default: Any, generation_eos: list[int], vocab: int) -> list[int]:
    ids = c.token_ids("eos_token_id", default)
    for t in generation_eos:
        if t not in ids:
            ids.append(t)
    return [t for t in ids if 0 <= t < vocab]


def _bos(c: _Cfg, default: Any, vocab: int) -> int | None:
    ids = c.token_ids("bos_token_id", default)
    if len(ids) != 1 or not 0 <= ids[0] < vocab:
        return None
    return ids[0]


# --------------------------------------------------------------- per family


def _cohere2_moe(c: _Cfg, name: str, generation_eos: list[int]) -> dict:
    _check_common(c)
    hidden = c.int("hidden_size", 8192)
    n_layers = c.layer_count(40)
    heads = c.int("num_attention_heads", 64)
    kv_heads = c.int("num_key_value_heads", heads)
    head_dim = c.int("head_dim", 128)
    vocab = c.int("vocab_size", 256000)
    max_pos = c.int("max_position_embeddings", 8192)

    if c.raw("rms_norm_eps", None) is None:
        raise c.fail("rms_norm_eps", "null selects LayerNorm (Cohere2MoeLayerNorm), which is not supported")
    eps = c.float("rms_norm_eps")

    n_shared = c.int("num_shared_experts", 0, minimum=0)
    if n_shared > 0:
        raise c.fail("num_shared_experts", f"shared experts are not supported (got {n_shared})")
    sel = c.str("expert_selection_fn", "softmax")
    if sel not in ("softmax", "sigmoid"):
        raise c.fail("expert_selection_fn", f"must be softmax or sigmoid (got {sel!r})")

    theta = _rope_theta(c, 10000.0)

    # Layer patterns, as Cohere2MoeConfig.__post_init__ derives them.
    first_k = c.int("first_k_dense_replace", 0, minimum=0)
    prefix_pat = c.int("prefix_dense_sliding_window_pattern", 1)
    sw_pat = c.int("sliding_window_pattern", 4)
    layer_types = c.raw("layer_types")
    if layer_types is None:
        layer_types = [
            "sliding_attention" if (i + 1) % prefix_pat != 0 else "full_attention" for i in range(first_k)
        ] + [
            "sliding_attention" if (i + 1) % sw_pat != 0 else "full_attention"
            for i in range(n_layers - first_k)
        ]
    mlp_types = c.raw("mlp_layer_types")
    if mlp_types is None:
        mlp_types = ["dense" if i < first_k else "sparse" for i in range(n_layers)]
    for key, vals, allowed in (
        ("layer_types", layer_types, ("full_attention", "sliding_attention")),
        ("mlp_layer_types", mlp_types, ("dense", "sparse")),
    ):
        if not isinstance(vals, list) or len(vals) != n_layers:
            got = len(vals) if isinstance(vals, list) else repr(vals)
            raise c.fail(key, f"expected a list of num_hidden_layers ({n_layers}) entries (got {got})")
        for i, v in enumerate(vals):
            if v not in allowed:
                raise c.fail(f"{key}[{i}]", f"{v!r} is not supported (expected one of {', '.join(allowed)})")

    window = c.int("sliding_window", 4096, nullable=True)
    if "sliding_attention" in layer_types and window is None:
        raise c.fail("sliding_window", "null, but layer_types has sliding_attention layers")
    max_context = max_pos
    if window is not None:
        window = min(window, max_context)

    layers = []
    for i in range(n_layers):
        sliding = layer_types[i] == "sliding_attention"
        dense = mlp_types[i] == "dense"
        layers.append({
            "attention": "sliding" if sliding else "full",
            "window": window if sliding else None,
            "rope": sliding or (dense and prefix_pat == 1),
            "ffn": "dense" if dense else "moe",
        })

    expert_width = c.int("intermediate_size", 22528)
    has_dense = "dense" in mlp_types
    has_moe = "sparse" in mlp_types
    dense_width = c.int("prefix_dense_intermediate_size", None, nullable=True)
    if dense_width is None:
        dense_width = expert_width  # Cohere2MoeMLP(config, None) uses intermediate_size
    moe = None
    if has_moe:
        moe = {
            "num_experts": c.int("num_experts", 8),
            "top_k": c.int("num_experts_per_tok", 2),
            "expert_intermediate_size": expert_width,
            "router": sel,
            "renormalize": c.bool("norm_topk_prob", True) if sel == "sigmoid" else False,
        }

    return {
        "name": name,
        "family": "cohere2_moe",
        "block": "parallel",
        "hidden_size": hidden,
        "num_layers": n_layers,
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "q_width": heads * head_dim,
        "layers": layers,
        "rope_theta": theta,
        "rope_style": "interleaved",
        "norm_eps": eps,
        "dense_intermediate_size": dense_width if has_dense else None,
        "moe": moe,
        "vocab_size": vocab,
        "tie_embeddings": c.bool("tie_word_embeddings", True),
        "logit_scale": c.float("logit_scale", 0.0625),
        "eos_token_ids": _eos(c, 255001, generation_eos, vocab),
        "bos_token_id": _bos(c, 5, vocab),
        "max_context": max_context,
    }


def _llama(c: _Cfg, name: str, generation_eos: list[int]) -> dict:
    _check_common(c)
    hidden = c.int("hidden_size", 4096)
    n_layers = c.layer_count(32)
    heads = c.int("num_attention_heads", 32)
    kv_heads = c.int("num_key_value_heads", heads)
    head_dim = c.int("head_dim", None, nullable=True)
    if head_dim is None:
        head_dim = hidden // heads
    vocab = c.int("vocab_size", 32000)
    if c.raw("rms_norm_eps", 1e-6) is None:
        raise c.fail("rms_norm_eps", "must not be null")
    eps = c.float("rms_norm_eps", 1e-6)
    theta = _rope_theta(c, 10000.0)
    if c.raw("sliding_window") is not None or c.raw("layer_types") is not None:
        key = "sliding_window" if c.raw("sliding_window") is not None else "layer_types"
        raise c.fail(key, "llama has no sliding-window layers (not supported)")
    return {
        "name": name,
        "family": "llama",
        "block": "sequential",
        "hidden_size": hidden,
        "num_layers": n_layers,
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "q_width": heads * head_dim,
        "layers": [{"attention": "full", "window": None, "rope": True, "ffn": "dense"}] * n_layers,
        "rope_theta": theta,
        "rope_style": "half",
        "norm_eps": eps,
        "dense_intermediate_size": c.int("intermediate_size", 11008),
        "moe": None,
        "vocab_size": vocab,
        "tie_embeddings": c.bool("tie_word_embeddings", False),
        "logit_scale": 1.0,
        "eos_token_ids": _eos(c, 2, generation_eos, vocab),
        "bos_token_id": _bos(c, 1, vocab),
        "max_context": c.int("max_position_embeddings", 2048),
    }


_FAMILIES = {"cohere2_moe": _cohere2_moe, "llama": _llama}


# ------------------------------------------------------------------ entry points


def _read_json(path: Path, source: str) -> Any:

    text = read_text_file(path, source)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecError(f"{source}:{e.lineno}: invalid JSON: {e.msg}") from None


def spec_dict_from_hf_config(config: dict, *, name: str, source: str = "config.json",
                             generation_eos: list[int] | None = None) -> dict:
    """The ModelSpec fields (a dict) for one config.json mapping."""
    if not isinstance(config, dict):
        raise SpecError(f"{source}: expected a JSON object at the top level")
    c = _Cfg(config, source)
    mt = config.get("model_type")
    if mt is None:
        raise c.fail("model_type", "missing")
    if mt not in _FAMILIES:
        raise c.fail("model_type", f"{mt!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    return _FAMILIES[mt](c, name, list(generation_eos or []))


def spec_from_hf_config(config: dict, *, name: str, source: str = "config.json",
                        generation_eos: list[int] | None = None) -> ModelSpec:
    data = spec_dict_from_hf_config(config, name=name, source=source, generation_eos=generation_eos)
    try:
        return ModelSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(validation_error_line(err, source)) from None


def spec_from_hf(path: str | os.PathLike, *, name: str | None = None) -> ModelSpec:
    """Map a checkpoint directory (or its config.json) to a ModelSpec with the
    default target."""
    p = Path(path)
    if p.is_dir():
        cfg_path = p / "config.json"
        if not cfg_path.is_file():
            raise SpecError(f"{path}: no config.json in this directory (expected a Hugging Face checkpoint)")
    else:
        cfg_path = p
    source = str(cfg_path)
    config = _read_json(cfg_path, source)
    gen_eos: list[int] = []
    gen_path = cfg_path.parent / "generation_config.json"
    if gen_path.is_file():
        gen = _read_json(gen_path, str(gen_path))
        if isinstance(gen, dict):
            gen_eos = _Cfg(gen, str(gen_path)).token_ids("eos_token_id", None)
    if name is None:
        name = cfg_path.resolve().parent.name or "model"
    return spec_from_hf_config(config, name=name, source=source, generation_eos=gen_eos)


# ------------------------------------------------------------------ spec → HF


def to_hf_config(spec: ModelSpec) -> dict:
    """config.json contents for which transformers builds the reference model of
    ``spec`` (``Cohere2MoeForCausalLM`` / ``LlamaForCausalLM``); mapping it back
    with :func:`spec_from_hf_config` gives the same model fields (not target)."""
    if len(spec.eos_token_ids) == 0:
        eos: Any = None
    elif len(spec.eos_token_ids) == 1:
        eos = spec.eos_token_ids[0]
    else:
        eos = list(spec.eos_token_ids)
    common = {
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_context,
        "rms_norm_eps": spec.norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "tie_word_embeddings": spec.tie_embeddings,
        "eos_token_id": eos,
        "bos_token_id": spec.bos_token_id,
        "pad_token_id": None,
        "hidden_act": "silu",
        "attention_bias": False,
    }
    if spec.family == "llama":
        if spec.hidden_size % spec.num_heads:
            raise SpecError(f"{spec.name}: num_heads: transformers' LlamaConfig needs hidden_size % num_heads == 0")
        return {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            **common,
            "intermediate_size": spec.dense_intermediate_size,
            "mlp_bias": False,
        }
    # cohere2_moe. ModelSpec's family check guarantees: sliding ⇒ rope, full MoE
    # ⇒ NoPE, all full dense layers share one rope flag (→ the prefix pattern).
    full_dense_rope = [l.rope for l in spec.layers if l.attention == "full" and l.ffn == "dense"]
    prefix_pat = 1 if (not full_dense_rope or full_dense_rope[0]) else 2
    windows = [l.window for l in spec.layers if l.attention == "sliding"]
    moe = spec.moe
    out = {
        "model_type": "cohere2_moe",
        "architectures": ["Cohere2MoeForCausalLM"],
        **common,
        "logit_scale": spec.logit_scale,
        "sliding_window": windows[0] if windows else None,
        "layer_types": [f"{l.attention}_attention" for l in spec.layers],
        "mlp_layer_types": ["dense" if l.ffn == "dense" else "sparse" for l in spec.layers],
        "prefix_dense_sliding_window_pattern": prefix_pat,
        "intermediate_size": moe.expert_intermediate_size if moe else spec.dense_intermediate_size,
        "prefix_dense_intermediate_size": spec.dense_intermediate_size,
        "num_shared_experts": 0,
    }
    if moe is not None:
        out.update({
            "num_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "expert_selection_fn": moe.router,
            "norm_topk_prob": moe.renormalize,
        })
    return out


def write_hf_config(spec: ModelSpec, directory: str | os.PathLike) -> Path:
    """Write ``to_hf_config(spec)`` as ``<directory>/config.json``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / "config.json"
    path.write_text(json.dumps(to_hf_config(spec), indent=2) + "\n", encoding="utf-8")
    return path


def to_transformers_config(spec: ModelSpec):
    """The transformers config object (``Cohere2MoeConfig`` / ``LlamaConfig``)
    for ``spec``; imports transformers (tests and reference runs only)."""
    from transformers import AutoConfig

    d = dict(to_hf_config(spec))
    model_type = d.pop("model_type")
    return AutoConfig.for_model(model_type, **d)


__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "spec_dict_from_hf_config",
    "spec_from_hf",
    "spec_from_hf_config",
    "to_hf_config",
    "to_transformers_config",
    "write_hf_config",
]

"""Load a :class:`~megac.spec.model.ModelSpec` from a name, a YAML file or a
Hugging Face checkpoint directory.

``load_spec(MODEL)`` resolves MODEL as, in this order:

1. a **bundled** spec name (``megac/spec/bundled/<name>.yaml``, see
   :func:`list_bundled`), unless MODEL looks like a path (contains ``/``,
   starts with ``.`` or ``~``, or ends in ``.yaml``/``.yml``/``.json``);
   write ``./north-mini-code`` to mean a local directory of that name;
2. a ``.yaml``/``.yml`` **model file** (format below);
3. a **checkpoint directory** holding ``config.json`` (or the ``config.json``
   file itself): mapped field by field by :mod:`megac.spec.hf`.

Every problem raises :class:`~megac.errors.SpecError` with one line naming the
file, the line where known, and the field, e.g.
``model.yaml:7: q_width: num_heads*head_dim (4000) != q_width (4096)`` or
``model.yaml:12: unknown field 'moe.foo'``.

model.yaml format
-----------------

The top-level keys are the :class:`ModelSpec` fields::

    name: tiny-moe              # optional in a file: defaults to the file stem
    family: cohere2_moe         # cohere2_moe | llama (names the HF reference)
    block: parallel             # parallel | sequential
    hidden_size: 64
    num_layers: 6
    num_heads: 4
    num_kv_heads: 2
    head_dim: 16
    q_width: 64                 # must equal num_heads * head_dim
    rope_theta: 50000.0
    rope_style: interleaved     # interleaved (GPT-J pairs) | half (NeoX halves)
    norm_eps: 1.0e-6            # RMSNorm epsilon
    dense_intermediate_size: 96 # width of dense SwiGLU layers (omit if none)
    moe:                        # omit if no MoE layer
      num_experts: 8
      top_k: 2
      expert_intermediate_size: 32
      router: sigmoid           # sigmoid | softmax
      renormalize: false
    vocab_size: 256
    tie_embeddings: true
    logit_scale: 1.0            # logits are multiplied by it (default 1.0)
    eos_token_ids: [2]
    bos_token_id: 1             # optional
    max_context: 4096
    layers: ...                 # see below
    target:                     # optional; every key optional (TargetSpec)
      gpu: h200                 # h100 | h200
      num_sms: 132
      batch_sizes: [1, 2, 4, 8]
      kv_block_size: 64         # power of two
      attn_split_tokens: 512    # a row's KV splits into ceil(span/this) ...
      attn_max_splits: 32       # ... at most this many
      context_buckets: null     # null: 1024, 2048, ... (powers of two), max_context
      tiles: {moe_up_bn: 96}    # optional tile sizes (megac.geometry.DEFAULT_TILES keys;
                                # fused_topk: 1 / fused_gather: 1 do the MoE top-k / the
                                # gather inside ROUTE_FINALIZE; routed_claims: N, batches
                                # of <= N rows have every up claimer rank the rows itself;
                                # norm_fold: N, batches of <= N rows fold the norm into
                                # the QKV and router tiles, 0 never)

``layers`` is either an explicit list, one mapping per layer::

    layers:
      - {attention: full, rope: true, ffn: dense}
      - {attention: sliding, window: 4096, rope: true, ffn: moe}
      ...

or a **compact** mapping that expands to that list::

    layers:
      attention_pattern: [full, sliding, sliding, sliding]  # repeats from layer 0
      sliding_window: 4096        # required iff the pattern has 'sliding'
      rope: sliding_and_dense_prefix
      dense_prefix: 1

* ``attention_pattern``: a list of ``full``/``sliding`` repeated over the
  layers (layer ``i`` gets ``pattern[i % len(pattern)]``), or one word for all.
* ``dense_prefix``: the first N layers have a dense FFN and the rest MoE (the
  ``moe:`` block must be given when N < num_layers). Without ``moe:`` every
  layer is dense and ``dense_prefix`` may be omitted (or equal num_layers).
  Default: 0 with ``moe:``, num_layers without.
* ``rope`` (required): which layers apply RoPE (the others are NoPE):
  ``all`` | ``none`` | ``sliding`` (sliding layers only) |
  ``sliding_and_dense_prefix`` (sliding layers and layers < dense_prefix:
  Cohere2 MoE with ``prefix_dense_sliding_window_pattern == 1``) | an explicit
  list of layer indices, e.g. ``[0, 1, 2]``.
"""

from __future__ import annotations

import difflib
import os
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from megac.errors import SpecError
from megac.spec.compact import CompactLayers, expand_layers
from megac.spec.hf import spec_from_hf
from megac.spec.limits import num_layers_problem
from megac.spec.messages import FIELD_PREFIX, parse_path, read_text_file, short, validation_error_line, where
from megac.spec.model import ModelSpec, TargetSpec

BUNDLED_PACKAGE = "megac.spec"
BUNDLED_DIR = "bundled"


# --------------------------------------------------------------------------- YAML


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (PyYAML keeps the last silently)."""


def _construct_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            dup = key in seen
        except TypeError:  # unhashable key: let PyYAML report it
            dup = False
        if dup:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        try:
            seen.add(key)
        except TypeError:
            pass
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _parse_yaml(text: str, source: str) -> tuple[Any, yaml.Node | None]:
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        if problem.startswith("duplicate key"):
            raise SpecError(f"{where}: {problem}") from None
        raise SpecError(f"{where}: YAML syntax error: {problem}") from None
    finally:
        loader.dispose()
    return data, node


# ------------------------------------------------------------------- from dicts


def spec_from_dict(data: Any, *, source: str = "<spec>", node: yaml.Node | None = None,
                   default_name: str | None = None) -> ModelSpec:
    """Validate a model.yaml-shaped mapping (compact or explicit layers)."""
    if not isinstance(data, dict):
        kind = "empty" if data is None else type(data).__name__
        raise SpecError(f"{source}: expected a mapping of model fields at the top level (got {kind})")
    data = dict(data)
    if "name" not in data and default_name:
        data["name"] = default_name

    layers = data.get("layers")
    if isinstance(layers, dict):
        if "num_layers" not in data:
            raise SpecError(f"{source}: missing field 'num_layers'")
        n = data["num_layers"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise SpecError(f"{where(source, node, ['num_layers'])}: num_layers: "
                            f"must be a positive integer (got {short(n)})")
        too_many = num_layers_problem(n)
        if too_many:  # before the expansion makes one entry per layer
            raise SpecError(f"{where(source, node, ['num_layers'])}: num_layers: {too_many}")
        try:
            data["layers"] = expand_layers(layers, num_layers=n, has_moe=data.get("moe") is not None)
        except ValidationError as err:
            raise SpecError(validation_error_line(err, source, node, prefix=["layers"])) from None
        except ValueError as err:
            m = FIELD_PREFIX.match(str(err))
            at = where(source, node, parse_path(m.group(1)) if m else ["layers"])
            raise SpecError(f"{at}: {err}") from None
    elif layers is not None and not isinstance(layers, list):
        raise SpecError(f"{where(source, node, ['layers'])}: layers: expected a list of layers "
                        f"or a compact layers mapping (got {type(layers).__name__})")

    try:
        return ModelSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(validation_error_line(err, source, node)) from None


def spec_from_yaml_text(text: str, *, source: str = "<yaml>", default_name: str | None = None) -> ModelSpec:
    data, node = _parse_yaml(text, source)
    return spec_from_dict(data, source=source, node=node, default_name=default_name)


def load_yaml_spec(path: str | os.PathLike, *, source: str | None = None) -> ModelSpec:
    p = Path(path)
    source = source or str(path)
    return spec_from_yaml_text(read_text_file(p, source), source=source, default_name=p.stem)


def spec_to_yaml(spec: ModelSpec) -> str:
    """The spec as model.yaml text (explicit layer list); loads back equal."""
    data = spec.model_dump(mode="json")
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=None)


# --------------------------------------------------------------------- overrides


def _coerce_list(value: Any) -> Any:
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",") if p.strip()]
        try:
            return [int(p) for p in parts]
        except ValueError:
            return value
    if isinstance(value, tuple):
        return list(value)
    return value


def apply_overrides(spec: ModelSpec, *, source: str, target_overrides: dict | None = None,
                    max_context: int | None = None) -> ModelSpec:
    """Return ``spec`` with target fields (keys whose value is None are ignored)
    and/or max_context replaced. Lowering max_context clamps sliding windows to
    it (same attention within the context) and drops larger explicit buckets."""
    overrides = {k: v for k, v in (target_overrides or {}).items() if v is not None}
    if not overrides and max_context is None:
        return spec
    data = spec.model_dump()
    for key, value in overrides.items():
        if key not in TargetSpec.model_fields:
            close = difflib.get_close_matches(str(key), list(TargetSpec.model_fields), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise SpecError(f"{source}: unknown field 'target.{key}'{hint}")
        if key in ("batch_sizes", "context_buckets"):
            value = _coerce_list(value)
        data["target"][key] = value
    if max_context is not None:
        if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 1:
            raise SpecError(f"{source}: max_context: must be a positive integer (got {short(max_context)})")
        data["max_context"] = max_context
        for layer in data["layers"]:
            if layer["window"] is not None and layer["window"] > max_context:
                layer["window"] = max_context
        cb = data["target"].get("context_buckets")
        if cb is not None and "context_buckets" not in overrides:
            kept = [b for b in cb if b < max_context]
            data["target"]["context_buckets"] = kept + [max_context]
    try:
        return ModelSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(validation_error_line(err, source)) from None


# ----------------------------------------------------------------------- bundled


def _bundled_root():
    return resources.files(BUNDLED_PACKAGE).joinpath(BUNDLED_DIR)


def list_bundled() -> list[str]:
    """Names of the specs shipped with megac."""
    root = _bundled_root()
    try:
        entries = list(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(e.name[: -len(".yaml")] for e in entries if e.name.endswith(".yaml"))


def load_bundled(name: str) -> ModelSpec:
    res = _bundled_root().joinpath(f"{name}.yaml")
    if not res.is_file():
        raise SpecError(f"unknown bundled model '{name}' (bundled: {', '.join(list_bundled())})")
    return spec_from_yaml_text(res.read_text(encoding="utf-8"), source=f"bundled/{name}.yaml",
                               default_name=name)


# ---------------------------------------------------------------------- load_spec


def _looks_like_path(s: str) -> bool:
    return ("/" in s or os.sep in s or s.startswith((".", "~"))
            or s.lower().endswith((".yaml", ".yml", ".json")))


def _load_base(model: str | os.PathLike) -> tuple[ModelSpec, str]:
    s = os.fspath(model)
    if not s:
        raise SpecError("no model given")
    if not _looks_like_path(s) and s in list_bundled():
        return load_bundled(s), s
    p = Path(s).expanduser()
    if p.is_dir():
        cfg = p / "config.json"
        if not cfg.is_file():
            raise SpecError(f"{s}: no config.json in this directory (expected a Hugging Face checkpoint)")
        return spec_from_hf(p), str(cfg)
    if p.is_file():
        if p.suffix.lower() in (".yaml", ".yml"):
            return load_yaml_spec(p, source=s), s
        if p.suffix.lower() == ".json":
                return spec_from_hf(p), s
        raise SpecError(f"{s}: not a model spec (expected a .yaml file, a config.json or a checkpoint directory)")
    if p.exists():
        raise SpecError(f"{s}: not a regular file or directory")
    if _looks_like_path(s):
        raise SpecError(f"{s}: no such file or directory")
    raise SpecError(
        f"unknown model '{s}': not a bundled model ({', '.join(list_bundled())}) "
        f"nor an existing .yaml file or checkpoint directory"
    )


def load_spec(model: str | os.PathLike, *, target_overrides: dict | None = None,
              max_context: int | None = None) -> ModelSpec:
    """Resolve MODEL (bundled name, .yaml file, checkpoint dir) to a ModelSpec.

    ``target_overrides``: TargetSpec fields to replace (None values ignored, so
    a CLI can pass every option). ``max_context``: a smaller (or larger)
    context limit than the model's; sliding windows are clamped to it."""
    spec, source = _load_base(model)
    return apply_overrides(spec, source=source, target_overrides=target_overrides, max_context=max_context)


__all__ = [
    "CompactLayers",
    "apply_overrides",
    "expand_layers",
    "list_bundled",
    "load_bundled",
    "load_spec",
    "load_yaml_spec",
    "spec_from_dict",
    "spec_from_yaml_text",
    "spec_to_yaml",
    "validation_error_line",
]

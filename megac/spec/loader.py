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
import re
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from megac.errors import SpecError
from megac.spec.model import LayerSpec, ModelSpec, MoESpec, TargetSpec

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


def _node_line(root: yaml.Node | None, path: list[str | int]) -> int | None:
    """1-based line of the deepest node along ``path`` (keys and list indices)."""
    node, line = root, None
    for part in path:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.value == str(part):
                    node, line = v, k.start_mark.line + 1
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if 0 <= part < len(node.value):
                node = node.value[part]
                line = node.start_mark.line + 1
            else:
                return line
        else:
            return line
    return line


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


# ------------------------------------------------------------- error formatting

_MODELS_BY_PATH: dict[tuple[str, ...], type[BaseModel]] = {
    (): ModelSpec,
    ("moe",): MoESpec,
    ("target",): TargetSpec,
    ("layers",): CompactLayers,
    ("layers", "#"): LayerSpec,
}
_TYPE_TAGS = {"int", "float", "str", "bool", "none", "list", "dict"}
_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w]*(?:\[\d+\])?(?:\.[A-Za-z_]\w*(?:\[\d+\])?)*): ")


def _clean_loc(loc: tuple) -> list[str | int]:
    out: list[str | int] = []
    for part in loc:
        if isinstance(part, str) and ("[" in part or "(" in part or part in _TYPE_TAGS):
            continue  # union branch tags such as 'list[int]' or "literal['all', ...]"
        out.append(part)
    return out


def format_loc(loc: list[str | int]) -> str:
    s = ""
    for part in loc:
        if isinstance(part, int):
            s += f"[{part}]"
        else:
            s += ("." if s else "") + part
    return s


def _parse_path(text: str) -> list[str | int]:
    out: list[str | int] = []
    for piece in text.split("."):
        m = re.match(r"^(\w+)((?:\[\d+\])*)$", piece)
        if not m:
            return out
        out.append(m.group(1))
        out.extend(int(x) for x in re.findall(r"\[(\d+)\]", m.group(2)))
    return out


def _short(value: Any) -> str:
    r = repr(value)
    return r if len(r) <= 60 else r[:57] + "..."


def _did_you_mean(parent: list[str | int], name: str) -> str:
    key = tuple("#" if isinstance(p, int) else p for p in parent)
    model = _MODELS_BY_PATH.get(key)
    if model is None:
        return ""
    close = difflib.get_close_matches(name, list(model.model_fields), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _where(source: str, node: yaml.Node | None, path: list[str | int]) -> str:
    line = _node_line(node, path) if node is not None and path else None
    return f"{source}:{line}" if line is not None else source


def validation_error_line(err: ValidationError, source: str, node: yaml.Node | None = None,
                          prefix: list[str | int] | None = None) -> str:
    """One line for the first error of a pydantic ValidationError."""
    errors = err.errors()
    # A misspelt key shows up as both 'missing' and 'extra_forbidden': name the typo.
    e = next((x for x in errors if x["type"] == "extra_forbidden"), errors[0])
    loc = list(prefix or []) + _clean_loc(tuple(e["loc"]))
    etype, msg = e["type"], e["msg"]
    if etype == "extra_forbidden":
        name = loc[-1] if loc else "?"
        return (f"{_where(source, node, loc)}: unknown field '{format_loc(loc)}'"
                f"{_did_you_mean(loc[:-1], str(name))}")
    if etype == "missing":
        return f"{_where(source, node, loc[:-1])}: missing field '{format_loc(loc)}'"
    if etype in ("value_error", "assertion_error"):
        msg = re.sub(r"^(Value error|Assertion failed), ", "", msg)
        m = _FIELD_PREFIX.match(msg)
        if m:  # a model validator naming a sub-field: join it to the location
            sub = _parse_path(m.group(1))
            full = loc + sub
            return f"{_where(source, node, full)}: {format_loc(full)}: {msg[m.end():]}"
        path = format_loc(loc)
        return f"{_where(source, node, loc)}: {path + ': ' if path else ''}{msg}"
    path = format_loc(loc)
    got = f" (got {_short(e.get('input'))})" if "input" in e and not isinstance(e.get("input"), (dict, list)) else ""
    return f"{_where(source, node, loc)}: {path + ': ' if path else ''}{msg}{got}"


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
            raise SpecError(f"{_where(source, node, ['num_layers'])}: num_layers: "
                            f"must be a positive integer (got {_short(n)})")
        try:
            data["layers"] = expand_layers(layers, num_layers=n, has_moe=data.get("moe") is not None)
        except ValidationError as err:
            raise SpecError(validation_error_line(err, source, node, prefix=["layers"])) from None
        except ValueError as err:
            m = _FIELD_PREFIX.match(str(err))
            where = _where(source, node, _parse_path(m.group(1)) if m else ["layers"])
            raise SpecError(f"{where}: {err}") from None
    elif layers is not None and not isinstance(layers, list):
        raise SpecError(f"{_where(source, node, ['layers'])}: layers: expected a list of layers "
                        f"or a compact layers mapping (got {type(layers).__name__})")

    try:
        return ModelSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(validation_error_line(err, source, node)) from None


def spec_from_yaml_text(text: str, *, source: str = "<yaml>", default_name: str | None = None) -> ModelSpec:
    data, node = _parse_yaml(text, source)
    return spec_from_dict(data, source=source, node=node, default_name=default_name)


def read_text_file(path: Path, source: str) -> str:
    """A spec file's text, or a one-line SpecError saying why not."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{source}: no such file") from None
    except OSError as e:
        raise SpecError(f"{source}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise SpecError(f"{source}: not a UTF-8 text file") from None


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
            raise SpecError(f"{source}: max_context: must be a positive integer (got {_short(max_context)})")
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
        from megac.spec.hf import spec_from_hf

        cfg = p / "config.json"
        if not cfg.is_file():
            raise SpecError(f"{s}: no config.json in this directory (expected a Hugging Face checkpoint)")
        return spec_from_hf(p), str(cfg)
    if p.is_file():
        if p.suffix.lower() in (".yaml", ".yml"):
            return load_yaml_spec(p, source=s), s
        if p.suffix.lower() == ".json":
            from megac.spec.hf import spec_from_hf

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

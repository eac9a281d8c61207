"""One-line spec errors: pydantic validation errors and unreadable files
turned into ``<source>[:line]: <field>: <what is wrong>`` (with a "did you
mean" for a misspelt key), shared by the YAML and the HF config loaders."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from megac.errors import SpecError
from megac.spec.compact import CompactLayers
from megac.spec.model import LayerSpec, ModelSpec, MoESpec, TargetSpec


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


# ------------------------------------------------------------- error formatting

_MODELS_BY_PATH: dict[tuple[str, ...], type[BaseModel]] = {
    (): ModelSpec,
    ("moe",): MoESpec,
    ("target",): TargetSpec,
    ("layers",): CompactLayers,
    ("layers", "#"): LayerSpec,
}
_TYPE_TAGS = {"int", "float", "str", "bool", "none", "list", "dict"}
FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w]*(?:\[\d+\])?(?:\.[A-Za-z_]\w*(?:\[\d+\])?)*): ")


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


def parse_path(text: str) -> list[str | int]:
    out: list[str | int] = []
    for piece in text.split("."):
        m = re.match(r"^(\w+)((?:\[\d+\])*)$", piece)
        if not m:
            return out
        out.append(m.group(1))
        out.extend(int(x) for x in re.findall(r"\[(\d+)\]", m.group(2)))
    return out


def short(value: Any) -> str:
    r = repr(value)
    return r if len(r) <= 60 else r[:57] + "..."


def _did_you_mean(parent: list[str | int], name: str) -> str:
    key = tuple("#" if isinstance(p, int) else p for p in parent)
    model = _MODELS_BY_PATH.get(key)
    if model is None:
        return ""
    close = difflib.get_close_matches(name, list(model.model_fields), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def where(source: str, node: yaml.Node | None, path: list[str | int]) -> str:
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
        return (f"{where(source, node, loc)}: unknown field '{format_loc(loc)}'"
                f"{_did_you_mean(loc[:-1], str(name))}")
    if etype == "missing":
        return f"{where(source, node, loc[:-1])}: missing field '{format_loc(loc)}'"
    if etype in ("value_error", "assertion_error"):
        msg = re.sub(r"^(Value error|Assertion failed), ", "", msg)
        m = FIELD_PREFIX.match(msg)
        if m:  # a model validator naming a sub-field: join it to the location
            sub = parse_path(m.group(1))
            full = loc + sub
            return f"{where(source, node, full)}: {format_loc(full)}: {msg[m.end():]}"
        path = format_loc(loc)
        return f"{where(source, node, loc)}: {path + ': ' if path else ''}{msg}"
    path = format_loc(loc)
    got = f" (got {short(e.get('input'))})" if "input" in e and not isinstance(e.get("input"), (dict, list)) else ""
    return f"{where(source, node, loc)}: {path + ': ' if path else ''}{msg}{got}"


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


__all__ = ["FIELD_PREFIX", "format_loc", "parse_path", "read_text_file", "short", "validation_error_line", "where"]

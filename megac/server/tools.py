"""Tool-call parsers: model output text -> content + OpenAI tool calls.

Pluggable per model family: :data:`PARSERS` maps a parser name to a
:class:`ToolParser` class; :func:`parser_for_family` picks the default for a
spec family (``--tool-call-parser`` overrides). One parser so far:

``hermes`` (:class:`HermesToolParser`)
    ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``, possibly
    several in a row, text before the first one being content (Hermes,
    Qwen 2.5/3, and what our tool-aware ChatML template asks SmolLM2 for).

Every parser is a *streaming* parser first: :meth:`StreamingToolParser.feed`
takes text deltas at arbitrary boundaries and returns what may be shown now
(content, and tool-call deltas: a call's ``id`` and ``name`` once the name
is complete, then its ``arguments`` in fragments as they arrive). The
non-streaming result is the same parser run over the whole text, so the
concatenated fragments of a stream equal the non-streamed ``arguments``
exactly.

How a call block is read: a small scanner walks the block's top-level JSON
object (strings and escapes respected, nested objects and arrays bracket
matched) and finds its ``name`` and ``arguments`` (or ``parameters``) keys
in any order. ``arguments`` is passed on as the raw JSON text of the value
(an object is streamed as it grows, a partial end tag held back; a value
that is a JSON string holding JSON is decoded once complete). A block
without a readable name by its end tag (or the end of output) is returned as
content; a called function whose arguments cannot be read gets ``{}``
(:attr:`ToolCall.complete` tells a call whose arguments were read to their
end from one cut off by the end of output, or whose arguments are not a JSON
object: ``{a: 1}`` and ``[1, 2]`` are refused, never passed on). An
end tag inside a JSON string (``"</tool_call>"`` in an argument) does not end
the block. Text after a call block is dropped (as vLLM does).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

# ---------------------------------------------------------------------------- results


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text
    #: the arguments' value was read to its end (False: cut off, e.g. by max_tokens)
    complete: bool = True


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)

    def extend(self, other: "ParsedDelta") -> None:
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ---------------------------------------------------------------------------- JSON scanning


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\r\n":
        i += 1
    return i


def _scan_string(s: str, i: int) -> int | None:
    """``s[i] == '"'``: index after the closing quote, None if incomplete."""
    j = i + 1
    while j < len(s):
        c = s[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


_NUM = frozenset("+-0123456789.eE")


def object_prefix_ok(s: str) -> bool:
    """Whether ``s`` is a JSON object or the beginning of one (some text
    could follow that makes it a valid JSON object). Tool-call arguments must
    be a JSON object: ``{a: 1}``, ``[1, 2]`` or ``5`` are not."""
    stack: list[str] = []
    state, i, n = "object", 0, len(s)
    while i < n:
        c = s[i]
        if c in " \t\r\n":
            i += 1
            continue
        if state == "done":
            return False
        if state == "object" and c != "{":
            return False
        if state in ("object", "value", "value_or_close"):
            if state == "value_or_close" and c == "]":
                stack.pop()
                i, state = i + 1, "comma_or_close" if stack else "done"
                continue
            if c in "{[":
                stack.append(c)
                i, state = i + 1, "key_or_close" if c == "{" else "value_or_close"
                continue
            if c == '"':
                j = _scan_string(s, i)
                if j is None:
                    return True
            elif c in _NUM:
                j = i
                while j < n and s[j] in _NUM:
                    j += 1
                if j == n:
                    return True
                try:
                    json.loads(s[i:j])
                except ValueError:
                    return False
            else:
                lit = next((w for w in ("true", "false", "null") if w[0] == c), None)
                if lit is None or not lit.startswith(s[i:i + len(lit)]):
                    return False
                if i + len(lit) > n:
                    return True
                j = i + len(lit)
            i, state = j, "comma_or_close" if stack else "done"
        elif state in ("key", "key_or_close"):
            if state == "key_or_close" and c == "}":
                stack.pop()
                i, state = i + 1, "comma_or_close" if stack else "done"
                continue
            if c != '"':
                return False
            j = _scan_string(s, i)
            if j is None:
                return True
            i, state = j, "colon"
        elif state == "colon":
            if c != ":":
                return False
            i, state = i + 1, "value"
        else:  # comma_or_close
            top = stack[-1]
            if c == ",":
                i, state = i + 1, "key" if top == "{" else "value"
            elif c == ("}" if top == "{" else "]"):
                stack.pop()
                i, state = i + 1, "comma_or_close" if stack else "done"
            else:
                return False
    return True


def _scan_value(s: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at ``s[i]``; None if the
    text ends before the value does."""
    if i >= len(s):
        return None
    c = s[i]
    if c == '"':
        return _scan_string(s, i)
    if c in "{[":
        depth = 0
        j = i
        while j < len(s):
            c = s[j]
            if c == '"':
                k = _scan_string(s, j)
                if k is None:
                    return None
                j = k
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(s) and s[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(s) else None


def scan_object(s: str) -> tuple[dict[str, tuple[int, int | None]], bool]:
    """Top-level keys of the (possibly partial) JSON object in ``s``:
    ``{key: (value_start, value_end or None)}`` and whether the object closed."""
    keys: dict[str, tuple[int, int | None]] = {}
    i = _skip_ws(s, 0)
    if i >= len(s) or s[i] != "{":
        return keys, False
    i += 1
    while True:
        i = _skip_ws(s, i)
        if i >= len(s):
            return keys, False
        if s[i] == "}":
            return keys, True
        if s[i] != '"':
            return keys, False
        k_end = _scan_string(s, i)
        if k_end is None:
            return keys, False
        try:
            key = json.loads(s[i:k_end])
        except ValueError:
            return keys, False
        i = _skip_ws(s, k_end)
        if i >= len(s) or s[i] != ":":
            return keys, False
        v0 = _skip_ws(s, i + 1)
        if v0 >= len(s):
            return keys, False
        v1 = _scan_value(s, v0)
        keys[key] = (v0, v1)
        if v1 is None:
            return keys, False
        i = _skip_ws(s, v1)
        if i < len(s) and s[i] == ",":
            i += 1
        elif i < len(s) and s[i] == "}":
            return keys, True
        elif i < len(s):
            return keys, False


def _ends_in_string(s: str) -> bool:
    """Whether ``s`` ends inside a JSON string (quotes and escapes tracked)."""
    inside = False
    i = 0
    while i < len(s):
        c = s[i]
        if inside and c == "\\":
            i += 2
            continue
        if c == '"':
            inside = not inside
        i += 1
    return inside


def _find_end(s: str, tag: str, start: int) -> int:
    """First ``tag`` in ``s`` at or after ``start`` that is not inside a JSON
    string of the block starting at ``start`` (-1: none yet)."""
    j = s.find(tag, start)
    while j >= 0 and _ends_in_string(s[start:j]):
        j = s.find(tag, j + 1)
    return j


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# ---------------------------------------------------------------------------- parsers


class StreamingToolParser:
    """Incremental parser state (one per response)."""

    def feed(self, text: str) -> ParsedDelta:  # pragma: no cover - interface
        raise NotImplementedError

    def finish(self) -> ParsedDelta:  # pragma: no cover - interface
        raise NotImplementedError

    @property
    def content(self) -> str:  # pragma: no cover - interface
        raise NotImplementedError

    @property
    def tool_calls(self) -> list[ToolCall]:  # pragma: no cover - interface
        raise NotImplementedError


class ToolParser:
    """A parser family: makes streaming parsers; ``parse`` runs one over a
    whole text."""

    name = "base"

    def stream(self, prefix: str = "") -> StreamingToolParser:  # pragma: no cover - interface
        raise NotImplementedError

    def parse(self, text: str, prefix: str = "") -> tuple[str, list[ToolCall]]:
        """``(content, tool_calls)`` of a complete output (``prefix``: text
        the prompt already put in the model's mouth, e.g. a tool seed)."""
        p = self.stream(prefix)
        p.feed(text)
        p.finish()
        return p.content, p.tool_calls


@dataclass
class _Call:
    index: int | None = None  # assigned once the name is known
    id: str = ""
    name: str | None = None
    args_sent: str = ""
    args_done: bool = False
    args_complete: bool = False  # the value ended in the text (not merely at the end of output)
    closed: bool = False


class _HermesStream(StreamingToolParser):
    START = "<tool_call>"
    END = "</tool_call>"

    def __init__(self, prefix: str = "") -> None:
        self.buf = prefix
        self._content_sent = 0
        self._content = ""
        self._calls: list[_Call] = []  # one per block seen (named or not)
        self._n_named = 0
        self._finished = False

    # results
    @property
    def content(self) -> str:
        return self._content

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [ToolCall(c.id, c.name, c.args_sent, c.args_complete) for c in self._calls if c.name is not None]

    def feed(self, text: str) -> ParsedDelta:
        self.buf += text
        return self._scan(final=False)

    def finish(self) -> ParsedDelta:
        if self._finished:
            return ParsedDelta()
        self._finished = True
        return self._scan(final=True)

    # internals
    def _emit_content(self, out: ParsedDelta, upto: int) -> None:
        if upto > self._content_sent:
            piece = self.buf[self._content_sent:upto]
            self._content += piece
            out.content += piece
            self._content_sent = upto

    def _scan(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        first = self.buf.find(self.START)
        if first < 0:
            hold = 0 if final else _partial_suffix(self.buf, self.START)
            self._emit_content(out, len(self.buf) - hold)
            return out
        self._emit_content(out, first)
        self._content_sent = max(self._content_sent, first)
        pos, k = first, 0
        while pos >= 0:
            body0 = pos + len(self.START)
            end = _find_end(self.buf, self.END, body0)
            closed = end >= 0
            body = self.buf[body0:end] if closed else self.buf[body0:]
            if k == len(self._calls):
                self._calls.append(_Call())
            call = self._calls[k]
            if not call.closed:
                self._update_call(call, body, closed or final, out, closed)
                call.closed = closed
            k += 1
            if not closed:
                break
            pos = self.buf.find(self.START, end + len(self.END))
        return out

    def _update_call(self, call: _Call, body: str, ending: bool, out: ParsedDelta, closed: bool) -> None:
        keys, complete = scan_object(body)
        if call.name is None:
            span = keys.get("name")
            if span and span[1] is not None and body[span[0]] == '"':
                try:
                    call.name = str(json.loads(body[span[0]:span[1]]))
                except ValueError:
                    call.name = None
            if call.name is not None:
                call.index, call.id = self._n_named, new_call_id()
                self._n_named += 1
                out.tool_calls.append(ToolCallDelta(call.index, call.id, call.name, None))
            elif ending:
                # no readable call: show the block as text
                raw = self.START + body + (self.END if closed else "")
                self._content += raw
                out.content += raw
                call.closed = True
                return
            else:
                return
        if call.args_done:
            return
        span = keys.get("arguments") or keys.get("parameters")
        frag = None
        if span is not None:
            v0, v1 = span
            if body[v0] == "{":
                if v1 is not None:
                    new = body[v0:v1]
                    call.args_done = call.args_complete = True
                else:
                    new = body[v0:]
                    new = new[: len(new) - _partial_suffix(new, self.END)] if not ending else new.rstrip()
                    if ending:
                        call.args_done = True
                if not object_prefix_ok(new):
                    # not a JSON object ({a: 1}): the call is not complete, and its
                    # arguments end with the longest beginning of a JSON object
                    # (prefix validity is monotone: what was streamed is inside it)
                    lo, hi = len(call.args_sent), len(new)
                    while lo + 1 < hi:
                        mid = (lo + hi) // 2
                        lo, hi = (mid, hi) if object_prefix_ok(new[:mid]) else (lo, mid)
                    call.args_done, call.args_complete, new = True, False, new[:lo]
                if len(new) > len(call.args_sent) and new.startswith(call.args_sent):
                    frag = new[len(call.args_sent):]
            elif v1 is not None or body[v0] == "[" or ending:
                # a string holding a JSON object is decoded; anything else ([1, 2],
                # 5, a string that is no object) is rejected: the call is not complete
                raw = body[v0:v1] if v1 is not None else ""
                try:
                    obj = json.loads(raw) if body[v0] == '"' and v1 is not None else None
                    dec = json.loads(obj) if isinstance(obj, str) else None
                except ValueError:
                    dec = None
                call.args_done = True
                if isinstance(dec, dict):
                    frag, call.args_complete = obj, True
                else:
                    frag = "{}"  # never a called function without arguments; not complete
        elif ending or complete:
            frag = "{}"
            call.args_done = True
            call.args_complete = complete
        if ending and not call.args_done:
            # unreadable arguments at the end: never leave a called function without any
            call.args_done = True
            if not call.args_sent and not frag:
                frag = "{}"
        if frag:
            call.args_sent += frag
            out.tool_calls.append(ToolCallDelta(call.index, None, None, frag))


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (module docstring)."""

    name = "hermes"

    def stream(self, prefix: str = "") -> StreamingToolParser:
        return _HermesStream(prefix)


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser}

#: default parser per ModelSpec.family
FAMILY_DEFAULTS = {"llama": "hermes", "cohere2_moe": "hermes"}


def get_tool_parser(name: str) -> ToolParser:
    from megac.errors import MegacError

    if name not in PARSERS:
        raise MegacError(f"--tool-call-parser {name}: choose one of {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()


def parser_for_family(family: str) -> ToolParser:
    return get_tool_parser(FAMILY_DEFAULTS.get(family, "hermes"))


__all__ = [
    "FAMILY_DEFAULTS",
    "HermesToolParser",
    "PARSERS",
    "ParsedDelta",
    "StreamingToolParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "get_tool_parser",
    "new_call_id",
    "parser_for_family",
    "scan_object",
]

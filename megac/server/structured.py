"""Structured output of chat requests: the grammar a request's output is
held to (:mod:`megac.grammar` constrains the decoding).

``tool_choice: "required"``
    One or more calls of the declared functions in the Hermes format the
    tool-aware template asks for and :class:`~megac.server.tools.HermesToolParser`
    reads. The prompt already ends in the seed ``<tool_call>\\n``
    (:func:`megac.server.chat.tool_seed`); the grammar continues it with
    ``{"name": NAME, "arguments": ARGS}\\n</tool_call>`` where NAME is a
    declared function's and ARGS is valid against that function's
    ``parameters``; with ``parallel_tool_calls`` further
    ``\\n<tool_call>\\n...`` blocks may follow, else the output ends there.
``tool_choice`` naming a function
    The seed already holds ``{"name": NAME, "arguments": ``; the grammar
    continues with ARGS valid against NAME's ``parameters``, then
    ``}\\n</tool_call>``, and the output ends.
``response_format`` ``json_object`` / ``json_schema``
    One JSON object / one JSON value valid against
    ``response_format.json_schema.schema``. A forced tool call takes
    precedence over ``response_format`` (the reply is then a call).

Function ``parameters`` are object schemas: a schema without ``type`` gets
``"type": "object"`` and a missing one means "no parameters" (``{}``), so
the arguments are always a JSON object. JSON is written in one layout
(:data:`megac.grammar.JSON_STYLE`). A schema the grammar library cannot
compile is the client's 400, naming the field.
"""

from __future__ import annotations

from typing import Any

from megac.grammar import Grammar, GrammarError, json_grammar, lark_json, lark_literal
from megac.server.errors import bad, clip

#: the arguments of a function declared without ``parameters``
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}

#: what ends a call block, and what starts the next one (the template's layout)
CALL_END = "\n</tool_call>"
NEXT_CALL = "\n<tool_call>\n"


def arguments_schema(function: dict[str, Any]) -> dict[str, Any]:
    """The schema a function's arguments must satisfy (module docstring)."""
    params = function.get("parameters")
    if params is None:
        return NO_PARAMETERS
    return params if "type" in params else {**params, "type": "object"}


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    """``{"name": NAME, "arguments": ARGS}``, the keys in that order."""
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             "arguments": arguments_schema(function)},
            "required": ["name", "arguments"], "additionalProperties": False}


def required_call_grammar(functions: list[dict[str, Any]], parallel: bool) -> str:
    """After the seed ``<tool_call>\\n``: calls of ``functions`` (module docstring)."""
    rules = [f"fn{i}: {lark_json(_call_schema(f))}" for i, f in enumerate(functions)]
    alternatives = " | ".join(f"fn{i}" for i in range(len(functions)))
    start = f"start: call ({lark_literal(NEXT_CALL)} call)*" if parallel else "start: call"
    return "\n".join([start, f"call: ({alternatives}) {lark_literal(CALL_END)}", *rules]) + "\n"


def named_call_grammar(function: dict[str, Any]) -> str:
    """After the seed ``...{"name": NAME, "arguments": ``: the arguments and the end of the call."""
    return (f"start: args {lark_literal('}' + CALL_END)}\n"
            f"args: {lark_json(arguments_schema(function))}\n")


def response_format_schema(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """The JSON schema ``response_format`` asks for; None for plain text.
    Raises the 400 of a malformed ``response_format``."""
    fmt = (response_format or {}).get("type", "text")
    if fmt == "text":
        return None
    if fmt == "json_object":
        return {"type": "object"}
    if fmt == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise bad("response_format.json_schema: required for type 'json_schema' (an object with a 'schema')",
                      "response_format")
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            got = "missing" if schema is None else f"a {type(schema).__name__}"
            raise bad(f"response_format.json_schema.schema must be a JSON schema object (got {got})",
                      "response_format")
        return schema
    raise bad(f"response_format type {clip(str(fmt))!r} is not supported (use 'text', 'json_object' or "
              f"'json_schema')", "response_format", "unsupported_value")


def tool_call_grammar(tokenizer, tools: list[dict[str, Any]], tool_choice: Any, parallel: bool) -> Grammar:
    """The compiled grammar of a forced tool call (``tool_choice``
    ``"required"`` or a named function; ``tools``: OpenAI tool dicts);
    ``tokenizer``: a :class:`megac.grammar.GrammarTokenizer`."""
    functions = [t["function"] for t in tools]
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        index = next(i for i, f in enumerate(functions) if f["name"] == name)
        candidates = [(index, functions[index])]
        text = named_call_grammar(functions[index])
    else:
        candidates = list(enumerate(functions))
        text = required_call_grammar(functions, parallel)
    try:
        return tokenizer.compile(text)
    except GrammarError as err:
        # name the function whose parameters broke it
        for i, f in candidates:
            why = tokenizer.schema_error(arguments_schema(f))
            if why:
                raise bad(f"tools[{i}].function.parameters: invalid JSON schema for function "
                          f"{clip(f['name'])!r}: {_one_line(why)}", "tools")
        raise bad(f"tools: the declared functions cannot be compiled into a tool-call grammar: "
                  f"{_one_line(err.message)}", "tools")


def response_format_grammar(tokenizer, schema: dict[str, Any]) -> Grammar:
    """The compiled grammar of one JSON value valid against ``schema``."""
    try:
        return tokenizer.compile(json_grammar(schema))
    except GrammarError as err:
        why = tokenizer.schema_error(schema) or err.message
        raise bad(f"response_format.json_schema.schema: invalid JSON schema: {_one_line(why)}", "response_format")


def _one_line(message: str) -> str:
    """A compiler message on one line, clipped (a regex error spans lines)."""
    return clip(" ".join(message.split()), 300)


__all__ = ["CALL_END", "NEXT_CALL", "NO_PARAMETERS", "arguments_schema", "named_call_grammar",
           "required_call_grammar", "response_format_grammar", "response_format_schema", "tool_call_grammar"]

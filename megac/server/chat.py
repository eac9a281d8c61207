"""Tokenizers and chat templates for the server.

Tokenizers
    :class:`Tokenizer` wraps either a transformers tokenizer (a GGUF's, a
    checkpoint directory's, or ``--tokenizer DIR``) or the built-in
    :class:`ByteTokenizer`, so the engine and the API see one interface:
    ``encode``, ``decode``, ``token_strs``, ``chat_template``, special tokens.

    :class:`ByteTokenizer` is the fallback for random-weight models that come
    without a tokenizer (``megac serve tiny-llama --random-weights``): token
    id = UTF-8 byte value (ids 0..255, needs ``vocab_size >= 256``); the
    spec's BOS / EOS ids are special tokens (``<s>``, ``</s>``) that decoding
    skips; ids >= 256 decode to nothing. Its chat template is plain-text
    ChatML. Output of a random model is random bytes, usually invalid UTF-8,
    which decodes to U+FFFD characters.

Chat templates
    Templates are rendered here with a sandboxed Jinja environment (the same
    conventions as transformers' ``apply_chat_template``: ``trim_blocks``,
    ``lstrip_blocks``, ``raise_exception``, a ``tojson`` filter), then
    tokenised without adding special tokens. A template error is the client's
    (400).

    Tools: when the request has ``tools`` (and ``tool_choice`` is not
    ``none``), or its history has tool calls or tool results, and the model's
    template does not mention ``tools`` (SmolLM2's ChatML template ignores
    them), :data:`TOOL_CHATML_TEMPLATE` is used instead: a system block
    listing the tools as JSON and asking for
    ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (Hermes
    style, what :class:`megac.server.tools.HermesToolParser` reads), past
    assistant tool calls rendered the same way, tool results as
    ``<tool_response>`` user turns. ``tool_choice`` ``required`` and a named
    function add an instruction and **seed** the assistant turn
    (``<tool_call>\\n`` resp. ``<tool_call>\\n{"name": "NAME", "arguments": ``):
    grammar-free forcing; the seed is part of the prompt and the tool parser
    is primed with it.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from megac.errors import MegacError

log = logging.getLogger("megac.server")

# ---------------------------------------------------------------------------- tokenizers

PLAIN_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ByteTokenizer:
    """Byte-level fallback tokenizer (see the module docstring)."""

    def __init__(self, vocab_size: int, bos_token_id: int | None = None, eos_token_ids: Sequence[int] = ()) -> None:
        if vocab_size < 256:
            raise MegacError(f"the byte-level tokenizer needs vocab_size >= 256 (the model has {vocab_size}); "
                             f"pass --tokenizer DIR")
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        self.special = {i: "<s>" for i in ([bos_token_id] if bos_token_id is not None else [])}
        self.special.update({i: "</s>" for i in self.eos_token_ids})
        self.chat_template = PLAIN_CHATML_TEMPLATE

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        if add_special_tokens and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for t in ids:
            t = int(t)
            if t in self.special:
                if not skip_special_tokens:
                    out += self.special[t].encode()
            elif 0 <= t < 256:
                out.append(t)
        return out.decode("utf-8", errors="replace")

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        return [self.special.get(int(t), bytes([int(t)]).decode("latin-1") if 0 <= int(t) < 256 else f"<{t}>")
                for t in ids]


class Tokenizer:
    """One interface over a transformers tokenizer or :class:`ByteTokenizer`."""

    def __init__(self, impl: Any, *, eos_token_ids: Sequence[int] = (), kind: str | None = None) -> None:
        self.impl = impl
        # transformers' fast tokenizers are not safe to share between threads
        # (the API encodes while the engine thread decodes)
        self._lock = threading.Lock()
        self.kind = kind or ("byte" if isinstance(impl, ByteTokenizer) else "hf")
        eos = set(int(t) for t in eos_token_ids)
        impl_eos = getattr(impl, "eos_token_id", None)
        if impl_eos is not None:
            eos.add(int(impl_eos))
        self.eos_token_ids = sorted(eos)
        self.chat_template: str | None = getattr(impl, "chat_template", None) or None
        self._grammar_tokenizers: dict = {}  # model vocab size -> megac.grammar.GrammarTokenizer
        if self.kind == "byte":
            self.bos_token, self.eos_token = "<s>", "</s>"
        else:
            self.bos_token = getattr(impl, "bos_token", None) or ""
            self.eos_token = getattr(impl, "eos_token", None) or ""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        with self._lock:
            return list(self.impl.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        with self._lock:
            return self.impl.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        with self._lock:
            if self.kind == "byte":
                return self.impl.token_strs(ids)
            return [str(t) for t in self.impl.convert_ids_to_tokens(list(ids))]

    def copy(self) -> "Tokenizer":
        """An independent copy with its own lock. The server tokenizes
        requests on a copy so that a 10 MB prompt being tokenized never makes
        the engine thread, which detokenizes the running streams on the
        original, wait for the lock."""
        impl = self.impl
        if self.kind != "byte":  # the byte tokenizer holds no mutable state
            try:
                impl = copy.deepcopy(self.impl)
            except Exception as err:  # noqa: BLE001 -- sharing one tokenizer is slower, not wrong
                log.warning("could not copy the tokenizer (%s: %s); requests share the engine's", type(err).__name__,
                            err)
                return self
        twin = Tokenizer(impl, eos_token_ids=self.eos_token_ids, kind=self.kind)
        twin.chat_template = self.chat_template
        return twin

    @property
    def max_token_bytes(self) -> int | None:
        """Most bytes of input text one token can stand for; ``None`` where
        that bounds nothing (see :mod:`megac.server.prompt_length`).

        Byte tokenizer: 1. A transformers tokenizer: only a byte-level one
        without a normalizer (SmolLM2's, GPT-2's, Llama 3's): every input byte
        is one character of a vocabulary string, so a token's string is at
        least as many UTF-8 bytes as the text it stands for. A normalizer may
        drop or merge characters, and a tokenizer with an unknown token may
        fold any run of unknown text into one, so neither gets a bound."""
        if self.kind == "byte":
            return 1
        if not hasattr(self, "_max_token_bytes"):
            self._max_token_bytes = self._byte_level_longest_token()
        return self._max_token_bytes

    def _byte_level_longest_token(self) -> int | None:
        backend = getattr(self.impl, "backend_tokenizer", None)
        if backend is None or backend.normalizer is not None or "ByteLevel" not in repr(backend.pre_tokenizer):
            return None
        with self._lock:
            vocab = self.impl.get_vocab()
        return max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=None)

    def grammar_tokenizer(self, vocab_size: int):
        """The vocabulary as the grammar library sees it, with its cache of
        compiled grammars (:class:`megac.grammar.GrammarTokenizer`); built once
        per tokenizer and model vocabulary size (~1 s for a 49k BPE)."""
        from megac.grammar import GrammarTokenizer

        cache = self._grammar_tokenizers
        with self._lock:
            if vocab_size not in cache:
                if self.kind == "byte":
                    special = self.impl.special
                    tokens = [special[i].encode() if i in special else bytes([i]) if i < 256 else b""
                              for i in range(self.impl.vocab_size)]
                    cache[vocab_size] = GrammarTokenizer.from_bytes(
                        tokens, vocab_size, sorted(special), self.eos_token_ids, self.impl.bos_token_id, list)
                else:
                    cache[vocab_size] = GrammarTokenizer.from_hf(self.impl, vocab_size, self.eos_token_ids)
            return cache[vocab_size]

    @property
    def template_mentions_tools(self) -> bool:
        return bool(self.chat_template) and "tools" in self.chat_template


# ---------------------------------------------------------------------------- templates

TOOL_CHATML_TEMPLATE = """\
{%- if tools or system_message %}
{{- '<|im_start|>system\\n' }}
{%- if system_message %}{{ system_message }}{% if tools %}{{ '\\n\\n' }}{% endif %}{% endif %}
{%- if tools %}
{{- 'You are a function calling AI model. You are provided with function signatures within <tools></tools> XML tags. You may call one or more functions to assist with the user query. Do not make assumptions about what values to plug into functions.' }}
{%- if tool_instruction %}{{ ' ' + tool_instruction }}{% endif %}
{{- '\\n<tools>\\n' }}
{%- for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}
{{- '</tools>\\nFor each function call, return a JSON object with the function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + (message.content or '') }}
{%- for tc in message.tool_calls or [] %}
{%- if loop.first and message.content %}{{ '\\n' }}{% endif %}
{{- '<tool_call>\\n{\"name\": ' + (tc.function.name | tojson) + ', \"arguments\": ' + tc.function.arguments + '}\\n</tool_call>' }}
{%- if not loop.last %}{{ '\\n' }}{% endif %}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}
"""


def _raise(msg: str):
    raise jinja2.exceptions.TemplateError(msg)


def _tojson(x, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
    return json.dumps(x, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)


_ENV = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
_ENV.filters["tojson"] = _tojson
_ENV.globals["raise_exception"] = _raise


class ChatTemplateError(MegacError):
    """A chat template failed on the request's messages (a client error)."""


@dataclass
class RenderedChat:
    text: str  # the prompt text, seed included
    seed: str  # text appended after the generation prompt (primes the tool parser)
    used_tool_template: bool


def tool_instruction(tool_choice: Any) -> str:
    if tool_choice == "required":
        return "You must call at least one of these functions."
    if isinstance(tool_choice, dict):
        return f"You must call the function {tool_choice['function']['name']}."
    return ""


def tool_seed(tool_choice: Any) -> str:
    if tool_choice == "required":
        return "<tool_call>\n"
    if isinstance(tool_choice, dict):
        return '<tool_call>\n{"name": ' + json.dumps(tool_choice["function"]["name"]) + ', "arguments": '
    return ""


def render_chat(tok: Tokenizer, messages: list[dict], *, tools: list[dict] | None = None,
                tool_choice: Any = None, add_generation_prompt: bool = True,
                chat_template: str | None = None, template_kwargs: dict | None = None) -> RenderedChat:
    """The prompt text of a chat request (see the module docstring).

    ``messages``: dicts with ``role``, ``content`` (str; None for an assistant
    turn that only calls tools), optional ``tool_calls`` (OpenAI shape, with
    ``function.arguments`` a JSON string) and ``tool_call_id``. ``tools``:
    OpenAI tool dicts (``{"type": "function", "function": {...}}``)."""
    template = chat_template or tok.chat_template or PLAIN_CHATML_TEMPLATE
    use_tools = bool(tools) and tool_choice != "none"
    history_tools = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
    model_knows_tools = "tools" in template
    seed = tool_seed(tool_choice) if use_tools else ""
    variables = dict(template_kwargs or {})
    variables.update(bos_token=tok.bos_token, eos_token=tok.eos_token, add_generation_prompt=add_generation_prompt)
    used_tool_template = False
    if (use_tools or history_tools) and not model_knows_tools:
        used_tool_template = True
        template = TOOL_CHATML_TEMPLATE
        system = [m for m in messages if m.get("role") in ("system", "developer")]
        rest = [m for m in messages if m.get("role") not in ("system", "developer")]
        variables.update(
            messages=rest,
            system_message="\n\n".join(str(m.get("content") or "") for m in system),
            tools=[t["function"] for t in tools] if use_tools else [],
            tool_instruction=tool_instruction(tool_choice) if use_tools else "",
        )
    else:
        variables.update(messages=messages)
        if use_tools:
            variables["tools"] = tools
    try:
        text = _ENV.from_string(template).render(**variables)
    except jinja2.exceptions.TemplateError as err:
        raise ChatTemplateError(f"chat template: {err}")
    except (TypeError, KeyError, ValueError, AttributeError) as err:
        raise ChatTemplateError(f"chat template failed on these messages: {type(err).__name__}: {err}")
    return RenderedChat(text + seed if add_generation_prompt else text, seed if add_generation_prompt else "",
                        used_tool_template)


__all__ = [
    "ByteTokenizer",
    "ChatTemplateError",
    "PLAIN_CHATML_TEMPLATE",
    "RenderedChat",
    "TOOL_CHATML_TEMPLATE",
    "Tokenizer",
    "render_chat",
    "tool_seed",
]

"""Request validation and preparation: a parsed chat or completion request
becomes prompt token ids and :class:`~megac.sampling.SamplingParams`
(:class:`Prepared`). A bad request never harms the engine: everything is
validated before a request is queued.

These functions render templates and tokenize, which can take seconds for a
large prompt, and compile structured-output grammars
(:mod:`megac.server.structured`): the server calls them on a worker thread
(:mod:`megac.server.offload`), never on the event loop."""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megac.sampling import SamplingParams
from megac.server import protocol as P
from megac.server.chat import ChatTemplateError, render_chat
from megac.server.errors import bad, clip
from megac.server.prompt_length import context_length_error, refuse_obviously_too_long
from megac.server.state import ServerState
from megac.server.structured import response_format_grammar, response_format_schema, tool_call_grammar
from megac.server.tools import ToolParser

if TYPE_CHECKING:
    from megac.grammar import Grammar


@dataclass
class Prepared:
    kind: str  # chat | completion
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    arrival: float
    created: int = field(default_factory=lambda: int(time.time()))
    tool_parser: ToolParser | None = None
    tool_seed: str = ""
    named_tool: bool = False
    parallel_tool_calls: bool = True
    #: structured output: the grammar the output is held to (a fresh matcher per submission)
    grammar: "Grammar | None" = None
    #: tool_choice required / named: the output is tool calls only, held to their grammar
    forced_tool_calls: bool = False


def _message_dicts(messages: list[P.ChatMessage]) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text":
                    raise bad(f"messages[{i}].content[{j}]: only text parts are supported "
                              f"(got type {clip(part.type)!r})", "messages")
                if part.text is None:
                    raise bad(f"messages[{i}].content[{j}]: content part of type 'text' has no 'text' field",
                              "messages")
                texts.append(part.text)
            content = "\n".join(texts)
        if content is None and not (m.role == "assistant" and m.tool_calls):
            raise bad(f"messages[{i}].content: required for a {m.role} message", "messages")
        d: dict[str, Any] = {"role": m.role, "content": content}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [
                {"id": tc.id or "", "type": "function",
                 "function": {"name": tc.function.name,
                              "arguments": tc.function.arguments if isinstance(tc.function.arguments, str)
                              else json.dumps(tc.function.arguments, ensure_ascii=False)}}
                for tc in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def _sampling_params(state: ServerState, r: P._SamplingRequest, prompt_len: int, max_tokens: int | None,
                     default_max: int) -> SamplingParams:
    vocab = state.spec.vocab_size
    mml = state.max_model_len
    if prompt_len >= mml:
        raise context_length_error(mml, prompt_len, "messages" if isinstance(r, P.ChatCompletionRequest) else "prompt")
    if max_tokens is None:
        max_tokens = min(default_max, mml - prompt_len, max(1, state.engine.max_tokens_fitting(prompt_len)))
    if prompt_len + max_tokens > mml:
        raise bad(f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
                  f"context length is {mml} tokens and your request has {prompt_len} input tokens "
                  f"({max_tokens} > {mml} - {prompt_len}).", "max_tokens", "context_length_exceeded")
    why = state.engine.check_fits(prompt_len + max_tokens)
    if why:
        raise bad(f"request too large for the KV cache: {why}", "max_tokens", "context_length_exceeded")
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"):
        v = getattr(r, name)
        if v is not None and not math.isfinite(v):
            raise bad(f"{name} must be a finite number", name)
    if r.n is not None and r.n != 1:
        raise bad("n > 1 is not supported: send one request per choice", "n", "unsupported_value")
    if r.repetition_penalty not in (None, 1.0):
        raise bad("repetition_penalty is not supported (use presence_penalty / frequency_penalty)",
                  "repetition_penalty", "unsupported_value")
    if r.stream_options is not None and not r.stream:
        raise bad("Stream options can only be defined when `stream=True`.", "stream_options")
    bias = {}
    for k, v in (r.logit_bias or {}).items():
        try:
            t = int(k)
        except ValueError:
            raise bad(f"logit_bias: key {k!r} is not a token id", "logit_bias")
        if not 0 <= t < vocab:
            raise bad(f"logit_bias: token id {t} outside the vocabulary (0..{vocab - 1})", "logit_bias")
        if not math.isfinite(v):
            raise bad("logit_bias values must be finite", "logit_bias")
        bias[t] = max(-100.0, min(100.0, v))
    for t in r.stop_token_ids or []:
        if not 0 <= t < vocab:
            raise bad(f"stop_token_ids: token id {t} outside the vocabulary (0..{vocab - 1})", "stop_token_ids")
    min_tokens = r.min_tokens or 0
    if min_tokens > max_tokens:
        raise bad(f"min_tokens ({min_tokens}) must be <= max_tokens ({max_tokens})", "min_tokens")
    top_k = r.top_k if r.top_k is not None else -1
    return SamplingParams(
        temperature=1.0 if r.temperature is None else r.temperature,
        top_p=1.0 if r.top_p is None else r.top_p,
        top_k=top_k if top_k > 0 else -1,
        min_p=r.min_p or 0.0,
        seed=r.seed,
        presence_penalty=r.presence_penalty or 0.0,
        frequency_penalty=r.frequency_penalty or 0.0,
        logit_bias=bias or None,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop=r.stop_list(),
        stop_token_ids=list(r.stop_token_ids or []),
        ignore_eos=bool(r.ignore_eos),
        include_stop_str_in_output=bool(r.include_stop_str_in_output),
        skip_special_tokens=True if r.skip_special_tokens is None else bool(r.skip_special_tokens),
    )


def prepare_chat(state: ServerState, r: P.ChatCompletionRequest, arrival: float) -> Prepared:
    state.check_model(r.model)
    if r.logprobs or r.top_logprobs:
        raise bad("logprobs are not supported yet", "logprobs", "unsupported_value")
    json_schema = response_format_schema(r.response_format)
    tools = [t.model_dump(exclude_none=True) for t in r.tools] if r.tools is not None else None
    choice: Any = r.tool_choice
    if tools is not None and not tools:
        raise bad("tools must not be empty (omit the field instead)", "tools")
    if isinstance(choice, P.NamedToolChoice):
        if not tools:
            raise bad("tool_choice names a function but no tools were given", "tool_choice")
        names = [t["function"]["name"] for t in tools]
        if choice.function.name not in names:
            raise bad(f"tool_choice: function {clip(choice.function.name)!r} is not in tools "
                      f"({clip(', '.join(names))})", "tool_choice")
        choice = {"type": "function", "function": {"name": choice.function.name}}
    elif choice in ("auto", "required") and not tools:
        raise bad(f"tool_choice {choice!r} needs tools", "tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    messages = _message_dicts(r.messages)
    try:
        rendered = render_chat(state.request_tokenizer, messages, tools=tools, tool_choice=choice,
                               add_generation_prompt=r.add_generation_prompt is not False,
                               chat_template=state.chat_template, template_kwargs=r.chat_template_kwargs)
    except ChatTemplateError as err:
        raise bad(err.message, "messages")
    refuse_obviously_too_long(state.request_tokenizer, rendered.text, state.max_model_len, "messages")
    prompt_ids = state.request_tokenizer.encode(rendered.text, add_special_tokens=False)
    if not prompt_ids:
        raise bad("the rendered prompt is empty", "messages")
    max_tokens = r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens
    params = _sampling_params(state, r, len(prompt_ids), max_tokens, default_max=state.max_model_len)
    use_tools = bool(tools) and choice != "none"
    parallel = r.parallel_tool_calls is not False
    forced = use_tools and (choice == "required" or isinstance(choice, dict)) and bool(rendered.seed)
    grammar = None
    if forced or json_schema is not None:
        vocabulary = state.request_tokenizer.grammar_tokenizer(state.spec.vocab_size)
        grammar = (tool_call_grammar(vocabulary, tools, choice, parallel) if forced
                   else response_format_grammar(vocabulary, json_schema))
    return Prepared("chat", f"chatcmpl-{uuid.uuid4().hex}", prompt_ids, params, bool(r.stream),
                    bool(r.stream_options and r.stream_options.include_usage), arrival,
                    tool_parser=state.tool_parser if use_tools else None, tool_seed=rendered.seed,
                    named_tool=isinstance(choice, dict), parallel_tool_calls=parallel, grammar=grammar,
                    forced_tool_calls=forced)


def prepare_completion(state: ServerState, r: P.CompletionRequest, arrival: float) -> Prepared:
    state.check_model(r.model)
    if r.echo:
        raise bad("echo is not supported", "echo", "unsupported_value")
    if r.suffix:
        raise bad("suffix is not supported", "suffix", "unsupported_value")
    if r.best_of not in (None, 1):
        raise bad("best_of > 1 is not supported", "best_of", "unsupported_value")
    if r.logprobs is not None:
        raise bad("logprobs are not supported yet", "logprobs", "unsupported_value")
    prompt = r.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad(f"one prompt per request is supported (got {len(prompt)})", "prompt", "unsupported_value")
        prompt = prompt[0]
    if isinstance(prompt, str):
        refuse_obviously_too_long(state.request_tokenizer, prompt, state.max_model_len, "prompt")
        ids = state.request_tokenizer.encode(prompt, add_special_tokens=True)
    else:
        ids = list(prompt)
        vocab = state.spec.vocab_size
        for t in ids:
            if not 0 <= t < vocab:
                raise bad(f"prompt: token id {t} outside the vocabulary (0..{vocab - 1})", "prompt")
    if not ids:
        raise bad("prompt must not be empty", "prompt")
    params = _sampling_params(state, r, len(ids), r.max_tokens, default_max=16)
    return Prepared("completion", f"cmpl-{uuid.uuid4().hex}", ids, params, bool(r.stream),
                    bool(r.stream_options and r.stream_options.include_usage), arrival)


__all__ = ["Prepared", "prepare_chat", "prepare_completion"]

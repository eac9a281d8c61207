"""The OpenAI-compatible HTTP server (FastAPI) in front of the engine.

Routes
    ``POST /v1/chat/completions``, ``POST /v1/completions`` (SSE streaming or
    not), ``GET /v1/models``, ``GET /health`` (503 until the model is loaded
    and one warm-up request went through the engine; 503 again if the engine
    died), ``GET /metrics`` (Prometheus, :mod:`megac.server.metrics`),
    ``POST /tokenize`` + ``/v1/tokenize``, ``POST /detokenize`` +
    ``/v1/detokenize``, ``GET /version``.

Streaming (``data: <json>\\n\\n`` events, then ``data: [DONE]``): chat sends
a role chunk ``{"role": "assistant", "content": ""}`` with the first
output, then content (or tool-call) deltas, then a chunk with
``finish_reason``, then, with ``stream_options.include_usage``, a chunk
with ``choices: []`` and ``usage``. An error after the stream started is
sent as ``data: {"error": {...}}`` before ``[DONE]``.

Errors use the OpenAI envelope ``{"error": {"message", "type", "param",
"code"}}``: 400 ``invalid_request_error`` for every client mistake
(malformed JSON, wrong types, out-of-range values, context overflow,
unsupported options such as ``n > 1``), 404 ``not_found_error`` for an
unknown model (``code: model_not_found``) or route, 401
``authentication_error`` with ``--api-key`` (checked on ``/v1/*``), 503
while loading, 500 only for server faults. A bad request never harms the
engine: everything is validated before a request is queued.

A client that disconnects (streaming or not) aborts its request; the engine
frees its KV blocks at the next iteration.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from megac.engine.request import EngineOutput, Request
from megac.errors import MegacError
from megac.sampling import SamplingParams
from megac.server import protocol as P
from megac.server.chat import ChatTemplateError, Tokenizer, render_chat
from megac.server.metrics import CONTENT_TYPE, ServerMetrics
from megac.server.tools import ToolParser, get_tool_parser, parser_for_family

log = logging.getLogger("megac.server")

VERSION = "0.1.0"


# ---------------------------------------------------------------------------- configuration


@dataclass
class ServeConfig:
    """Every ``megac serve`` option (see :mod:`megac.server.cli`)."""

    model: str | None = None
    backend: str = "auto"
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch_size: int = 16
    max_model_len: int | None = None
    served_model_name: str | None = None
    api_key: str | None = None
    dtype: str = "float32"
    weights: str | None = None
    random_weights: bool = False
    seed: int = 0
    tokenizer: str | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    prefill_chunk: int | None = None
    max_num_batched_tokens: int | None = None
    prefix_caching: bool = True
    tool_call_parser: str | None = None
    chat_template: str | None = None
    log_stats_interval: float = 10.0
    log_level: str = "info"
    #: torch intra-op threads (OpenMP). 1 by default: on a small shared CPU a
    #: 2-thread OpenMP team stalls whenever the other core is busy (measured:
    #: SmolLM2 decode 40 ms/step with 1 thread, 1.2-1.6 s/step with 2 under load)
    threads: int = 1


class APIError(Exception):
    """An error answered with the OpenAI envelope."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 500: "internal_server_error",
             501: "not_implemented_error", 503: "service_unavailable_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type_ or self.TYPES.get(status, "invalid_request_error")
        self.code = code or {400: "invalid_request", 401: "invalid_api_key", 404: "not_found",
                             500: "internal_error", 503: "not_ready"}.get(status, str(status))

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


# ---------------------------------------------------------------------------- state


class ServerState:
    """The loaded model, tokenizer and engine (filled by :meth:`load`)."""

    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.ready = False
        self.load_error: str | None = None
        self.engine = None
        self.tokenizer: Tokenizer | None = None
        self.spec = None
        self.served_name = cfg.served_model_name or "megac"
        self.max_model_len = 0
        self.metrics: ServerMetrics | None = None
        self.tool_parser: ToolParser | None = None
        self.chat_template: str | None = None
        self.created = int(time.time())

    # -------------------------------------------------------------- loading

    def load(self) -> None:
        """Load model + tokenizer, build the engine, run one warm-up request."""
        t0 = time.perf_counter()
        cfg = self.cfg
        try:
            if cfg.threads > 0:
                import torch

                torch.set_num_threads(cfg.threads)
            loaded = load_model(cfg)
            self.spec, self.tokenizer = loaded.spec, loaded.tokenizer
            self.served_name = cfg.served_model_name or loaded.name
            self.metrics = ServerMetrics(self.served_name)
            self.engine = build_engine(cfg, loaded, self.metrics)
            self.metrics.engine = self.engine
            self.max_model_len = self.engine.config.max_model_len
            self.tool_parser = (get_tool_parser(cfg.tool_call_parser) if cfg.tool_call_parser
                                else parser_for_family(self.spec.family))
            if cfg.chat_template:
                with open(cfg.chat_template, encoding="utf-8") as f:
                    self.chat_template = f.read()
            self.engine.start()
            self._warm_up()
            # the warm-up request does not count in the metrics
            self.metrics = ServerMetrics(self.served_name)
            self.metrics.engine = self.engine
            self.engine.observer = self.metrics
        except MegacError as err:
            self.load_error = err.message
            log.error("error: %s", err.message)
            return
        except Exception as err:  # noqa: BLE001 -- reported on /health and in the log
            self.load_error = f"{type(err).__name__}: {err}"
            log.exception("loading failed")
            return
        self.ready = True
        log.info("ready in %.1f s: model %s on the %s backend; http://%s:%d/v1 (max_model_len %d, "
                 "max batch %d, %d KV blocks of %d tokens)", time.perf_counter() - t0, self.served_name,
                 self.engine.backend.name, cfg.host, cfg.port, self.max_model_len, self.engine.config.max_batch_size,
                 self.engine.kv.num_blocks, self.engine.kv.block_size)

    def _warm_up(self) -> None:
        done = threading.Event()
        outs: list[EngineOutput] = []

        def sink(out: EngineOutput) -> None:
            outs.append(out)
            if out.finished:
                done.set()

        ids = self.tokenizer.encode("Hello") or [0]
        req = Request(ids[:4], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                      request_id="warmup", tokenizer=self.tokenizer, eos_ids=self.tokenizer.eos_token_ids, sink=sink)
        self.engine.submit(req)
        if not done.wait(600):
            raise MegacError("warm-up request did not finish in 600 s")
        if outs[-1].finish_reason == "error":
            raise MegacError(f"warm-up request failed: {outs[-1].error}")

    # -------------------------------------------------------------- checks

    def require_ready(self) -> None:
        if self.load_error:
            raise APIError(503, f"the model failed to load: {self.load_error}")
        if not self.ready:
            raise APIError(503, "the model is still loading; retry when GET /health answers 200")
        if self.engine.dead:
            raise APIError(500, f"the engine stopped: {self.engine.dead}", code="engine_dead")

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_name:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


# ---------------------------------------------------------------------------- request preparation


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


def _message_dicts(messages: list[P.ChatMessage]) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad(f"messages[{i}].content: only text parts are supported (got type {part.type!r})",
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
        raise bad(f"This model's maximum context length is {mml} tokens. However, your request has "
                  f"{prompt_len} input tokens. Please reduce the length of the input.",
                  "messages" if isinstance(r, P.ChatCompletionRequest) else "prompt", "context_length_exceeded")
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
    fmt = (r.response_format or {}).get("type", "text")
    if fmt != "text":
        raise bad(f"response_format type {fmt!r} is not supported (only 'text'; no constrained decoding yet)",
                  "response_format", "unsupported_value")
    tools = [t.model_dump(exclude_none=True) for t in r.tools] if r.tools is not None else None
    choice: Any = r.tool_choice
    if tools is not None and not tools:
        raise bad("tools must not be empty (omit the field instead)", "tools")
    if isinstance(choice, P.NamedToolChoice):
        if not tools:
            raise bad("tool_choice names a function but no tools were given", "tool_choice")
        names = [t["function"]["name"] for t in tools]
        if choice.function.name not in names:
            raise bad(f"tool_choice: function {choice.function.name!r} is not in tools ({', '.join(names)})",
                      "tool_choice")
        choice = {"type": "function", "function": {"name": choice.function.name}}
    elif choice in ("auto", "required") and not tools:
        raise bad(f"tool_choice {choice!r} needs tools", "tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    messages = _message_dicts(r.messages)
    try:
        rendered = render_chat(state.tokenizer, messages, tools=tools, tool_choice=choice,
                               add_generation_prompt=r.add_generation_prompt is not False,
                               chat_template=state.chat_template, template_kwargs=r.chat_template_kwargs)
    except ChatTemplateError as err:
        raise bad(err.message, "messages")
    prompt_ids = state.tokenizer.encode(rendered.text, add_special_tokens=False)
    if not prompt_ids:
        raise bad("the rendered prompt is empty", "messages")
    max_tokens = r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens
    params = _sampling_params(state, r, len(prompt_ids), max_tokens, default_max=state.max_model_len)
    use_tools = bool(tools) and choice != "none"
    return Prepared("chat", f"chatcmpl-{uuid.uuid4().hex}", prompt_ids, params, bool(r.stream),
                    bool(r.stream_options and r.stream_options.include_usage), arrival,
                    tool_parser=state.tool_parser if use_tools else None, tool_seed=rendered.seed,
                    named_tool=isinstance(choice, dict), parallel_tool_calls=r.parallel_tool_calls is not False)


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
        ids = state.tokenizer.encode(prompt, add_special_tokens=True)
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


# ---------------------------------------------------------------------------- running a request


class ClientGone(Exception):
    """The client of a non-streaming request disconnected (answered 499,
    which nobody reads)."""


class _Submitted:
    def __init__(self, state: ServerState, prep: Prepared) -> None:
        self.state = state
        self.prep = prep
        self.queue: asyncio.Queue[EngineOutput] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def sink(out: EngineOutput) -> None:
            try:
                loop.call_soon_threadsafe(self.queue.put_nowait, out)
            except RuntimeError:  # the loop is gone (shutdown)
                pass

        self.req = Request(prep.prompt_ids, prep.params, request_id=prep.request_id, tokenizer=state.tokenizer,
                           eos_ids=state.tokenizer.eos_token_ids, sink=sink, arrival_time=prep.arrival)
        self.finished = False
        try:
            state.engine.submit(self.req)
        except MegacError as err:
            raise APIError(500, err.message, code="engine_dead")

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.state.engine.abort(self.req.id)
            log.info("request %s aborted (client went away)", self.req.id)

    async def events(self) -> AsyncIterator[EngineOutput]:
        while not self.finished:
            out = await self.queue.get()
            if out.finished:
                self.finished = True
            yield out

    async def collect(self, http: HTTPRequest) -> list[EngineOutput]:
        """All events of a non-streaming request (polls for a disconnect)."""
        outs: list[EngineOutput] = []
        last_check = time.monotonic()
        while True:
            try:
                out = await asyncio.wait_for(self.queue.get(), timeout=0.5)
            except asyncio.TimeoutError:
                out = None
            if time.monotonic() - last_check >= 0.5:
                last_check = time.monotonic()
                if await http.is_disconnected():
                    self.abort()
                    raise ClientGone()
            if out is None:
                continue
            outs.append(out)
            if out.finished:
                self.finished = True
                return outs


def _usage(out: EngineOutput) -> dict:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _finish_reason(prep: Prepared, reason: str | None, had_calls: bool) -> str | None:
    if had_calls and reason == "stop" and not prep.named_tool:
        return "tool_calls"
    return reason


def _engine_error(out: EngineOutput) -> APIError:
    return APIError(500, f"generation failed: {out.error or 'engine error'}", code="engine_error")


async def chat_full(state: ServerState, prep: Prepared, http: HTTPRequest) -> dict:
    sub = _Submitted(state, prep)
    outs = await sub.collect(http)
    last = outs[-1]
    if last.finish_reason == "error":
        raise _engine_error(last)
    text = "".join(o.text for o in outs)
    content: str | None = text
    calls = []
    if prep.tool_parser is not None:
        content, parsed = prep.tool_parser.parse(text, prefix=prep.tool_seed)
        if not prep.parallel_tool_calls:
            parsed = parsed[:1]
        calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for c in parsed]
        if calls and not content.strip():
            content = None
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return {
        "id": prep.request_id, "object": "chat.completion", "created": prep.created, "model": state.served_name,
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": _finish_reason(prep, last.finish_reason, bool(calls)),
                     "stop_reason": last.stop_reason}],
        "usage": _usage(last),
    }


async def chat_stream(state: ServerState, prep: Prepared, sub: _Submitted) -> AsyncIterator[str]:
    base = {"id": prep.request_id, "object": "chat.completion.chunk", "created": prep.created,
            "model": state.served_name}

    def chunk(delta: dict, finish: str | None = None, stop_reason=None) -> str:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop_reason
        return _sse({**base, "choices": [choice]})

    parser = prep.tool_parser.stream(prep.tool_seed) if prep.tool_parser is not None else None
    calls_sent: set[int] = set()
    first = True
    try:
        async for out in sub.events():
            if first:
                first = False
                yield chunk({"role": "assistant", "content": ""})
            if out.finish_reason == "error":
                yield _sse(_engine_error(out).body())
                break
            if parser is None:
                if out.text:
                    yield chunk({"content": out.text})
            else:
                pd = parser.feed(out.text)
                if out.finished:
                    pd.extend(parser.finish())
                if pd.content:
                    yield chunk({"content": pd.content})
                for d in pd.tool_calls:
                    if not prep.parallel_tool_calls and d.index > 0:
                        continue
                    tc: dict[str, Any] = {"index": d.index}
                    if d.id is not None:
                        calls_sent.add(d.index)
                        tc.update(id=d.id, type="function", function={"name": d.name, "arguments": ""})
                    else:
                        tc["function"] = {"arguments": d.arguments}
                    yield chunk({"tool_calls": [tc]})
            if out.finished:
                reason = _finish_reason(prep, out.finish_reason, bool(calls_sent))
                yield chunk({}, reason, out.stop_reason)
                if prep.include_usage:
                    yield _sse({**base, "choices": [], "usage": _usage(out)})
        yield "data: [DONE]\n\n"
    finally:
        sub.abort()


async def completion_full(state: ServerState, prep: Prepared, http: HTTPRequest) -> dict:
    sub = _Submitted(state, prep)
    outs = await sub.collect(http)
    last = outs[-1]
    if last.finish_reason == "error":
        raise _engine_error(last)
    return {
        "id": prep.request_id, "object": "text_completion", "created": prep.created, "model": state.served_name,
        "choices": [{"index": 0, "text": "".join(o.text for o in outs), "logprobs": None,
                     "finish_reason": last.finish_reason, "stop_reason": last.stop_reason}],
        "usage": _usage(last),
    }


async def completion_stream(state: ServerState, prep: Prepared, sub: _Submitted) -> AsyncIterator[str]:
    base = {"id": prep.request_id, "object": "text_completion", "created": prep.created, "model": state.served_name}
    try:
        async for out in sub.events():
            if out.finish_reason == "error":
                yield _sse(_engine_error(out).body())
                break
            if out.text and not out.finished:
                yield _sse({**base, "choices": [{"index": 0, "text": out.text, "logprobs": None,
                                                 "finish_reason": None}]})
            if out.finished:
                yield _sse({**base, "choices": [{"index": 0, "text": out.text, "logprobs": None,
                                                 "finish_reason": out.finish_reason,
                                                 "stop_reason": out.stop_reason}]})
                if prep.include_usage:
                    yield _sse({**base, "choices": [], "usage": _usage(out)})
        yield "data: [DONE]\n\n"
    finally:
        sub.abort()


# ---------------------------------------------------------------------------- the app


async def _body(http: HTTPRequest) -> bytes:
    ctype = http.headers.get("content-type", "application/json")
    if "json" not in ctype.lower():
        raise bad(f"Content-Type must be application/json (got {ctype})", None, "invalid_content_type")
    return await http.body()


def _parse(cls, body: bytes):
    try:
        model = P.parse_request(cls, body)
    except ValidationError as err:
        msg, param = P.describe_validation_error(err)
        raise bad(msg, param, "invalid_json" if param is None and "JSON" in msg else "invalid_value")
    extra = P.unknown_fields(model)
    if extra:
        log.info("ignored unknown request fields: %s", ", ".join(extra))
    return model


def _sse_response(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def create_app(cfg: ServeConfig, state: ServerState | None = None, *, load: bool = True) -> FastAPI:
    """The FastAPI app; with ``load`` the model loads in a background thread
    at startup (``/health`` answers 503 until it is ready)."""
    state = state or ServerState(cfg)
    stats_task: list[asyncio.Task] = []

    async def lifespan(app: FastAPI):
        if load:
            threading.Thread(target=state.load, name="megac-loader", daemon=True).start()
        if cfg.log_stats_interval > 0:
            stats_task.append(asyncio.create_task(_log_stats(state, cfg.log_stats_interval)))
        yield
        for t in stats_task:
            t.cancel()
        if state.engine is not None:
            state.engine.shutdown()

    app = FastAPI(title="megac", version=VERSION, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.megac = state

    @app.exception_handler(APIError)
    async def _api_error(_req, err: APIError):
        return err.response()

    @app.exception_handler(ClientGone)
    async def _gone(_req, _err: ClientGone):
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req, err: RequestValidationError):
        return APIError(400, f"invalid request: {err.errors()[:3]}").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req, err: StarletteHTTPException):
        return APIError(err.status_code, str(err.detail), code=str(err.status_code)).response()

    @app.exception_handler(Exception)
    async def _internal(_req, err: Exception):
        log.exception("internal error")
        return APIError(500, f"internal server error: {type(err).__name__}: {err}").response()

    app.add_middleware(_AuthAndCount, state=state, api_key=cfg.api_key)

    @app.get("/health")
    async def health():
        if state.load_error:
            return APIError(503, f"the model failed to load: {state.load_error}").response()
        if not state.ready:
            return APIError(503, "loading").response()
        if state.engine.dead:
            return APIError(503, f"the engine stopped: {state.engine.dead}").response()
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.get("/metrics")
    async def metrics():
        if state.metrics is None:
            return PlainTextResponse("", media_type=CONTENT_TYPE)
        return PlainTextResponse(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        state.require_ready()
        return {"object": "list", "data": [{
            "id": state.served_name, "object": "model", "created": state.created, "owned_by": "megac",
            "root": state.cfg.model or state.spec.name, "parent": None, "max_model_len": state.max_model_len}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        arrival = time.monotonic()
        state.require_ready()
        r = _parse(P.ChatCompletionRequest, await _body(http))
        prep = prepare_chat(state, r, arrival)
        if prep.stream:
            return _sse_response(chat_stream(state, prep, _Submitted(state, prep)))
        return JSONResponse(await chat_full(state, prep, http))

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        arrival = time.monotonic()
        state.require_ready()
        r = _parse(P.CompletionRequest, await _body(http))
        prep = prepare_completion(state, r, arrival)
        if prep.stream:
            return _sse_response(completion_stream(state, prep, _Submitted(state, prep)))
        return JSONResponse(await completion_full(state, prep, http))

    async def tokenize(http: HTTPRequest):
        state.require_ready()
        r = _parse(P.TokenizeRequest, await _body(http))
        state.check_model(r.model)
        if (r.prompt is None) == (r.messages is None):
            raise bad("give exactly one of 'prompt' or 'messages'", "prompt")
        if r.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in r.tools] if r.tools else None
            try:
                rendered = render_chat(state.tokenizer, _message_dicts(r.messages), tools=tools,
                                       tool_choice="auto" if tools else "none",
                                       add_generation_prompt=r.add_generation_prompt is not False,
                                       chat_template=state.chat_template)
            except ChatTemplateError as err:
                raise bad(err.message, "messages")
            ids = state.tokenizer.encode(rendered.text, add_special_tokens=False)
        else:
            ids = state.tokenizer.encode(r.prompt, add_special_tokens=r.add_special_tokens is not False)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
        if r.return_token_strs:
            out["token_strs"] = state.tokenizer.token_strs(ids)
        return out

    async def detokenize(http: HTTPRequest):
        state.require_ready()
        r = _parse(P.DetokenizeRequest, await _body(http))
        state.check_model(r.model)
        vocab = state.spec.vocab_size
        for t in r.tokens:
            if not 0 <= t < vocab:
                raise bad(f"tokens: token id {t} outside the vocabulary (0..{vocab - 1})", "tokens")
        return {"prompt": state.tokenizer.decode(r.tokens, skip_special_tokens=False)}

    for path in ("/tokenize", "/v1/tokenize"):
        app.add_api_route(path, tokenize, methods=["POST"])
    for path in ("/detokenize", "/v1/detokenize"):
        app.add_api_route(path, detokenize, methods=["POST"])

    return app


class _AuthAndCount:
    """Pure ASGI middleware (Starlette's ``BaseHTTPMiddleware`` would wrap
    ``receive`` and hide client disconnects): the API key on ``/v1/*``, and
    the per-route HTTP counter."""

    def __init__(self, app, state: ServerState, api_key: str | None) -> None:
        self.app, self.state, self.api_key = app, state, api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if self.api_key and path.startswith("/v1"):
            auth = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
            if auth != f"Bearer {self.api_key}":
                resp = APIError(401, "Unauthorized: invalid or missing API key (send 'Authorization: Bearer KEY')",
                                code="invalid_api_key").response()
                await resp(scope, receive, send)
                _count(self.state, path, 401)
                return
        status = [500]

        async def send_status(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            _count(self.state, path, status[0])


_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/v1/tokenize", "/detokenize",
           "/v1/detokenize", "/health", "/metrics", "/version")


def _count(state: ServerState, path: str, status: int) -> None:
    if state.metrics is not None and path not in ("/metrics", "/health"):
        state.metrics.http_requests.inc(handler=path if path in _ROUTES else "other", status=str(status))


async def _log_stats(state: ServerState, interval: float) -> None:
    """Every ``interval`` s while busy: throughput, queue, KV and prefix-cache use."""
    last_prompt = last_gen = 0.0
    last_t = time.monotonic()
    while True:
        await asyncio.sleep(interval)
        m, e = state.metrics, state.engine
        if m is None or e is None or not state.ready:
            continue
        now = time.monotonic()
        prompt, gen = m.prompt_tokens.total(), m.generation_tokens.total()
        dt = max(1e-9, now - last_t)
        if gen != last_gen or e.num_running or e.num_waiting:
            q, h = m.prefix_queries.total(), m.prefix_hits.total()
            log.info("prompt throughput %.1f tok/s, generation throughput %.1f tok/s, running %d, waiting %d, "
                     "KV blocks %d/%d (%.0f%%), prefix cache hit rate %.0f%%, preemptions %d",
                     (prompt - last_prompt) / dt, (gen - last_gen) / dt, e.num_running, e.num_waiting,
                     e.num_blocks_used, e.kv.num_blocks, 100.0 * e.num_blocks_used / e.kv.num_blocks,
                     100.0 * h / q if q else 0.0, e.num_preemptions)
        last_prompt, last_gen, last_t = prompt, gen, now


# ---------------------------------------------------------------------------- loading


@dataclass
class LoadedModel:
    name: str  # default served name
    spec: Any
    weights: Any
    tokenizer: Tokenizer


def _tokenizer_for(cfg: ServeConfig, spec, default=None) -> Tokenizer:
    """``--tokenizer`` (``byte``, ``smollm2`` or a directory), else ``default``
    (the checkpoint's own), else the byte-level fallback."""
    from megac.loading import load_hf_tokenizer
    from megac.server.chat import ByteTokenizer

    choice = cfg.tokenizer
    if choice is None and default is not None:
        return Tokenizer(default, eos_token_ids=spec.eos_token_ids)
    if choice == "smollm2":
        from megac.weights.gguf import smollm2_gguf_path

        path = smollm2_gguf_path()
        log.info("loading the SmolLM2 tokenizer from %s", path)
        return Tokenizer(load_hf_tokenizer(str(path.parent), gguf_file=path.name), eos_token_ids=spec.eos_token_ids)
    if choice not in (None, "byte"):
        log.info("loading tokenizer %s", choice)
        return Tokenizer(load_hf_tokenizer(choice), eos_token_ids=spec.eos_token_ids)
    log.info("using the built-in byte-level tokenizer (ids 0..255 = bytes; BOS %s, EOS %s)",
             spec.bos_token_id, spec.eos_token_ids)
    return Tokenizer(ByteTokenizer(spec.vocab_size, spec.bos_token_id, spec.eos_token_ids),
                     eos_token_ids=spec.eos_token_ids)


def load_model(cfg: ServeConfig) -> LoadedModel:
    """Resolve MODEL (:mod:`megac.loading`) to spec, weights and the server's tokenizer."""
    from megac.loading import dtype_of
    from megac.loading import load_model as resolve

    t0 = time.perf_counter()
    m = resolve(cfg.model, weights=cfg.weights, random_weights=cfg.random_weights, seed=cfg.seed, dtype=dtype_of(cfg.dtype),
                tokenizer=cfg.tokenizer is None)
    loaded = LoadedModel(m.name, m.spec, m.weights, _tokenizer_for(cfg, m.spec, m.tokenizer))
    log.info("loaded %s in %.1f s: %s", loaded.name, time.perf_counter() - t0, loaded.spec.describe().splitlines()[0])
    return loaded


def build_engine(cfg: ServeConfig, loaded: LoadedModel, observer=None):
    """KV pool, backend and engine for ``loaded`` under ``cfg``."""
    from megac.engine.backend import make_backend
    from megac.engine.scheduler import Engine, EngineConfig
    from megac.kv.paged import PagedKVCache, blocks_for_tokens

    spec, weights = loaded.spec, loaded.weights
    mml = cfg.max_model_len or spec.max_context
    if mml < 2:
        raise MegacError(f"--max-model-len {mml}: must be at least 2")
    if mml > spec.max_context:
        raise MegacError(f"--max-model-len {mml} exceeds the model's max_context {spec.max_context}")
    if cfg.max_batch_size < 1:
        raise MegacError("--max-batch-size must be >= 1")
    bs = spec.target.kv_block_size
    chunk = cfg.prefill_chunk or max(bs, (256 // bs) * bs)
    if chunk < bs or chunk % bs:
        raise MegacError(f"--prefill-chunk {chunk}: must be a positive multiple of the KV block size {bs}")
    per_request = blocks_for_tokens(spec, mml, bs)
    if cfg.num_kv_blocks:
        num_blocks = cfg.num_kv_blocks
    else:
        elem = 2 if cfg.dtype == "bfloat16" else 4
        block_bytes = 2 * bs * spec.num_kv_heads * spec.head_dim * elem
        budget = int(cfg.kv_cache_memory_gb * 2 ** 30) // block_bytes
        num_blocks = max(per_request, min(cfg.max_batch_size * per_request, budget))
    kv = PagedKVCache(spec, max_rows=cfg.max_batch_size, num_blocks=num_blocks, max_context=mml,
                      dtype=weights.dtype, block_size=bs)
    backend = make_backend(cfg.backend, spec, weights, kv, max_batch_size=max(64, cfg.max_batch_size),
                           progress=lambda msg: log.info("compile: %s", msg))
    batch = min(cfg.max_batch_size, backend.max_batch_size)
    if batch < cfg.max_batch_size:
        log.info("max batch size %d -> %d (the most the %s backend runs)", cfg.max_batch_size, batch, backend.name)
    econf = EngineConfig(max_batch_size=batch, max_model_len=mml, chunk_tokens=chunk,
                         prefill_budget=cfg.max_num_batched_tokens or chunk, prefix_caching=cfg.prefix_caching)
    engine = Engine(backend, econf, observer=observer)
    log.info("KV cache: %d blocks of %d tokens (%s; %.1f full-length requests of %d tokens); prefill chunk %d; "
             "prefix caching %s", num_blocks, bs, cfg.dtype, num_blocks / per_request, mml, chunk,
             "on" if engine.prefix_cache.enabled else "off")
    return engine


__all__ = ["APIError", "LoadedModel", "Prepared", "ServeConfig", "ServerState", "build_engine", "create_app",
           "load_model", "prepare_chat", "prepare_completion"]

"""The OpenAI-compatible HTTP server (FastAPI) in front of the engine.

Routes
    ``POST /v1/chat/completions``, ``POST /v1/completions`` (SSE streaming or
    not), ``GET /v1/models`` + ``/v1/models/{id}``, ``GET /health`` (503 until the model is loaded
    and one warm-up request went through the engine; 503 again if the engine
    died), ``GET /metrics`` (Prometheus, :mod:`megac.server.metrics`),
    ``POST /tokenize`` + ``/v1/tokenize``, ``POST /detokenize`` +
    ``/v1/detokenize``, ``GET /version``.

Configuration in :mod:`megac.server.config`, the error envelope in
:mod:`megac.server.errors`, the API key, body limit and HTTP counter in
:mod:`megac.server.guard`, the loaded model and engine in
:mod:`megac.server.state` (built by :mod:`megac.server.startup`), request
validation in :mod:`megac.server.prepare`, answers and SSE streams in
:mod:`megac.server.responses`.

Handlers parse, template, tokenize and detokenize on worker threads
(:mod:`megac.server.offload`): the event loop only moves bytes, so
``/health`` and running streams never wait for a large request.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from megac.server import protocol as P
from megac.server.chat import ChatTemplateError, render_chat
from megac.server.config import ServeConfig
from megac.server.errors import APIError, ClientGone, bad, clip
from megac.server.guard import GuardAndCount
from megac.server.metrics import CONTENT_TYPE
from megac.server.offload import off_loop
from megac.server.openapi_bodies import publish_request_bodies
from megac.server.prepare import _message_dicts, prepare_chat, prepare_completion
from megac.server.responses import (_sse_response, _Submitted, chat_full, chat_stream, completion_full,
                                    completion_stream)
from megac.server.state import ServerState

log = logging.getLogger("megac.server")

VERSION = "0.1.0"


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
        log.info("ignored unknown request fields: %s", clip(", ".join(extra), 500))
    return model


def create_app(cfg: ServeConfig, state: ServerState | None = None, *, load: bool = True) -> FastAPI:
    """The FastAPI app; with ``load`` the model loads in a background thread
    at startup (``/health`` answers 503 until it is ready)."""
    state = state or ServerState(cfg)
    stats_task: list[asyncio.Task] = []

    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()  # the shutdown signal hands work to it
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

    app.add_middleware(GuardAndCount, state=state, api_key=cfg.api_key, max_request_bytes=cfg.max_request_bytes,
                       metrics_without_key=cfg.metrics_without_key)

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
        return {"object": "list", "data": [state.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        state.require_ready()
        state.check_model(model_id)
        return state.model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        arrival = time.monotonic()
        state.require_ready()
        r = await off_loop(_parse, P.ChatCompletionRequest, await _body(http))
        prep = await off_loop(prepare_chat, state, r, arrival)
        if prep.stream:
            return _sse_response(chat_stream(state, prep, _Submitted(state, prep)))
        return JSONResponse(await chat_full(state, prep, http))

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        arrival = time.monotonic()
        state.require_ready()
        r = await off_loop(_parse, P.CompletionRequest, await _body(http))
        prep = await off_loop(prepare_completion, state, r, arrival)
        if prep.stream:
            return _sse_response(completion_stream(state, prep, _Submitted(state, prep)))
        return JSONResponse(await completion_full(state, prep, http))

    async def tokenize(http: HTTPRequest):
        state.require_ready()
        r = await off_loop(_parse, P.TokenizeRequest, await _body(http))
        return await off_loop(_json, _tokenize, state, r)

    async def detokenize(http: HTTPRequest):
        state.require_ready()
        r = await off_loop(_parse, P.DetokenizeRequest, await _body(http))
        return await off_loop(_json, _detokenize, state, r)

    for path in ("/tokenize", "/v1/tokenize"):
        app.add_api_route(path, tokenize, methods=["POST"])
    for path in ("/detokenize", "/v1/detokenize"):
        app.add_api_route(path, detokenize, methods=["POST"])

    publish_request_bodies(app, {
        "/v1/chat/completions": P.ChatCompletionRequest, "/v1/completions": P.CompletionRequest,
        "/tokenize": P.TokenizeRequest, "/v1/tokenize": P.TokenizeRequest,
        "/detokenize": P.DetokenizeRequest, "/v1/detokenize": P.DetokenizeRequest})

    return app


def _json(fn, *args) -> JSONResponse:
    """``fn(*args)`` as a rendered JSON response: a list of millions of token
    ids takes a while to write, which must not happen on the event loop."""
    return JSONResponse(fn(*args))


def _tokenize(state: ServerState, r: P.TokenizeRequest) -> dict[str, Any]:
    state.check_model(r.model)
    if (r.prompt is None) == (r.messages is None):
        raise bad("give exactly one of 'prompt' or 'messages'", "prompt")
    tok = state.request_tokenizer
    if r.messages is not None:
        tools = [t.model_dump(exclude_none=True) for t in r.tools] if r.tools else None
        try:
            rendered = render_chat(tok, _message_dicts(r.messages), tools=tools,
                                   tool_choice="auto" if tools else "none",
                                   add_generation_prompt=r.add_generation_prompt is not False,
                                   chat_template=state.chat_template)
        except ChatTemplateError as err:
            raise bad(err.message, "messages")
        ids = tok.encode(rendered.text, add_special_tokens=False)
    else:
        ids = tok.encode(r.prompt, add_special_tokens=r.add_special_tokens is not False)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
    if r.return_token_strs:
        out["token_strs"] = tok.token_strs(ids)
    return out


def _detokenize(state: ServerState, r: P.DetokenizeRequest) -> dict[str, str]:
    state.check_model(r.model)
    vocab = state.spec.vocab_size
    for t in r.tokens:
        if not 0 <= t < vocab:
            raise bad(f"tokens: token id {t} outside the vocabulary (0..{vocab - 1})", "tokens")
    return {"prompt": state.request_tokenizer.decode(r.tokens, skip_special_tokens=False)}


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
        prompt, gen = m.total("megac:prompt_tokens_total"), m.total("megac:generation_tokens_total")
        dt = max(1e-9, now - last_t)
        if gen != last_gen or e.num_running or e.num_waiting:
            q, h = m.total("megac:prefix_cache_queries_total"), m.total("megac:prefix_cache_hits_total")
            log.info("prompt throughput %.1f tok/s, generation throughput %.1f tok/s, running %d, waiting %d, "
                     "KV blocks %d/%d (%.0f%%), prefix cache hit rate %.0f%%, preemptions %d",
                     (prompt - last_prompt) / dt, (gen - last_gen) / dt, e.num_running, e.num_waiting,
                     e.num_blocks_used, e.kv.num_blocks, 100.0 * e.num_blocks_used / e.kv.num_blocks,
                     100.0 * h / q if q else 0.0, e.num_preemptions)
        last_prompt, last_gen, last_t = prompt, gen, now



__all__ = ["VERSION", "create_app"]

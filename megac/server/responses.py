"""Running a prepared request on the engine and answering it: the full
JSON bodies and the SSE streams of chat and completions.

Streaming (``data: <json>\\n\\n`` events, then ``data: [DONE]``): chat sends
a role chunk ``{"role": "assistant", "content": ""}`` with the first
output, then content (or tool-call) deltas, then a chunk with
``finish_reason``, then, with ``stream_options.include_usage``, a chunk
with ``choices: []`` and ``usage``. An error after the stream started is
sent as ``data: {"error": {...}}`` before ``[DONE]``; so is the shutdown
(SIGTERM): every request in flight ends with a 503 ``server_shutdown``
error, as its last stream event or as its answer.

A client that disconnects (streaming or not) aborts its request; the engine
frees its KV blocks at the next iteration.

Forced tool calls (``tool_choice`` ``required`` or named, held to their
grammar by :mod:`megac.server.structured`): ``content`` is null and
``tool_calls`` holds the calls whose arguments were generated to their end
(so they parse and satisfy the schema); a call cut off by ``max_tokens``
(``finish_reason: "length"``) is left out, so a response cut inside the
first call has ``content: null`` and no ``tool_calls``. A stream sends each
call whole (id, name and arguments in one delta) once its arguments are
complete, so the stream and the full response hold the same calls.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, AsyncIterator

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from megac.engine.request import EngineOutput, Request
from megac.errors import MegacError
from megac.server.errors import APIError, ClientGone, ServerStopping
from megac.server.prepare import Prepared
from megac.server.state import ServerState

log = logging.getLogger("megac.server")

#: queued in place of an engine output when the server shuts down
_STOP = object()


class _Submitted:
    def __init__(self, state: ServerState, prep: Prepared) -> None:
        if state.stopping:
            raise ServerStopping().error
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
                           eos_ids=state.tokenizer.eos_token_ids, sink=sink, arrival_time=prep.arrival,
                           grammar=prep.grammar.matcher() if prep.grammar is not None else None)
        self.finished = False
        try:
            state.engine.submit(self.req)
        except MegacError as err:
            raise APIError(500, err.message, code="engine_dead")
        state.in_flight.add(self)

    def _done(self) -> None:
        self.finished = True
        self.state.in_flight.discard(self)

    def abort(self, why: str = "client went away") -> None:
        if not self.finished:
            self._done()
            self.state.engine.abort(self.req.id)
            log.info("request %s aborted (%s)", self.req.id, why)

    def stop(self) -> None:
        """The server shuts down: the request's reader gets the shutdown
        error next (called on the event loop)."""
        self.queue.put_nowait(_STOP)  # type: ignore[arg-type]

    async def _next(self) -> EngineOutput:
        out = await self.queue.get()
        if out is _STOP:
            self.abort("the server is shutting down")
            raise ServerStopping()
        return out

    async def events(self) -> AsyncIterator[EngineOutput | ServerStopping]:
        """Engine outputs up to the finished one; on shutdown the
        ServerStopping (its error is the stream's last event) instead."""
        while not self.finished:
            try:
                out = await self._next()
            except ServerStopping as stop:
                yield stop
                return
            if out.finished:
                self._done()
            yield out

    async def collect(self, http: HTTPRequest) -> list[EngineOutput]:
        """All events of a non-streaming request (polls for a disconnect); an
        engine failure raises its 500."""
        outs: list[EngineOutput] = []
        last_check = time.monotonic()
        while True:
            try:
                out = await asyncio.wait_for(self._next(), timeout=0.5)
            except asyncio.TimeoutError:
                out = None
            except ServerStopping as stop:
                raise stop.error
            if time.monotonic() - last_check >= 0.5:
                last_check = time.monotonic()
                if await http.is_disconnected():
                    self.abort()
                    raise ClientGone()
            if out is None:
                continue
            outs.append(out)
            if out.finished:
                self._done()
                if out.finish_reason == "error":
                    raise _engine_error(out)
                return outs


def _usage(out: EngineOutput) -> dict:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _sse_response(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


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
    text = "".join(o.text for o in outs)
    content: str | None = text
    calls = []
    if prep.tool_parser is not None:
        content, parsed = prep.tool_parser.parse(text, prefix=prep.tool_seed)
        if prep.forced_tool_calls:
            content, parsed = None, [c for c in parsed if c.complete]
        if not prep.parallel_tool_calls:
            parsed = parsed[:1]
        calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for c in parsed]
        if calls and content is not None and not content.strip():
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
            if isinstance(out, ServerStopping):
                yield _sse(out.error.body())
                break
            if first:
                first = False
                yield chunk({"role": "assistant", "content": ""})
            if out.finish_reason == "error":
                yield _sse(_engine_error(out).body())
                break
            if parser is None:
                if out.text:
                    yield chunk({"content": out.text})
            elif prep.forced_tool_calls:
                parser.feed(out.text)
                if out.finished:
                    parser.finish()
                for i, call in enumerate(parser.tool_calls):
                    if call.complete and i not in calls_sent and (prep.parallel_tool_calls or i == 0):
                        calls_sent.add(i)
                        yield chunk({"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                                     "function": {"name": call.name,
                                                                  "arguments": call.arguments}}]})
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
            if isinstance(out, ServerStopping):
                yield _sse(out.error.body())
                break
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


__all__ = ["chat_full", "chat_stream", "completion_full", "completion_stream"]

"""The ASGI middleware in front of every route: the API key, the request
body limit, and the per-route HTTP counter.

It is pure ASGI: Starlette's ``BaseHTTPMiddleware`` would wrap ``receive``
and hide client disconnects from the streaming routes.

API key (``--api-key``)
    Every route but ``/health`` (load balancers probe it without
    credentials) needs ``Authorization: Bearer KEY``: the API, ``/tokenize``,
    ``/metrics``, ``/openapi.json``, ``/version``, and unknown paths too, so
    that nothing about the server is readable without the key.
    ``--metrics-without-key`` opens ``/metrics`` for scrapers. The scheme is
    matched case-insensitively (RFC 9110 section 11.1: ``bearer`` is as good
    as ``Bearer``) and the key in constant time (``hmac.compare_digest``), so
    the answer's timing does not tell how much of a guessed key was right.

Body limit (``--max-request-bytes``)
    A declared ``Content-Length`` over the limit is answered 413 before a
    byte of the body is read; a body without one (chunked) is counted as it
    arrives and refused (413) as soon as it passes the limit, so an
    oversized body never sits whole in memory.
"""

from __future__ import annotations

import hmac

from megac.server.errors import APIError
from megac.server.state import ServerState

#: paths answered without the API key
OPEN_PATHS = frozenset({"/health"})

#: handler label of the HTTP counter (anything else counts as "other", so a
#: client probing random paths cannot grow the metric without bound)
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/v1/tokenize", "/detokenize",
          "/v1/detokenize", "/health", "/metrics", "/version")


def key_matches(authorization: bytes, key: str) -> bool:
    """Whether an ``Authorization`` header value carries ``key`` as a Bearer token."""
    scheme, _, token = authorization.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    return hmac.compare_digest(token.strip(), key.encode("utf-8"))


def unauthorized() -> APIError:
    return APIError(401, "Unauthorized: invalid or missing API key (send 'Authorization: Bearer KEY')",
                    code="invalid_api_key")


def too_large(limit: int) -> APIError:
    return APIError(413, f"request body too large: the limit is {limit} bytes (megac serve --max-request-bytes)",
                    code="request_too_large")


def _declared_length(headers: dict[bytes, bytes]) -> int | None:
    try:
        return int(headers[b"content-length"])
    except (KeyError, ValueError):
        return None  # absent (chunked) or malformed (the HTTP parser refuses that itself)


class GuardAndCount:
    """API key, body limit and HTTP counter (see the module docstring)."""

    def __init__(self, app, state: ServerState, api_key: str | None, max_request_bytes: int,
                 metrics_without_key: bool = False) -> None:
        self.app, self.state, self.api_key = app, state, api_key
        self.max_request_bytes = max_request_bytes
        self.open_paths = OPEN_PATHS | ({"/metrics"} if metrics_without_key else set())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        headers = dict(scope.get("headers") or [])
        refusal = None
        if self.api_key and path not in self.open_paths and not key_matches(headers.get(b"authorization", b""),
                                                                            self.api_key):
            refusal = unauthorized()
        elif (_declared_length(headers) or 0) > self.max_request_bytes:
            refusal = too_large(self.max_request_bytes)
        if refusal is not None:
            await refusal.response()(scope, receive, send)
            _count(self.state, path, refusal.status)
            return

        limit, received = self.max_request_bytes, 0

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise too_large(limit)  # answered by the app's APIError handler
            return message

        status = [500]

        async def send_status(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, counted_receive, send_status)
        finally:
            _count(self.state, path, status[0])


def _count(state: ServerState, path: str, status: int) -> None:
    if state.metrics is not None and path not in ("/metrics", "/health"):
        state.metrics.count_http(path if path in ROUTES else "other", status)


__all__ = ["GuardAndCount", "OPEN_PATHS", "ROUTES", "key_matches", "too_large", "unauthorized"]

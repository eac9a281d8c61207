"""Errors answered to HTTP clients.

Errors use the OpenAI envelope ``{"error": {"message", "type", "param",
"code"}}``: 400 ``invalid_request_error`` for every client mistake
(malformed JSON, wrong types, out-of-range values, context overflow,
unsupported options such as ``n > 1``), 404 ``not_found_error`` for an
unknown model (``code: model_not_found``) or route, 401
``authentication_error`` with ``--api-key`` (checked on every route but
``/health``), 413 for a body over ``--max-request-bytes``, 503 while loading
and while the server shuts down, 500 only for server faults.

Text the client sent is echoed in a message at most :data:`ECHO_LIMIT`
characters long (:func:`clip`): a 100k-character model name must not come
back whole, nor fill the log.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse


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


ECHO_LIMIT = 100


def clip(text: str, limit: int = ECHO_LIMIT) -> str:
    """``text`` cut to ``limit`` characters, an ellipsis marking the cut."""
    return text if len(text) <= limit else text[:limit - 1] + "…"


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


class ClientGone(Exception):
    """The client of a non-streaming request disconnected (answered 499,
    which nobody reads)."""


class ServerStopping(Exception):
    """The server is shutting down (SIGTERM / SIGINT): a request in flight
    ends with this error (a streamed one as its last SSE event)."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down")
        self.error = APIError(503, "the server is shutting down; retry on another replica or after the restart",
                              code="server_shutdown")


__all__ = ["APIError", "ClientGone", "ECHO_LIMIT", "ServerStopping", "bad", "clip"]

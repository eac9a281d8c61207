"""The middleware in front of every route: the API key guards every route
but /health, and the body limit answers 413 without reading an oversized
body. In-process app (no model): the guard answers before any route runs."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient
from starlette.routing import Route

from megac.server.guard import key_matches
from stub_state import stub_app

KEY = "s3cret-key"


def _paths(app) -> list[tuple[str, str]]:
    """(method, path) of every route of the app, path parameters filled in,
    and paths that exist on no server (they must not tell a stranger that)."""
    out = []
    for r in app.routes:
        if isinstance(r, Route):
            method = sorted(r.methods or {"GET"})[0]
            if method == "HEAD":
                method = "GET"
            out.append((method, r.path.replace("{model_id:path}", "some/model")))
    return out + [("GET", "/docs"), ("GET", "/redoc"), ("GET", "/no-such-route"), ("POST", "/v1/embeddings")]


def _is_401(resp) -> bool:
    if resp.status_code != 401:
        return False
    err = resp.json()["error"]
    assert (err["type"], err["code"]) == ("authentication_error", "invalid_api_key")
    return True


@pytest.mark.parametrize("ready", [False, True], ids=["loading", "ready"])
def test_every_route_but_health_needs_the_key(ready):
    app, _ = stub_app(api_key=KEY, ready=ready)
    paths = _paths(app)
    for must in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/v1/tokenize", "/detokenize",
                 "/v1/detokenize", "/metrics", "/openapi.json", "/version", "/health"):
        assert must in {p for _, p in paths}, must
    c = TestClient(app)
    for method, path in paths:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                        {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"},
                        {"Authorization": f"Bearer {KEY[:-1]}"}):
            resp = c.request(method, path, headers=headers, json={})
            assert _is_401(resp) == (path != "/health"), (method, path, headers, resp.status_code)
        # the right key, in any spelling of the scheme, passes the guard
        for scheme in ("Bearer", "bearer", "BEARER"):
            resp = c.request(method, path, headers={"Authorization": f"{scheme} {KEY}"}, json={})
            assert resp.status_code != 401, (method, path, scheme)


def test_metrics_without_key_opens_only_metrics():
    app, _ = stub_app(api_key=KEY, metrics_without_key=True)
    c = TestClient(app)
    assert c.get("/metrics").status_code == 200
    assert c.get("/health").status_code == 200
    for method, path in _paths(app):
        if path not in ("/metrics", "/health"):
            assert _is_401(c.request(method, path, json={})), path


def test_key_matches():
    assert key_matches(b"Bearer abc", "abc") and key_matches(b"bEaReR abc", "abc")
    assert key_matches(b"  Bearer   abc  ", "abc")
    for header in (b"", b"Bearer", b"Bearer ", b"abc", b"Bearerabc", b"Bearer abcd", b"Bearer ab", b"Token abc",
                   b"Bearer ABC"):
        assert not key_matches(header, "abc"), header
    assert key_matches("Bearer clé".encode(), "clé")


# ------------------------------------------------------------------ body limit

LIMIT = 100_000


async def _call(app, path: str, headers: list[tuple[bytes, bytes]], chunks):
    """Run one raw ASGI request; ``chunks`` yields the body pieces. Returns
    (status, body JSON, number of body pieces the app read)."""
    read = 0
    pieces = iter(chunks)

    async def receive():
        nonlocal read
        try:
            piece, more = next(pieces)
        except StopIteration:
            return {"type": "http.disconnect"}
        read += 1
        return {"type": "http.request", "body": piece, "more_body": more}

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"stub"), (b"content-type", b"application/json"), *headers],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body), read


def _endless(piece: bytes):
    while True:
        yield piece, True


def _assert_413(status, body):
    assert status == 413
    err = body["error"]
    assert (err["type"], err["code"]) == ("invalid_request_error", "request_too_large")
    assert str(LIMIT) in err["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"])
def test_declared_oversized_body_is_refused_unread(path):
    app, _ = stub_app(max_request_bytes=LIMIT)
    status, body, read = asyncio.run(_call(app, path, [(b"content-length", str(LIMIT + 1).encode())],
                                           _endless(b" " * 1000)))
    _assert_413(status, body)
    assert read == 0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_streamed_oversized_body_is_refused_once_past_the_limit(path):
    app, _ = stub_app(max_request_bytes=LIMIT)
    # an endless chunked body: the app must stop reading at the limit
    status, body, read = asyncio.run(_call(app, path, [], _endless(b" " * 1000)))
    _assert_413(status, body)
    assert read == LIMIT // 1000 + 1


def test_body_at_the_limit_is_accepted():
    app, _ = stub_app(max_request_bytes=LIMIT)
    doc = json.dumps({"prompt": "a"}).encode()
    doc = doc[:-1] + b" " * (LIMIT - len(doc)) + b"}"
    assert len(doc) == LIMIT
    status, body, _ = asyncio.run(_call(app, "/tokenize", [(b"content-length", str(LIMIT).encode())],
                                        iter([(doc[:LIMIT // 2], True), (doc[LIMIT // 2:], False)])))
    assert status == 200 and body["count"] == 2, body

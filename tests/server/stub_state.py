"""An in-process app over a stub model: a loaded-looking ``ServerState``
with the byte-level tokenizer (optionally gated: its calls wait for the
test's go-ahead) and a stub engine that answers every request at once with
one token, or never (``answer=False``) so requests stay in flight.

For tests of the HTTP layer that need no real model: which thread does the
work, the API key and body limit, shutdown."""

from __future__ import annotations

import threading

import httpx

from megac.engine.request import EngineOutput
from megac.server.app import create_app
from megac.server.chat import ByteTokenizer, Tokenizer
from megac.server.config import ServeConfig
from megac.server.state import ServerState
from megac.spec import load_spec

#: how long a gated tokenizer waits before it gives up (only reached when the
#: test itself is blocked, i.e. the tokenizer ran on the event loop)
GATE_TIMEOUT = 10.0


class GatedTokenizer(ByteTokenizer):
    """The byte-level tokenizer whose encode / decode wait for :attr:`release`
    (set by the test); :attr:`entered` is set when the first call starts."""

    def __init__(self, gated: bool = True) -> None:
        super().__init__(256, bos_token_id=1, eos_token_ids=[2])
        self.gated = gated
        self.entered = threading.Event()
        self.release = threading.Event()
        self.timed_out = False
        self.calls = 0
        self.threads: set[str] = set()

    def _gate(self) -> None:
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        self.entered.set()
        if self.gated and not self.release.wait(GATE_TIMEOUT):
            self.timed_out = True

    def encode(self, text, add_special_tokens=False):
        self._gate()
        return super().encode(text, add_special_tokens)

    def decode(self, ids, skip_special_tokens=True):
        self._gate()
        return super().decode(ids, skip_special_tokens)


class StubEngine:
    """What the routes use of an engine; ``answer``: finish every request
    at once with the text "ok", else keep it in flight forever."""

    def __init__(self, answer: bool = True) -> None:
        self.answer = answer
        self.dead = None
        self.submitted: list = []
        self.aborted: list[str] = []

    def submit(self, req) -> None:
        self.submitted.append(req)
        if self.answer:
            req.sink(EngineOutput(req.id, text="ok", token_ids=[111], finished=True, finish_reason="length",
                                  prompt_tokens=len(req.prompt_ids), completion_tokens=1))

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def max_tokens_fitting(self, prompt_len: int) -> int:
        return 1 << 20

    def check_fits(self, num_tokens: int) -> None:
        return None

    def shutdown(self) -> None:
        pass


def stub_app(tokenizer: ByteTokenizer | None = None, *, max_model_len: int = 4096, engine: StubEngine | None = None,
             ready: bool = True, **cfg_fields):
    """``(app, state)``: the real app over a stub state (no lifespan needed)."""
    cfg = ServeConfig(model="stub", served_model_name="stub", log_stats_interval=0, **cfg_fields)
    state = ServerState(cfg)
    if ready:
        tok = Tokenizer(tokenizer or GatedTokenizer(gated=False), eos_token_ids=[2])
        state.spec = load_spec("tiny-llama")
        state.tokenizer = state.request_tokenizer = tok
        state.max_model_len = max_model_len
        state.engine = engine or StubEngine()
        state.ready = True
    return create_app(cfg, state, load=False), state


def async_client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://stub", timeout=60)


__all__ = ["GATE_TIMEOUT", "GatedTokenizer", "StubEngine", "async_client", "stub_app"]

"""The server's state: the loaded model, tokenizer and engine, and the
readiness checks of the routes."""

from __future__ import annotations

import logging
import threading
import time

from megac.engine.request import EngineOutput, Request
from megac.errors import MegacError
from megac.sampling import SamplingParams
from megac.server.chat import Tokenizer
from megac.server.config import ServeConfig
from megac.server.errors import APIError, ServerStopping, clip
from megac.server.metrics import ServerMetrics
from megac.server.startup import build_served_engine, load_served_model
from megac.server.tools import ToolParser, get_tool_parser, parser_for_family

log = logging.getLogger("megac.server")


class ServerState:
    """The loaded model, tokenizer and engine (filled by :meth:`load`)."""

    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.ready = False
        self.load_error: str | None = None
        self.engine = None
        self.tokenizer: Tokenizer | None = None  # the engine's (detokenizes the streams)
        self.request_tokenizer: Tokenizer | None = None  # a copy for the request handlers (Tokenizer.copy)
        self.spec = None
        self.served_name = cfg.served_model_name or "megac"
        self.max_model_len = 0
        self.metrics: ServerMetrics | None = None
        self.tool_parser: ToolParser | None = None
        self.chat_template: str | None = None
        self.created = int(time.time())
        #: requests in flight (``responses._Submitted``), told to stop on shutdown
        self.in_flight: set = set()
        self.stopping = False
        self.loop = None  # the server's event loop (set by the app's lifespan)

    # -------------------------------------------------------------- loading

    def load(self) -> None:
        """Load model + tokenizer, build the engine, run one warm-up request."""
        t0 = time.perf_counter()
        cfg = self.cfg
        try:
            if cfg.threads > 0:
                import torch

                torch.set_num_threads(cfg.threads)
            loaded = load_served_model(cfg)
            self.spec, self.tokenizer = loaded.spec, loaded.tokenizer
            self.request_tokenizer = loaded.tokenizer.copy()
            self.served_name = cfg.served_model_name or loaded.name
            self.metrics = ServerMetrics(self.served_name)
            self.engine = build_served_engine(cfg, loaded, self.metrics)
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
                 "max batch %d, %d KV blocks of %d tokens, decode burst %d)", time.perf_counter() - t0,
                 self.served_name, self.engine.backend.name, cfg.host, cfg.port, self.max_model_len,
                 self.engine.config.max_batch_size, self.engine.kv.num_blocks, self.engine.kv.block_size,
                 self.engine.config.decode_burst)

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
        if self.stopping:
            raise ServerStopping().error
        if self.load_error:
            raise APIError(503, f"the model failed to load: {self.load_error}")
        if not self.ready:
            raise APIError(503, "the model is still loading; retry when GET /health answers 200")
        if self.engine.dead:
            raise APIError(500, f"the engine stopped: {self.engine.dead}", code="engine_dead")

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_name:
            raise APIError(404, f"The model `{clip(name)}` does not exist.", param="model", code="model_not_found")

    def model_card(self) -> dict:
        """The ``/v1/models`` entry of the served model."""
        return {"id": self.served_name, "object": "model", "created": self.created, "owned_by": "megac",
                "root": self.cfg.model or self.spec.name, "parent": None, "max_model_len": self.max_model_len}

    # -------------------------------------------------------------- shutdown

    def stop_requests(self) -> None:
        """Shutdown began: every request in flight ends with the shutdown
        error (a stream as its last event), new ones are refused. Runs on
        the event loop."""
        self.stopping = True
        for sub in list(self.in_flight):
            sub.stop()


__all__ = ["ServerState"]

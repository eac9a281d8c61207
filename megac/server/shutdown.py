"""Graceful shutdown of ``megac serve``: on SIGTERM (or Ctrl-C) every
request in flight ends with the 503 ``server_shutdown`` error (a stream as
its last SSE event, before ``[DONE]``), the engine stops, and the log says
``megac serve: stopped``.

uvicorn alone handles the signal by setting ``should_exit``: it stops
listening, waits ``timeout_graceful_shutdown`` seconds for the open
connections, then cancels what is left, so a long stream is cut without a
word. :class:`GracefulServer` also tells every request in flight to stop
the moment the signal arrives, so the connections end well inside the grace
period. uvicorn re-raises the signal once it is done; ``serve`` maps a
re-raised SIGTERM to the same clean exit as Ctrl-C (:func:`exit_like_ctrl_c`)
instead of dying before it logs that it stopped.
"""

from __future__ import annotations

import logging
import signal

import uvicorn

from megac.server.state import ServerState

log = logging.getLogger("megac.server")


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        loop = self.state.loop
        if loop is not None and not self.state.stopping:
            # a signal handler may interrupt the loop anywhere: hand the work to it
            loop.call_soon_threadsafe(self._stop_requests, signal.Signals(sig).name)

    def _stop_requests(self, signame: str) -> None:
        if self.state.stopping:
            return
        log.info("%s: shutting down; %d request(s) in flight end with an error", signame,
                 len(self.state.in_flight))
        self.state.stop_requests()


def exit_like_ctrl_c() -> None:
    """SIGTERM raises KeyboardInterrupt from now on, as SIGINT does."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)


__all__ = ["GracefulServer", "exit_like_ctrl_c"]

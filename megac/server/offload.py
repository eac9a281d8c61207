"""Request work that can take long runs on worker threads, never on the
event loop.

Parsing a large JSON body, rendering a chat template, tokenizing and
detokenizing take about a second per MB of text here; on the event loop
that second would stall ``/health``, every other request and every running
stream. :func:`off_loop` runs such work on a small pool of threads instead.

The pool is bounded (:data:`REQUEST_WORKERS`): a burst of huge requests
queues here rather than taking every core from the engine thread.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")

REQUEST_WORKERS = 4

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=REQUEST_WORKERS, thread_name_prefix="megac-request")
        return _pool


async def off_loop(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on a request worker thread; its exceptions
    (e.g. an ``APIError`` for the client) are raised here."""
    return await asyncio.get_running_loop().run_in_executor(_executor(), functools.partial(fn, *args, **kwargs))


__all__ = ["REQUEST_WORKERS", "off_loop"]

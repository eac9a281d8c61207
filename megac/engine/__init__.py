"""The serving engine: backends (one decode-step interface), requests,
continuous batching with chunked prefill, prefix caching and preemption.

* :mod:`megac.engine.backend` -- ``Backend`` protocol, ``ReferenceBackend``, ``make_backend``
* :mod:`megac.engine.request` -- ``Request`` (state, detokenisation, stop strings)
* :mod:`megac.engine.scheduler` -- ``Engine`` / ``EngineConfig`` (the engine thread)
* :mod:`megac.engine.prefix_cache` -- ``PrefixCache`` (hash chain over full prefill chunks)
"""

from megac.engine.backend import Backend, ReferenceBackend, make_backend
from megac.engine.request import EngineOutput, Request
from megac.engine.scheduler import Engine, EngineConfig, EngineObserver

__all__ = ["Backend", "Engine", "EngineConfig", "EngineObserver", "EngineOutput", "ReferenceBackend", "Request",
           "make_backend"]

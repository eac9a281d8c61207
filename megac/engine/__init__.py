"""The serving engine: continuous batching with chunked prefill, prefix
caching and preemption over one backend (:mod:`megac.runtime.backend`).

* :mod:`megac.engine.request` -- ``Request`` (state, detokenisation, stop strings)
* :mod:`megac.engine.scheduler` -- ``Engine`` / ``EngineConfig`` (the engine thread)
* :mod:`megac.engine.prefix_cache` -- ``PrefixCache`` (hash chain over full prefill chunks)
* :mod:`megac.engine.build` -- ``build_engine``: artifact, KV pool, backend, engine
* :mod:`megac.engine.generate` -- ``generate``: offline generation through the engine
"""

from megac.engine.request import EngineOutput, Request
from megac.engine.scheduler import Engine, EngineConfig, EngineObserver

__all__ = ["Engine", "EngineConfig", "EngineObserver", "EngineOutput", "Request"]

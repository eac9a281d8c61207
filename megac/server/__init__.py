"""The OpenAI-compatible server (``megac serve``) and its load client
(``megac bench-serve``).

* :mod:`megac.server.app` -- FastAPI app, request validation, streaming, model loading
* :mod:`megac.server.protocol` -- pydantic request/response models
* :mod:`megac.server.chat` -- tokenizers (incl. the byte-level fallback) and chat templates
* :mod:`megac.server.tools` -- tool-call parsers (Hermes), streaming
* :mod:`megac.server.metrics` -- Prometheus metrics
* :mod:`megac.server.bench` -- the benchmark client
* :mod:`megac.server.cli` -- the click commands ``serve_cmd`` and ``bench_serve_cmd``
"""

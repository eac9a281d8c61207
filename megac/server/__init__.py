"""The OpenAI-compatible server (``megac serve``) and its load client
(``megac bench-serve``).

* :mod:`megac.server.app` -- FastAPI app: routes, stats log
* :mod:`megac.server.guard` -- middleware: API key, request body limit, HTTP counter
* :mod:`megac.server.offload` -- request work (parse, template, tokenize) on worker threads
* :mod:`megac.server.prompt_length` -- the context-length error; too-long prompts refused before tokenizing
* :mod:`megac.server.shutdown` -- graceful SIGTERM: in-flight requests end with an error event
* :mod:`megac.server.config` -- ``ServeConfig``, every ``megac serve`` option
* :mod:`megac.server.errors` -- ``APIError`` (the OpenAI error envelope), ``bad``, ``ClientGone``
* :mod:`megac.server.state` -- ``ServerState``: loaded model, tokenizer, engine; readiness checks
* :mod:`megac.server.startup` -- model + tokenizer loading (``load_served_model``) and ``build_served_engine``
* :mod:`megac.server.prepare` -- request validation: prompt ids and sampling parameters
* :mod:`megac.server.responses` -- running a request: JSON answers, SSE streams, disconnects
* :mod:`megac.server.protocol` -- pydantic request/response models
* :mod:`megac.server.chat` -- tokenizers (incl. the byte-level fallback) and chat templates
* :mod:`megac.server.tools` -- tool-call parsers (Hermes), streaming
* :mod:`megac.server.structured` -- the grammar of ``response_format`` and of forced tool calls
* :mod:`megac.server.metrics` -- Prometheus metrics
* :mod:`megac.server.bench` -- the benchmark client
* :mod:`megac.server.cli` -- the click commands ``serve_cmd`` and ``bench_serve_cmd``
"""

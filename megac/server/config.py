"""The ``megac serve`` configuration (:class:`ServeConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

#: default ``--max-request-bytes``: far above any prompt a model here can take
#: (North Mini Code's 262144 tokens are about 1 MB of text), small enough that
#: a stray upload is refused before it is read into memory
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024


@dataclass
class ServeConfig:
    """Every ``megac serve`` option (see :mod:`megac.server.cli`)."""

    model: str | None = None
    backend: str = "auto"
    #: wave order of the compiled schedules, and an artifact directory to serve as it is
    order: str = "tuned"
    artifact: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    #: None: the most the backend runs (the largest compiled batch size; 16 for the reference backend)
    max_batch_size: int | None = None
    max_model_len: int | None = None
    served_model_name: str | None = None
    api_key: str | None = None
    #: /metrics without the API key (for Prometheus scrapers)
    metrics_without_key: bool = False
    #: largest request body accepted (413 above it)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    dtype: str = "float32"
    weights: str | None = None
    random_weights: bool = False
    seed: int = 0
    tokenizer: str | None = None
    num_kv_blocks: int | None = None
    #: None: on the GPU gpu_memory_utilization of what the weights leave, on the CPU 1 GiB
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    prefill_chunk: int | None = None
    max_num_batched_tokens: int | None = None
    prefix_caching: bool = True
    #: greedy decode steps run back to back on a steady batch (EngineConfig.decode_burst);
    #: None: megac.engine.build.default_decode_burst (4 on a GPU backend, 1 on the CPU)
    decode_burst: int | None = None
    tool_call_parser: str | None = None
    chat_template: str | None = None
    log_stats_interval: float = 10.0
    log_level: str = "info"
    #: torch intra-op threads (OpenMP). 1 by default: on a small shared CPU a
    #: 2-thread OpenMP team stalls whenever the other core is busy (measured:
    #: SmolLM2 decode 40 ms/step with 1 thread, 1.2-1.6 s/step with 2 under load)
    threads: int = 1


__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "ServeConfig"]

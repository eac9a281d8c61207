"""Loading the served model (spec, weights, the server's tokenizer) and
building the engine around it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from megac.server.chat import Tokenizer
from megac.server.config import ServeConfig

log = logging.getLogger("megac.server")


@dataclass
class ServedModel:
    name: str  # default served name
    spec: Any
    weights: Any
    tokenizer: Tokenizer


def _tokenizer_for(cfg: ServeConfig, spec, default=None) -> Tokenizer:
    """``--tokenizer`` (``byte``, ``smollm2`` or a directory), else ``default``
    (the checkpoint's own), else the byte-level fallback."""
    from megac.loading import load_hf_tokenizer
    from megac.server.chat import ByteTokenizer

    choice = cfg.tokenizer
    if choice is None and default is not None:
        return Tokenizer(default, eos_token_ids=spec.eos_token_ids)
    if choice == "smollm2":
        from megac.weights.gguf import smollm2_gguf_path

        path = smollm2_gguf_path()
        log.info("loading the SmolLM2 tokenizer from %s", path)
        return Tokenizer(load_hf_tokenizer(str(path.parent), gguf_file=path.name), eos_token_ids=spec.eos_token_ids)
    if choice not in (None, "byte"):
        log.info("loading tokenizer %s", choice)
        return Tokenizer(load_hf_tokenizer(choice), eos_token_ids=spec.eos_token_ids)
    log.info("using the built-in byte-level tokenizer (ids 0..255 = bytes; BOS %s, EOS %s)",
             spec.bos_token_id, spec.eos_token_ids)
    return Tokenizer(ByteTokenizer(spec.vocab_size, spec.bos_token_id, spec.eos_token_ids),
                     eos_token_ids=spec.eos_token_ids)


def load_served_model(cfg: ServeConfig) -> ServedModel:
    """Resolve MODEL (:mod:`megac.loading`) to spec, weights and the server's tokenizer."""
    from megac.loading import dtype_of
    from megac.loading import load_model as resolve
    from megac.runtime.backends import random_weights_placement

    t0 = time.perf_counter()
    dtype, device = dtype_of(cfg.dtype), "cpu"
    if cfg.random_weights:
        dtype, device = random_weights_placement(cfg.backend, dtype)
    m = resolve(cfg.model, weights=cfg.weights, random_weights=cfg.random_weights, seed=cfg.seed, dtype=dtype,
                tokenizer=cfg.tokenizer is None, device=device)
    loaded = ServedModel(m.name, m.spec, m.weights, _tokenizer_for(cfg, m.spec, m.tokenizer))
    log.info("loaded %s in %.1f s: %s", loaded.name, time.perf_counter() - t0, loaded.spec.describe().splitlines()[0])
    return loaded


def build_served_engine(cfg: ServeConfig, loaded: ServedModel, observer=None):
    """KV pool, backend and engine for ``loaded`` under ``cfg``
    (:func:`megac.engine.build.build_engine`: the artifact is compiled once
    and cached, or ``--artifact`` is served as it is)."""
    from megac.engine.build import EngineOptions
    from megac.engine.build import build_engine as build

    opts = EngineOptions(backend=cfg.backend, order=cfg.order, artifact=cfg.artifact,
                         max_batch_size=cfg.max_batch_size, max_model_len=cfg.max_model_len,
                         num_kv_blocks=cfg.num_kv_blocks, kv_cache_memory_gb=cfg.kv_cache_memory_gb,
                         gpu_memory_utilization=cfg.gpu_memory_utilization,
                         prefill_chunk=cfg.prefill_chunk, max_num_batched_tokens=cfg.max_num_batched_tokens,
                         prefix_caching=cfg.prefix_caching, decode_burst=cfg.decode_burst)
    return build(loaded.spec, loaded.weights, opts, observer=observer, progress=lambda msg: log.info("%s", msg))


__all__ = ["ServedModel", "build_served_engine", "load_served_model"]

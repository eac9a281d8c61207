"""Loading the served model (spec, weights, the server's tokenizer) and
building the engine around it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from megac.errors import MegacError
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

    t0 = time.perf_counter()
    m = resolve(cfg.model, weights=cfg.weights, random_weights=cfg.random_weights, seed=cfg.seed, dtype=dtype_of(cfg.dtype),
                tokenizer=cfg.tokenizer is None)
    loaded = ServedModel(m.name, m.spec, m.weights, _tokenizer_for(cfg, m.spec, m.tokenizer))
    log.info("loaded %s in %.1f s: %s", loaded.name, time.perf_counter() - t0, loaded.spec.describe().splitlines()[0])
    return loaded


def build_engine(cfg: ServeConfig, loaded: ServedModel, observer=None):
    """KV pool, backend and engine for ``loaded`` under ``cfg``."""
    from megac.engine.backend import make_backend
    from megac.engine.scheduler import Engine, EngineConfig
    from megac.kv.paged import PagedKVCache, blocks_for_tokens

    spec, weights = loaded.spec, loaded.weights
    mml = cfg.max_model_len or spec.max_context
    if mml < 2:
        raise MegacError(f"--max-model-len {mml}: must be at least 2")
    if mml > spec.max_context:
        raise MegacError(f"--max-model-len {mml} exceeds the model's max_context {spec.max_context}")
    if cfg.max_batch_size < 1:
        raise MegacError("--max-batch-size must be >= 1")
    bs = spec.target.kv_block_size
    chunk = cfg.prefill_chunk or max(bs, (256 // bs) * bs)
    if chunk < bs or chunk % bs:
        raise MegacError(f"--prefill-chunk {chunk}: must be a positive multiple of the KV block size {bs}")
    per_request = blocks_for_tokens(spec, mml, bs)
    if cfg.num_kv_blocks:
        num_blocks = cfg.num_kv_blocks
    else:
        elem = 2 if cfg.dtype == "bfloat16" else 4
        block_bytes = 2 * bs * spec.num_kv_heads * spec.head_dim * elem
        budget = int(cfg.kv_cache_memory_gb * 2 ** 30) // block_bytes
        num_blocks = max(per_request, min(cfg.max_batch_size * per_request, budget))
    kv = PagedKVCache(spec, max_rows=cfg.max_batch_size, num_blocks=num_blocks, max_context=mml,
                      dtype=weights.dtype, block_size=bs)
    backend = make_backend(cfg.backend, spec, weights, kv, max_batch_size=max(64, cfg.max_batch_size),
                           progress=lambda msg: log.info("compile: %s", msg))
    batch = min(cfg.max_batch_size, backend.max_batch_size)
    if batch < cfg.max_batch_size:
        log.info("max batch size %d -> %d (the most the %s backend runs)", cfg.max_batch_size, batch, backend.name)
    econf = EngineConfig(max_batch_size=batch, max_model_len=mml, chunk_tokens=chunk,
                         prefill_budget=cfg.max_num_batched_tokens or chunk, prefix_caching=cfg.prefix_caching)
    engine = Engine(backend, econf, observer=observer)
    log.info("KV cache: %d blocks of %d tokens (%s; %.1f full-length requests of %d tokens); prefill chunk %d; "
             "prefix caching %s", num_blocks, bs, cfg.dtype, num_blocks / per_request, mml, chunk,
             "on" if engine.prefix_cache.enabled else "off")
    return engine


__all__ = ["ServedModel", "build_engine", "load_served_model"]

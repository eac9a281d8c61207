"""Build a serving engine for a loaded model: the artifact (compiled or
loaded from the cache), the paged KV pool, the backend and the engine
configuration. ``megac serve`` and ``megac generate`` both come here, so
both run the same schedules through the same generation loop.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from megac.engine.scheduler import Engine, EngineConfig
from megac.errors import MegacError
from megac.geometry import kv_head_major_of
from megac.kv.paged import PagedKVCache, peak_blocks_for_tokens
from megac.runtime.artifacts import load_or_compile
from megac.runtime.backends import make_backend, needs_schedules, resolve_kind, runs_on_gpu
from megac.runtime.schedules import ScheduleSet

log = logging.getLogger("megac.engine")


@dataclass
class EngineOptions:
    backend: str = "auto"
    order: str = "tuned"
    #: a compiled artifact directory to serve (default: compile or load from the cache)
    artifact: str | None = None
    #: most requests decoding at once; None: the most the backend runs (the
    #: largest compiled batch size, or REFERENCE_BATCH for the reference backend)
    max_batch_size: int | None = None
    max_model_len: int | None = None
    #: KV pool size in blocks; default: every row at full length, within the KV budget
    num_kv_blocks: int | None = None
    #: KV budget in GiB; None: on the GPU gpu_memory_utilization of the memory
    #: free once the weights are there, on the CPU DEFAULT_CPU_KV_GB
    kv_cache_memory_gb: float | None = 4.0
    gpu_memory_utilization: float = 0.9
    prefill_chunk: int | None = None
    max_num_batched_tokens: int | None = None
    prefix_caching: bool = True
    #: greedy decode steps run back to back on a steady batch (EngineConfig.decode_burst; 1: off;
    #: None: default_decode_burst, as megac serve leaves it)
    decode_burst: int | None = 1
    #: decode only (``megac bench``): the GPU backends lay out their kernel
    #: copy from the canonical weights and drop them as they go (one copy of
    #: the model at the peak, so batch 8 at 128K fits); prefill then raises
    decode_only: bool = False
    #: cuda only: placements of the task lists and step buffers tried at start, the
    #: fastest kept (megac.gpu.placement: an experiment whose choice did not hold
    #: outside its loop; 0, the first one's, everywhere but the GPU checks)
    placement_trials: int = 0
    #: VM only: fast | checked (interleaved SM queues, happens-before checked)
    mode: str = "fast"
    policy: str = "round_robin"
    seed: int = 0


#: default batch of the reference backend, which runs any batch size
REFERENCE_BATCH = 16
#: prompt tokens per prefill chunk (and prefix-cache granularity) unless
#: --prefill-chunk says otherwise: on the CPU, and on a GPU backend
DEFAULT_PREFILL_CHUNK = 256
DEFAULT_PREFILL_CHUNK_GPU = 1024
#: decode burst when none is given, on a GPU backend (1 elsewhere)
DEFAULT_DECODE_BURST_GPU = 4
#: KV budget on the CPU when none is given
DEFAULT_CPU_KV_GB = 1.0
#: GPU memory kept out of the KV pool for the backend's own buffers (logits,
#: partials, descriptors), the sampler and the allocator's slack
GPU_HEADROOM_BYTES = 1 << 30


def kv_budget_bytes(asked_gb: float | None, free_gpu_bytes: int | None, utilization: float) -> int:
    """Bytes the KV pool may take: ``asked_gb`` when given; else, on the
    GPU (``free_gpu_bytes``: free memory once the weights are loaded),
    ``utilization`` of it less a fixed headroom; else DEFAULT_CPU_KV_GB."""
    if asked_gb is not None:
        return int(asked_gb * 2 ** 30)
    if free_gpu_bytes is None:
        return int(DEFAULT_CPU_KV_GB * 2 ** 30)
    if not 0.0 < utilization <= 1.0:
        raise MegacError(f"--gpu-memory-utilization {utilization}: must be in (0, 1]")
    return max(0, int(free_gpu_bytes * utilization) - GPU_HEADROOM_BYTES)


def fit_max_model_len(spec, asked: int | None, budget_blocks: int, block_size: int) -> int:
    """The longest context one row can hold in ``budget_blocks`` (at most the
    model's max_context): ``asked`` when it fits, else a one-line error; with
    nothing asked, the longest that fits (and at least 2 tokens' worth)."""
    want = asked or spec.max_context
    if peak_blocks_for_tokens(spec, want, block_size) <= budget_blocks:
        return want
    if asked:
        need = peak_blocks_for_tokens(spec, asked, block_size)
        raise MegacError(f"--max-model-len {asked}: one request needs {need} "
                         f"KV blocks, the KV budget holds {budget_blocks}; lower --max-model-len or raise "
                         f"--kv-cache-memory / --gpu-memory-utilization")
    lo, hi = 2, want  # the largest length whose blocks fit (the peak grows with tokens)
    if peak_blocks_for_tokens(spec, lo, block_size) > budget_blocks:
        raise MegacError(f"the KV budget holds {budget_blocks} blocks, less than one request of 2 tokens needs; "
                         f"raise --kv-cache-memory / --gpu-memory-utilization")
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if peak_blocks_for_tokens(spec, mid, block_size) <= budget_blocks else (lo, mid - 1)
    return lo


def batch_size_for(asked: int | None, schedules) -> tuple[int, str | None]:
    """The engine's max batch size and, when it differs from ``asked``, why:
    a backend running compiled schedules decodes at most the largest batch
    size they were compiled for (the target's ``batch_sizes``)."""
    most = ScheduleSet(schedules).max_rows if schedules is not None else None
    if asked is None:
        return (most or REFERENCE_BATCH), None
    if most is not None and asked > most:
        return most, f"max batch size {asked} -> {most} (the largest batch size compiled for this target)"
    return asked, None


def default_prefill_chunk(kind: str, block_size: int) -> int:
    """The prefill chunk when none is given, a multiple of the KV block. On
    the GPU a chunk's cost is mostly the host issuing its ~2000 operations
    (North Mini Code on the H200: 256 tokens in 89 ms, 1024 in 121), so
    larger chunks prefill ~3x faster; the prefix cache's reuse granularity
    coarsens with them (a hit reuses whole chunks only)."""
    want = DEFAULT_PREFILL_CHUNK_GPU if runs_on_gpu(kind) else DEFAULT_PREFILL_CHUNK
    return max(block_size, (want // block_size) * block_size)


def default_decode_burst(kind: str) -> int:
    """The decode burst when none is given: on a GPU backend the burst's
    steps are pipelined, hiding the host part of a step (SmolLM2 serving
    +34-51 % output tok/s on the H200); on the CPU there is nothing to hide,
    and an arrival would only wait longer."""
    return DEFAULT_DECODE_BURST_GPU if runs_on_gpu(kind) else 1


def build_engine(spec, weights, opts: EngineOptions, *, schedules=None, observer=None,
                 progress: Callable[[str], None] | None = None) -> Engine:
    """KV pool, backend and engine for ``spec`` with ``weights`` under ``opts``;
    ``schedules`` (compiled here, e.g. a subset of batch sizes) bypass the
    artifact cache."""
    kind = resolve_kind(opts.backend)
    mml = opts.max_model_len or spec.max_context
    if mml < 2:
        raise MegacError(f"--max-model-len {mml}: must be at least 2")
    if mml > spec.max_context:
        raise MegacError(f"--max-model-len {mml} exceeds the model's max_context {spec.max_context}")
    if opts.max_batch_size is not None and opts.max_batch_size < 1:
        raise MegacError("--max-batch-size must be >= 1")
    bs = spec.target.kv_block_size
    chunk = opts.prefill_chunk or default_prefill_chunk(kind, bs)
    if chunk < bs or chunk % bs:
        raise MegacError(f"--prefill-chunk {chunk}: must be a positive multiple of the KV block size {bs}")
    if opts.placement_trials < 0:
        raise MegacError(f"--placement-trials {opts.placement_trials}: must be >= 0")
    artifact_dir = opts.artifact
    if schedules is None and needs_schedules(kind):
        got = load_or_compile(spec, opts.order, artifact=opts.artifact, progress=progress)
        schedules, artifact_dir = got.schedules, got.path
    elif opts.artifact is not None and not needs_schedules(kind):
        raise MegacError(f"--artifact: the {kind} backend runs no compiled schedules")
    device, free = "cpu", None
    # the megakernel (and the graphs baseline, where a GPU is visible) read
    # bf16 weights and a bf16 KV pool on the GPU: build the pool there, never
    # a host pool first (batch 8 x 128K is ~30 GB)
    if runs_on_gpu(kind):
        import torch

        weights, device = weights.to(torch.bfloat16, "cuda"), "cuda"
        free = int(torch.cuda.mem_get_info()[0])  # what the weights leave for the KV pool
    batch, why = batch_size_for(opts.max_batch_size, schedules)
    if why:
        log.info("%s", why)
    if opts.num_kv_blocks:
        num_blocks = opts.num_kv_blocks
        per_request = peak_blocks_for_tokens(spec, mml, bs)
    else:
        elem = weights.dtype.itemsize
        block_bytes = 2 * bs * spec.num_kv_heads * spec.head_dim * elem
        budget = kv_budget_bytes(opts.kv_cache_memory_gb, free, opts.gpu_memory_utilization) // block_bytes
        if free is not None:
            # on the GPU the pool bounds the context (a pool larger than the
            # budget would not fit): an asked length must fit, and without
            # one the longest that fits is served (and reported by /v1/models)
            fitted = fit_max_model_len(spec, opts.max_model_len, budget, bs)
            if fitted < mml:
                log.info("max model length %d -> %d (what the KV budget of %d blocks holds for one request)",
                         mml, fitted, budget)
            mml = fitted
        per_request = peak_blocks_for_tokens(spec, mml, bs)
        num_blocks = max(per_request, min(batch * per_request, budget))
    # the GPU backends' pool as the model's kv_head_major tile lays it out (the VM's is token-major)
    kv = PagedKVCache(spec, max_rows=batch, num_blocks=num_blocks, max_context=mml,
                      dtype=weights.dtype, block_size=bs, device=device,
                      head_major=runs_on_gpu(kind) and kv_head_major_of(spec))
    t0 = time.perf_counter()
    backend = make_backend(kind, spec, weights, kv, schedules=schedules, artifact_dir=artifact_dir,
                           max_batch_size=max(64, batch), mode=opts.mode, policy=opts.policy, seed=opts.seed,
                           decode_only=opts.decode_only)
    if progress is not None:
        progress(f"{backend.name} backend ready in {time.perf_counter() - t0:.1f} s")
    batch = min(batch, backend.max_batch_size)
    econf = EngineConfig(max_batch_size=batch, max_model_len=mml, chunk_tokens=chunk,
                         prefill_budget=opts.max_num_batched_tokens or chunk, prefix_caching=opts.prefix_caching,
                         decode_burst=default_decode_burst(kind) if opts.decode_burst is None else opts.decode_burst)
    engine = Engine(backend, econf, observer=observer)
    if kind == "cuda" and opts.placement_trials:
        from megac.gpu.placement import tune_engine

        report = tune_engine(engine, opts.placement_trials, progress=progress)
        backend.placement = report
        if report is not None:
            log.info("%s", report.line())
    log.info("KV cache: %d blocks of %d tokens (%s; %.1f full-length requests of %d tokens); prefill chunk %d; "
             "prefix caching %s", num_blocks, bs, str(weights.dtype).replace("torch.", ""), num_blocks / per_request,
             mml, chunk, "on" if engine.prefix_cache.enabled else "off")
    return engine


__all__ = ["DEFAULT_CPU_KV_GB", "GPU_HEADROOM_BYTES", "REFERENCE_BATCH", "EngineOptions", "batch_size_for",
           "build_engine", "fit_max_model_len", "kv_budget_bytes"]

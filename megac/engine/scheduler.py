"""The engine: continuous batching over one backend, in one thread.

Each iteration (``Engine.step``):

1. take new requests and aborts from the inbox (thread-safe; the API's
   asyncio loop submits);
2. **admit** waiting requests first-come first-served while a KV row is free
   (at most ``max_batch_size`` running) and the pool can hold the request's
   tokens so far plus one (free blocks + evictable prefix-cache blocks, plus a
   small watermark); a first admission attaches the longest cached prompt
   prefix (:mod:`megac.engine.prefix_cache`);
3. **decode**: every running request past its prompt feeds one token: the
   last sampled one (DECODE: the logits are sampled) or, after a preemption,
   the next already-generated one (REPLAY: the logits are dropped). Slots are
   reserved first; when the pool is short the engine evicts prefix-cache
   entries, then **preempts** the latest-admitted request (its blocks are
   freed, its tokens kept; it goes back to the front of the queue);
4. **chunked prefill**: prompts advance one chunk per call, chunks aligned to
   absolute multiples of ``chunk_tokens``, oldest request first, until
   ``prefill_budget`` prompt tokens were computed this iteration (the first
   chunk always runs). A prompt's last chunk gives the first token. So a long
   prompt never stalls the decoding rows for more than one budget;
5. finished requests leave (blocks freed, full chunks stay in the prefix cache).

**Same output, whatever happens around a request.** The backend computes a
row alone (batch invariance); a request's prompt is always cut into the same
aligned chunks, and the prefix cache only hands out whole chunks computed the
same way, so the cache contents never change a row's numbers; a preempted
request is recomputed exactly as it was computed the first time (prompt
chunks, then its generated tokens one decode step at a time) and keeps its
sampler noise stream. Greedy or seeded output is therefore identical alone,
batched, after a preemption and with or without prefix hits.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megac.engine.prefix_cache import PrefixCache
from megac.engine.request import Phase, Request, Status
from megac.errors import MegacError
from megac.kv.paged import KVOutOfBlocks, blocks_for_tokens, peak_blocks_for_tokens
from megac.runtime.backend import decode_and_sample, run_greedy
from megac.sampling import RowSampling, needs_logits, sample_row

if TYPE_CHECKING:
    from megac.runtime.backend import Backend

log = logging.getLogger("megac.engine")


@dataclass
class EngineConfig:
    max_batch_size: int = 16
    max_model_len: int = 2048
    #: prefill chunk (a multiple of the KV block size): prompts are cut at
    #: absolute multiples of it; also the prefix-cache granularity
    chunk_tokens: int = 256
    #: prompt tokens prefilled per iteration (at least one chunk runs)
    prefill_budget: int = 256
    prefix_caching: bool = True
    #: greedy decode steps run back to back while the batch is steady (every
    #: row plain greedy, nothing waiting or prefilling, each row K tokens from
    #: its end): the GPU backends pipeline them (step i+1 queued before the
    #: host reads step i's tokens), so the host part hides behind the kernel.
    #: Tokens still stream step by step; a row that ends inside a burst is
    #: finished (and its KV row freed) after it. 1: off
    decode_burst: int = 1


class EngineObserver:
    """Hooks the metrics layer implements (called in the engine thread)."""

    def on_scheduled(self, req: Request, queue_s: float) -> None: ...
    def on_first_token(self, req: Request, ttft_s: float) -> None: ...
    def on_token(self, req: Request, itl_s: float) -> None: ...
    def on_finish(self, req: Request) -> None: ...
    def on_preempt(self, req: Request) -> None: ...
    def on_prefix_lookup(self, queried: int, hit: int) -> None: ...
    def on_iteration(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None: ...
    def on_decode_step(self, rows: int, seconds: float, device_seconds: float | None) -> None: ...


def _device_ms_since(backend, before: int) -> float | None:
    """Device time of what the backend ran since its ``kernel_ms`` had
    ``before`` entries (the megakernel's launch, the baseline's graph replay,
    timed with CUDA events); None for a backend that does not time its
    device work (the CPU VM, the reference)."""
    times = getattr(backend, "kernel_ms", None)
    if times is None or len(times) <= before:
        return None
    return sum(times[before:]) / 1e3


class Engine:
    """Continuous batching over ``backend`` (see the module docstring)."""

    def __init__(self, backend: "Backend", config: EngineConfig, *, observer: EngineObserver | None = None) -> None:
        self.backend = backend
        self.kv = backend.kv
        self.spec = backend.spec
        self.config = config
        self.observer = observer or EngineObserver()
        bs = self.kv.block_size
        if config.chunk_tokens < bs or config.chunk_tokens % bs:
            raise MegacError(f"prefill chunk {config.chunk_tokens} must be a positive multiple of the KV block "
                             f"size {bs}")
        if config.max_batch_size > self.kv.max_rows:
            raise MegacError(f"max batch size {config.max_batch_size} > KV rows {self.kv.max_rows}")
        if config.max_batch_size > backend.max_batch_size:
            raise MegacError(f"max batch size {config.max_batch_size} > what the {backend.name} backend runs "
                             f"({backend.max_batch_size})")
        if config.max_model_len > self.kv.max_context:
            raise MegacError(f"max model length {config.max_model_len} > KV max context {self.kv.max_context}")
        self.prefix_cache = PrefixCache(self.kv, config.chunk_tokens, enabled=config.prefix_caching)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._inbox: list[tuple[str, object]] = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._admit_counter = 0
        self.dead: str | None = None  # error text once the loop crashed
        self.num_preemptions = 0
        self.num_iterations = 0
        #: decode steps that failed recoverably (their requests got an error)
        self.num_step_faults = 0
        self.watermark_blocks = self.kv.num_layers

    # ------------------------------------------------------------------ API side (any thread)

    def blocks_needed(self, tokens: int) -> int:
        """Blocks (all layers) a row holding ``tokens`` tokens maps."""
        return blocks_for_tokens(self.spec, tokens, self.kv.block_size)

    def peak_blocks(self, tokens: int) -> int:
        """Blocks a row needs at most on its way to ``tokens`` tokens (sliding
        windows make the count at the end smaller than on the way)."""
        return peak_blocks_for_tokens(self.spec, tokens, self.kv.block_size)

    def check_fits(self, tokens: int) -> str | None:
        """Why a request of ``tokens`` tokens (prompt + max new) can never
        run, or None."""
        need = self.peak_blocks(tokens)
        if need > self.kv.num_blocks:
            return (f"prompt + max_tokens ({tokens} tokens) needs {need} KV blocks but the pool has "
                    f"{self.kv.num_blocks}")
        return None

    def max_tokens_fitting(self, prompt_len: int) -> int:
        """Most new tokens a request with ``prompt_len`` prompt tokens can
        ever get from the whole pool (0: not even the prompt fits)."""
        lo, hi = 0, max(0, self.kv.max_context - prompt_len)
        if self.peak_blocks(prompt_len + 1) > self.kv.num_blocks:
            return 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.peak_blocks(prompt_len + mid) <= self.kv.num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def submit(self, req: Request) -> None:
        with self._cv:
            if self.dead:
                raise MegacError(f"engine is dead: {self.dead}")
            self._inbox.append(("add", req))
            self._cv.notify()

    def abort(self, request_id: str) -> None:
        with self._cv:
            self._inbox.append(("abort", request_id))
            self._cv.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="megac-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ gauges

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_blocks_used(self) -> int:
        return self.kv.num_used_blocks

    @property
    def num_blocks_active(self) -> int:
        """Blocks mapped by live rows (excludes blocks only the prefix cache holds)."""
        return self.kv.num_used_blocks - self.prefix_cache.num_evictable_blocks()

    def has_work(self) -> bool:
        return bool(self._inbox or self.running or self.waiting)

    # ------------------------------------------------------------------ loop

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not (self._inbox or self.running or self.waiting):
                    self._cv.wait()
                if self._stop:
                    break
            try:
                self.step()
            except Exception as err:  # noqa: BLE001 -- the engine must report, not vanish
                log.exception("engine step failed")
                self._fail_all(f"{type(err).__name__}: {err}")
                return

    def _fail_all(self, msg: str) -> None:
        self.dead = msg
        with self._cv:
            inbox, self._inbox = self._inbox, []
        reqs = list(self.running) + list(self.waiting) + [r for kind, r in inbox if kind == "add"]
        for r in reqs:
            if isinstance(r, Request) and not r.finished:
                r.status = Status.FINISHED
                r.send(r.final_event("error", msg))
        self.running.clear()
        self.waiting.clear()

    def run_until_idle(self, max_iterations: int = 1_000_000) -> None:
        """Step until nothing is left (tests; no thread)."""
        for _ in range(max_iterations):
            if not self.has_work():
                return
            self.step()
        raise MegacError("engine did not become idle")

    # ------------------------------------------------------------------ one iteration

    def step(self) -> None:
        t0 = time.perf_counter()
        self.num_iterations += 1
        self._drain_inbox()
        self._admit()
        n_dec = self._decode()
        n_pre = self._prefill()
        if n_dec or n_pre:
            self.observer.on_iteration(n_dec, n_pre, time.perf_counter() - t0)

    def _drain_inbox(self) -> None:
        with self._cv:
            inbox, self._inbox = self._inbox, []
        for kind, item in inbox:
            if kind == "add":
                assert isinstance(item, Request)
                self.waiting.append(item)
            else:
                self._abort(str(item))

    def _abort(self, request_id: str) -> None:
        for r in self.running:
            if r.id == request_id:
                self._finish(r, "abort")
                return
        for r in self.waiting:
            if r.id == request_id:
                self.waiting.remove(r)
                r.status = Status.FINISHED
                r.aborted = True
                r.finish_time = time.monotonic()
                r.send(r.final_event("abort"))
                self.observer.on_finish(r)
                return

    # ------------------------------------------------------------------ admission

    def _available_blocks(self) -> int:
        return self.kv.num_free_blocks + self.prefix_cache.num_evictable_blocks()

    def _admit(self) -> None:
        C = self.config.chunk_tokens
        while self.waiting and len(self.running) < self.config.max_batch_size:
            req = self.waiting[0]
            row = self.kv.allocate_row()
            first = not req.admitted_once
            # a fresh request must compute at least one prompt token (its logits
            # give the first output token); a resumed one only replays
            n = len(req.prompt_ids)
            max_chunks = (n // C) if req.output_ids else ((n - 1) // C)
            hashes, blocks = self.prefix_cache.match(req.prompt_ids, max_chunks)
            self.kv.attach_shared(row, blocks)
            hit = len(hashes) * C
            need = self.blocks_needed(req.num_tokens + 1) - int((blocks >= 0).sum())  # -1: released, not held
            others = len(self.running) > 0
            if need + (self.watermark_blocks if others else 0) > self._available_blocks():
                self.kv.free_row(row)  # the attached blocks go back to the cache alone
                if not others and self.prefix_cache.evict(need - self.kv.num_free_blocks) > 0:
                    continue  # alone it fits the pool (check_fits) once the cache gave its blocks back
                break
            self.waiting.popleft()
            req.row = row
            req.num_computed = hit
            req.status = Status.RUNNING
            req.admit_seq = self._admit_counter
            self._admit_counter += 1
            self.running.append(req)
            if first:
                req.admitted_once = True
                req.num_cached_tokens = hit
                req.first_scheduled_time = time.monotonic()
                self.prefix_cache.queries += n
                self.prefix_cache.hits += hit
                self.observer.on_prefix_lookup(n, hit)
                self.observer.on_scheduled(req, req.first_scheduled_time - req.arrival_time)

    # ------------------------------------------------------------------ memory pressure

    def _make_room(self, err: KVOutOfBlocks, req: Request) -> bool:
        """Free blocks for ``req``: evict cache entries, else preempt the
        latest-admitted other request. False: ``req`` itself must go."""
        want = max(1, err.needed - err.free)
        if self.prefix_cache.evict(want) > 0:
            return True
        victims = [r for r in self.running if r is not req]
        if not victims:
            return False
        victim = max(victims, key=lambda r: r.admit_seq)
        if victim.admit_seq < req.admit_seq:
            return False  # req is the latest: it yields
        self._preempt(victim)
        return True

    def _preempt(self, req: Request) -> None:
        log.info("preempting %s (%d tokens computed, %d generated)", req.id, req.num_computed, len(req.output_ids))
        self.kv.free_row(req.row)
        req.row = None
        req.num_computed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        self.observer.on_preempt(req)

    # ------------------------------------------------------------------ decode

    def _decode(self) -> int:
        batch: list[Request] = []
        for req in list(self.running):
            if req.status is not Status.RUNNING or req.phase is Phase.PREFILL:
                continue
            while True:
                try:
                    self.kv.append_slot(req.row)
                    batch.append(req)
                    break
                except KVOutOfBlocks as err:
                    if not self._make_room(err, req):
                        self._preempt(req)
                        break
        batch = [r for r in batch if r.status is Status.RUNNING]
        if not batch:
            return 0
        # REPLAY rows sample nothing: their tokens were drawn (and their grammar advanced) before the preemption
        samples = [RowSampling(r.params, r.stream, r.output_ids, r.eos_ids, r.grammar) if r.phase is Phase.DECODE
                   else None for r in batch]
        keep = any(r.keep_logits and s is not None for r, s in zip(batch, samples))
        burst = self._burst_steps(batch, samples, keep)
        if burst > 1:
            return self._decode_burst(batch, burst)
        timed = len(getattr(self.backend, "kernel_ms", ()))
        t0 = time.perf_counter()
        try:
            tokens, logits = decode_and_sample(self.backend, [r.row for r in batch], [r.next_input() for r in batch],
                                               samples, keep_logits=keep)
        except Exception as err:  # noqa: BLE001 -- a recoverable device fault fails this step's requests only
            if not getattr(err, "recoverable", False):
                raise
            self._fail_step(batch, err)
            return 0
        # the step as the engine waits for it, and the device's part of it:
        # the rest is host time (page tables, uploads, sampling hand-off)
        self.observer.on_decode_step(len(batch), time.perf_counter() - t0, _device_ms_since(self.backend, timed))
        for i, req in enumerate(batch):
            req.num_computed += 1
            if samples[i] is not None:
                self._accept(req, tokens[i], logits[i] if keep else None)
        return len(batch)

    def _burst_steps(self, batch: list[Request], samples, keep: bool) -> int:
        """How many greedy steps ``batch`` can run back to back (1: one step
        as usual): a steady batch only, and only as far as every row's token
        budget and the KV pool reach; the slots of those steps are reserved
        here."""
        k = self.config.decode_burst
        if k <= 1 or keep or self.waiting or any(r.phase is not Phase.DECODE for r in self.running):
            return 1
        for r, s in zip(batch, samples):
            # plain greedy now and after this step's token (penalties start
            # with the first output token; min_tokens only ever ends)
            if s is None or needs_logits(s.params, s.output_ids, s.grammar) or \
                    needs_logits(s.params, [*s.output_ids, 0], s.grammar):
                return 1
            k = min(k, r.params.max_tokens - len(r.output_ids), self.config.max_model_len - r.num_tokens)
        if k <= 1:
            return 1
        try:  # every row's K slots now: the burst cannot run out of blocks halfway
            for r in batch:
                self.kv.reserve(r.row, k, stepwise=True)  # each step still sees its own window
        except KVOutOfBlocks:
            return 1
        return k

    def _decode_burst(self, batch: list[Request], steps: int) -> int:
        """``steps`` greedy steps of ``batch`` through
        :func:`megac.runtime.backend.run_greedy` (pipelined on the GPU). Each
        step's tokens are accepted as they reach the host (streamed); a row
        that ends is finished after the burst, when no step still writes its
        KV row."""
        ended: list[tuple[Request, str, object]] = []
        live = set(range(len(batch)))
        timed = len(getattr(self.backend, "kernel_ms", ()))

        def accept(_k, tokens):
            for i in sorted(live):
                req = batch[i]
                req.num_computed += 1
                out = self._accept(req, int(tokens[i]), defer=True)
                if req.finish_reason is not None:
                    live.discard(i)
                    ended.append((req, req.finish_reason, out))

        try:
            _tokens, walls = run_greedy(self.backend, [r.row for r in batch], [r.next_input() for r in batch], steps,
                                        accept)
        except Exception as err:  # noqa: BLE001 -- a recoverable device fault fails this burst's requests only
            if not getattr(err, "recoverable", False):
                raise
            for req, reason, out in ended:
                self._finish(req, reason, out)
            self._fail_step([batch[i] for i in sorted(live)], err)
            return 0
        device = _device_ms_since(self.backend, timed)
        for w in walls:
            self.observer.on_decode_step(len(batch), w / 1e3, None if device is None else device / len(walls))
        for req, reason, out in ended:
            self._finish(req, reason, out)
        return len(batch) * steps

    # ------------------------------------------------------------------ prefill

    def _prefill(self) -> int:
        C = self.config.chunk_tokens
        budget = self.config.prefill_budget
        done = 0
        for req in list(self.running):
            if req.status is not Status.RUNNING or req.phase is not Phase.PREFILL:
                continue
            a = req.num_computed
            b = min(len(req.prompt_ids), (a // C + 1) * C)
            if done and b - a > budget - done:
                break
            logits = None
            while True:
                try:
                    logits = self.backend.prefill(req.row, req.prompt_ids[a:b])
                    break
                except KVOutOfBlocks as err:
                    if not self._make_room(err, req):
                        self._preempt(req)
                        break
            if logits is None:
                continue
            req.num_computed = b
            done += b - a
            if b - a == C:
                self.prefix_cache.register(req.row, req.prompt_ids, a // C)
            if b == len(req.prompt_ids) and not req.output_ids:
                self._emit(req, logits)
            if done >= budget:
                break
        return done

    # ------------------------------------------------------------------ output

    def _emit(self, req: Request, logits) -> None:
        """Sample the first token from a prompt's last logits (where they live)."""
        tok = sample_row(logits, req.params, req.stream, req.output_ids, req.eos_ids, req.grammar)
        self._accept(req, tok, logits)

    def _accept(self, req: Request, tok: int, logits=None, defer: bool = False):
        """``tok`` joins ``req``'s output and streams; an ending request is
        finished here, or (``defer``: a burst still runs on its KV row) left
        for the caller: its final event is returned unsent."""
        if req.keep_logits:
            req.logits.append(logits.float().cpu())
        now = time.monotonic()
        out = req.append_token(tok, self.config.max_model_len)
        if req.first_token_time is None:
            req.first_token_time = now
            self.observer.on_first_token(req, now - req.arrival_time)
        else:
            self.observer.on_token(req, now - (req.last_token_time or now))
        req.last_token_time = now
        if req.finish_reason is not None:
            if defer:
                return out
            self._finish(req, req.finish_reason, out)
        else:
            req.send(out)
        return None

    def _fail_step(self, batch: list[Request], err: Exception) -> None:
        """A recoverable fault of one decode step (the megakernel's watchdog:
        ``MegakernelHang``): the step's requests end with the error, their
        rows go back to the pool, the backend recovers if it must, and the
        engine serves everything else on."""
        self.num_step_faults += 1
        log.error("decode step failed; %d request(s) end with an error (%s): %s%s", len(batch),
                  ", ".join(r.id for r in batch), err,
                  f"; record {err.record}" if getattr(err, "record", None) else "")
        msg = f"{type(err).__name__}: {err}"
        for req in batch:
            self._finish(req, "error", req.final_event("error", msg))
        recover = getattr(self.backend, "recover", None)
        if recover is not None:
            recover()

    def _finish(self, req: Request, reason: str, out=None) -> None:
        if req.row is not None:
            self.kv.free_row(req.row)
            req.row = None
        if req in self.running:
            self.running.remove(req)
        req.status = Status.FINISHED
        req.finish_time = time.monotonic()
        if reason == "abort":
            req.aborted = True
            out = req.final_event("abort")
        req.finish_reason = reason
        req.send(out if out is not None else req.final_event(reason))
        self.observer.on_finish(req)


__all__ = ["Engine", "EngineConfig", "EngineObserver"]

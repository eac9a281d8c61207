"""The engine in-process (no HTTP): continuous batching, chunked prefill,
prefix caching, preemption by recompute, aborts, output processing. A row's
output must be the same alone, batched, preempted and with prefix hits.

The model is tiny-llama with untied random embeddings (tied random weights
make greedy decoding repeat the last token, which would prove nothing)."""

from __future__ import annotations

import pytest
import torch

from megac.engine import Engine, EngineConfig, Request
from megac.passes.pipeline import compile_schedules
from megac.runtime.backend import ReferenceBackend
from megac.runtime.backends import make_backend
from megac.engine.prefix_cache import PrefixCache, chain_hashes
from megac.engine.request import IncrementalDetokenizer, Phase
from megac.errors import MegacError
from megac.kv.paged import PagedKVCache
from megac.sampling import SamplingParams
from megac.server.chat import ByteTokenizer, Tokenizer
from megac.weights.random import random_weights
from models import variant

SPEC = variant("tiny-llama", "tiny-llama-untied", tie_embeddings=False)
WEIGHTS = random_weights(SPEC, seed=13)  # a seed whose greedy outputs differ between prompts and reach EOS
TOK = Tokenizer(ByteTokenizer(256, 1, [2]), eos_token_ids=[2])


def make_engine(*, num_blocks=4000, max_batch=8, chunk=32, budget=None, prefix=True, max_len=1024):
    kv = PagedKVCache(SPEC, max_rows=max_batch, num_blocks=num_blocks, max_context=max_len, dtype=torch.float32)
    backend = ReferenceBackend(SPEC, WEIGHTS, kv)
    return Engine(backend, EngineConfig(max_batch_size=max_batch, max_model_len=max_len, chunk_tokens=chunk,
                                        prefill_budget=budget or chunk, prefix_caching=prefix))


def submit(eng, prompt, params, rid, sink=None):
    outs = []
    req = Request(TOK.encode(prompt), params, request_id=rid, tokenizer=TOK, eos_ids=[2],
                  sink=sink or outs.append)
    eng.submit(req)
    return req, outs


def run_all(eng, prompts, params_of):
    got = {}
    reqs = [submit(eng, p, params_of(i), f"r{i}") for i, p in enumerate(prompts)]
    eng.run_until_idle()
    for i, (req, outs) in enumerate(reqs):
        assert outs[-1].finished
        got[i] = (req.output_ids, "".join(o.text for o in outs), outs[-1].finish_reason)
    eng.prefix_cache.check()
    return got


PROMPTS = [f"Request {i}: " + "lorem ipsum dolor sit amet " * (i % 6) for i in range(12)]


def greedy(i):
    return SamplingParams(temperature=0.0, max_tokens=24)


def seeded(i):
    return SamplingParams(temperature=1.0, top_p=0.95, seed=100 + i, max_tokens=24)


@pytest.fixture(scope="module")
def alone():
    out = {}
    for name, fn in (("greedy", greedy), ("seeded", seeded)):
        out[name] = {i: run_all(make_engine(), [p], lambda _j, i=i, fn=fn: fn(i))[0] for i, p in enumerate(PROMPTS)}
    return out


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_batched_equals_alone(alone, mode):
    fn = greedy if mode == "greedy" else seeded
    eng = make_engine(max_batch=5)
    got = run_all(eng, PROMPTS, fn)
    assert got == alone[mode]
    assert len({tuple(v[0]) for v in got.values()}) > 6  # outputs really differ between prompts


def test_preemption_recomputes_to_the_same_output(alone):
    # 12 requests of up to ~190 tokens, 2 layers, blocks of 16: a 60-block pool cannot hold them all
    eng = make_engine(num_blocks=60, max_batch=8)
    got = run_all(eng, PROMPTS, seeded)
    assert eng.num_preemptions > 0
    assert got == alone["seeded"]
    assert eng.kv.num_used_blocks == eng.prefix_cache.num_blocks_held  # only the cache holds blocks


def test_max_batch_size_is_respected():
    eng = make_engine(max_batch=3)
    for i, p in enumerate(PROMPTS[:7]):
        submit(eng, p, greedy(i), f"r{i}")
    peak = 0
    while eng.has_work():
        eng.step()
        peak = max(peak, eng.num_running)
        assert eng.num_running <= 3
    assert peak == 3


def test_chunked_prefill_keeps_other_rows_decoding():
    eng = make_engine(chunk=32)
    a, _ = submit(eng, "short", SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True), "a")
    for _ in range(3):
        eng.step()
    b, _ = submit(eng, "x" * 300, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), "b")
    prefill_steps = 0
    while not b.output_ids:
        n = len(a.output_ids)
        eng.step()
        if b.phase is Phase.PREFILL or b.output_ids:
            prefill_steps += 1
            assert len(a.output_ids) == n + 1  # a decoded in the same iteration
    assert prefill_steps == -(-301 // 32)  # BOS + 300 bytes, one aligned chunk per iteration
    eng.run_until_idle()


def test_prefix_cache_hits_and_does_not_change_output():
    system = "You are a careful assistant. Answer briefly and exactly. " * 4
    prompts = [system + f"Question {i}?" for i in range(4)]
    ref = {i: run_all(make_engine(prefix=False), [p], lambda _j, i=i: seeded(i))[0] for i, p in enumerate(prompts)}
    eng = make_engine()
    got = {}
    for i, p in enumerate(prompts):  # one after the other: later ones find the earlier chunks
        got[i] = run_all(eng, [p], lambda _j, i=i: seeded(i))[0]
    assert got == ref
    n0 = len(TOK.encode(prompts[0]))
    assert eng.prefix_cache.queries == sum(len(TOK.encode(p)) for p in prompts)
    assert eng.prefix_cache.hits == 3 * ((n0 - 1) // 32) * 32
    assert len(eng.prefix_cache) > 0


def test_prefix_cache_eviction_under_pressure(monkeypatch):
    """A 40-block pool cannot keep every prompt's chunks cached: the engine
    evicts least recently used entries (which really frees blocks), and
    every output equals the one of an uncached engine with a big pool."""
    prompts = [f"{i} unique prompt text that fills a few chunks " * 3 for i in range(6)]
    ref = [run_all(make_engine(prefix=False), [p], greedy)[0] for p in prompts]
    eng = make_engine(num_blocks=40)
    freed = []
    evict = eng.prefix_cache.evict
    monkeypatch.setattr(eng.prefix_cache, "evict", lambda n: freed.append(evict(n)) or freed[-1])
    got = [run_all(eng, [p], greedy)[0] for p in prompts]
    assert got == ref
    assert sum(freed) > 0, "no cache entry was evicted: the test does not exercise eviction"
    # the least recently used chunks (the first prompt's) are the ones gone; the last prompt's stay
    first = chain_hashes(TOK.encode(prompts[0]), 32)
    last = chain_hashes(TOK.encode(prompts[-1]), 32)
    assert first and not any(h in eng.prefix_cache._entries for h in first)
    assert last and all(h in eng.prefix_cache._entries for h in last)
    # with nothing running, the pool holds exactly the cache's blocks
    assert eng.kv.num_used_blocks == eng.prefix_cache.num_blocks_held <= 40
    # the evicted prompt again: a miss that recomputes the same output
    again = run_all(eng, [prompts[0]], greedy)[0]
    assert again == ref[0]
    eng.prefix_cache.check()


def test_abort_frees_blocks():
    eng = make_engine()
    r, outs = submit(eng, "abort me " * 10, SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True), "x")
    for _ in range(5):
        eng.step()
    assert eng.num_blocks_active > 0
    eng.abort("x")
    eng.step()
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert eng.num_running == 0 and eng.num_blocks_active == 0
    eng.prefix_cache.check()


def test_abort_while_waiting():
    eng = make_engine(max_batch=1)
    submit(eng, "first", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), "a")
    r, outs = submit(eng, "second", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), "b")
    eng.step()
    eng.abort("b")
    eng.run_until_idle()
    assert outs[-1].finish_reason == "abort" and not r.output_ids


def test_eos_length_and_max_model_len():
    eng = make_engine(max_len=64)
    got = run_all(eng, ["Hello", "x" * 50], lambda i: SamplingParams(temperature=0.0, max_tokens=40))
    assert got[0][2] == "stop" and got[0][0][-1] == 2  # this prompt's greedy output ends in EOS (id 2)
    assert got[1][2] == "length" and 50 + len(got[1][0]) == 64


def test_prefix_hash_chain_and_attach():
    kv = PagedKVCache(SPEC, max_rows=2, num_blocks=100, max_context=256, dtype=torch.float32)
    pc = PrefixCache(kv, 32)
    toks = list(range(100))
    h = chain_hashes(toks, 32)
    assert len(h) == 3 and h == chain_hashes(toks[:96], 32) and chain_hashes(toks[:64], 32) == h[:2]
    assert chain_hashes([9] + toks[1:], 32)[1] != h[1]  # a change anywhere before changes every later key
    with pytest.raises(MegacError):
        PrefixCache(kv, 24)
    row = kv.allocate_row()
    kv.reserve(row, 64)
    kv.advance(row, 64)
    assert pc.register(row, toks, 0) and not pc.register(row, toks, 0)
    other = kv.allocate_row()
    hashes, blocks = pc.match(toks, 2)
    assert len(hashes) == 1
    kv.attach_shared(other, blocks)
    assert kv.seq_pos[other] == 32 and kv.blocks_of_row(other) <= kv.blocks_of_row(row)
    pc.check()
    kv.free_row(row)
    kv.free_row(other)
    assert pc.num_evictable_blocks() == blocks.size
    assert pc.evict(1) == blocks.size and kv.num_used_blocks == 0


def test_request_stop_strings_hold_back_and_cut():
    tok = TOK
    r = Request([1], SamplingParams(temperature=0.0, max_tokens=100, stop=["STOP", "xyz"]), tokenizer=tok,
                eos_ids=[2])
    shown = ""
    for ch in "hello ST":
        out = r.append_token(ord(ch), 1000)
        shown += out.text if out else ""
    assert shown == "hello " and r.finish_reason is None  # "ST" may start "STOP": held back (3 chars)
    for ch in "OP and more":
        out = r.append_token(ord(ch), 1000)
        if out:
            shown += out.text
        if r.finish_reason:
            break
    assert r.finish_reason == "stop" and r.stop_reason == "STOP" and shown == "hello "
    r2 = Request([1], SamplingParams(temperature=0.0, max_tokens=100, stop=["b"], include_stop_str_in_output=True),
                 tokenizer=tok, eos_ids=[2])
    text = "".join((r2.append_token(ord(c), 1000) or type("o", (), {"text": ""})).text for c in "aab")
    assert text == "aab" and r2.finish_reason == "stop"


def test_detokenizer_waits_for_complete_utf8():
    d = IncrementalDetokenizer(TOK)
    b = "é€".encode()
    assert [d.step(x) for x in b] == ["", "é", "", "", "€"]
    d = IncrementalDetokenizer(TOK)
    assert d.step(0xE2) == "" and d.flush() == "\ufffd"


def test_make_backend():
    kv = PagedKVCache(SPEC, max_rows=1, num_blocks=10, max_context=64, dtype=torch.float32)
    scheds = compile_schedules(SPEC).schedules
    vm = make_backend("cpu", SPEC, WEIGHTS, kv, schedules=scheds)
    assert vm.name == "vm" and vm.max_batch_size == max(SPEC.target.batch_sizes)
    assert make_backend("auto", SPEC, WEIGHTS, kv, schedules=scheds).name == "vm"
    with pytest.raises(MegacError, match="needs compiled schedules"):
        make_backend("cpu", SPEC, WEIGHTS, kv)
    assert make_backend("reference", SPEC, WEIGHTS, kv).name == "reference"
    with pytest.raises(MegacError, match="no CUDA device visible"):
        make_backend("cuda", SPEC, WEIGHTS, kv)
    with pytest.raises(MegacError):
        make_backend("tpu", SPEC, WEIGHTS, kv)


def test_decode_steps_report_the_backends_device_time():
    """The engine hands each decode step's wall time and the device time the
    backend measured for it (here a backend that says 2 ms per step) to the
    observer; a backend that measures nothing reports None."""

    class TimedBackend(ReferenceBackend):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.kernel_ms = []

        def decode(self, rows, tokens):
            self.kernel_ms.append(2.0)
            return super().decode(rows, tokens)

    class Seen:
        def __getattr__(self, name):
            return lambda *a: None

        def __init__(self):
            self.steps = []

        def on_decode_step(self, rows, seconds, device_seconds):
            self.steps.append((rows, seconds, device_seconds))

    for backend_cls, device in ((TimedBackend, 0.002), (ReferenceBackend, None)):
        kv = PagedKVCache(SPEC, max_rows=2, num_blocks=200, max_context=256, dtype=torch.float32)
        seen = Seen()
        eng = Engine(backend_cls(SPEC, WEIGHTS, kv), EngineConfig(max_batch_size=2, max_model_len=256, chunk_tokens=32,
                                                                  prefill_budget=32), observer=seen)
        req, outs = submit(eng, "hello there", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), "a")
        eng.run_until_idle()
        assert len(req.output_ids) == 5
        # the first token comes from the prefill; each later one from a decode step of one row
        assert [(r, d) for r, _, d in seen.steps] == [(1, device)] * 4
        assert all(s > 0 for _, s, _ in seen.steps)


class StepFault(MegacError):
    """A fault the engine may recover from (as MegakernelHang)."""

    recoverable = True


def test_a_recoverable_step_fault_fails_that_step_and_serving_goes_on(alone):
    """The third decode step raises: the two requests in it end with the
    error (tokens so far delivered, rows freed), the engine stays up, and a
    request submitted afterwards gets the same output as alone."""

    class FaultyBackend(ReferenceBackend):
        calls = 0

        def decode(self, rows, tokens):
            FaultyBackend.calls += 1
            if FaultyBackend.calls == 3:
                raise StepFault("megakernel hang (COUNTER_TIMEOUT): test fault")
            return super().decode(rows, tokens)

    kv = PagedKVCache(SPEC, max_rows=8, num_blocks=4000, max_context=1024, dtype=torch.float32)
    eng = Engine(FaultyBackend(SPEC, WEIGHTS, kv), EngineConfig(max_batch_size=8, max_model_len=1024, chunk_tokens=32,
                                                                prefill_budget=64))
    hit = [submit(eng, PROMPTS[i], greedy(i), f"hit{i}") for i in (0, 1)]
    eng.run_until_idle()
    for req, outs in hit:
        assert outs[-1].finished and outs[-1].finish_reason == "error"
        assert "test fault" in outs[-1].error
        assert req.row is None and len(req.output_ids) >= 1
    assert eng.dead is None and eng.num_step_faults == 1 and not eng.running
    eng.prefix_cache.check()
    req, outs = submit(eng, PROMPTS[2], greedy(2), "after")
    eng.run_until_idle()
    assert (req.output_ids, "".join(o.text for o in outs), outs[-1].finish_reason) == alone["greedy"][2]
    # a fault that is not recoverable still stops the engine (the thread reports it)
    assert not getattr(MegacError("x"), "recoverable", False)

"""Prefix caching on a model with sliding-window layers (North Mini Code's
kind): a cached prefix skips prefill on sliding and full layers alike, and
every output equals the uncached run's bit for bit.

tiny-moe (full, sliding and NoPE layers, KV blocks of 16) with untied
random embeddings, chunks of 32 tokens; sliding windows of 8 (shorter than
a chunk: a chunk's first blocks are released during its own prefill) and
of 48 (longer than a chunk)."""

from __future__ import annotations

import pytest
import torch

from megac.engine import Engine, EngineConfig, Request
from megac.engine.prefix_cache import chain_hashes
from megac.kv.paged import PagedKVCache
from megac.runtime.backend import ReferenceBackend
from megac.sampling import SamplingParams
from megac.server.chat import ByteTokenizer, Tokenizer
from megac.weights.random import random_weights
from models import variant

CHUNK = 32
TOK = Tokenizer(ByteTokenizer(256, 1, [2]), eos_token_ids=[2])


def spec_with_window(window: int):
    base = variant("tiny-moe")
    layers = [{**l, "window": window if l["window"] else None} for l in base.model_dump()["layers"]]
    return variant(base, f"tiny-moe-w{window}", layers=layers, tie_embeddings=False)


@pytest.fixture(scope="module", params=[8, 48])
def model(request):
    spec = spec_with_window(request.param)
    assert any(l.window == request.param for l in spec.layers) and any(l.window is None for l in spec.layers)
    return spec, random_weights(spec, seed=5)


def make_engine(model, *, prefix: bool):
    spec, weights = model
    kv = PagedKVCache(spec, max_rows=4, num_blocks=600, max_context=1024, dtype=torch.float32)
    return Engine(ReferenceBackend(spec, weights, kv),
                  EngineConfig(max_batch_size=4, max_model_len=1024, chunk_tokens=CHUNK, prefill_budget=CHUNK,
                               prefix_caching=prefix))


def run_one(eng, ids, i):
    outs = []
    req = Request(list(ids), SamplingParams(temperature=1.0, top_p=0.9, seed=300 + i, max_tokens=8),
                  request_id=f"r{i}", tokenizer=TOK, eos_ids=[], sink=outs.append)
    eng.submit(req)
    eng.run_until_idle()
    assert outs[-1].finished
    eng.prefix_cache.check()
    return list(req.output_ids)


def shared_chunks(ids, earlier, max_chunks):
    """Leading full chunks of ``ids`` that one of ``earlier`` registered
    (their prompts' full chunks), as the cache could hand out."""
    mine = chain_hashes(ids, CHUNK, max_chunks)
    known = {h for e in earlier for h in chain_hashes(e, CHUNK)}
    n = 0
    while n < len(mine) and mine[n] in known:
        n += 1
    return n


def test_shared_system_prompt_hits_and_keeps_outputs(model):
    system = TOK.encode("You are North, a careful coding assistant. Answer in one short line. " * 3)
    prompts = [system + TOK.encode(f"Task {i}: reverse a list in Python.") for i in range(4)]
    ref = [run_one(make_engine(model, prefix=False), p, i) for i, p in enumerate(prompts)]
    eng = make_engine(model, prefix=True)
    got, hits = [], []
    for i, p in enumerate(prompts):
        before = eng.prefix_cache.hits
        got.append(run_one(eng, p, i))
        hits.append(eng.prefix_cache.hits - before)
    assert got == ref
    expect = [shared_chunks(p, prompts[:i], (len(p) - 1) // CHUNK) * CHUNK for i, p in enumerate(prompts)]
    assert hits == expect and all(h > 0 for h in expect[1:])


def test_conversation_prefills_only_new_tokens(model):
    """Six turns, each prompt = the last one + its answer + a new question:
    every turn after the first finds the last prompt's full chunks (sliding
    layers included) and prefills only the rest; answers equal a run
    without the cache."""
    ref_eng = make_engine(model, prefix=False)
    eng = make_engine(model, prefix=True)
    prompt = TOK.encode("System: you help with code. " * 4)
    for turn in range(6):
        prompt = prompt + TOK.encode(f" User {turn}: and what about case {turn}?")
        before = eng.prefix_cache.hits
        got = run_one(eng, prompt, turn)
        hit = eng.prefix_cache.hits - before
        assert got == run_one(ref_eng, prompt, turn), turn
        if turn:
            # the previous prompt's full chunks, within this prompt's lookup
            assert hit == min(len(last) // CHUNK, (len(prompt) - 1) // CHUNK) * CHUNK > 0, turn
        last = prompt
        prompt = prompt + got


def test_a_pool_of_one_request_serves_a_cached_conversation(model):
    """The pool holds exactly one request of the model length (what a GPU
    server at batch 1 gets). A turn whose prompt hits the last turn's chunks
    must still get blocks to write: the cache hands a row only its sliding
    windows' blocks, and gives back the sliding blocks it alone holds. (It
    handed out every cached block: the row held the whole pool, was
    preempted for want of one more and re-admitted with the same hit,
    forever.) Answers equal the uncached run's; bounded steps."""
    from megac.kv.paged import blocks_for_tokens

    spec, weights = model
    mml = 320
    pool = blocks_for_tokens(spec, mml, 16)

    def engine(prefix):
        kv = PagedKVCache(spec, max_rows=1, num_blocks=pool, max_context=mml, dtype=torch.float32, block_size=16)
        return Engine(ReferenceBackend(spec, weights, kv),
                      EngineConfig(max_batch_size=1, max_model_len=mml, chunk_tokens=CHUNK, prefill_budget=CHUNK,
                                   prefix_caching=prefix))

    def answer(eng, ids, i):
        outs = []
        req = Request(list(ids), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                      request_id=f"p{i}", tokenizer=TOK, eos_ids=[], sink=outs.append)
        eng.submit(req)
        eng.run_until_idle(max_iterations=2000)
        assert outs[-1].finished and outs[-1].finish_reason == "length", outs[-1]
        eng.prefix_cache.check()
        return list(req.output_ids)

    cached, plain = engine(True), engine(False)
    prompt = TOK.encode("System: you help with code. " * 4)
    hits = []
    for turn in range(4):
        prompt = prompt + TOK.encode(f" User {turn}: and case {turn}?")
        before = cached.prefix_cache.hits
        got = answer(cached, prompt, turn)
        hits.append(cached.prefix_cache.hits - before)
        assert got == answer(plain, prompt, turn), turn
        prompt = prompt + got
    # a pool this tight evicts chains as it must (a turn may find none); hits still happen
    assert sum(hits[1:]) > 0, hits

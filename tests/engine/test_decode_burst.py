"""Greedy decode bursts (EngineConfig.decode_burst): a steady batch runs K
greedy steps back to back through runtime.backend.run_greedy (pipelined on
the GPU backends; here the steps run one by one with the same semantics).
Every request's tokens, text and finish reason must equal the one-step
engine's, whether it ends by EOS, a stop string, max_tokens or an abort, and
whether requests arrive while others decode; no KV block is leaked."""

from __future__ import annotations

import pytest
import torch

from megac.engine import Engine, EngineConfig, Request
from megac.kv.paged import PagedKVCache
from megac.runtime.backend import ReferenceBackend
from megac.sampling import SamplingParams
from megac.server.chat import ByteTokenizer, Tokenizer
from megac.weights.random import random_weights
from models import variant

SPEC = variant("tiny-llama", "tiny-llama-untied", tie_embeddings=False)
WEIGHTS = random_weights(SPEC, seed=13)  # greedy outputs that differ between prompts and reach EOS
TOK = Tokenizer(ByteTokenizer(256, 1, [2]), eos_token_ids=[2])
PROMPTS = [f"Request {i}: " + "lorem ipsum dolor sit amet " * (i % 5) for i in range(9)]


def params(i: int) -> SamplingParams:
    """A mix: short budgets (below a burst), long ones, a stop string, EOS on or ignored."""
    return SamplingParams(temperature=0.0, max_tokens=(3, 24, 7, 40, 1, 17, 30, 5, 12)[i],
                          stop=["e"] if i == 5 else [], ignore_eos=i in (3, 6))


class Counting(ReferenceBackend):
    """The reference backend, counting the steps run through the burst path."""

    bursts = 0

    def decode_greedy_run(self, rows, token_ids, steps, progress=None):
        from megac.runtime.backend import run_greedy_steps

        Counting.bursts += 1
        return run_greedy_steps(self, rows, token_ids, steps, progress)


def make_engine(burst: int, max_batch: int = 4, num_blocks: int = 4000) -> Engine:
    kv = PagedKVCache(SPEC, max_rows=max_batch, num_blocks=num_blocks, max_context=512, dtype=torch.float32)
    return Engine(Counting(SPEC, WEIGHTS, kv), EngineConfig(max_batch_size=max_batch, max_model_len=512,
                                                            chunk_tokens=32, prefill_budget=32, decode_burst=burst))


def run(eng: Engine, staggered: bool) -> dict:
    reqs = {}
    for i, p in enumerate(PROMPTS):
        outs: list = []
        req = Request(TOK.encode(p), params(i), request_id=f"r{i}", tokenizer=TOK, eos_ids=[2], sink=outs.append)
        eng.submit(req)
        reqs[i] = (req, outs)
        if staggered:  # arrivals while others decode (and burst)
            for _ in range(3):
                eng.step()
    eng.run_until_idle()
    got = {}
    for i, (req, outs) in reqs.items():
        assert outs[-1].finished and sum(o.finished for o in outs) == 1
        got[i] = (list(req.output_ids), "".join(o.text for o in outs), outs[-1].finish_reason)
    return got


@pytest.mark.parametrize("staggered", [False, True])
@pytest.mark.parametrize("burst", [2, 5])
def test_bursts_give_the_one_step_engine_outputs(burst, staggered):
    want = run(make_engine(1), staggered)
    Counting.bursts = 0
    eng = make_engine(burst)
    got = run(eng, staggered)
    assert Counting.bursts > 0  # the burst path ran (not only the one-step one)
    assert got == want
    reasons = {r for _, _, r in got.values()}
    assert {"length", "stop"} <= reasons, reasons  # budgets and EOS / stop strings both ended requests
    # every row given back: nothing held past the requests
    eng.prefix_cache.evict(eng.kv.num_blocks)
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_an_abort_during_bursts_ends_only_its_request():
    eng = make_engine(4)
    outs_a: list = []
    outs_b: list = []
    a = Request(TOK.encode("keep going"), SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True),
                request_id="a", tokenizer=TOK, eos_ids=[2], sink=outs_a.append)
    b = Request(TOK.encode("stop me"), SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True),
                request_id="b", tokenizer=TOK, eos_ids=[2], sink=outs_b.append)
    eng.submit(a)
    eng.submit(b)
    for _ in range(8):
        eng.step()
    eng.abort("b")
    eng.run_until_idle()
    assert outs_b[-1].finish_reason == "abort" and outs_a[-1].finish_reason == "length"
    assert len(a.output_ids) == 200
    eng.prefix_cache.evict(eng.kv.num_blocks)
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_logit_processing_keeps_a_row_out_of_bursts_while_it_applies():
    """A row whose logits are processed (min_tokens masks EOS for its first
    tokens; a presence penalty from its first output token on) is never
    decoded from the argmax records: the batch runs one step at a time while
    that applies, and bursts once it stops, with the one-step engine's
    outputs throughout."""
    def both(burst):
        eng = make_engine(burst)
        reqs = []
        for i, p in enumerate((SamplingParams(temperature=0.0, max_tokens=30, min_tokens=12),
                               SamplingParams(temperature=0.0, max_tokens=20, presence_penalty=0.5),
                               SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))):
            outs: list = []
            req = Request(TOK.encode(PROMPTS[i + 2]), p, request_id=f"p{i}", tokenizer=TOK, eos_ids=[2],
                          sink=outs.append)
            eng.submit(req)
            reqs.append((req, outs))
        eng.run_until_idle()
        return [(list(r.output_ids), outs[-1].finish_reason) for r, outs in reqs]

    want = both(1)
    Counting.bursts = 0
    assert both(4) == want
    assert Counting.bursts > 0  # once the penalised row ended and min_tokens was met


def test_bursts_over_sliding_window_layers_give_the_one_step_outputs():
    """A burst reserves its K slots at once; on a sliding layer that must not
    release the blocks its first steps still attend to (North Mini Code's
    serving died on exactly that: "position 382 was already released")."""
    from megac.spec import load_spec

    spec = load_spec("tiny-moe")  # sliding window 8: 4-token blocks leave it every other step
    weights = random_weights(spec, seed=5)

    def outputs(burst):
        kv = PagedKVCache(spec, max_rows=3, num_blocks=600, max_context=256, block_size=4, dtype=torch.float32)
        eng = Engine(Counting(spec, weights, kv), EngineConfig(max_batch_size=3, max_model_len=256, chunk_tokens=32,
                                                               prefill_budget=32, decode_burst=burst))
        reqs = []
        for i in range(3):
            outs: list = []
            req = Request(TOK.encode(PROMPTS[i]), SamplingParams(temperature=0.0, max_tokens=23 + 4 * i,
                                                                 ignore_eos=True),
                          request_id=f"w{i}", tokenizer=TOK, eos_ids=[2], sink=outs.append)
            eng.submit(req)
            reqs.append((req, outs))
        eng.run_until_idle()
        eng.prefix_cache.evict(eng.kv.num_blocks)
        assert eng.kv.num_free_blocks == eng.kv.num_blocks
        return [(list(r.output_ids), outs[-1].finish_reason) for r, outs in reqs]

    want = outputs(1)
    Counting.bursts = 0
    assert outputs(4) == want
    assert Counting.bursts > 0

"""A long shared prefix, turn after turn (issue 13): North Mini Code with
random weights on ``--backend cuda``, a 2K-token conversation prefix grown
by a new question and the answer each turn. With the prefix cache every
turn after the first must find the previous prompt's full chunks (sliding
and full layers alike) and prefill only the rest, and give the text of an
engine without the cache; the time to first token both ways is reported.

``python -m gpu.prefix_check --model tiny-moe --backend cpu`` is a dry run
of the driver on the CPU VM.
"""

from __future__ import annotations

import json
import time


def check_prefix_turns(model: str = "north-mini-code", backend: str = "cuda", turns: int = 3,
                       prefix_tokens: int = 2048, answer_tokens: int = 16, chunk: int = 256) -> dict:
    import numpy as np
    import torch

    from megac.engine import Request
    from megac.engine.build import EngineOptions, build_engine
    from megac.engine.prefix_cache import chain_hashes
    from megac.sampling import SamplingParams
    from megac.server.chat import ByteTokenizer, Tokenizer
    from megac.spec import load_spec
    from megac.weights import random_weights

    spec = load_spec(model)
    dev = "cuda" if backend == "cuda" else "cpu"
    w = random_weights(spec, seed=3, dtype=torch.bfloat16 if dev == "cuda" else torch.float32, device=dev)
    tok = Tokenizer(ByteTokenizer(min(spec.vocab_size, 256), 1, [2]), eos_token_ids=[2])
    longest = prefix_tokens + turns * (64 + answer_tokens) + 64

    def engine(prefix: bool):
        return build_engine(spec, w, EngineOptions(backend=backend, max_batch_size=2, max_model_len=longest,
                                                   prefill_chunk=chunk, prefix_caching=prefix))

    def run(eng, ids, i):
        outs, first = [], []
        t0 = time.perf_counter()

        def sink(out):
            if not first and out.token_ids:
                first.append(time.perf_counter() - t0)
            outs.append(out)

        req = Request(list(ids), SamplingParams(temperature=0.0, max_tokens=answer_tokens, ignore_eos=True),
                      request_id=f"t{i}", tokenizer=tok, eos_ids=[], sink=sink)
        eng.submit(req)
        eng.run_until_idle()
        return list(req.output_ids), (first[0] if first else None)

    rng = np.random.default_rng(0)
    vocab = min(spec.vocab_size, 256)
    prompt = [int(t) for t in rng.integers(3, vocab, prefix_tokens)]
    # One engine at a time: North Mini Code's weights and their kernel copy
    # fill most of the H200, and a second backend's copy does not fit. The
    # cached engine runs the conversation; the uncached one replays its prompts.
    cached = engine(True)
    rows, prompts, last = [], [], None
    for turn in range(turns):
        prompt = prompt + [int(t) for t in rng.integers(3, vocab, 64)]
        before = cached.prefix_cache.hits
        got, ttft_cached = run(cached, prompt, turn)
        hit = cached.prefix_cache.hits - before
        # what the cache can hand out: the previous prompt's full chunks that lead this one
        expect = 0
        if last is not None:
            mine, known = chain_hashes(prompt, chunk, (len(prompt) - 1) // chunk), set(chain_hashes(last, chunk))
            while expect < len(mine) and mine[expect] in known:
                expect += 1
            expect *= chunk
        rows.append({"turn": turn, "prompt_tokens": len(prompt), "hit_tokens": hit, "expected_hit_tokens": expect,
                     "ttft_cached_s": round(ttft_cached or -1, 4)})
        prompts.append((list(prompt), got))
        last = prompt
        prompt = prompt + got
    del cached
    _free()
    plain = engine(False)
    for turn, (p, got) in enumerate(prompts):
        ref, ttft_plain = run(plain, p, turn)
        rows[turn].update(text_equal_uncached=got == ref, ttft_uncached_s=round(ttft_plain or -1, 4))
        print(json.dumps(rows[turn]), flush=True)
    del plain
    _free()
    return {"model": model, "backend": backend, "chunk": chunk, "rows": rows,
            "all_equal": all(r["text_equal_uncached"] for r in rows),
            "hits_as_expected": all(r["hit_tokens"] == r["expected_hit_tokens"] for r in rows),
            "every_turn_hit": all(r["hit_tokens"] > 0 for r in rows[1:])}


def _free() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="gpu.prefix_check")
    ap.add_argument("--model", default="north-mini-code")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=256)
    a = ap.parse_args()
    print(json.dumps(check_prefix_turns(a.model, a.backend, a.turns, a.prefix, chunk=a.chunk), indent=1))

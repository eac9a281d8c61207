"""Offline generation through the serving engine (``megac generate``, tools,
tests): the one generation loop, driven to completion in this thread.

::

    engine = build_engine(spec, weights, EngineOptions(backend="cpu"))
    outs = generate(engine, [[1, 2, 3], [4, 5]], max_tokens=32)
    outs[0].tokens, outs[0].finish_reason            # "stop" (EOS / stop token) or "length"

Every prompt becomes one :class:`~megac.engine.request.Request` (greedy, or
sampled with a generator seeded per prompt: ``seed`` int gives prompt ``i``
``seed + i``, a list gives each its own), submitted in order; the engine
batches them continuously, prefills in chunks and decodes through its
backend. The EOS or stop token that ends a request is not returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from megac.engine.request import Request
from megac.errors import MegacError
from megac.sampling import SamplingParams


@dataclass
class Completion:
    tokens: list[int]
    finish_reason: str  # "stop" | "length"
    #: fp32 logits [vocab] each token (and the final EOS) was sampled from (return_logits=True)
    logits: list[torch.Tensor] | None = None
    prompt_tokens: int = 0


def generate(engine, prompts: Sequence[Sequence[int]], *, max_tokens: int = 32, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, seed: int | Sequence[int] = 0,
             eos_token_ids: Sequence[int] | None = None, return_logits: bool = False) -> list[Completion]:
    """Run ``prompts`` through ``engine`` (an idle :class:`~megac.engine.scheduler.Engine`
    not running its own thread) to completion."""
    prompts = [[int(t) for t in p] for p in prompts]
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise MegacError("generate: empty prompt")
    if max_tokens < 1:
        raise MegacError(f"generate: max_tokens must be >= 1 (got {max_tokens})")
    seeds = [int(seed) + i for i in range(len(prompts))] if isinstance(seed, int) else [int(s) for s in seed]
    if len(seeds) != len(prompts):
        raise MegacError(f"generate: {len(seeds)} seeds for {len(prompts)} prompts")
    eos = list(engine.spec.eos_token_ids if eos_token_ids is None else eos_token_ids)
    mml = engine.config.max_model_len
    reqs = []
    for p, s in zip(prompts, seeds):
        if len(p) + max_tokens > mml:
            raise MegacError(f"generate: a prompt of {len(p)} tokens + {max_tokens} new ones exceeds the model "
                             f"length ({mml})")
        why = engine.check_fits(len(p) + max_tokens)
        if why:
            raise MegacError(f"generate: {why}")
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=s, max_tokens=max_tokens)
        r = Request(p, params, eos_ids=eos)
        r.keep_logits = return_logits
        reqs.append(r)
        engine.submit(r)
    engine.run_until_idle()
    out = []
    for r in reqs:
        if r.finish_reason not in ("stop", "length"):
            raise MegacError(f"generate: request ended with {r.finish_reason}")
        toks = list(r.output_ids)
        if r.finish_reason == "stop" and toks and toks[-1] in r.eos_ids:
            toks = toks[:-1]
        out.append(Completion(toks, r.finish_reason, list(r.logits) if return_logits else None, len(r.prompt_ids)))
    return out


__all__ = ["Completion", "generate"]

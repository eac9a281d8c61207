"""Test helpers: tiny random transformers models (``Cohere2MoeForCausalLM`` /
``LlamaForCausalLM``) built from a megac spec, saved with ``save_pretrained``.

Weights come from :func:`megac.weights.random.random_weights` (well-scaled, so
logits are spread and greedy tokens are not near-ties) and are loaded into
transformers' own model class; ``save_checkpoint`` then writes what
transformers writes (per-expert tensor names by default, fused ones with
``original_format=False``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from megac.abi import TASK_WORDS, H
from megac.spec import ModelSpec, load_spec
from megac.weights.canonical import ModelWeights
from megac.weights.hf import build_hf_model
from megac.weights.random import random_weights


def variant(spec: ModelSpec | str, name: str | None = None, *, moe: dict | None = None,
            layers: list[dict] | None = None, tiles: dict | None = None, **fields) -> ModelSpec:
    """``spec`` (or a bundled name) with fields replaced (``moe`` entries
    merged; ``tiles``: its target's tile settings, replaced)."""
    if isinstance(spec, str):
        spec = load_spec(spec)
    data = spec.model_dump()
    if name:
        data["name"] = name
    if moe:
        data["moe"] = {**data["moe"], **moe}
    if layers is not None:
        data["layers"] = layers
        data["num_layers"] = len(layers)
    data.update(fields)
    if tiles is not None:
        data["target"] = {**data["target"], "tiles": tiles}
    return ModelSpec.model_validate(data)


def tasks_of(sched, op):
    """The task words ``[n, TASK_WORDS]`` of opcode ``op`` in schedule
    ``sched`` (every SM's list in order)."""
    t = sched.tasks.reshape(-1, TASK_WORDS)
    return t[t[:, H.OPCODE] == int(op)]


def hf_model(spec: ModelSpec, weights: ModelWeights | None = None, *, seed: int = 0,
             dtype: torch.dtype = torch.float32):
    """transformers' model for ``spec`` holding ``weights`` (random by default)."""
    if weights is None:
        weights = random_weights(spec, seed=seed, dtype=dtype)
    return build_hf_model(weights, spec)


def save_checkpoint(spec: ModelSpec, directory: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                    original_format: bool = True, max_shard_size: str | None = None):
    """Build the tiny random model and ``save_pretrained`` it to ``directory``;
    returns the transformers model (the reference)."""
    model = hf_model(spec, seed=seed, dtype=dtype)
    kwargs = {"save_original_format": original_format}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(directory), **kwargs)
    return model


@torch.no_grad()
def hf_last_logits(model, tokens: list[int]) -> torch.Tensor:
    """fp32 logits of the last position of ``tokens`` (full recompute, no cache)."""
    ids = torch.tensor([tokens], dtype=torch.int64)
    return model(input_ids=ids, use_cache=False).logits[0, -1].float()


def assert_steps_match_hf(model, prompt: list[int], out, label=None, rtol: float = 1e-4) -> None:
    """Each decoded step of ``out`` (tokens and logits of ``prompt``'s
    generation): its logits within ``rtol`` of the largest of transformers'
    fp32 logits for the same sequence (the prompt and the tokens before)."""
    seq = list(prompt)
    for tok, logits in zip(out.tokens, out.logits):
        ref = hf_last_logits(model, seq)
        assert float((logits - ref).abs().max()) <= rtol * float(ref.abs().max()), label
        seq.append(tok)

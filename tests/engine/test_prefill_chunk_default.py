"""The prefill chunk when none is given: 1024 tokens on a GPU backend (where
a chunk's cost is mostly host launches), 256 on the CPU, always a multiple
of the model's KV block; an explicit chunk is kept."""

from __future__ import annotations

import pytest

import megac.engine.build as build
from megac.engine.build import EngineOptions, build_engine, default_prefill_chunk
from megac.spec import load_spec
from megac.weights.random import random_weights


@pytest.mark.parametrize("on_gpu, block, want", [(False, 16, 256), (True, 16, 1024), (True, 48, 1008),
                                                  (False, 512, 512)])
def test_default_chunk_follows_the_backend_and_the_block(monkeypatch, on_gpu, block, want):
    monkeypatch.setattr(build, "runs_on_gpu", lambda kind: on_gpu)
    assert default_prefill_chunk("cuda", block) == want


def test_cpu_engine_takes_the_cpu_default_unless_told():
    spec = load_spec("tiny-llama")
    w = random_weights(spec, seed=0)
    opts = dict(backend="cpu", max_batch_size=1, max_model_len=64)
    assert build_engine(spec, w, EngineOptions(**opts)).config.chunk_tokens == build.DEFAULT_PREFILL_CHUNK
    assert build_engine(spec, w, EngineOptions(**opts, prefill_chunk=32)).config.chunk_tokens == 32

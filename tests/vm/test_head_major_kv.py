"""Head-major KV pools (target tile ``kv_head_major``: storage ``[blocks,
kv_heads, block_size, head_dim]``, one KV head's keys of a block contiguous,
opcodes/kv_pool.cuh). The host sees them through a token-major view, so the
prefill's writes and the VM's reads over a head-major cache must give the
token-major cache's bits; the megakernel is generated for the layout and
only the GPU backends' engines take it."""

from __future__ import annotations

import pytest
import torch

from megac.codegen.megakernel import render_megakernel
from megac.engine.build import EngineOptions, build_engine
from megac.geometry import kv_head_major_of
from megac.kv.paged import PagedKVCache
from megac.passes.pipeline import compile_schedules
from megac.spec import load_spec
from megac.vm import VMBackend
from megac.weights import random_weights
from models import variant


def _head_major(name="tiny-moe"):
    spec = load_spec(name)
    return variant(spec, f"{name}-kvh", tiles={"kv_head_major": 1})


def test_prefill_and_vm_decode_over_a_head_major_pool_give_the_same_bits():
    """A 21-token prompt (two 16-token blocks, past tiny-moe's window of 8)
    then 6 greedy steps, once per layout: identical logits every step."""
    spec = load_spec("tiny-moe")
    w = random_weights(spec, seed=5)
    comp = compile_schedules(spec, batch_sizes=[1])
    prompt = torch.randint(3, spec.vocab_size, (21,), generator=torch.Generator().manual_seed(2)).tolist()
    runs = []
    for head_major in (False, True):
        kv = PagedKVCache(spec, max_rows=1, num_blocks=64, dtype=torch.float32, head_major=head_major)
        be = VMBackend(spec, w, kv, comp)
        row = kv.allocate_row()
        out = [be.prefill(row, prompt)]
        for _ in range(6):
            tok = int(out[-1].argmax())
            kv.append_slot(row)
            out.append(be.decode([row], [tok])[0])
        runs.append(torch.stack(out))
        assert kv.k_pool.transpose(1, 2).is_contiguous() is head_major
    assert torch.equal(runs[0], runs[1])


def test_the_megakernel_and_the_engines_follow_the_tile():
    """KV_HEAD_MAJOR in the generated model constants; a CPU engine keeps a
    token-major pool (the VM's), whatever the tile says."""
    spec = _head_major()
    assert kv_head_major_of(spec) and not kv_head_major_of(load_spec("tiny-moe"))
    res = compile_schedules(spec, batch_sizes=[1, 2])
    assert all(s.geometry.kv_head_major for s in res.schedules)
    assert "KV_HEAD_MAJOR = 1;" in render_megakernel(spec, res.schedules)
    assert "KV_HEAD_MAJOR = 0;" in render_megakernel(load_spec("tiny-moe"), compile_schedules(
        load_spec("tiny-moe"), batch_sizes=[1]).schedules)
    eng = build_engine(spec, random_weights(spec, seed=0), EngineOptions(backend="cpu", max_model_len=256))
    assert not eng.backend.kv.k_pool.transpose(1, 2).is_contiguous()  # token-major storage


@pytest.mark.parametrize("value", [2, -1])
def test_the_tile_is_zero_or_one(value):
    spec = load_spec("tiny-moe")
    with pytest.raises(ValueError, match="kv_head_major is 0 or 1"):
        variant(spec, "bad", tiles={"kv_head_major": value})

"""QKV tiles of part of a head (target tile ``qkv_bn`` < head_dim): more,
smaller Q/K/V projection tasks, so the attention behind them starts sooner
on more SMs. Each tile computes the same dot products and, with interleaved
RoPE, rotates the same adjacent column pairs, so decoding must give the
whole-head schedule's tokens and logits bit for bit, in the VM's fast mode
and in its checked mode (every read of q and of the KV pools against the
counters' happens-before order: attention must wait for every part of its
heads). Half-style RoPE pairs a column with one half a head away: such
models keep whole heads, and a spec that asks otherwise is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engines import assert_same_bits_as
from megac.abi import TASK_WORDS, H, Op, field_index
from megac.errors import MegacError
from megac.passes.pipeline import compile_one
from megac.spec import load_spec
from megac.weights import random_weights
from models import assert_steps_match_hf, hf_model, variant


def _spec(qkv_bn: int | None, name: str = "qkv"):
    """tiny-moe with heads of 32 dims (the smallest tile is 16 columns)."""
    moe = load_spec("tiny-moe")
    tiles = {"qkv_bn": qkv_bn} if qkv_bn else {}
    return variant(moe, f"{name}-{qkv_bn}", head_dim=32, q_width=moe.num_heads * 32, tie_embeddings=False,
                   tiles=tiles)


def _qkv_words(sched) -> np.ndarray:
    t = sched.tasks.reshape(-1, TASK_WORDS)
    return t[t[:, H.OPCODE] == int(Op.QKV_PROJ)]


def test_part_head_tiles_cover_every_head_and_attention_waits_for_all_of_them():
    whole, half = _spec(None), _spec(16)
    a = compile_one(whole, rows=2, context=1024)
    b = compile_one(half, rows=2, context=1024)
    wa, wb = _qkv_words(a), _qkv_words(b)
    assert len(wb) == 2 * len(wa)
    n_len = wb[:, field_index(Op.QKV_PROJ, "N_LEN")]
    n0 = wb[:, field_index(Op.QKV_PROJ, "N0")]
    assert set(n_len.tolist()) == {16}
    geo = b.geometry
    for layer in range(geo.num_layers):
        cols = np.sort(n0[wb[:, H.LAYER] == layer])
        assert cols.tolist() == list(range(0, geo.qkv_width, 16))
    # a decode split waits on its kv head's counter for every tile of its
    # query heads, its K head and its V head
    t = b.tasks.reshape(-1, TASK_WORDS)
    dec = t[t[:, H.OPCODE] == int(Op.ATTN_DECODE)]
    assert len(dec) and (dec[:, H.TARGET0] == 2 * (geo.heads_per_kv + 2)).all()


def test_part_head_tiles_give_the_whole_head_bits():
    base, half = _spec(None), _spec(16)
    w = random_weights(base, seed=11)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, base.vocab_size, (n,), generator=g).tolist() for n in (3, 19, 11)]
    assert_same_bits_as(base, half, w, prompts, "qkv_bn 16")


def test_part_head_tiles_match_transformers():
    """The same decode against transformers' model (fp32): every step's
    logits within 1e-4 of its scale (fp32 sums in another order)."""
    from engines import run
    from megac.passes.pipeline import compile_schedules

    half = _spec(16)
    w = random_weights(half, seed=5)
    prompt = torch.randint(0, half.vocab_size, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    out = run(half, w, compile_schedules(half, batch_sizes=[1], buckets=[1024]), [prompt], max_tokens=4,
              eos_token_ids=[], return_logits=True)[0]
    assert_steps_match_hf(hf_model(half, w), prompt, out)


@pytest.mark.parametrize("qkv_bn, why", [(24, "divide"), (8, "multiples of 16")])
def test_a_qkv_tile_that_does_not_split_a_head_evenly_is_refused(qkv_bn, why):
    with pytest.raises((MegacError, ValueError), match="qkv_bn"):
        _spec(qkv_bn)


def test_half_style_rope_keeps_whole_heads():
    llama = load_spec("tiny-llama")
    with pytest.raises((MegacError, ValueError), match="half-style RoPE"):
        variant(llama, "llama-qkv", head_dim=32, q_width=llama.num_heads * 32,
                tiles={"qkv_bn": 16})
    # at or above head_dim the tile is the whole head: accepted
    ok = variant(llama, "llama-qkv", head_dim=32, q_width=llama.num_heads * 32,
                 tiles={"qkv_bn": 64})
    assert compile_one(ok, rows=1, context=1024).geometry.qkv_bn == 32

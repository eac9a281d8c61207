"""The expert down projection split-K inside the up claims (target tile
``split_down``: a row bound). Each claimed up tile multiplies its SiLU*up
features by their columns of the expert's down matrix and writes that
partial of the expert's output (``moe_out`` gains a tile axis); MOE_COMBINE
sums a slot's tiles in tile order before weighting it; no MOE_DOWN_DRAIN,
and the combine waits on the up claims' one counter. The sums run in
another order than the down claims' (split-K), so the check is against
transformers' fp32 model and the default schedule's tokens, in the VM's
fast mode and in its checked mode (every read of moe_out against the
counters' happens-before order: the combine must wait for every tile)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engines import run
from megac.abi import Flag, H, Op, field_index
from megac.passes.pipeline import compile_one, compile_schedules
from megac.spec import load_spec
from megac.weights import random_weights
from models import assert_steps_match_hf, hf_model, tasks_of, variant


def _spec(bound: int, **tiles):
    """tiny-moe with experts of 64 features in up tiles of 32 (two split-K
    partials per expert; a slice's K a multiple of 32 as the tensor cores
    need): the split schedules' up tiles are the plain ones (split_up_bn 0)."""
    moe = load_spec("tiny-moe")
    return variant(moe, f"sd-{bound}-{'-'.join(f'{k}{v}' for k, v in tiles.items())}", tie_embeddings=False,
                   moe={"expert_intermediate_size": 64},
                   tiles={"split_down": bound, "moe_up_bn": 64,
                                                                "split_up_bn": 0, **tiles})


def test_split_schedules_have_no_down_claims_up_to_the_bound():
    spec = _spec(2)
    base = compile_one(_spec(0), "tuned", 2, 1024)
    for rows in (1, 2):
        s = compile_one(spec, "tuned", rows, 1024)
        assert "MOE_DOWN_DRAIN" not in s.tasks_per_opcode
        assert s.geometry.split_down and s.geometry.moe_out_tiles == s.geometry.up_tiles > 1
        up, comb = tasks_of(s, Op.MOE_UPGATE_DRAIN), tasks_of(s, Op.MOE_COMBINE)
        assert len(up) and (up[:, H.FLAGS] & int(Flag.SPLIT_DOWN)).all()
        assert len(comb) and (comb[:, H.FLAGS] & int(Flag.SPLIT_DOWN)).all()
    assert compile_one(spec, "tuned", 2, 1024).num_counters < base.num_counters
    # the combine of a row spread over combine_splits feature ranges that tile the row
    two = compile_one(spec, "tuned", 2, 1024)
    comb, D, S = tasks_of(two, Op.MOE_COMBINE), two.geometry.hidden, two.geometry.combine_splits
    assert S > 1 and len(comb) == 2 * S * len(two.geometry.moe_layers)
    for (layer, row) in {(int(w[H.LAYER]), int(w[field_index(Op.MOE_COMBINE, "ROW")])) for w in comb}:
        mine = comb[(comb[:, H.LAYER] == layer) & (comb[:, field_index(Op.MOE_COMBINE, "ROW")] == row)]
        c0 = np.sort(mine[:, field_index(Op.MOE_COMBINE, "COL0")])
        cols = mine[np.argsort(mine[:, field_index(Op.MOE_COMBINE, "COL0")]), field_index(Op.MOE_COMBINE, "COLS")]
        assert c0[0] == 0 and (c0[1:] == (c0 + cols)[:-1]).all() and c0[-1] + cols[-1] == D
        assert (c0 % 4 == 0).all() and (cols % 4 == 0).all()
    # past the bound the down claims are back, unflagged, on the same moe_out (tile 0)
    three = compile_one(spec, "tuned", 3, 1024)
    assert three.tasks_per_opcode["MOE_DOWN_DRAIN"] > 0 and not three.geometry.split_down
    assert three.geometry.moe_out_tiles == three.geometry.up_tiles
    assert not (tasks_of(three, Op.MOE_COMBINE)[:, H.FLAGS] & int(Flag.SPLIT_DOWN)).any()


@pytest.mark.parametrize("routed", [None, 0])
def test_split_down_matches_transformers_and_the_default_tokens(routed):
    """Batches of 1..3 rows through one engine (split at 1-2 rows, down
    claims at 3): every step's logits within 1e-4 of their scale of
    transformers' fp32 model, and the default schedule's tokens."""
    extra = {} if routed is None else {"routed_claims": routed}
    spec, base = _spec(2, **extra), _spec(0, **extra)
    w = random_weights(spec, seed=13)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for n in (7, 12, 4)]
    model = hf_model(spec, w)
    ref_tokens = [o.tokens for o in run(base, w, compile_schedules(base, batch_sizes=[1, 2, 4], buckets=[1024]),
                                        prompts, max_tokens=4, eos_token_ids=[])]
    scheds = compile_schedules(spec, batch_sizes=[1, 2, 4], buckets=[1024])
    for mode in ("fast", "checked"):
        for n in (1, 2, 3):
            out = run(spec, w, scheds, prompts[:n], max_tokens=4, eos_token_ids=[], return_logits=True, mode=mode)
            for p, o, want in zip(prompts, out, ref_tokens):
                assert o.tokens == want, (mode, n)
                assert_steps_match_hf(model, p, o, (mode, n))


def test_split_down_excludes_the_combine_in_the_norm():
    with pytest.raises(ValueError, match="split_down and fused_combine"):
        compile_one(_spec(1, fused_combine=1), "tuned", 1, 1024)


def test_split_down_is_a_row_bound():
    moe = load_spec("tiny-moe")
    with pytest.raises(ValueError, match="split_down"):
        variant(moe, "bad", tiles={"split_down": -2})


def test_automatic_split_is_batch_one_of_large_moe_models_with_their_own_tiles():
    """split_down -1: batch 1 where the model is wide (North Mini Code), off
    for a narrow one (tiny-moe); the split schedules take split_o_proj_bn
    (256 by default), the others keep theirs, and moe_out's tile axis follows
    the up tiles in every schedule (one kernel). Off by default (0). The
    O-projection merges the attention splits at batch 1 of the wide MoE
    model either way (o_proj_merge -1)."""
    from megac.geometry import DEFAULT_TILES, PLAIN_TILES, Geometry, split_down_bound

    assert (DEFAULT_TILES["split_down"], DEFAULT_TILES["split_up_bn"], DEFAULT_TILES["split_o_proj_bn"]) == (0, 0, 256)
    tiles = {"split_down": -1, "moe_up_bn": 128}
    tiny = load_spec("tiny-moe")
    tiny_auto = variant(tiny, "tiny-auto", tiles=tiles)
    assert split_down_bound(tiny_auto) == 0 and not Geometry.from_spec(tiny, 1, 1024).o_proj_merge
    nmc = load_spec("north-mini-code")
    auto = variant(nmc, "nmc-auto", tiles=tiles)
    assert split_down_bound(auto) == 1 and split_down_bound(nmc) == 0
    one, two = Geometry.from_spec(auto, 1, 8192), Geometry.from_spec(auto, 2, 8192)
    assert (one.split_down, one.moe_up_bn, one.o_proj_bn, one.o_proj_merge) == (True, 128, 256, True)
    plain = Geometry.from_spec(nmc, 1, 8192)
    assert (two.split_down, two.moe_up_bn, two.o_proj_bn, two.o_proj_merge) == (False, 128, plain.o_proj_bn, False)
    assert not plain.split_down and plain.o_proj_merge and plain.moe_up_bn == 256 and plain.o_proj_bn == 128
    none = variant(nmc, "nmc-plain", tiles=PLAIN_TILES)
    assert not Geometry.from_spec(none, 1, 8192).o_proj_merge
    assert one.moe_out_tiles == two.moe_out_tiles == 2 * 768 // 128
    assert plain.moe_out_tiles == 1


@pytest.mark.parametrize("up_bn, width, why", [(512, None, "at most 256 rows"), (96, None, "multiple of 32"),
                                                (128, 800, "must divide")])
def test_split_down_needs_up_tiles_that_slice_the_down_matrix(up_bn, width, why):
    """An up tile's features are the down projection's K slice: at most 128
    (their rows live in shared memory), a multiple of 32 (the tensor cores'
    blocks), and the tiles must cover the expert evenly."""
    from megac.geometry import Geometry

    nmc = load_spec("north-mini-code")
    spec = variant(nmc, f"sd-bad-{up_bn}", moe={"expert_intermediate_size": width} if width else None,
                   tiles={"split_down": 1, "moe_up_bn": up_bn, "split_up_bn": 0})
    with pytest.raises(ValueError, match=why):
        Geometry.from_spec(spec, 1, 1024)


def test_split_up_tiles_of_their_own_share_one_interleave():
    """One copy of the expert weights serves every batch size, so the
    gate/up interleave is the chunk every schedule's tiles hold whole:
    half the gcd of the plain and the split up tiles (North Mini Code with
    128-row split tiles beside 256-row plain ones: chunks of 64, in both
    schedules), and the automatic bound keeps the split."""
    from megac.geometry import Geometry, split_down_bound

    nmc = load_spec("north-mini-code")
    assert Geometry.from_spec(nmc, 1, 8192).moe_chunk == 128  # no split: moe_up_bn / 2
    own = variant(nmc, "sd-own", tiles={"split_down": -1, "split_up_bn": 128})
    assert split_down_bound(own) == 1
    one, two = Geometry.from_spec(own, 1, 8192), Geometry.from_spec(own, 2, 8192)
    assert (one.split_down, one.moe_up_bn, one.moe_chunk) == (True, 128, 64)
    assert (two.split_down, two.moe_up_bn, two.moe_chunk) == (False, 256, 64)


@pytest.mark.parametrize("n", [1, 3])
def test_split_up_tiles_of_their_own_match_transformers(n):
    """Experts of 64 features: plain up tiles of all 128 gate/up rows, split
    tiles of 64 rows at 1-2 rows (gate/up chunks of 32, so a plain tile
    pairs two chunks): the step of one row (split) and of three (plain
    tiles over two chunks each) within 1e-4 of transformers' fp32 model."""
    spec = _spec(2, moe_up_bn=128, split_up_bn=64)
    scheds = compile_schedules(spec, batch_sizes=[1, 4], buckets=[1024])
    assert {s.geometry.moe_chunk for s in scheds.schedules} == {32}
    assert {s.geometry.moe_up_bn for s in scheds.schedules} == {64, 128}
    w = random_weights(spec, seed=29)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, spec.vocab_size, (k,), generator=g).tolist() for k in (9, 5, 11)][:n]
    model = hf_model(spec, w)
    for p, o in zip(prompts, run(spec, w, scheds, prompts, max_tokens=3, eos_token_ids=[], return_logits=True)):
        assert_steps_match_hf(model, p, o)


def test_the_o_projection_over_attention_and_qkv_sms_gives_the_same_bits():
    """schedules/experiments/split-oproj-attn-qkv.yaml places a split
    schedule's O-projection tiles on the attention SMs and then on the QKV
    SMs, before their up claimers: where a task runs changes no arithmetic,
    so one row decodes to the tuned order's tokens and logits bit for bit,
    in the VM's fast mode and in its checked mode (every read against the
    counters' happens-before order)."""
    from megac.resources import schedules_dir

    spec = _spec(1)
    order = str(schedules_dir() / "experiments" / "split-oproj-attn-qkv.yaml")
    base = compile_schedules(spec, batch_sizes=[1], buckets=[1024])
    moved = compile_schedules(spec, order=order, batch_sizes=[1], buckets=[1024])
    assert moved.schedules[0].geometry.split_down
    assert not np.array_equal(moved.schedules[0].tasks, base.schedules[0].tasks)
    w = random_weights(spec, seed=31)
    prompt = [torch.randint(0, spec.vocab_size, (7,), generator=torch.Generator().manual_seed(8)).tolist()]
    ref = run(spec, w, base, prompt, max_tokens=4, eos_token_ids=[], return_logits=True)[0]
    for mode in ("fast", "checked"):
        got = run(spec, w, moved, prompt, max_tokens=4, eos_token_ids=[], return_logits=True, mode=mode)[0]
        assert got.tokens == ref.tokens, mode
        assert all(torch.equal(a, b) for a, b in zip(got.logits, ref.logits)), mode

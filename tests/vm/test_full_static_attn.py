"""Full-attention layers' splits as static tasks (target tile
``full_static_attn: N``, schedules of at most N rows: geometry
``full_static``). A full layer's attention lowers to ATTN_DECODE tasks, one
per (row, KV head, split) for every split of the bucket's context, reading
the row's split count from the host's full-layer word, instead of ATTN_DRAIN
claims of the host's attention queue (which the host then leaves empty).
The split ranges and the arithmetic are the claims', so the logits must
equal the default schedule's exactly, in the VM's fast mode and in its
checked mode (every read against the counters' happens-before order: each
O-projection or combine must wait for all of its head's static splits).
A VM or a lowering that left out the splits past the first, or read the
sliding word, would change the logits of rows longer than one split."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engines import assert_same_bits_as
from megac import abi
from megac.abi import Flag, H, Op, field_index
from megac.geometry import Geometry
from megac.passes.pipeline import compile_one
from megac.runtime.step import host_words
from megac.spec import load_spec
from megac.weights import random_weights
from models import tasks_of, variant


def _spec(name: str, bound: int):
    return variant(load_spec(name), f"{name}-fs{bound}", tie_embeddings=False, tiles={"full_static_attn": bound})


def test_full_layers_lower_to_static_splits_sized_for_the_bucket():
    spec, base = _spec("tiny-moe", 1), _spec("tiny-moe", 0)
    for ctx in (128, 1024):
        sched = compile_one(spec, "tuned", 1, ctx)
        geo = sched.geometry
        assert geo.full_static and geo.full_layers
        assert not len(tasks_of(sched, Op.ATTN_DRAIN))
        dec = tasks_of(sched, Op.ATTN_DECODE)
        tw = geo.target_words
        for l in range(geo.num_layers):
            mine = dec[dec[:, H.LAYER] == l]
            f = lambda n: mine[:, field_index(Op.ATTN_DECODE, n)]  # noqa: E731
            if geo.sliding[l]:
                assert len(mine) == geo.kv_heads * geo.sliding_static_splits
                assert (mine[:, H.FLAGS] & int(Flag.SLIDING)).all()
                continue
            # every (kv head, split) of the bucket's context, each once
            S = geo.attn_splits(geo.context)
            assert S == geo.full_max_splits and S > 1
            assert sorted(zip(f("KV_HEAD"), f("SPLIT"))) == [(h, s) for h in range(geo.kv_heads) for s in range(S)]
            assert not (mine[:, H.FLAGS] & int(Flag.SLIDING)).any() and (f("WINDOW") == 0).all()
            # the split count is the host's full-layer word of the row, not the sliding one
            assert (f("NUM_SPLITS") == abi.dyn(tw.attn_splits_full(0))).all()
        # the default claims them
        assert len(tasks_of(compile_one(base, "tuned", 1, ctx), Op.ATTN_DRAIN))
    # past the row bound the schedule claims them, task for task the default's
    two, two_base = compile_one(spec, "tuned", 2, 1024), compile_one(base, "tuned", 2, 1024)
    assert not two.geometry.full_static
    assert (two.tasks == two_base.tasks).all()


def test_static_full_splits_compile_per_bucket_and_leave_the_queue_empty():
    spec = _spec("tiny-moe", 1)
    sig = {ctx: Geometry.from_spec(spec, 1, ctx).split_signature for ctx in (128, 512, 1024, 4096)}
    # the static splits follow the bucket's context up to attn_max_splits
    assert len({sig[128], sig[512], sig[1024]}) == 3 and sig[1024] == sig[4096]
    base = _spec("tiny-moe", 0)
    assert Geometry.from_spec(base, 1, 1024).split_signature == Geometry.from_spec(base, 1, 4096).split_signature
    for s, want_queue in ((spec, False), (base, True)):
        geo = Geometry.from_spec(s, 1, 1024)
        targets = np.full(geo.target_words.total, -7, dtype=np.int64)
        queue = np.zeros((geo.attn_queue_cap, abi.QUEUE_RECORD_WORDS), dtype=np.int64)
        n = host_words(geo, [300], targets, queue)
        splits = geo.attn_splits(301)
        assert targets[geo.target_words.attn_splits_full(0)] == splits > 1
        assert n == (geo.kv_heads * splits if want_queue else 0)
        assert targets[geo.target_words.attn_queue_len] == n


def test_a_bad_full_static_bound_is_refused():
    with pytest.raises(ValueError, match="full_static_attn is a row bound"):
        _spec("tiny-moe", -1)


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-llama"])
def test_static_full_splits_give_the_default_logits_bit_for_bit(name):
    """Rows of 1 to 4 over prompts long enough for several splits a full
    layer (and short ones, whose splits past the first are empty), two
    context buckets: every step's logits equal the claiming schedule's."""
    spec, base = _spec(name, 4), _spec(name, 0)
    w = random_weights(spec, seed=41)
    g = torch.Generator().manual_seed(13)
    split = spec.target.attn_split_tokens
    lengths = (2 * split + 5, 3, split - 1, 3 * split + 9)
    prompts = [torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for n in lengths]
    for ps in ([prompts[0]], prompts[:2], prompts):
        assert_same_bits_as(base, spec, w, ps, (name, len(ps)), buckets=(256, 1024), max_tokens=4)


def test_the_full_static_order_puts_a_full_layers_splits_on_its_qkv_sms_before_the_up_claimers():
    """schedules/experiments/full-static.yaml places a full layer's attention
    on its QKV SMs: static (one row), each split after that SM's QKV tile and
    before its up claimer; claimed (two rows), the placement is moot and the
    claimers are dealt in place on every SM."""
    from megac.resources import schedules_dir

    order = str(schedules_dir() / "experiments" / "full-static.yaml")
    spec = _spec("tiny-moe", 1)
    sched = compile_one(spec, order, 1, 1024)
    geo = sched.geometry
    moe_full = [l for l in geo.moe_layers if not geo.sliding[l]]
    assert moe_full
    for l in moe_full:
        seen = 0
        for sm in range(sched.tasks.shape[0]):
            ops = [int(w[H.OPCODE]) for w in sched.tasks[sm] if int(w[H.LAYER]) == l and int(w[H.OPCODE])]
            if Op.ATTN_DECODE not in ops:
                continue
            seen += ops.count(Op.ATTN_DECODE)
            first = ops.index(Op.ATTN_DECODE)
            assert Op.QKV_PROJ in ops[:first] and Op.MOE_UPGATE_DRAIN in ops[first:], (l, sm, ops)
        assert seen == geo.kv_heads * geo.full_max_splits
    two = compile_one(spec, order, 2, 1024)
    drains = tasks_of(two, Op.ATTN_DRAIN)
    assert len(drains) == two.tasks.shape[0] * len(two.geometry.full_layers)


def test_the_cost_model_charges_a_static_full_layers_keys_once_at_a_shorter_context():
    """A bucket's static splits at a context shorter than the bucket's: the
    splits past the row's count read no keys, so a full layer's attention
    moves the context's K and V once (within one key a split of rounding),
    not the bucket's splits times the context's split length."""
    from megac import costmodel as cm

    spec = _spec("tiny-moe", 1)
    sched = compile_one(spec, "tuned", 1, 1024)
    geo = sched.geometry
    for ctx in (100, 500):
        r = cm.simulate(sched, context=ctx)
        ns = geo.attn_splits(ctx)
        assert ns < geo.full_max_splits
        fixed = geo.heads_per_kv * geo.head_dim * 2 + geo.heads_per_kv * (geo.head_dim + 1) * 4
        for l in geo.full_layers:
            m = (r.layer == l) & (r.opcode == Op.ATTN_DECODE)
            kv = r.nbytes[m].sum() - m.sum() * fixed
            want = geo.kv_heads * ctx * geo.head_dim * 2 * 2
            assert want <= kv <= want + geo.kv_heads * ns * geo.head_dim * 2 * 2, (ctx, l)

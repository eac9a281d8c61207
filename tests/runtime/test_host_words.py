"""The host words of a step (megac.runtime.step.host_words) against the
rule written out plainly here: per row, the full-attention split count of
its span and the sliding one of its window, and one attention record
{row, kv head, split, num splits} per full-attention split, row by row,
then split, then kv head (a split's heads share its KV pages)."""

from __future__ import annotations

import numpy as np
import pytest

from megac import abi
from megac.errors import MegacError
from megac.passes.pipeline import compile_one
from megac.runtime.step import host_words
from megac.spec import load_spec


def spelled_out(geo, positions):
    splits_full, splits_sliding, records = [], [], []
    for i in range(geo.rows):
        seq = positions[i] + 1 if i < len(positions) else 1
        full = min(geo.attn_max_splits, max(1, -(-seq // geo.attn_split_tokens)))
        span = min(seq, geo.max_window)
        sliding = min(geo.attn_max_splits, max(1, -(-span // geo.attn_split_tokens))) if geo.max_window else 0
        splits_full.append(full)
        splits_sliding.append(sliding)
        if geo.full_layers:
            records += [(i, h, s, full) for s in range(full) for h in range(geo.kv_heads)]
    return splits_full, splits_sliding, records


@pytest.mark.parametrize("model,rows,context", [("north-mini-code", 8, 8192), ("tiny-moe", 4, 256),
                                                ("tiny-llama", 2, 128)])
def test_host_words_follow_the_rule(model, rows, context):
    geo = compile_one(load_spec(model), "tuned", rows=rows, context=context).geometry
    tw = geo.target_words
    rng = np.random.default_rng(11)
    R = [abi.record_index(abi.Queue.ATTN, f) for f in ("ROW", "KV_HEAD", "SPLIT", "NUM_SPLITS")]
    for live in range(rows + 1):
        positions = rng.integers(0, context, size=live).tolist()
        targets = np.full(tw.host_words + 8, 77, dtype=np.int32)
        queue = np.full((geo.kv_heads * geo.attn_max_splits * rows, abi.QUEUE_RECORD_WORDS), -5, dtype=np.int32)
        n = host_words(geo, positions, targets, queue)
        full, sliding, records = spelled_out(geo, positions)
        assert n == len(records) == targets[tw.attn_queue_len]
        assert [int(targets[tw.attn_splits_full(i)]) for i in range(rows)] == full
        assert [int(targets[tw.attn_splits_sliding(i)]) for i in range(rows)] == sliding
        assert [tuple(int(x) for x in queue[k, R]) for k in range(n)] == records
        assert (queue[n:] == -5).all()  # nothing past the queue's length


def test_a_queue_too_small_is_refused():
    geo = compile_one(load_spec("tiny-moe"), "tuned", rows=2, context=256).geometry
    targets = np.zeros(geo.target_words.host_words + 1, dtype=np.int32)
    with pytest.raises(MegacError, match="over capacity"):
        host_words(geo, [200, 200], targets, np.zeros((1, abi.QUEUE_RECORD_WORDS), dtype=np.int32))

"""The LM head's argmax record (abi.ARGMAX_RECORD) and the greedy rule.

One rule everywhere: the larger value wins, ties go to the lower vocabulary
index, NaN ranks above every number (lowest-index NaN wins) -- which is what
torch.argmax does over the full row, so the records reduce to the sampler's
greedy token. Checked here for the ABI helpers on their own and for the
records the VM writes (fast and checked modes), on random inputs and on LM
heads built to force ties within and across tiles, and NaN logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megac import abi
from megac.kv import PagedKVCache
from megac.passes.pipeline import compile_one
from megac.vm import DecodeStep, DeviceState, VMWeights
from megac.weights import random_weights
from models import variant

VOCAB = 1000  # four LM tiles of 256, the last one short (232)
ROWS = 3


def _records(values: np.ndarray, bn: int) -> np.ndarray:
    """Per-tile records of ``values`` [rows, n] by abi.argmax_select, the
    short last tile padded with -inf (as the VM does)."""
    rows, n = values.shape
    tiles = -(-n // bn)
    pad = np.full((rows, tiles * bn), -np.inf, dtype=np.float32)
    pad[:, :n] = values
    seg = pad.reshape(rows, tiles, bn)
    cols = np.arange(tiles * bn).reshape(tiles, bn)
    pos = abi.argmax_select(seg, cols)
    rec = np.empty((rows, tiles, abi.ARGMAX_RECORD_WORDS), dtype=np.int32)
    rec[..., 0] = np.take_along_axis(seg, pos[..., None], axis=-1)[..., 0].view(np.int32)
    rec[..., 1] = cols[:, 0] + pos
    return rec


def _tile_argmax(values: np.ndarray, bn: int) -> np.ndarray:
    """Per-tile records by numpy's argmax over each tile's own columns
    (first maximum, NaN first): independent of abi.argmax_select, which the
    VM itself calls."""
    rows, n = values.shape
    tiles = -(-n // bn)
    rec = np.empty((rows, tiles, abi.ARGMAX_RECORD_WORDS), dtype=np.int32)
    for t in range(tiles):
        seg = values[:, t * bn:(t + 1) * bn]
        pos = np.argmax(seg, axis=-1)
        rec[:, t, 0] = seg[np.arange(rows), pos].view(np.int32)
        rec[:, t, 1] = t * bn + pos
    return rec


def test_rule_is_torch_argmax():
    """argmax_select and argmax_reduce agree with torch.argmax over the full
    row on ties (within and across tiles), +-inf, signed zeros and NaNs, and
    the reduction does not depend on the order of the records."""
    rng = np.random.default_rng(0)
    for trial in range(300):
        n = int(rng.integers(1, 400))
        v = rng.integers(-3, 4, (4, n)).astype(np.float32)  # few values: many ties
        if trial % 3 == 0:
            v[rng.random(v.shape) < 0.02] = np.nan
        if trial % 5 == 0:
            v[rng.random(v.shape) < 0.05] = np.inf
        if trial % 7 == 0:
            v[1] = -np.inf
        if trial % 11 == 0:
            v[2] = -0.0
            v[2, -1] = 0.0
        want = torch.from_numpy(v).argmax(-1).numpy()
        assert np.array_equal(abi.argmax_select(v, np.arange(n)), want)
        rec = _records(v, int(rng.integers(1, 64)))
        rec = rec[:, rng.permutation(rec.shape[1])]
        tokens, values = abi.argmax_reduce(rec)
        assert np.array_equal(tokens, want)
        assert np.array_equal(values.view(np.int32), v[np.arange(4), want].view(np.int32))


def test_record_layout():
    assert abi.ARGMAX_RECORD_BYTES == 8 and [(n, c) for n, c, _ in abi.ARGMAX_RECORD] == [
        ("value", "f32"), ("index", "i32")]
    with pytest.raises(ValueError, match="int32"):
        abi.argmax_reduce(np.zeros((2, 3, 2), dtype=np.float32))


# --------------------------------------------------------------------------- the VM
_SCHED: dict = {}


def _schedule():
    if not _SCHED:
        spec = variant("tiny-llama", "argmax-llama", tie_embeddings=False, vocab_size=VOCAB)
        _SCHED["v"] = (spec, compile_one(spec, "tuned", rows=ROWS, context=64))
    return _SCHED["v"]


def _lm_head(kind: str, spec, seed: int) -> torch.Tensor | None:
    """LM-head weights for ``kind`` (None: the random ones).

    ties: every row has one nonzero, a in {+-1, +-2} at a dim d < 4, so each
    logit is exactly a * x[d] and the 16 (a, d) pairs repeat ~62 times over
    the vocabulary: every row's maximum occurs several times in one tile and
    in several tiles. nan: random rows plus NaN rows at 700, 300 and 290."""
    if kind == "random":
        return None
    g = torch.Generator().manual_seed(seed)
    if kind == "ties":
        w = torch.zeros(VOCAB, spec.hidden_size)
        a = torch.tensor([-2.0, -1.0, 1.0, 2.0])[torch.randint(0, 4, (VOCAB,), generator=g)]
        w[torch.arange(VOCAB), torch.randint(0, 4, (VOCAB,), generator=g)] = a
        return w
    w = torch.randn(VOCAB, spec.hidden_size, generator=g) * spec.hidden_size ** -0.5
    w[[700, 300, 290]] = float("nan")
    return w


@pytest.mark.parametrize("mode", ["fast", "checked"])
@pytest.mark.parametrize("kind", ["random", "ties", "nan"])
def test_vm_records_reduce_to_torch_argmax(kind, mode):
    spec, sched = _schedule()
    geo = sched.geometry
    assert geo.lm_tiles == 4 and geo.vocab % geo.lm_bn
    for seed in (1, 2):
        w = random_weights(spec, seed=seed)
        head = _lm_head(kind, spec, seed)
        if head is not None:
            w.lm_head = head
        step = DecodeStep(DeviceState(sched, VMWeights.from_weights(w, spec, geo)), mode=mode)
        kv = PagedKVCache(spec, max_rows=ROWS, num_blocks=32, dtype=torch.float32)
        rows = [kv.allocate_row() for _ in range(ROWS)]
        g = torch.Generator().manual_seed(10 + seed)
        tokens = torch.randint(0, VOCAB, (ROWS,), generator=g).tolist()
        for _ in range(2):
            out = step(kv, rows, tokens)
            logits = step.st["logits"][:ROWS]
            want = logits.argmax(-1)
            rec = step.st["argmax_part"][:ROWS]
            got, values = abi.argmax_reduce(rec)
            assert np.array_equal(got, want.numpy())
            assert np.array_equal(got, np.argmax(logits.numpy(), axis=-1))  # numpy's reduction agrees
            assert np.array_equal(values.view(np.int32), logits.view(torch.int32)[torch.arange(ROWS), want].numpy())
            # each tile's record is that tile's own greedy pick
            assert np.array_equal(rec.numpy(), _tile_argmax(logits.numpy(), geo.lm_bn))
            assert torch.equal(out.argmax(-1), want)  # logit_scale 1: the sampler's greedy
            if kind == "ties":
                top = logits == logits.max(-1, keepdim=True).values
                per_tile = torch.nn.functional.pad(top, (0, geo.lm_tiles * geo.lm_bn - VOCAB))
                per_tile = per_tile.view(ROWS, geo.lm_tiles, geo.lm_bn).sum(-1)
                assert (per_tile.max(-1).values >= 2).all() and ((per_tile > 0).sum(-1) >= 2).all()
            if kind == "nan":
                assert got.tolist() == [290] * ROWS and np.isnan(values).all()
            tokens = got.tolist()

"""``megac bench``'s measurement core on the CPU VM: every case decodes,
the numbers are consistent, and the bytes a step moves follow the model's
dimensions (KV grows by exactly 2 x layers x kv_heads x head_dim x 2 bytes
per token and row)."""

from __future__ import annotations

import pytest

from megac import decode_bench as db
from megac.engine.build import EngineOptions, build_engine
from megac.passes.pipeline import compile_one
from megac.spec import load_spec
from megac.weights import random_weights


def test_kv_bytes_grow_with_the_context_as_the_dimensions_say():
    spec = load_spec("tiny-llama")
    sched = compile_one(spec, order="tuned", rows=2, context=256)
    # 40 and 60 tokens: the same number of attention splits (so the same
    # partials): only the keys read differ
    split = spec.target.attn_split_tokens
    assert -(-40 // split) == -(-60 // split)
    a, _ = db.step_bytes(sched, 40)
    b, _ = db.step_bytes(sched, 60)
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 2  # K and V, bf16
    assert b - a == per_token * (60 - 40) * 2  # two rows
    w = random_weights(spec, seed=0)
    assert a >= 2 * (w.num_params() - spec.vocab_size * spec.hidden_size)  # every weight but the gathered embedding


@pytest.fixture(scope="module")
def engine():
    spec = load_spec("tiny-moe")
    eng = build_engine(spec, random_weights(spec, seed=1), EngineOptions(backend="cpu", max_batch_size=4,
                                                                           max_model_len=256))
    db.fill_kv_noise(eng.kv)
    return eng


def test_run_reports_each_case_and_frees_its_rows(engine):
    seen = []
    free_before = engine.kv.num_free_blocks
    rows = db.run(engine, [(1, 64), (2, 200)], steps=2, warmup=1, progress=lambda *a: seen.append(a))
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 64), (2, 200)]
    for r in rows:
        assert r["kernel_ms"] > 0 and r["step_ms"] >= r["kernel_ms"]
        assert r["tok_s"] == pytest.approx(r["batch"] * 1e3 / r["kernel_ms"], rel=1e-2)
        assert r["bytes"] > 0 and r["predicted_ms"] > 0
    assert seen[-1][1:] == (6, 6)  # (2 + 1) steps per case, two cases
    assert engine.kv.num_free_blocks == free_before  # every case's rows were freed
    text = db.table(rows)
    assert "ms/step" in text and len(text.splitlines()) == 4


def test_a_batch_over_the_backend_is_refused(engine):
    from megac.errors import MegacError

    with pytest.raises(MegacError, match="exceeds"):
        db.run(engine, [(99, 64)], steps=1, warmup=0)


@pytest.mark.parametrize("context", [40, 700])
def test_the_bench_pool_holds_rows_filled_in_pieces(context):
    """rows_at fills a row in 512-token pieces; a sliding window shorter
    than a piece holds the whole piece for a moment, so the steady-state
    count alone ran `megac bench tiny-moe --batch-size 8 --context 40` out of
    blocks. pool_blocks rows fill a pool of exactly that size, then step."""
    from megac import decode_bench as db
    from megac.kv.paged import PagedKVCache
    from megac.spec import load_spec

    spec = load_spec("tiny-moe")
    steps = 5
    kv = PagedKVCache(spec, max_rows=8, num_blocks=db.pool_blocks(spec, 8, context + steps),
                      max_context=context + steps)
    rows = db.rows_at(kv, 8, context)
    for _ in range(steps):
        for r in rows:
            kv.append_slot(r)
            kv.advance(r, 1)
    assert all(int(kv.seq_pos[r]) == context - 1 + steps for r in rows)


def test_the_model_column_simulates_the_schedule_the_timed_steps_ran(monkeypatch):
    """A case at a bucket's edge (1024 tokens) decodes its timed steps at
    1025 and beyond, on the next bucket's schedule: the bytes and the cost
    model's prediction must come from that schedule, not the 1024 bucket's
    (North Mini Code at batch 4: +10.9 % against +2.7 % once it did)."""
    from megac.runtime.schedules import ScheduleSet

    spec = load_spec("tiny-moe")
    eng = build_engine(spec, random_weights(spec, seed=2), EngineOptions(backend="cpu", max_batch_size=1,
                                                                           max_model_len=2048))
    db.fill_kv_noise(eng.kv)
    picked = []
    real = ScheduleSet.pick

    def spy(self, rows, context):
        s = real(self, rows, context)
        picked.append((context, int(s.geometry.context)))
        return s

    monkeypatch.setattr(ScheduleSet, "pick", spy)
    db.run(eng, [(1, 1024)], steps=2, warmup=1)
    # the first pick is the bench's own (the median timed step's), then one per decoded step
    bench, steps = picked[0], picked[1:]
    assert [ctx for ctx, _ in steps] == [1024, 1025, 1026]
    # the bench asks for the median timed step's context and gets that step's schedule (tiny-moe's
    # buckets share one schedule; North Mini Code's 1024 and 2048 buckets do not)
    assert bench == (db.timed_context(1024, 1, 2), steps[-1][1]) and 1025 <= bench[0] <= 1026

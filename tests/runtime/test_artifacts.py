"""Compile or load: the artifact cache is keyed by what decides the task
words, a second load compiles nothing, and an artifact of another model is
refused with one line."""

from __future__ import annotations

import numpy as np
import pytest

from megac.errors import MegacError
from megac.runtime.artifacts import cache_path, load_or_compile
from megac.spec import load_spec


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _same(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(sorted(a, key=lambda s: (s.rows, s.context)), sorted(b, key=lambda s: (s.rows, s.context))):
        assert (x.rows, x.context) == (y.rows, y.context)
        assert np.array_equal(x.tasks, y.tasks) and np.array_equal(x.task_counts, y.task_counts)
        assert np.array_equal(x.global_order, y.global_order)


def test_second_load_compiles_nothing(cache):
    spec = load_spec("tiny-moe")
    first = load_or_compile(spec, "tuned", batch_sizes=[1, 2])
    assert not first.cached and first.path.is_relative_to(cache)
    assert (first.path / "manifest.json").is_file() and (first.path / "megac_layout.h").is_file()
    second = load_or_compile(spec, "tuned", batch_sizes=[1, 2])
    assert second.cached and second.path == first.path
    _same(first.schedules, second.schedules)
    # what decides the words is in the key: another order, another entry
    other = load_or_compile(spec, "interleaved", batch_sizes=[1, 2])
    assert not other.cached and other.path != first.path
    assert cache_path(spec, "interleaved", [1, 2]) == other.path


def test_damaged_entry_is_recompiled(cache):
    spec = load_spec("tiny-llama")
    first = load_or_compile(spec, "tuned", batch_sizes=[1])
    npz = first.path / "schedule.npz"
    npz.write_bytes(npz.read_bytes()[:-7])
    again = load_or_compile(spec, "tuned", batch_sizes=[1])
    assert not again.cached
    _same(first.schedules, again.schedules)


def test_named_artifact_must_fit_the_model(cache, tmp_path):
    moe = load_spec("tiny-moe")
    built = load_or_compile(moe, "tuned", batch_sizes=[1])
    got = load_or_compile(moe, "tuned", artifact=built.path)
    assert got.cached
    _same(built.schedules, got.schedules)
    with pytest.raises(MegacError, match=r"built for tiny-moe, whose .* differs from the model tiny-llama"):
        load_or_compile(load_spec("tiny-llama"), "tuned", artifact=built.path)
    with pytest.raises(MegacError, match="not a megac artifact"):
        load_or_compile(moe, "tuned", artifact=tmp_path)

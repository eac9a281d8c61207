"""Shared pytest setup: GPU tests skip cleanly (and visibly) without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

# helper modules of tests/ (``from models import ...``) importable from test files in subdirectories
_TESTS = str(Path(__file__).parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

import pytest  # noqa: E402


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # torch missing or broken: no GPU path either
        return False


def pytest_collection_modifyitems(config, items):
    # pytest-xdist (scripts/test.sh) schedules tests by node id: tests that
    # share one would run once and the rest vanish without a word
    seen: set[str] = set()
    twice = sorted({i.nodeid for i in items if i.nodeid in seen or seen.add(i.nodeid)})
    if twice:
        raise pytest.UsageError(f"tests share a node id (only one would run under xdist): {', '.join(twice[:5])}")
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (marked gpu)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not the tests/gpu/ directory name
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _private_artifact_cache(tmp_path_factory):
    """Artifacts compiled by tests (and by the servers and CLIs they start)
    go to a cache of this session, never the user's ~/.cache/megac."""
    import os

    old = os.environ.get("MEGAC_CACHE_DIR")
    os.environ["MEGAC_CACHE_DIR"] = str(tmp_path_factory.mktemp("megac-cache"))
    yield
    if old is None:
        os.environ.pop("MEGAC_CACHE_DIR", None)
    else:
        os.environ["MEGAC_CACHE_DIR"] = old


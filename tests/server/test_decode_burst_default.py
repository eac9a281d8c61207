"""``megac serve``'s decode burst: unset, it is DEFAULT_GPU_DECODE_BURST on a
backend that runs on the GPU (where bursts pipeline the host part away) and
1 on the CPU (nothing to hide there; an arrival would only wait longer); a
given value is kept either way."""

from __future__ import annotations

import pytest

import megac.runtime.backends as backends
from megac.server import startup
from megac.server.config import ServeConfig


@pytest.mark.parametrize("on_gpu, given, want", [(False, None, 1), (True, None, startup.DEFAULT_GPU_DECODE_BURST),
                                                  (True, 1, 1), (False, 3, 3)])
def test_burst_default_follows_the_backend(monkeypatch, on_gpu, given, want):
    cfg = ServeConfig(model="tiny-llama", backend="cpu", random_weights=True, max_batch_size=2, max_model_len=64,
                      decode_burst=given)
    loaded = startup.load_served_model(cfg)  # on the CPU: only the burst's choice sees a GPU
    monkeypatch.setattr(backends, "runs_on_gpu", lambda kind: on_gpu)
    engine = startup.build_served_engine(cfg, loaded)
    assert engine.config.decode_burst == want

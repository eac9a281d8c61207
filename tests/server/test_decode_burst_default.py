"""``megac serve``'s decode burst: unset, it is the engine builder's default
(``megac.engine.build.default_decode_burst``): DEFAULT_DECODE_BURST_GPU on a
backend that runs on the GPU (where bursts pipeline the host part away) and
1 on the CPU (nothing to hide there; an arrival would only wait longer); a
given value is kept either way."""

from __future__ import annotations

import pytest

import megac.engine.build as build
from megac.server import startup
from megac.server.config import ServeConfig


@pytest.mark.parametrize("on_gpu, given, want", [(False, None, 1), (True, None, build.DEFAULT_DECODE_BURST_GPU),
                                                  (True, 1, 1), (False, 3, 3)])
def test_burst_default_follows_the_backend(monkeypatch, on_gpu, given, want):
    cfg = ServeConfig(model="tiny-llama", backend="cpu", random_weights=True, max_batch_size=2, max_model_len=64,
                      decode_burst=given)
    loaded = startup.load_served_model(cfg)
    real = build.default_decode_burst

    def chosen(kind):  # the real choice, as if the backend ran on the GPU; the engine itself stays on the CPU
        with monkeypatch.context() as m:
            m.setattr(build, "runs_on_gpu", lambda k: on_gpu)
            return real(kind)

    monkeypatch.setattr(build, "default_decode_burst", chosen)
    engine = startup.build_served_engine(cfg, loaded)
    assert engine.config.decode_burst == want

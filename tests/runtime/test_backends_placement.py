"""Where ``--random-weights`` are drawn: a GPU backend's on the GPU in bf16
(North Mini Code drawn on the host in fp32 would take 120 GB and minutes),
any other backend's on the CPU in the asked dtype."""

import torch

from megac.runtime import backends


def test_cpu_backends_draw_on_the_cpu_in_the_asked_dtype(monkeypatch):
    monkeypatch.setattr(backends, "cuda_visible", lambda: False)
    for kind in ("cpu", "auto", "reference", "graphs"):
        assert backends.random_weights_placement(kind, torch.float32) == (torch.float32, "cpu"), kind


def test_gpu_backends_draw_on_the_gpu_in_bf16(monkeypatch):
    monkeypatch.setattr(backends, "cuda_visible", lambda: True)
    for kind in ("cuda", "waves", "graphs", "auto"):
        assert backends.random_weights_placement(kind, torch.float32) == (torch.bfloat16, "cuda"), kind
    assert backends.random_weights_placement("cpu", torch.float32) == (torch.float32, "cpu")

"""Baselines the megakernel is measured against (``megac bench --backend``):
:mod:`megac.baselines.graphs`, the model as ordinary per-op kernels in a
CUDA graph."""

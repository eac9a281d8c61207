"""The runtime: what running a compiled artifact needs on the host,
whatever executes the task words.

* :mod:`megac.runtime.backend` -- the ``Backend`` protocol the engine drives
  (one decode step over the shared paged KV cache, the PyTorch prefill),
  ``ReferenceBackend``;
* :mod:`megac.runtime.backends` -- ``make_backend``: ``cpu`` (the VM,
  :mod:`megac.vm`), ``reference``; later ``cuda``;
* :mod:`megac.runtime.step` -- the host side of one step (rows, page tables,
  target words, the attention queue, the seed, the sampler hand-off);
* :mod:`megac.runtime.schedules` -- ``ScheduleSet``: the schedule for a live
  batch and context;
* :mod:`megac.runtime.artifacts` -- compile-or-load through the artifact
  cache (keyed by spec, target, order, ABI and compiler).

Kept import-free: import the module you need.
"""

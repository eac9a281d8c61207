"""The ``waves`` baseline: the megakernel's own opcode device functions, one
kernel launch per wave, the step's launches in one CUDA graph.

Same cubin, weights, buffers, host words and sampling as
:class:`~megac.gpu.backend.CudaBackend`; only the launch differs. Each
wave's task lists (:func:`megac.runtime.waves.split_waves`: SM ``s`` runs
the tasks of that wave from its own list, in order) get a descriptor of
their own, and the step launches them one after the other on one stream,
so a kernel boundary orders every wave after the one before (a task only
waits on counters earlier launches completed: no co-residency needed, a
plain launch). Against the persistent launch this isolates what the
persistent schedule itself buys: waves that overlap, no launch gaps, no
pipeline drain at every boundary.

The launches of one (schedule, page-table row length) are captured into a
``torch.cuda.CUDAGraph`` on first use and replayed after (cupy launches on
torch's capture stream); where capture is refused they run as direct
launches (``graph_mode`` says which). Not done: programmatic dependent
launch between the waves (each launch starts when the previous one has
drained). A watchdog report names the task by its index in its wave's list.
"""

from __future__ import annotations

from megac.errors import MegacError
from megac.gpu.backend import CudaBackend, _torch, capture_graph
from megac.runtime.waves import split_waves


class WavesBackend(CudaBackend):
    """See the module docstring."""

    name = "waves"

    def __init__(self, spec, weights, kv, schedules, artifact_dir, **kw) -> None:
        super().__init__(spec, weights, kv, schedules, artifact_dir, **kw)
        torch = _torch()
        self.waves: dict = {}
        for s in self.schedules.schedules:
            if s.num_sms != self.big.num_sms:
                raise MegacError(f"waves: schedule {s.rows}x{s.context} is built for {s.num_sms} SMs, "
                                 f"the kernel for {self.big.num_sms}")
            ws = split_waves(s)
            self.waves[id(s)] = [w.name for w in ws]
            for i, w in enumerate(ws):
                self.parts[(id(s), i)] = (torch.from_numpy(w.tasks).to(self.dev),
                                          torch.from_numpy(w.counts).to(self.dev))
        self._graphs: dict = {}
        self.graph_mode = "graph"
        # the step graph captures the persistent launch: the waves run their own graph (_run)
        self.step_graph = False

    def use_cubin(self, cubin) -> None:
        from megac.gpu import launch

        super().use_cubin(cubin)
        self._graphs = {}
        # one CTA per SM as the persistent launch has, but no co-residency asked
        self._wave_launch = launch.Prepared(self.module, self.entry, (self.big.num_sms,), (self.threads,),
                                            shared_mem=self.smem, cooperative=False)

    def reserve_counters(self, n: int) -> None:
        super().reserve_counters(n)
        self._graphs = {}  # the graphs hold the old buffers' descriptors

    def _launch_waves(self, descs, stream=None) -> None:
        for d in descs:
            self._wave_launch((d,), stream=stream)

    def _run(self, sched, page_rows: int) -> None:
        key = (id(sched), page_rows)
        graph = self._graphs.get(key)
        if graph is None:
            descs = [self._descriptor(sched, page_rows, part=i) for i in range(len(self.waves[id(sched)]))]
            if self.graph_mode == "graph":
                graph = self._capture(descs)
            if graph is None:
                self._launch_waves(descs)
                return
            self._graphs[key] = graph
        graph.replay()

    def _capture(self, descs):
        """The wave launches as one CUDA graph, or None (direct launches from
        now on) where capture is refused."""
        graph = capture_graph(lambda stream: self._launch_waves(descs, stream=stream), "waves")
        if graph is None:
            self.graph_mode = "direct"
        return graph


__all__ = ["WavesBackend"]

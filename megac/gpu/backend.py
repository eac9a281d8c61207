"""The CUDA megakernel as a backend (``name = "cuda"``).

::

    be = CudaBackend(spec, weights, kv, schedules, artifact_dir)   # weights bf16, kv on the GPU
    logits = be.decode(rows, tokens)                                # one launch per step
    tokens, _ = be.decode_sample(rows, tokens, samples)             # sampled on the GPU

At construction: the artifact's megakernel cubin (built here with nvcc when
it is not cached), the kernel-layout weights on the GPU (bf16), every
schedule's task words, and every buffer of the launch descriptor planned
for the largest schedule key (one kernel serves every batch size and
bucket). Each step: the host side of the step (:mod:`megac.runtime.step`:
rows and page tables, split counts and the attention queue) into pinned
staging and up, the seed (embedding gather + first RMSNorm, on the GPU),
the reset of counters, claim cursors and the status word, one cooperative
launch, then the logits, or (``decode_sample``) the tokens sampled on the
GPU: greedy rows from the LM head's argmax records, only token ids cross. A watchdog abort raises :class:`MegakernelHang`
naming the waiting task, its counter and the producers that never arrived;
the next step launches normally.

Imports torch and cupy lazily: the module loads on a machine without a GPU.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from megac import abi
from megac.errors import MegacError
from megac.gpu import hang
from megac.runtime import step as host
from megac.runtime.backend import TorchPrefillMixin
from megac.runtime.descriptor import scalar, scalar_values
from megac.runtime.schedules import ScheduleSet

log = logging.getLogger("megac.gpu")

_TORCH_DTYPE = {"bf16": "bfloat16", "fp32": "float32", "int32": "int32", "uint32": "int32", "argmax": "int32"}
#: int32 buffers the host writes before each step (staged on the host)
_HOST_WORDS = ("seq_pos", "row_active", "targets", "attn_queue", "token_ids", "page_table")
#: int32 buffers every step starts from zero
_ZEROED = ("counters", "queue_heads", "status", "progress")
#: their order in the step's one upload: the page tables last, so a step
#: sends only the part its schedule's context bucket uses (North Mini Code's
#: full table is 6.4 MB: filling and sending all of it cost ~1.5 ms a step)
_UPLOAD_ORDER = ("seq_pos", "row_active", "targets", "attn_queue", *_ZEROED, "token_ids", "page_table")
#: not a descriptor buffer: the step's token ids, which the step graph's seed
#: reads on the device (MEGAC_STEP_GRAPH)
_TOKEN_IDS = "token_ids"


class MegakernelHang(MegacError):
    """A wait of the megakernel exceeded the watchdog. ``record`` is the
    first failure (sm, task, opcode, counter, value, target, layer, kind),
    ``counters`` every counter at exit, ``missing`` the producers of the
    awaited counter that had not run."""

    #: the engine fails only the step's requests and serves on: the next
    #: step's upload resets counters, cursors, status and progress
    recoverable = True

    def __init__(self, message: str, record: dict, counters: np.ndarray, missing: list[str]) -> None:
        super().__init__(message)
        self.record, self.counters, self.missing = record, counters, missing


def capture_graph(record, what: str):
    """``record(stream)``'s work (torch ops on the current stream, cupy
    launches on ``stream``) captured as one ``torch.cuda.CUDAGraph``, or None
    where capture is refused (logged, naming ``what``)."""
    torch = _torch()
    cp = __import__("cupy")
    graph = torch.cuda.CUDAGraph()
    try:
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, capture_error_mode="relaxed"):
            record(cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream))
    except Exception as err:  # noqa: BLE001 -- any refusal: the caller launches directly
        log.warning("%s: CUDA graph capture refused (%s); launching directly", what, err)
        return None
    return graph


def _torch():
    import torch  # noqa: PLC0415

    return torch


class CudaBackend(TorchPrefillMixin):
    """See the module docstring."""

    name = "cuda"

    def __init__(self, spec, weights, kv, schedules, artifact_dir, *, watchdog_ns: int = abi.DEFAULT_WATCHDOG_NS,
                 cubin=None, decode_only: bool = False) -> None:
        from megac.codegen.megakernel import ENTRY, THREADS, build_megakernel, largest
        from megac.gpu import launch
        from megac.weights.layout import LAYOUT_ROW_MAJOR, LaidOutWeights, kernel_weights, relayout_

        torch = _torch()
        if not torch.cuda.is_available():
            raise MegacError("--backend cuda: no CUDA device visible")
        self.spec, self.kv = spec, kv
        self.dev = torch.device("cuda")
        if kv.k_pool.device.type != "cuda" or kv.k_pool.dtype != torch.bfloat16:
            raise MegacError("cuda backend: the KV cache must be bf16 on the GPU")
        self.schedules = ScheduleSet(schedules)
        self.big = largest(self.schedules.schedules)
        want, have = self.big.geometry.kv_head_major, kv.head_major
        if have != want:  # the cubin computes the pools' addresses in one layout
            raise MegacError(f"cuda backend: the KV pools are {'head' if have else 'token'}-major, the schedules' "
                             f"megakernel reads them {'head' if want else 'token'}-major (the model's "
                             f"kv_head_major tile; build the cache with head_major={want})")
        self.weights = weights.to(torch.bfloat16, self.dev)
        self.max_batch_size = self.schedules.max_rows
        self.watchdog_ns = int(watchdog_ns)
        launch.expect_sms(self.big.num_sms)
        self.entry = ENTRY
        self.threads = THREADS
        #: the artifact the megakernel was generated into (other builds of it: megac.gpu.profile)
        self.artifact_dir = Path(artifact_dir)
        self.use_cubin(cubin or build_megakernel(artifact_dir))
        geo = self.big.geometry
        chunk = max(1, geo.upgate_bn // 2)
        # the expert interleave every schedule of these tiles shares (geometry.moe_chunk_rows;
        # the generated MOE_CHUNK, which model_constants checks is every schedule's)
        moe_chunk = geo.moe_chunk
        #: the gate/up interleave (dense chunk, expert chunk) its kernel weights are laid out in
        self.interleave = (chunk, moe_chunk)
        # decode only: the canonical layers are emptied as their kernel copy is
        # made, so the peak is one copy of the model, not two
        if isinstance(self.weights, LaidOutWeights):  # another engine's, adopted (decode only)
            kw, have = self.weights.adopt(chunk, moe_chunk), self.weights.layout
            self.weights = None
        else:
            kw, have = kernel_weights(self.weights, spec, chunk=chunk, moe_chunk=moe_chunk,
                                      consume=decode_only), LAYOUT_ROW_MAJOR
            if decode_only:
                self.weights = None
        self.kernel_weights = {k: v.to(self.dev).contiguous() for k, v in kw.items()}
        # the GEMM weights as this cubin reads them (use_cubin re-lays them out
        # when a build with another layout is swapped in)
        relayout_(self.kernel_weights, have, self.layout)
        self.kernel_weights["layer_slot"] = self.kernel_weights["layer_slot"].to(torch.int32)
        self.kernel_weights["rope_inv_freq"] = self.kernel_weights["rope_inv_freq"].to(torch.float32)
        # buffers of the largest key (counters: the most any schedule uses)
        self.buf: dict = {}
        for f in abi.LAUNCH_DESC:
            b = self.big.plan.buffers[f.name]
            if f.ctype != "ptr" or f.name in kw or f.name in ("k_pool", "v_pool", "kv_tmaps", "tasks", "task_counts"):
                continue
            shape = tuple(int(d) for d in b.shape)
            if f.name == "counters":
                shape = (max(s.num_counters for s in self.schedules.schedules),)
            if b.dtype == "argmax":
                shape = shape + (abi.ARGMAX_RECORD_WORDS,)
            self.buf[f.name] = torch.zeros(shape, dtype=getattr(torch, _TORCH_DTYPE[b.dtype]), device=self.dev)
        self._unland()
        self.tasks = {id(s): (torch.from_numpy(np.ascontiguousarray(s.tasks, dtype=np.int32)).to(self.dev),
                              torch.from_numpy(np.ascontiguousarray(s.task_counts, dtype=np.int32)).to(self.dev))
                      for s in self.schedules.schedules}
        #: (id(schedule), part) -> other task lists the same buffers run with
        #: (the waves baseline's, an injected fault's)
        self.parts: dict = {}
        #: MEGAC_FAULT_HANG_STEPS=3,40: those decode steps (counted from 0 by
        #: this backend) launch with one static wait target raised by one, so
        #: the real watchdog fires and MegakernelHang reaches the engine: how
        #: the GPU checks provoke a hang while serving
        self.fault_steps = {int(x) for x in os.environ.get("MEGAC_FAULT_HANG_STEPS", "").split(",") if x.strip()}
        #: the step graph (MEGAC_STEP_GRAPH=0 turns it off): the seed
        #: (embedding gather and first norm, from the uploaded token ids) and
        #: the launch replay as one CUDA graph per (schedule, page-row length,
        #: rows) instead of ~12 separate launches; kernel_ms then includes the
        #: seed. Bit-identical on the H200 (GPU check step_graph) and 0.3 ms
        #: less host time per North Mini Code step at batch 1
        self.step_graph = os.environ.get("MEGAC_STEP_GRAPH", "1") == "1"
        self._step_graphs: dict = {}
        self._desc_cache: dict = {}
        self._mb_cache: dict = {}
        #: the pools' tensor maps and the (pool addresses, shape) they were encoded for (_kv_tmaps_ptr)
        self._tmaps = self._tmaps_key = None
        self.host: dict = {}
        self.reserve_counters(0)
        self._status_host = torch.zeros(tuple(self.buf["status"].shape), dtype=torch.int32).pin_memory()
        #: an all-greedy step's tokens, copied here behind the kernel (decode_sample)
        self._greedy_host = torch.zeros(self.max_batch_size, dtype=torch.int64).pin_memory()
        self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))

        self.steps = 0
        self.kernel_ms: list[float] = []
        #: what placement tuning measured and kept (megac.gpu.placement; None: not tuned)
        self.placement = None
        #: before each step, NaN into every float buffer the step writes and
        #: abi.INT_POISON into the int ones (as the VM's checked mode does)
        self.poison = False
        self._written = [n for n, t in self.buf.items()
                         if self.big.plan.buffers[n].kind in ("activation", "scratch")
                         or n in ("moe_up_queue", "moe_down_queue")]

    def use_cubin(self, cubin) -> None:
        """Load (or swap in) a build of the megakernel: its module, the
        shared memory it asks for, its prepared launch."""
        from megac.codegen.megakernel import (COMBINE_SYMBOL, LAYOUT_SYMBOL, QKV_COMBINE_SYMBOL, SMEM_SYMBOL,
                                              UP_COMBINE_SYMBOL)
        from megac.gpu import launch
        from megac.weights.layout import relayout_

        self.cubin = cubin
        self.module = launch.load_module(cubin)
        self.smem = int(self._read_symbol(SMEM_SYMBOL))
        if any(s.geometry.router_combine for s in self.schedules.schedules) and not self._has_symbol(COMBINE_SYMBOL):
            # its router and finalize would read inputs nothing ordered (ops_gemm.cuh MEGAC_ROUTER_COMBINE)
            raise MegacError(f"megakernel build {cubin}: the schedules fold the MoE combine into the router "
                             f"(tile router_combine) but this build has no code for it (MEGAC_ROUTER_COMBINE=0); "
                             f"rebuild from the schedules' own megakernel.cu")
        if any(s.geometry.qkv_combine for s in self.schedules.schedules) and not self._has_symbol(QKV_COMBINE_SYMBOL):
            # its QKV tiles would add no experts (ops_gemm.cuh MEGAC_QKV_COMBINE)
            raise MegacError(f"megakernel build {cubin}: the schedules' QKV tiles add the MoE combine in their "
                             f"fold (tile qkv_combine) but this build has no code for it (MEGAC_QKV_COMBINE=0); "
                             f"rebuild from the schedules' own megakernel.cu")
        if any(s.geometry.up_combine for s in self.schedules.schedules) and not self._has_symbol(UP_COMBINE_SYMBOL):
            # its claimed up tiles would read x_norm, which nothing ordered before them (ops_gemm.cuh MEGAC_UP_COMBINE)
            raise MegacError(f"megakernel build {cubin}: the schedules' up claims fold the norm with the MoE "
                             f"combine (tile up_combine) but this build has no code for it (MEGAC_UP_COMBINE=0); "
                             f"rebuild from the schedules' own megakernel.cu")
        layout = int(self._read_symbol(LAYOUT_SYMBOL))
        if getattr(self, "kernel_weights", None) is not None and layout != self.layout:
            relayout_(self.kernel_weights, self.layout, layout)
            self._desc_cache.clear()  # w_lm_head is a new tensor
        #: how this cubin reads the GEMM weights (megac.weights.layout.LAYOUT_*)
        self.layout = layout
        self._launch = launch.Prepared(self.module, self.entry, (self.big.num_sms,), (self.threads,),
                                       shared_mem=self.smem, cooperative=True)
        # a captured step graph launches the build it was captured with: a
        # swapped-in build (the profiler's) would otherwise never run
        self._step_graphs = {}
        if getattr(self, "buf", None):
            # the build before may not write polled words back (a build that does not poll leaves
            # router_part landed): a build that polls must start from unlanded words
            self._unland()

    def reserve_counters(self, n: int) -> None:
        """Lay the host-written words and the per-step zeroed buffers out in
        one int32 device buffer with a pinned host twin (at least ``n``
        counters), so one asynchronous copy per step uploads the step's
        words and resets the counters, cursors, status and progress."""
        torch = _torch()
        shapes = {name: tuple(int(d) for d in self.buf["seq_pos" if name == _TOKEN_IDS else name].shape)
                  for name in _UPLOAD_ORDER}
        shapes["counters"] = (max(int(n), shapes["counters"][0]),)
        offs, total = {}, 0
        for name, shape in shapes.items():
            if name != _TOKEN_IDS and self.buf[name].dtype != torch.int32:
                raise MegacError(f"cuda backend: {name} must be int32 to share the step's upload")
            offs[name] = total
            total += -(-int(np.prod(shape)) // 64) * 64  # 256-byte aligned pieces
        self._words = torch.zeros(total, dtype=torch.int32, device=self.dev)
        self._words_host = torch.zeros(total, dtype=torch.int32).pin_memory()
        staged = self._words_host.numpy()
        for name, shape in shapes.items():
            size = int(np.prod(shape))
            view = self._words[offs[name]: offs[name] + size].view(shape)
            if name == _TOKEN_IDS:
                self._tok = view
            else:
                self.buf[name] = view
            if name in _HOST_WORDS:
                self.host[name] = staged[offs[name]: offs[name] + size].reshape(shape)
        self._pt_off = offs["page_table"]
        #: (rows, row length, KV version) of the page tables the device holds
        self._pt_key = self._pt_staged = None
        self._desc_cache.clear()
        self._step_graphs = {}  # they hold the old buffers

    def _page_rows(self, sched) -> int:
        """Page-table row length of ``sched`` (its context bucket's blocks):
        the device's page tables are ``[layers, max rows, this]`` for the
        step (the descriptor's ``max_blocks_per_seq``), packed at the start of
        the largest key's buffer."""
        got = self._mb_cache.get(id(sched))
        if got is None:
            got = self._mb_cache[id(sched)] = int(scalar_values(sched, self.spec)["max_blocks_per_seq"])
        return got

    def _page_table_host(self, mb: int) -> np.ndarray:
        """The step's page tables ``[layers, max rows, mb]``, packed at the
        start of the staging buffer (rows ``mb`` pages long)."""
        L, R, _ = self.host["page_table"].shape
        return self.host["page_table"].reshape(-1)[: L * R * mb].reshape(L, R, mb)

    def _kv_tmaps_ptr(self) -> int:
        """Device address of the pools' tensor maps (megac.gpu.tensormap),
        encoded once per pair of pools; 0 where the boxes do not fit the
        pools or MEGAC_KV_TMAPS=0 (the splits then copy in 16-byte pieces:
        the same build, the other copy path)."""
        from megac.gpu.tensormap import kv_tmaps

        if os.environ.get("MEGAC_KV_TMAPS", "1") == "0":
            return 0
        key = (self.kv.k_pool.data_ptr(), self.kv.v_pool.data_ptr(), tuple(self.kv.k_pool.shape))
        if self._tmaps_key != key:
            self._tmaps = kv_tmaps(self.kv.k_pool, self.kv.v_pool)
            self._tmaps_key = key
        return 0 if self._tmaps is None else self._tmaps.data_ptr()

    def _has_symbol(self, name: str) -> bool:
        try:
            self.module.get_global(name)
        except Exception:  # cupy's CUDADriverError: CUDA_ERROR_NOT_FOUND
            return False
        return True

    def _read_symbol(self, name: str) -> int:
        cp = __import__("cupy")
        ptr = self.module.get_global(name)
        out = np.zeros(1, dtype=np.int32)
        cp.cuda.runtime.memcpy(out.ctypes.data, ptr.ptr, 4, cp.cuda.runtime.memcpyDeviceToHost)
        return int(out[0])

    # ------------------------------------------------------------------ descriptor
    def _descriptor(self, sched, page_rows: int | None = None, part: int | None = None):
        """The launch descriptor of ``sched`` on the GPU whose page-table
        rows are ``page_rows`` pages long (default: the schedule's bucket);
        built once per (schedule, row length); ``_desc_cache.clear()`` after
        changing a buffer. ``part``: the task lists are ``self.parts[(id(sched),
        part)]`` (tasks, counts) instead of the schedule's (the waves
        baseline's launches, an injected fault)."""
        torch = _torch()
        page_rows = self._page_rows(sched) if page_rows is None else int(page_rows)
        key = (id(sched), page_rows, part)
        got = self._desc_cache.get(key)
        if got is not None:
            return got
        tasks, counts = self.tasks[id(sched)] if part is None else self.parts[(id(sched), part)]
        values = {}
        scal = scalar_values(sched, self.spec, watchdog_ns=self.watchdog_ns)
        big_scal = scalar_values(self.big, self.spec)
        for f in abi.LAUNCH_DESC:
            if f.ctype != "ptr":
                # buffer sizes are the largest key's; the rows and the task list the schedule's
                src = scal if f.name in ("rows", "max_tasks", "num_sms", "num_counters", "max_blocks_per_seq") \
                    else big_scal
                if f.name == "watchdog_ns":
                    src = scal
                values[f.name] = scalar(src, f.name, f.ctype)
            elif f.name == "tasks":
                values[f.name] = tasks.data_ptr()
            elif f.name == "task_counts":
                values[f.name] = counts.data_ptr()
            elif f.name in ("k_pool", "v_pool"):
                values[f.name] = getattr(self.kv, f.name).data_ptr()
            elif f.name == "kv_tmaps":
                values[f.name] = self._kv_tmaps_ptr()
            elif f.name in self.kernel_weights:
                values[f.name] = self.kernel_weights[f.name].data_ptr()
            else:
                values[f.name] = self.buf[f.name].data_ptr()
        values["max_blocks_per_seq"] = page_rows  # the page tables' row length this step
        if part is not None:
            values["max_tasks"] = int(tasks.shape[1])
        packed = torch.frombuffer(bytearray(abi.pack_descriptor(values)), dtype=torch.uint8).to(self.dev)
        self._desc_cache[key] = packed
        return packed

    # ------------------------------------------------------------------ one step
    def _step(self, rows: list[int], token_ids: Sequence[int], tail=None) -> None:
        """One launch over ``rows``; raises MegakernelHang on a watchdog abort.
        ``tail()`` enqueues work behind the kernel before the one wait for
        the step (its launches overlap the kernel instead of following it)."""
        torch = _torch()
        if len(token_ids) != len(rows):
            raise MegacError(f"cuda: {len(token_ids)} tokens for {len(rows)} rows")
        sched = self.schedules.for_rows(self.kv, rows)
        geo = sched.geometry
        h = self.host
        positions, mb = self._reserve(rows, sched)
        n = self._stage_words(rows, positions, geo, mb)
        b = self.buf
        if self.poison:
            for name in self._written:
                b[name].fill_(float("nan") if b[name].is_floating_point() else abi.INT_POISON)
            self._unland()  # NaN too, the one a polled combine waits past
            h["targets"][geo.target_words.host_words:] = abi.INT_POISON
        # the step's words up and counters, cursors, status, progress to zero:
        # one asynchronous copy from pinned memory, up to the end of this
        # schedule's page tables
        graph = None
        if self.step_graph and not self.poison and self.steps not in self.fault_steps:
            ids = host.check_tokens(token_ids, geo.vocab)
            h[_TOKEN_IDS][: len(ids)] = ids.numpy()
            graph = self._step_graph(sched, mb, len(ids))
        self._upload_words(n)
        start, end = self._events
        if graph is not None:
            start.record()
            graph.replay()
            end.record()
        else:
            self._seed(geo, host.check_tokens(token_ids, geo.vocab).to(self.dev))
            start.record()
            self._run(sched, mb)
            end.record()
        if tail is not None:
            tail()
        self._status_host.copy_(b["status"], non_blocking=True)
        torch.cuda.current_stream().synchronize()  # the kernel and the status copy
        self.kernel_ms.append(start.elapsed_time(end))
        self.steps += 1
        status = self._status_host.numpy()
        if status[abi.STATUS_ABORT]:
            raise self._hang(sched, status)

    def _reserve(self, rows: list[int], sched) -> tuple[list[int], int]:
        """The rows' slots for this step: (each row's position, the step's
        page-table row length)."""
        positions = host.reserve_rows(self.kv, rows, sched.geometry)
        return positions, host.page_rows(positions, self.kv.block_size, self._page_rows(sched))

    def _stage_words(self, rows: list[int], positions: list[int], geo, mb: int) -> int:
        """The step's host words into the pinned staging buffer: page tables
        (rows ``mb`` pages long), positions, activity, split counts, the
        attention queue. Returns how many words the upload (``_upload_words``)
        sends: up to the end of the page tables, or only up to their start
        where the device holds this step's tables already (the same rows and
        row length, no KV change since: a row enters a new block once every
        block_size steps, and at 128K the tables are 6.4 MB a step)."""
        h = self.host
        key = (tuple(rows), mb, self.kv.version)
        if key == self._pt_key:
            host.fill_positions(positions, h["seq_pos"], h["row_active"])
            n = self._pt_off
        else:
            page_table = self._page_table_host(mb)
            host.fill_tables(self.kv, rows, positions, page_table, h["seq_pos"], h["row_active"])
            n = self._pt_off + page_table.size
        self._pt_staged = key
        host.host_words(geo, positions, h["targets"], h["attn_queue"])  # the queue's tail is never read
        return n

    def _upload_words(self, n: int) -> None:
        """The staged words up to ``n`` to the device (asynchronous, pinned):
        host words, the zeroed counters, cursors and status, token ids, and
        the page tables when ``n`` reaches past their start."""
        self._words[:n].copy_(self._words_host[:n], non_blocking=True)
        if n > self._pt_off:
            self._pt_key = self._pt_staged  # what the device's tables now hold

    def _run(self, sched, page_rows: int) -> None:
        """Launch the step's kernel work (asynchronous): the megakernel once,
        persistent, one CTA per SM."""
        from megac.gpu import launch

        part = self._fault_part(sched) if self.steps in self.fault_steps else None
        desc = self._descriptor(sched, page_rows, part)
        if sched.num_sms == self.big.num_sms:
            self._launch((desc,))
        else:
            launch.launch(self.module, self.entry, (sched.num_sms,), (self.threads,), (desc,),
                          shared_mem=self.smem, cooperative=True)

    def _seed(self, geo, ids) -> None:
        """The seed (host.seed_ids: embedding gather, first norm) of the token
        ids ``ids`` (on the GPU) into x_resid[0] and x_norm[0]."""
        torch = _torch()
        x, xn = host.seed_ids(ids, geo, self.kernel_weights["w_embed"], self.kernel_weights["w_norm"][0],
                              float(self.spec.norm_eps), torch.bfloat16)
        self.buf["x_resid"][0, : geo.rows].copy_(x)
        self.buf["x_norm"][0, : geo.rows].copy_(xn)

    def _seed_device(self, geo, n: int) -> None:
        """The seed of the uploaded token ids (the step graph's)."""
        self._seed(geo, self._tok[:n].long())

    def _step_graph(self, sched, page_rows: int, n: int):
        """The step's seed and launch as one CUDA graph (cached per schedule,
        page-row length and live rows), or None, and the step graph off from
        then on, where capture is refused."""
        key = (id(sched), page_rows, n)
        graph = self._step_graphs.get(key)
        if graph is not None or sched.num_sms != self.big.num_sms:
            return graph
        desc = self._descriptor(sched, page_rows)

        def record(stream):
            self._seed_device(sched.geometry, n)
            self._launch((desc,), stream=stream)

        graph = capture_graph(record, "step graph")
        if graph is None:
            self.step_graph = False  # the separate launches, as without the option
            return None
        self._step_graphs[key] = graph
        return graph

    def _fault_part(self, sched) -> str:
        """``sched``'s task lists with the middle static header wait's target
        raised by one (MEGAC_FAULT_HANG_STEPS): that wait can never be met."""
        torch = _torch()
        key = (id(sched), "fault")
        if key not in self.parts:
            t = np.ascontiguousarray(sched.tasks, dtype=np.int32).copy()
            live = [(s, j) for s in range(t.shape[0]) for j in range(int(sched.task_counts[s]))
                    if t[s, j, abi.H.WAIT0] >= 0 and not abi.is_dyn(int(t[s, j, abi.H.TARGET0]))]
            s, j = live[len(live) // 2]
            t[s, j, abi.H.TARGET0] += 1
            log.warning("fault injection: step %d's launch waits on counter %d with its target raised by one "
                        "(SM %d task %d)", self.steps, int(t[s, j, abi.H.WAIT0]), s, j)
            self.parts[key] = (torch.from_numpy(t).to(self.dev), self.tasks[id(sched)][1])
        return "fault"

    def decode(self, rows: Sequence[int], token_ids: Sequence[int]):
        rows = [int(r) for r in rows]
        self._step(rows, token_ids)
        return host.finish_rows(self.kv, rows, self.buf["logits"], float(self.spec.logit_scale)).cpu()

    def decode_sample(self, rows: Sequence[int], token_ids: Sequence[int], samples, *, keep_logits: bool = False):
        """One step, sampled on the GPU: plain greedy rows from the argmax
        records (valid while ``logit_scale > 0`` keeps the order), the others
        through :func:`megac.sampling.sample_rows` on the GPU logits; one
        copy of the token ids to the host."""
        from megac.sampling import needs_logits, sample_rows

        rows = [int(r) for r in rows]
        scale = float(self.spec.logit_scale)
        n = len(rows)
        if scale > 0 and not keep_logits and n and all(
                s is not None and not needs_logits(s.params, s.output_ids, s.grammar) for s in samples):
            # every row plain greedy (the bench, most serving steps): the
            # records' reduction and the copy of the tokens are queued behind
            # the kernel, so the host waits once and touches no logits
            def tail():
                self._greedy_host[:n].copy_(host.greedy_from_records(self.buf["argmax_part"][:n]), non_blocking=True)

            self._step(rows, token_ids, tail=tail)
            for r in rows:
                self.kv.advance(r, 1)
            return self._greedy_host[:n].tolist(), None
        self._step(rows, token_ids)
        greedy = host.greedy_from_records(self.buf["argmax_part"][:n]) if scale > 0 else None
        logits = host.finish_rows(self.kv, rows, self.buf["logits"], scale)
        tokens = sample_rows(logits, samples, greedy=greedy)
        return tokens, (logits.float().cpu() if keep_logits else None)

    def decode_greedy_run(self, rows: Sequence[int], token_ids: Sequence[int], steps: int, progress=None):
        """``steps`` greedy steps of the fixed ``rows``, pipelined: step i+1's
        host words are prepared and its launch queued while step i runs, its
        tokens go from step i's argmax records to step i+1's seed on the
        device, and the host reads step i's tokens only after step i+1 is
        queued, so the host part hides behind the kernel instead of adding
        to it (:func:`megac.runtime.backend.run_greedy`, which ``megac bench``
        times). Returns each step's tokens and the wall ms between
        consecutive steps' tokens reaching the host. Needs the step graph
        (its seed reads the device's token ids); without it, or in the
        checking modes (poison, injected faults), the steps run one by one."""
        from megac.gpu.pipeline import GreedyPipeline
        from megac.runtime.backend import run_greedy_steps

        torch = _torch()
        rows = [int(r) for r in rows]
        n = len(rows)
        if not (self.step_graph and not self.poison and not self.fault_steps and n and steps > 0
                and float(self.spec.logit_scale) > 0):
            return run_greedy_steps(self, rows, token_ids, steps, progress)
        first = host.check_tokens(token_ids, self.big.geometry.vocab)
        if len(first) != n:
            raise MegacError(f"cuda: {len(first)} tokens for {n} rows")
        # step i+1's seed reads this: step i's greedy tokens, never leaving the device
        fed = torch.empty(n, dtype=self._tok.dtype, device=self.dev)
        uploaded = torch.cuda.Event()  # the staging buffer's last copy is done with it
        pipe = GreedyPipeline(n, fed.dtype, self.kernel_ms, progress,
                              extra=lambda: {"status": torch.zeros_like(self._status_host).pin_memory()})

        def check(slot, sched):
            status = slot.extra["status"].numpy()
            if status[abi.STATUS_ABORT]:
                torch.cuda.current_stream().synchronize()
                raise self._hang(sched, status)

        for i in range(steps):
            sched = self.schedules.for_rows(self.kv, rows)
            positions, mb = self._reserve(rows, sched)
            graph = self._step_graph(sched, mb, n)
            if graph is None:  # capture refused: the rest one by one, after what is queued
                out, walls = pipe.finish()
                # (run_greedy_steps reserves this step's slots again: idempotent)
                more, more_walls = run_greedy_steps(
                    self, rows, out[-1] if out else first.tolist(), steps - i,
                    None if progress is None else (lambda k, t, done=len(out): progress(done + k, t)))
                return out + more, walls + more_walls
            if i > 0:
                uploaded.synchronize()  # long done: it preceded the step now running
            nw = self._stage_words(rows, positions, sched.geometry, mb)
            if i == 0:
                self.host[_TOKEN_IDS][:n] = first.numpy()
            self._upload_words(nw)
            uploaded.record()
            if i > 0:
                self._tok[:n].copy_(fed)  # over the staged (stale) ids: the last step's tokens
            slot = pipe.slot(i)
            slot.start.record()
            graph.replay()
            slot.end.record()
            fed.copy_(host.greedy_from_records(self.buf["argmax_part"][:n]))
            slot.tok.copy_(fed, non_blocking=True)
            slot.extra["status"].copy_(self.buf["status"], non_blocking=True)
            slot.done.record()
            for r in rows:
                self.kv.advance(r, 1)
            self.steps += 1
            pipe.queued(slot, lambda sl, sched=sched: check(sl, sched))
        return pipe.finish()

    def prefill(self, row: int, token_ids: Sequence[int]):
        """The last token's fp32 logits, left on the GPU (the engine samples there)."""
        return super().prefill(row, token_ids).float()

    def _unland(self) -> None:
        """moe_out's and router_part's words to abi.UNLANDED_F32: what a
        combine that polls its experts' outputs (MEGAC_COMBINE_POLL) and a
        routed claimer that polls the router's partials (MEGAC_ROUTER_POLL)
        read as not yet written. The device writes the bits back once the
        words are read (the combine as it reads; a layer's finalize for the
        layer before's partials), so this is needed once, and again after an
        abort, which can leave a layer's words landed and unread, or a
        poisoned step (NaN would read as landed). Harmless for other builds:
        they read both only after a counter says they are written."""
        for name in ("moe_out", "router_part"):
            out = self.buf.get(name)
            if out is not None and out.numel():
                out.view(_torch().int32).fill_(abi.UNLANDED_F32)  # < 2**31: an int32 as it is

    # ------------------------------------------------------------------ the watchdog report
    def _hang(self, sched, status: np.ndarray) -> MegakernelHang:
        self._unland()  # after the launches queued with the failed one (the callers synchronized)
        rec = dict(zip(("sm", "task", "opcode", "counter", "value", "target", "layer", "kind"),
                       (int(x) for x in status[abi.STATUS_RECORD: abi.STATUS_RECORD + abi.ERROR_WORDS])))
        counters = self.buf["counters"].cpu().numpy().view(np.uint32)[: sched.num_counters].copy()
        progress = self.buf["progress"].cpu().numpy()
        msg, missing = hang.describe(sched, rec, counters.astype(np.int64), progress, self.host["targets"],
                                     self.watchdog_ns / 1e9)
        return MegakernelHang(msg, rec, counters, missing)


__all__ = ["CudaBackend", "MegakernelHang"]

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

import time
from typing import Sequence

import numpy as np

from megac import abi
from megac.errors import MegacError
from megac.gpu import hang
from megac.runtime import step as host
from megac.runtime.backend import TorchPrefillMixin
from megac.runtime.descriptor import scalar, scalar_values
from megac.runtime.schedules import ScheduleSet

_TORCH_DTYPE = {"bf16": "bfloat16", "fp32": "float32", "int32": "int32", "uint32": "int32", "argmax": "int32"}


class MegakernelHang(MegacError):
    """A wait of the megakernel exceeded the watchdog. ``record`` is the
    first failure (sm, task, opcode, counter, value, target, layer, kind),
    ``counters`` every counter at exit, ``missing`` the producers of the
    awaited counter that had not run."""

    def __init__(self, message: str, record: dict, counters: np.ndarray, missing: list[str]) -> None:
        super().__init__(message)
        self.record, self.counters, self.missing = record, counters, missing


def _torch():
    import torch  # noqa: PLC0415

    return torch


class CudaBackend(TorchPrefillMixin):
    """See the module docstring."""

    name = "cuda"

    def __init__(self, spec, weights, kv, schedules, artifact_dir, *, watchdog_ns: int = abi.DEFAULT_WATCHDOG_NS,
                 cubin=None) -> None:
        from megac.codegen.megakernel import ENTRY, SMEM_SYMBOL, THREADS, build_megakernel, largest
        from megac.gpu import launch
        from megac.weights.layout import kernel_weights

        torch = _torch()
        if not torch.cuda.is_available():
            raise MegacError("--backend cuda: no CUDA device visible")
        self.spec, self.kv = spec, kv
        self.dev = torch.device("cuda")
        if kv.k_pool.device.type != "cuda" or kv.k_pool.dtype != torch.bfloat16:
            raise MegacError("cuda backend: the KV cache must be bf16 on the GPU")
        self.weights = weights.to(torch.bfloat16, self.dev)
        self.schedules = ScheduleSet(schedules)
        self.max_batch_size = self.schedules.max_rows
        self.big = largest(self.schedules.schedules)
        self.watchdog_ns = int(watchdog_ns)
        launch.expect_sms(self.big.num_sms)
        self.cubin = cubin or build_megakernel(artifact_dir)
        self.module = launch.load_module(self.cubin)
        self.entry = ENTRY
        self.threads = THREADS
        self.smem = int(self._read_symbol(SMEM_SYMBOL))
        geo = self.big.geometry
        chunk = max(1, geo.upgate_bn // 2)
        moe_chunk = max(1, geo.moe_up_bn // 2)
        kw = kernel_weights(self.weights, spec, chunk=chunk, moe_chunk=moe_chunk)
        self.kernel_weights = {k: v.to(self.dev).contiguous() for k, v in kw.items()}
        self.kernel_weights["layer_slot"] = self.kernel_weights["layer_slot"].to(torch.int32)
        self.kernel_weights["rope_inv_freq"] = self.kernel_weights["rope_inv_freq"].to(torch.float32)
        # buffers of the largest key (counters: the most any schedule uses)
        self.buf: dict = {}
        for f in abi.LAUNCH_DESC:
            b = self.big.plan.buffers[f.name]
            if f.ctype != "ptr" or f.name in kw or f.name in ("k_pool", "v_pool", "tasks", "task_counts"):
                continue
            shape = tuple(int(d) for d in b.shape)
            if f.name == "counters":
                shape = (max(s.num_counters for s in self.schedules.schedules),)
            if b.dtype == "argmax":
                shape = shape + (abi.ARGMAX_RECORD_WORDS,)
            self.buf[f.name] = torch.zeros(shape, dtype=getattr(torch, _TORCH_DTYPE[b.dtype]), device=self.dev)
        self.tasks = {id(s): (torch.from_numpy(np.ascontiguousarray(s.tasks, dtype=np.int32)).to(self.dev),
                              torch.from_numpy(np.ascontiguousarray(s.task_counts, dtype=np.int32)).to(self.dev))
                      for s in self.schedules.schedules}
        # host staging of what the host writes each step
        self.host = {name: np.zeros(tuple(self.buf[name].shape), dtype=np.int32)
                     for name in ("page_table", "seq_pos", "row_active", "targets", "attn_queue")}
        self.desc_dev = torch.zeros(abi.descriptor_offsets()["size"], dtype=torch.uint8, device=self.dev)
        self._desc_cache: dict = {}
        self.steps = 0
        self.kernel_ms: list[float] = []
        #: before each step, NaN into every float buffer the step writes and
        #: abi.INT_POISON into the int ones (as the VM's checked mode does)
        self.poison = False
        self._written = [n for n, t in self.buf.items()
                         if self.big.plan.buffers[n].kind in ("activation", "scratch")
                         or n in ("moe_up_queue", "moe_down_queue")]

    def _read_symbol(self, name: str) -> int:
        cp = __import__("cupy")
        ptr = self.module.get_global(name)
        out = np.zeros(1, dtype=np.int32)
        cp.cuda.runtime.memcpy(out.ctypes.data, ptr.ptr, 4, cp.cuda.runtime.memcpyDeviceToHost)
        return int(out[0])

    # ------------------------------------------------------------------ descriptor
    def _descriptor(self, sched) -> bytes:
        key = id(sched)
        got = self._desc_cache.get(key)
        if got is not None:
            return got
        tasks, counts = self.tasks[key]
        values = {}
        scal = scalar_values(sched, self.spec, watchdog_ns=self.watchdog_ns)
        big_scal = scalar_values(self.big, self.spec)
        for f in abi.LAUNCH_DESC:
            if f.ctype != "ptr":
                # buffer sizes are the largest key's; the rows and the task list the schedule's
                src = scal if f.name in ("rows", "max_tasks", "num_sms", "num_counters") else big_scal
                if f.name == "watchdog_ns":
                    src = scal
                values[f.name] = scalar(src, f.name, f.ctype)
            elif f.name == "tasks":
                values[f.name] = tasks.data_ptr()
            elif f.name == "task_counts":
                values[f.name] = counts.data_ptr()
            elif f.name in ("k_pool", "v_pool"):
                values[f.name] = getattr(self.kv, f.name).data_ptr()
            elif f.name in self.kernel_weights:
                values[f.name] = self.kernel_weights[f.name].data_ptr()
            else:
                values[f.name] = self.buf[f.name].data_ptr()
        packed = abi.pack_descriptor(values)
        self._desc_cache[key] = packed
        return packed

    # ------------------------------------------------------------------ one step
    def _step(self, rows: list[int], token_ids: Sequence[int]) -> None:
        """One launch over ``rows``; raises MegakernelHang on a watchdog abort."""
        torch = _torch()
        from megac.gpu import launch

        if len(token_ids) != len(rows):
            raise MegacError(f"cuda: {len(token_ids)} tokens for {len(rows)} rows")
        sched = self.schedules.for_rows(self.kv, rows)
        geo = sched.geometry
        h = self.host
        positions = host.load_rows(self.kv, rows, geo, h["page_table"], h["seq_pos"], h["row_active"])
        n_attn = host.host_words(geo, positions, h["targets"], h["attn_queue"])
        b = self.buf
        if self.poison:
            for name in self._written:
                b[name].fill_(float("nan") if b[name].is_floating_point() else abi.INT_POISON)
            h["targets"][geo.target_words.host_words:] = abi.INT_POISON
        for name in ("page_table", "seq_pos", "row_active", "targets"):
            b[name].copy_(torch.from_numpy(h[name]), non_blocking=False)
        if n_attn:
            b["attn_queue"][:n_attn].copy_(torch.from_numpy(h["attn_queue"][:n_attn]))
        x, xn = host.seed_rows(token_ids, geo, self.kernel_weights["w_embed"], self.kernel_weights["w_norm"][0],
                               float(self.spec.norm_eps), torch.bfloat16)
        b["x_resid"][: geo.rows].copy_(x)
        b["x_norm"][0, : geo.rows].copy_(xn)
        for name in ("counters", "queue_heads", "status", "progress"):
            b[name].zero_()
        self.desc_dev.copy_(torch.frombuffer(bytearray(self._descriptor(sched)), dtype=torch.uint8))
        t0 = time.perf_counter()
        launch.launch(self.module, self.entry, (sched.num_sms,), (self.threads,), (self.desc_dev,),
                      shared_mem=self.smem, cooperative=True)
        torch.cuda.synchronize()
        self.kernel_ms.append((time.perf_counter() - t0) * 1e3)
        self.steps += 1
        status = b["status"].cpu().numpy()
        if status[abi.STATUS_ABORT]:
            raise self._hang(sched, status)

    def decode(self, rows: Sequence[int], token_ids: Sequence[int]):
        rows = [int(r) for r in rows]
        self._step(rows, token_ids)
        return host.finish_rows(self.kv, rows, self.buf["logits"], float(self.spec.logit_scale)).cpu()

    def decode_sample(self, rows: Sequence[int], token_ids: Sequence[int], samples, *, keep_logits: bool = False):
        """One step, sampled on the GPU: plain greedy rows from the argmax
        records (valid while ``logit_scale > 0`` keeps the order), the others
        through :func:`megac.sampling.sample_rows` on the GPU logits; one
        copy of the token ids to the host."""
        from megac.sampling import sample_rows

        rows = [int(r) for r in rows]
        self._step(rows, token_ids)
        scale = float(self.spec.logit_scale)
        n = len(rows)
        greedy = host.greedy_from_records(self.buf["argmax_part"][:n]) if scale > 0 else None
        logits = host.finish_rows(self.kv, rows, self.buf["logits"], scale)
        tokens = sample_rows(logits, samples, greedy=greedy)
        return tokens, (logits.float().cpu() if keep_logits else None)


    def prefill(self, row: int, token_ids: Sequence[int]):
        """The last token's fp32 logits, left on the GPU (the engine samples there)."""
        return super().prefill(row, token_ids).float()

    # ------------------------------------------------------------------ the watchdog report
    def _hang(self, sched, status: np.ndarray) -> MegakernelHang:
        rec = dict(zip(("sm", "task", "opcode", "counter", "value", "target", "layer", "kind"),
                       (int(x) for x in status[abi.STATUS_RECORD: abi.STATUS_RECORD + abi.ERROR_WORDS])))
        counters = self.buf["counters"].cpu().numpy().view(np.uint32)[: sched.num_counters].copy()
        progress = self.buf["progress"].cpu().numpy()
        msg, missing = hang.describe(sched, rec, counters.astype(np.int64), progress, self.host["targets"],
                                     self.watchdog_ns / 1e9)
        return MegakernelHang(msg, rec, counters, missing)


__all__ = ["CudaBackend", "MegakernelHang"]

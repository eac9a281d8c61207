"""Device state of the CPU VM: every launch-descriptor buffer of one schedule.

::

    wts = VMWeights.from_weights(weights, spec, geometry, dtype=torch.float32)
    st = DeviceState(schedule, wts)          # scratch allocated from schedule.plan
    st.bind_kv(kv)                           # k_pool / v_pool are the cache's own tensors

:class:`VMWeights` holds the kernel-layout weights (``megac.weights.layout``:
fused QKV, gate/up interleaved in chunks of ``upgate_bn/2`` / ``moe_chunk``
so a tile's SiLU*up epilogue needs nothing outside the tile, expert stacks),
shared by every schedule (batch size, context bucket) of one model. In bf16
mode the descriptor tensors are bf16 and an fp32 copy of each is kept for the
arithmetic (bf16 inputs, fp32 accumulation: what the device's tensor cores do);
in fp32 mode there is one copy.

:class:`DeviceState` allocates every other descriptor pointer from the
schedule's :class:`~megac.schedule.BufferPlan` (shape and dtype exactly as
planned; ``bf16`` buffers are fp32 in fp32 mode; ``argmax`` records are int32
``[..., abi.ARGMAX_RECORD_WORDS]``, the value's fp32 bits in word 0 and the
index in word 1, the device's bytes), plus the scalars. ``desc`` maps every
``abi.LAUNCH_DESC`` name to its tensor or scalar (an unassigned field is an
error, :meth:`check_desc`).
Integer buffers the interpreter touches word by word (counters, queue heads,
targets, queues, tables) also have numpy views (``st.np[name]``) sharing
memory with the tensors.

Counters are uint32 on the device; the VM keeps them as int64 (never
negative, never near 2**32 within a step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megac import abi
from megac.errors import MegacError
from megac.runtime.descriptor import scalar, scalar_values
from megac.weights.canonical import ModelWeights
from megac.weights.layout import KERNEL_WEIGHT_FIELDS, kernel_weights

#: descriptor buffers that are weights (bound from VMWeights, never allocated here)
WEIGHT_FIELDS = KERNEL_WEIGHT_FIELDS
#: descriptor buffers bound from the paged KV cache at each step
KV_POOL_FIELDS = ("k_pool", "v_pool")
#: int32 host tables of the KV layout, allocated here, filled by the host each step
KV_TABLE_FIELDS = ("page_table", "seq_pos", "row_active")
#: integer sentinel written into int scratch when poisoning (checked mode)
INT_POISON = abi.INT_POISON

_VALID_DTYPES = (torch.float32, torch.bfloat16)


def act_dtype_of(dtype: torch.dtype) -> torch.dtype:
    if dtype not in _VALID_DTYPES:
        raise MegacError(f"vm: dtype must be torch.float32 or torch.bfloat16 (got {dtype})")
    return dtype


# ---------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------
class VMWeights:
    """Kernel-layout weights of one model (see the module docstring).

    ``tensors``: the descriptor's weight fields (``w_*``, ``layer_slot``,
    ``rope_inv_freq``) in ``dtype``; :meth:`compute` gives the fp32 tensor the
    arithmetic uses (the same object in fp32 mode)."""

    def __init__(self, tensors: dict[str, torch.Tensor], spec, *, dtype: torch.dtype, chunk: int,
                 moe_chunk: int) -> None:
        self.spec = spec
        self.dtype = act_dtype_of(dtype)
        self.chunk = int(chunk)
        self.moe_chunk = int(moe_chunk)
        missing = [f for f in WEIGHT_FIELDS if f not in tensors]
        if missing:
            raise MegacError(f"vm: kernel weights miss {missing}")
        self.tensors = dict(tensors)
        self._compute: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------ builders
    @classmethod
    def from_weights(cls, weights: ModelWeights, spec, geometry, *, dtype: torch.dtype | None = None,
                     consume: bool = False) -> "VMWeights":
        """Kernel layouts of ``weights`` for schedules of ``geometry``'s tiling
        (gate/up chunk = ``upgate_bn // 2``, expert chunk = ``moe_chunk``).

        ``consume=True`` builds the stacks one layer at a time and drops each
        layer's canonical tensors from ``weights`` as soon as they are copied
        (``weights`` is left without its layer tensors): peak memory is about
        one copy of the model, not two (:func:`kernel_weights`' ``consume``)."""
        dtype = act_dtype_of(dtype or weights.dtype)
        chunk = max(1, geometry.upgate_bn // 2)
        moe_chunk = geometry.moe_chunk
        if weights.dtype != dtype:
            if consume:
                raise MegacError("vm: consume=True needs weights already in the VM dtype")
            weights = weights.to(dtype)
        kw = kernel_weights(weights, spec, chunk=chunk, moe_chunk=moe_chunk, consume=consume)
        return cls(kw, spec, dtype=dtype, chunk=chunk, moe_chunk=moe_chunk)

    # ------------------------------------------------------------ access
    def compute(self, name: str) -> torch.Tensor:
        """fp32 tensor of weight ``name`` (bf16 values upcast exactly)."""
        t = self._compute.get(name)
        if t is None:
            src = self.tensors[name]
            t = src if src.dtype != torch.bfloat16 else src.float()
            self._compute[name] = t
        return t

    def check_geometry(self, geo) -> None:
        """The layout matches the tiles of ``geo`` (chunks, shapes)."""
        if geo.dense_width and geo.upgate_bn // 2 != self.chunk:
            raise MegacError(f"vm: weights interleaved in chunks of {self.chunk}, schedule tiles "
                             f"upgate_bn/2 = {geo.upgate_bn // 2}")
        if geo.num_experts and geo.moe_chunk != self.moe_chunk:
            raise MegacError(f"vm: expert weights interleaved in chunks of {self.moe_chunk}, schedule's "
                             f"moe_chunk {geo.moe_chunk}")


# ---------------------------------------------------------------------------
# Device state
# ---------------------------------------------------------------------------
@dataclass
class _Buf:
    name: str
    tensor: torch.Tensor
    kind: str


class DeviceState:
    """Every launch-descriptor buffer of one schedule (module docstring)."""

    def __init__(self, schedule, weights: VMWeights) -> None:
        self.schedule = schedule
        self.geo = geo = schedule.geometry
        self.spec = weights.spec
        self.weights = weights
        weights.check_geometry(geo)
        self.dtype = weights.dtype
        self.act = weights.dtype  # bf16 activations in bf16 mode, fp32 otherwise
        self.plan = schedule.plan
        self.desc: dict[str, object] = {}
        self.np: dict[str, np.ndarray] = {}
        self.scratch: list[str] = []  # float/int buffers written inside the step
        self.tw = geo.target_words
        self._scalars = scalar_values(schedule, self.spec)
        for f in abi.LAUNCH_DESC:
            spec = self.plan.buffers[f.name]
            if f.name in WEIGHT_FIELDS:
                t = weights.tensors[f.name]
                want = tuple(spec.shape)
                if tuple(t.shape) != want:
                    raise MegacError(f"vm: weight {f.name} has shape {list(t.shape)}, the plan says {list(want)}")
                self.desc[f.name] = t
            elif f.name in KV_POOL_FIELDS:
                self.desc[f.name] = None  # bound by bind_kv
            elif spec.kind == "scalar":
                self.desc[f.name] = self._scalar(f.name, f.ctype)
            else:
                self.desc[f.name] = self._alloc(spec)
        # the VM's private input of GEMM tiles that fold their norm (NORM_IN:
        # ops.norm.norm_in_input), shaped as x_norm; not a device buffer
        self.desc["x_fold"] = torch.zeros_like(self.desc["x_norm"])
        # and of router tiles that fold the MoE combine (COMBINE_IN: ops.norm.combine_in_input)
        self.desc["x_comb"] = torch.zeros_like(self.desc["x_norm"])
        # the schedule itself
        self.desc["tasks"] = torch.from_numpy(np.ascontiguousarray(schedule.tasks, dtype=np.int32))
        self.desc["task_counts"] = torch.from_numpy(np.ascontiguousarray(schedule.task_counts, dtype=np.int32))
        for name in ("tasks", "task_counts", "targets", "attn_queue", "moe_up_queue", "moe_down_queue",
                     "page_table", "seq_pos", "row_active", "topk_ids", "route_slot", "status",
                     "layer_slot"):
            t = self.desc[name]
            if isinstance(t, torch.Tensor) and t.dtype == torch.int32:
                self.np[name] = t.numpy()
        # counters and claim cursors: int64 in the VM (uint32 on the device)
        self.counters = np.zeros(schedule.num_counters, dtype=np.int64)
        self.queue_heads = np.zeros(tuple(self.plan.buffers["queue_heads"].shape), dtype=np.int64)
        self.desc["counters"] = self.counters
        self.desc["queue_heads"] = self.queue_heads
        self.layer_slot = [int(x) for x in weights.tensors["layer_slot"].tolist()]
        self.kv = None
        self.check_desc(allow_unbound=KV_POOL_FIELDS)

    # ------------------------------------------------------------ allocation
    def _torch_dtype(self, dtype: str) -> torch.dtype:
        return {"bf16": self.act, "fp32": torch.float32, "argmax": torch.int32, "int32": torch.int32,
                "uint32": torch.int64}[dtype]

    def _alloc(self, spec) -> torch.Tensor:
        shape = tuple(spec.shape)
        if spec.dtype == "argmax":
            shape = shape + (abi.ARGMAX_RECORD_WORDS,)
        t = torch.zeros(shape, dtype=self._torch_dtype(spec.dtype))
        if spec.kind in ("activation", "scratch"):
            self.scratch.append(spec.name)
        return t

    def _scalar(self, name: str, ctype: str):
        return scalar(self._scalars, name, ctype)

    def check_desc(self, allow_unbound=()) -> None:
        """Every descriptor field is assigned (fill by name; a gap is an error)."""
        for f in abi.LAUNCH_DESC:
            if f.name not in self.desc or (self.desc[f.name] is None and f.name not in allow_unbound):
                raise MegacError(f"vm: launch descriptor field {f.name} is not assigned")

    # ------------------------------------------------------------ accessors
    def __getitem__(self, name: str):
        return self.desc[name]

    @property
    def block_size(self) -> int:
        return int(self.desc["kv_block_size"])

    @property
    def max_blocks(self) -> int:
        return int(self.desc["max_blocks_per_seq"])

    def w(self, name: str) -> torch.Tensor:
        """fp32 compute tensor of weight ``name``."""
        return self.weights.compute(name)

    # ------------------------------------------------------------ KV
    def bind_kv(self, kv) -> None:
        """Use ``kv``'s pools as k_pool / v_pool (no copy)."""
        if kv.block_size != self.block_size:
            raise MegacError(f"vm: KV cache block size {kv.block_size} != schedule's {self.block_size}")
        if kv.kv_heads != self.geo.kv_heads or kv.head_dim != self.geo.head_dim:
            raise MegacError("vm: KV cache heads / head_dim differ from the schedule")
        if kv.k_pool.dtype != self.act:
            raise MegacError(f"vm: KV cache dtype {kv.k_pool.dtype} != VM dtype {self.act}")
        self.kv = kv
        self.desc["k_pool"] = kv.k_pool
        self.desc["v_pool"] = kv.v_pool

    # ------------------------------------------------------------ per step
    def reset(self) -> None:
        """The per-step reset: every buffer in ``plan.reset`` (counters, queue heads)."""
        for name in self.plan.reset:
            buf = self.desc[name]
            if isinstance(buf, np.ndarray):
                buf[...] = 0
            else:
                buf.zero_()

    def poison(self) -> None:
        """NaN into every float buffer written inside the step, a sentinel into
        int ones (x_resid / x_norm slot 0 are seeded afterwards)."""
        for name in self.scratch + ["moe_up_queue", "moe_down_queue"]:
            t = self.desc[name]
            if t.is_floating_point():
                t.fill_(float("nan"))
            else:
                t.fill_(INT_POISON)
        tw = self.tw
        self.np["targets"][tw.host_words:] = INT_POISON


__all__ = ["DeviceState", "INT_POISON", "VMWeights", "act_dtype_of"]

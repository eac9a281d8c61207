"""Kernel weight layouts: canonical :class:`ModelWeights` -> the ``w_*`` tensors
of the launch descriptor (``megac.abi.LAUNCH_DESC``), and back.

This is the one place that knows them (loaders never hard-code a layout; the
plan pass records ``chunk``). All weight tensors keep the dtype of the input
weights (cast with ``weights.to(torch.bfloat16)`` first for the device);
``layer_slot`` is int32 and ``rope_inv_freq`` fp32.

=================  ===========================================  ==========================================
field              shape                                        content
=================  ===========================================  ==========================================
``w_embed``        ``[vocab, hidden]``                          embedding
``w_lm_head``      ``[vocab, hidden]``                          LM head; **the same tensor** as
                                                                ``w_embed`` when tied
``w_norm``         ``[2L+1, hidden]``                           slot ``l``: input norm of layer ``l``;
                                                                ``L+l``: post-attention norm of sequential
                                                                layer ``l`` (1.0 for parallel layers);
                                                                ``2L``: final norm
``w_qkv``          ``[L, qkv_width, hidden]``                   Q rows, then K rows, then V rows
``w_o``            ``[L, hidden, q_width]``                     O-proj
``w_upgate``       ``[dense_layers, 2*dense_width, hidden]``    gate/up interleaved in chunks (below)
``w_down``         ``[dense_layers, hidden, dense_width]``      down
``w_router``       ``[moe_layers, experts, hidden]``            router
``w_moe_upgate``   ``[moe_layers, experts, 2*width, hidden]``   gate/up interleaved in chunks (below)
``w_moe_down``     ``[moe_layers, experts, hidden, width]``     expert down
``layer_slot``     ``[L]`` int32                                index of layer ``l`` in the dense stack
                                                                (dense layers) or in the MoE stack
``rope_inv_freq``  ``[head_dim/2]`` fp32                        ``1/theta**(arange(0, hd, 2)/hd)``
                                                                computed exactly as transformers does
=================  ===========================================  ==========================================

Dense and MoE stacks are in layer order. A model with no dense (MoE) layer
gets stacks with a leading dimension of 0.

**Gate/up interleave.** Rows of the fused gate+up matrix come in chunks of
``chunk`` rows: ``[gate 0..c-1 | up 0..c-1 | gate c..2c-1 | up c..2c-1 | ...]``.
When ``width`` is not a multiple of ``chunk`` the last chunk is shorter and
still gate-then-up (``[... | gate k*c..W-1 | up k*c..W-1]``). So a tile of
``2*len`` rows starting at row ``N0 = 2*t*c`` holds gate and up of hidden
columns ``t*c .. t*c+len-1`` (``OUT0 = N0/2``), and its SiLU*up epilogue needs
nothing outside the tile. :func:`upgate_row_map` gives the permutation.

**GEMM stage tiling (device storage).** The decode GEMM tile
(opcodes/gemm_tile.cuh, ``TILED``) streams weights in stages of 16 rows x BK
columns; measured on the H200 it reaches the bandwidth ceiling only when each
stage is contiguous and already in MMA fragment order (one bulk copy per
stage: 95-99 % against 49-70 % for row-major rows; BENCHMARKS.md).
:func:`tile_gemm_weights` permutes any ``[..., N, K]`` weight (after the
layouts above) into that storage order, :func:`untile_gemm_weights` inverts
it. Requirements: ``N % 16 == 0``, ``K % BK == 0``, ``BK % 32 == 0``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterable

import torch

from megac.errors import MegacError
from megac.weights.canonical import LayerWeights, ModelWeights

if TYPE_CHECKING:
    from megac.spec.model import ModelSpec

DEFAULT_CHUNK = 64

#: Descriptor fields this module fills (all of ``abi.LAUNCH_DESC``'s weights).
KERNEL_WEIGHT_FIELDS = (
    "w_embed", "w_lm_head", "w_norm", "w_qkv", "w_o", "w_upgate", "w_down",
    "w_router", "w_moe_upgate", "w_moe_down", "layer_slot", "rope_inv_freq",
)


# ------------------------------------------------------------------ pieces


def _check_tiling(shape: tuple[int, ...], bk: int) -> None:
    n, k = shape[-2], shape[-1]
    if bk <= 0 or bk % 32 or k % bk or n % 16:
        raise MegacError(f"GEMM stage tiling: [N={n}, K={k}] with BK={bk} needs N % 16 == 0, "
                         f"BK % 32 == 0 and K % BK == 0")


def tile_gemm_weights(w: torch.Tensor, bk: int) -> torch.Tensor:
    """Row-major ``[..., N, K]`` -> the stage-major storage of the GEMM tile,
    same shape and elements, permuted: ``[N/16][K/BK][BK/32][row half h]
    [row g][col group t][8]`` with row ``8h + g`` of the 16-row group and
    column ``32*kk + 8*t + e`` of the BK stage."""
    _check_tiling(tuple(w.shape), bk)
    *_, n, k = w.shape
    v = w.reshape(-1, n // 16, 2, 8, k // bk, bk // 32, 4, 8)  # mat rg h g kc kk t e
    return v.permute(0, 1, 4, 5, 2, 3, 6, 7).contiguous().reshape(w.shape)


def untile_gemm_weights(w: torch.Tensor, bk: int) -> torch.Tensor:
    """Inverse of :func:`tile_gemm_weights`."""
    _check_tiling(tuple(w.shape), bk)
    *_, n, k = w.shape
    v = w.reshape(-1, n // 16, k // bk, bk // 32, 2, 8, 4, 8)  # mat rg kc kk h g t e
    return v.permute(0, 1, 4, 5, 2, 3, 6, 7).contiguous().reshape(w.shape)


#: The GEMM weights the megakernel's tensor-core tile reads (opcodes/gemm_tc.cuh).
GEMM_WEIGHT_FIELDS = ("w_qkv", "w_o", "w_upgate", "w_down", "w_router", "w_moe_upgate", "w_moe_down", "w_lm_head")

#: ``megakernel_weight_layout`` (a symbol of the cubin): how the GEMM fields lie.
LAYOUT_ROW_MAJOR = 0
LAYOUT_TILED = 1


def gemm_tileable(kw: dict[str, torch.Tensor]) -> bool:
    """True when every GEMM field's ``[N, K]`` has ``N % 16 == 0`` and ``K % 32 == 0``."""
    return all(kw[f].shape[-2] % 16 == 0 and kw[f].shape[-1] % 32 == 0
               for f in GEMM_WEIGHT_FIELDS if kw[f].numel())


def relayout_(kw: dict[str, torch.Tensor], src: int, dst: int) -> dict[str, torch.Tensor]:
    """The descriptor's weight tensors ``kw`` from device layout ``src`` into
    ``dst`` (``LAYOUT_*``), in place where :func:`kernel_weights` made the
    tensor (the stacks: one matrix at a time, so North Mini Code's 39 GB of
    experts need no second copy) and as a new tensor for ``w_lm_head``, which
    may be the caller's embedding (tied). Returns ``kw``.

    ``LAYOUT_TILED``: every GEMM field in 16-row x 32-column blocks of 1 KB in
    MMA fragment order, ``[..., N/16, K/32, 2, 8, 4, 8]`` (the storage of
    :func:`tile_gemm_weights`, which does not depend on the stage width: a
    16-row group's K row is one contiguous run of blocks whatever BK is).
    ``w_embed`` always stays row-major (the host gathers its rows)."""
    for lay in (src, dst):
        if lay not in (LAYOUT_ROW_MAJOR, LAYOUT_TILED):
            raise MegacError(f"layout: unknown device weight layout {lay}")
    if src == dst:
        return kw
    fn = tile_gemm_weights if dst == LAYOUT_TILED else untile_gemm_weights
    for f in GEMM_WEIGHT_FIELDS:
        t = kw[f]
        if not t.numel():
            continue
        if not t.is_contiguous():  # the in-place pass below must write kw's own storage
            kw[f] = t = t.contiguous()
        if f == "w_lm_head":
            kw[f] = fn(t, 32)
            continue
        mats = t.reshape(-1, t.shape[-2], t.shape[-1])
        for i in range(mats.shape[0]):
            mats[i].copy_(fn(mats[i], 32))
    return kw


def upgate_row_map(width: int, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """int64 ``[2*width]``: interleaved row ``r`` holds row ``map[r]`` of
    ``cat([gate, up])`` (``< width``: a gate row, ``>= width``: up row
    ``map[r] - width``)."""
    if chunk < 1:
        raise MegacError(f"layout: chunk must be >= 1 (got {chunk})")
    idx: list[int] = []
    for start in range(0, width, chunk):
        stop = min(start + chunk, width)
        idx.extend(range(start, stop))
        idx.extend(range(width + start, width + stop))
    return torch.tensor(idx, dtype=torch.int64)


def _regroupable(t: torch.Tensor, old: int, new: int) -> bool:
    """Whether :func:`reinterleave_gate_up_` can take ``t`` from chunks of
    ``old`` rows to chunks of ``new``: nothing to move, or whole 16-row groups
    (``old``, ``new`` and the width ``W`` of ``[..., 2W, K]`` multiples of 16)."""
    return old == new or not t.numel() or not (old % 16 or new % 16 or (t.shape[-2] // 2) % 16)


def reinterleave_gate_up_(t: torch.Tensor, old: int, new: int) -> torch.Tensor:
    """The stacked fused gate/up matrices ``t`` (``[..., 2W, K]``, row-major
    or tiled: both keep a 16-row group's K row one contiguous run) from
    chunks of ``old`` rows into chunks of ``new``, in place, one matrix at a
    time (North Mini Code's 38 GB of expert gate/up rows need no second
    copy). Whole 16-row groups move, so ``old``, ``new`` and ``W`` must be
    multiples of 16; else :class:`LayoutMismatch`. Returns ``t``."""
    if old == new or not t.numel():
        return t
    two_w, k = t.shape[-2], t.shape[-1]
    width = two_w // 2
    if not _regroupable(t, old, new):
        raise LayoutMismatch(f"gate/up rows in chunks of {old} cannot be re-interleaved into chunks of {new} "
                             f"in place (width {width}: every one must be a multiple of 16)")
    # new row r holds cat([gate, up]) row new_map[r], which lies at old row inv_old[new_map[r]]
    src = torch.argsort(upgate_row_map(width, old))[upgate_row_map(width, new)]
    groups = src.view(-1, 16)
    assert torch.equal(groups, groups[:, :1] + torch.arange(16)) and not bool((groups[:, 0] % 16).any())
    g = (groups[:, 0] // 16).to(t.device)
    mats = t.reshape(-1, two_w // 16, 16 * k)
    for i in range(mats.shape[0]):
        mats[i].copy_(mats[i].index_select(0, g))
    return t


def tile_gate_up_rows(width: int, chunk: int, n0: int, n1: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A tile of interleaved rows ``[n0, n1)``: (its gate rows, its up rows),
    int64 offsets from ``n0`` that pair feature by feature over the tile's
    features ``n0/2 ..`` in order; None when the tile does not hold whole
    chunks of contiguous features (it would pair rows of other features)."""
    m = upgate_row_map(width, chunk)[n0:n1]
    gate = torch.nonzero(m < width).flatten()
    up = torch.nonzero(m >= width).flatten()
    h = (n1 - n0) // 2
    feats = torch.arange(n0 // 2, n0 // 2 + h)
    if len(gate) != h or len(up) != h or not torch.equal(m[gate], feats) or not torch.equal(m[up] - width, feats):
        return None
    return gate, up


def interleave_gate_up(gate: torch.Tensor, up: torch.Tensor, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """``[..., W, K]`` gate and up -> ``[..., 2W, K]`` interleaved in chunks."""
    if gate.shape != up.shape:
        raise MegacError(f"layout: gate {list(gate.shape)} and up {list(up.shape)} differ")
    width = gate.shape[-2]
    both = torch.cat([gate, up], dim=-2)
    return both.index_select(-2, upgate_row_map(width, chunk).to(both.device)).contiguous()


def deinterleave_gate_up(fused: torch.Tensor, chunk: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`interleave_gate_up`."""
    width = fused.shape[-2] // 2
    inv = torch.argsort(upgate_row_map(width, chunk))
    both = fused.index_select(-2, inv)
    return both[..., :width, :].contiguous(), both[..., width:, :].contiguous()


def rope_inv_freq(spec: "ModelSpec") -> torch.Tensor:
    """fp32 ``[head_dim/2]``, bit-identical to transformers'
    ``compute_default_rope_parameters``."""
    dim = spec.head_dim
    return 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def layer_slots(spec: "ModelSpec") -> torch.Tensor:
    """int32 ``[L]``: index of each layer in its dense or MoE weight stack."""
    dense, moe = spec.dense_layers, spec.moe_layers
    return torch.tensor(
        [dense.index(i) if l.ffn == "dense" else moe.index(i) for i, l in enumerate(spec.layers)],
        dtype=torch.int32,
    )


def norm_slot_input(spec: "ModelSpec", layer: int) -> int:
    return layer


def norm_slot_post_attn(spec: "ModelSpec", layer: int) -> int:
    return spec.num_layers + layer


def norm_slot_final(spec: "ModelSpec") -> int:
    return 2 * spec.num_layers


# ------------------------------------------------------------------ whole model


def _stack(items: Iterable[torch.Tensor], n: int, empty_shape: tuple[int, ...], dtype: torch.dtype,
           device: torch.device | None = None) -> torch.Tensor:
    """``torch.stack`` of the ``n`` tensors ``items`` yields, filled one at a
    time into one allocation on ``device`` (default: the first item's): a
    list of interleaved copies plus the stack held North Mini Code's expert
    weights twice over (72 GB beside the 61 GB canonical copy) and ran the
    GPU out of memory once the KV pool was large; this way the peak is the
    result plus one layer."""
    out = None
    for i, t in enumerate(items):
        if out is None:
            out = torch.empty((n, *t.shape), dtype=t.dtype, device=t.device if device is None else device)
        out[i].copy_(t)
        del t
    if out is None:
        return torch.empty((0, *empty_shape), dtype=dtype)
    return out


#: GPU memory left free beside a stack allocated from sources still on the
#: GPU (the allocator's rounding, the LM head's relayout copy, the CUDA
#: context's own growth)
STACK_MARGIN_BYTES = 2 << 30


def _device_free_bytes(device: torch.device) -> int | None:
    """Free bytes on ``device`` (None: not a GPU, no limit to plan for).
    Tests replace it to exercise the staging below without a GPU."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


def _make_room(layers, names: tuple[str, ...], stack_bytes: int, device: torch.device) -> bool:
    """Before a consumed stack of ``stack_bytes`` is allocated on ``device``
    beside its own sources: where it does not fit in the free memory (less
    :data:`STACK_MARGIN_BYTES`), move those sources (``names`` of every layer
    of ``layers``) to host memory first, so the peak is one copy of them on
    the GPU, not two. Why: North Mini Code's random weights are drawn in
    bf16 on the GPU (61 GB); its 39 GB gate/up expert stack beside them does
    not fit an 80 GB H100, though the model alone does. Returns whether it
    moved them."""
    free = _device_free_bytes(device)
    if free is None or free >= stack_bytes + STACK_MARGIN_BYTES:
        return False
    for lw in layers:
        for name in names:
            t = getattr(lw, name)
            if t is not None and t.device == device:
                setattr(lw, name, t.to("cpu"))
                del t
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the freed blocks back to the driver: the stack is one allocation
    return True


def _back_on(device: torch.device, make, names: tuple[str, ...]):
    """``make`` with a layer's sources ``names`` moved back to ``device``
    first, one layer at a time: staged sources are interleaved there, not by
    the host's two cores (the stack's peak grows by one layer's sources)."""
    def on_device(lw):
        for n in names:
            t = getattr(lw, n)
            if t is not None and t.device != device:
                setattr(lw, n, t.to(device))
        return make(lw)
    return on_device


def kernel_weights(weights: ModelWeights, spec: "ModelSpec", *, chunk: int = DEFAULT_CHUNK,
                   moe_chunk: int | None = None, consume: bool = False) -> dict[str, torch.Tensor]:
    """The descriptor's weight tensors (:data:`KERNEL_WEIGHT_FIELDS`) for
    ``weights``; ``chunk`` / ``moe_chunk`` (default: ``chunk``) are the gate/up
    interleave of dense and expert layers. ``consume``: each layer tensor of
    ``weights`` is emptied once copied (a decode-only engine: the peak is
    about one copy of the model, not two; ``weights`` is unusable after)."""
    weights.validate(spec)

    def taking(layers, make, *names):
        """``make(lw)`` for each layer; with ``consume`` its source tensors
        ``names`` are dropped right after (the last reference, freed at once)."""
        for lw in layers:
            t = make(lw)
            if consume:
                for n in names:
                    setattr(lw, n, None)
            yield t

    def stack_of(layers, make, names: tuple[str, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The stack of ``make(lw)`` (each ``shape``) over ``layers``, on the
        device of its sources; with ``consume``, where the stack would not
        fit there beside them, they wait in host memory first (_make_room)."""
        first = next((t for lw in layers for n in names if (t := getattr(lw, n)) is not None), None)
        device = None if first is None else first.device
        if consume and device is not None and _make_room(layers, names, len(layers) * dt.itemsize
                                                         * math.prod(shape), device):
            make = _back_on(device, make, names)
        return _stack(taking(layers, make, *names), len(layers), shape, dt, device)

    moe_chunk = chunk if moe_chunk is None else moe_chunk
    dt = weights.dtype
    d, L = spec.hidden_size, spec.num_layers

    norm = torch.ones((2 * L + 1, d), dtype=dt)
    for i, lw in enumerate(weights.layers):
        norm[norm_slot_input(spec, i)] = lw.input_norm
        if lw.post_attn_norm is not None:
            norm[norm_slot_post_attn(spec, i)] = lw.post_attn_norm
    norm[norm_slot_final(spec)] = weights.final_norm

    dense = [weights.layers[i] for i in spec.dense_layers]
    moe = [weights.layers[i] for i in spec.moe_layers]
    dw = spec.dense_intermediate_size or 0
    E = spec.moe.num_experts if spec.moe else 0
    ew = spec.moe.expert_intermediate_size if spec.moe else 0
    return {
        "w_embed": weights.embed,
        "w_lm_head": weights.lm_head_weight,
        "w_norm": norm,
        "w_qkv": stack_of(weights.layers, lambda lw: torch.cat([lw.q, lw.k, lw.v], dim=0), ("q", "k", "v"),
                          (spec.q_width + 2 * spec.kv_width, d)),
        "w_o": stack_of(weights.layers, lambda lw: lw.o, ("o",), (d, spec.q_width)),
        "w_upgate": stack_of(dense, lambda lw: interleave_gate_up(lw.gate, lw.up, chunk), ("gate", "up"), (2 * dw, d)),
        "w_down": stack_of(dense, lambda lw: lw.down, ("down",), (d, dw)),
        "w_router": stack_of(moe, lambda lw: lw.router, ("router",), (E, d)),
        "w_moe_upgate": stack_of(moe, lambda lw: interleave_gate_up(lw.experts_gate, lw.experts_up, moe_chunk),
                                 ("experts_gate", "experts_up"), (E, 2 * ew, d)),
        "w_moe_down": stack_of(moe, lambda lw: lw.experts_down, ("experts_down",), (E, d, ew)),
        "layer_slot": layer_slots(spec),
        "rope_inv_freq": rope_inv_freq(spec),
    }


def canonical_from_kernel(kw: dict[str, torch.Tensor], spec: "ModelSpec", *, chunk: int = DEFAULT_CHUNK,
                          moe_chunk: int | None = None) -> ModelWeights:
    """Inverse of :func:`kernel_weights` (tests: the round trip is exact)."""
    moe_chunk = chunk if moe_chunk is None else moe_chunk
    L, q, kv = spec.num_layers, spec.q_width, spec.kv_width
    slots = kw["layer_slot"].tolist()
    layers = []
    for i, ls in enumerate(spec.layers):
        qkv = kw["w_qkv"][i]
        lw = LayerWeights(
            input_norm=kw["w_norm"][norm_slot_input(spec, i)].clone(),
            q=qkv[:q].clone(), k=qkv[q:q + kv].clone(), v=qkv[q + kv:].clone(),
            o=kw["w_o"][i].clone(),
            post_attn_norm=(kw["w_norm"][norm_slot_post_attn(spec, i)].clone()
                            if spec.block == "sequential" else None),
        )
        s = slots[i]
        if ls.ffn == "dense":
            lw.gate, lw.up = deinterleave_gate_up(kw["w_upgate"][s], chunk)
            lw.down = kw["w_down"][s].clone()
        else:
            lw.router = kw["w_router"][s].clone()
            lw.experts_gate, lw.experts_up = deinterleave_gate_up(kw["w_moe_upgate"][s], moe_chunk)
            lw.experts_down = kw["w_moe_down"][s].clone()
        layers.append(lw)
    tied = kw["w_lm_head"] is kw["w_embed"] or spec.tie_embeddings
    return ModelWeights(
        embed=kw["w_embed"].clone(),
        final_norm=kw["w_norm"][norm_slot_final(spec)].clone(),
        layers=layers,
        lm_head=None if tied else kw["w_lm_head"].clone(),
    )


class LaidOutWeights:
    """A decode-only engine's kernel-layout weights handed on whole to the
    next engine of the same interleave (``chunk``, ``moe_chunk``): what
    timing several builds of a model that fits the GPU only once needs
    (North Mini Code on an 80 GB H100), where drawing and laying out the
    weights afresh took ~95 s an engine and moved them to other addresses.
    ``layout``: how the GEMM weights are tiled now (``LAYOUT_*``); the
    adopting backend re-lays them for its cubin. Stands in for
    :class:`ModelWeights` only where the cuda backend builds its engine."""

    def __init__(self, tensors: dict[str, torch.Tensor], layout: int, chunk: int, moe_chunk: int) -> None:
        self.tensors, self.layout, self.chunk, self.moe_chunk = tensors, layout, chunk, moe_chunk
        self.dtype = tensors["w_embed"].dtype

    @classmethod
    def take(cls, backend) -> "LaidOutWeights":
        """``backend``'s (a CudaBackend's) weights; that backend cannot run after."""
        got = cls(backend.kernel_weights, backend.layout, *backend.interleave)
        backend.kernel_weights = None
        return got

    def to(self, dtype=None, device=None) -> "LaidOutWeights":
        """Itself: the tensors are already bf16 on the GPU (they never move)."""
        if dtype is not None and dtype != self.dtype:
            raise MegacError(f"laid-out weights are {self.dtype}, not {dtype}: they are never cast")
        return self

    def adopt(self, chunk: int, moe_chunk: int) -> dict[str, torch.Tensor]:
        """The tensors, for a backend whose interleave is (``chunk``,
        ``moe_chunk``): re-interleaved in place where it differs (whole
        16-row groups: a split schedule's 64-row expert chunks beside the
        default's 128), else :class:`LayoutMismatch`; this object is empty
        after."""
        if self.tensors is None:
            raise MegacError("laid-out weights were already adopted by another engine")
        if (chunk, moe_chunk) != (self.chunk, self.moe_chunk):
            fields = (("w_upgate", self.chunk, chunk), ("w_moe_upgate", self.moe_chunk, moe_chunk))
            if not all(_regroupable(self.tensors[f], old, new) for f, old, new in fields):  # before any moves
                raise LayoutMismatch(f"laid-out weights interleave gate/up in chunks of {self.chunk} (experts "
                                     f"{self.moe_chunk}); these schedules read {chunk} ({moe_chunk}), and "
                                     "not every chunk is a whole number of 16-row groups")
            for f, old, new in fields:
                reinterleave_gate_up_(self.tensors[f], old, new)
            self.chunk, self.moe_chunk = chunk, moe_chunk
        got, self.tensors = self.tensors, None
        return got


class LayoutMismatch(MegacError):
    """Laid-out weights offered to schedules of another gate/up interleave."""


__all__ = [
    "DEFAULT_CHUNK",
    "GEMM_WEIGHT_FIELDS",
    "LAYOUT_ROW_MAJOR",
    "LAYOUT_TILED",
    "LaidOutWeights",
    "LayoutMismatch",
    "relayout_",
    "reinterleave_gate_up_",
    "gemm_tileable",
    "KERNEL_WEIGHT_FIELDS",
    "canonical_from_kernel",
    "deinterleave_gate_up",
    "interleave_gate_up",
    "kernel_weights",
    "layer_slots",
    "norm_slot_final",
    "norm_slot_input",
    "norm_slot_post_attn",
    "rope_inv_freq",
    "tile_gemm_weights",
    "untile_gemm_weights",
    "upgate_row_map",
]

"""ADD_RMSNORM: per row, ``x_resid += partials`` (the O-proj split-K partials
and/or the FFN partials, each set in index order; with ``ADD_MOE`` instead
of the FFN partials the row's expert outputs, score-weighted in k order:
MOE_COMBINE's sum, done here under the target's ``fused_combine``), then
RMSNorm with gamma ``GAMMA`` into ``x_norm[GAMMA]``.

``x_resid`` is the only buffer written more than once per step: each
ADD_RMSNORM of a row rewrites that row, and only its own row's chain reads it.

Device: none yet (the megakernel assembly adds it).
"""

from __future__ import annotations

import numpy as np
import torch

from megac import abi, routing
from megac.abi import Flag, H, Op
from megac.errors import BadTaskError
from megac.ops.base import BF16, BIG, FP32, OpDef, at, field, span
from megac.ops.cpu import as_slice, cast, idx
from megac.ops.moe import routed_slots


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float, act: torch.dtype) -> torch.Tensor:
    """``gamma * round(x * rsqrt(mean(x^2) + eps))`` (fp32 statistics, ``act``
    out): the one RMSNorm of the CPU semantics and the step's seed."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return cast(gamma * cast(y, act), act)


class _Rows:
    """The rows ``rs`` (a slice or an index tensor) of ADD_RMSNORM's ``[R, D]``
    planes: the residual, the norm output and the partials. With a slice the
    row views are taken once (reads and writes are then plain tensors)."""

    def __init__(self, rs, resid: torch.Tensor, norm: torch.Tensor, parts: list[torch.Tensor]) -> None:
        self.rs = rs
        self.sliced = isinstance(rs, slice)
        pick = (lambda t: t[rs]) if self.sliced else (lambda t: t)
        self.resid, self.norm, self.parts = pick(resid), pick(norm), [pick(t) for t in parts]

    def read(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.sliced else t[self.rs]

    def write(self, t: torch.Tensor, x: torch.Tensor) -> None:
        if self.sliced:
            t.copy_(x)
        else:
            t[self.rs] = x


def track(vm, layer: int, gamma: int, rows: list[int], parts: list[tuple[str, int]], slots=None) -> None:
    """ADD_RMSNORM's accesses of ``rows`` (checked mode), in execution order
    (``slots``: the rows' routed slots where the norm does the MoE combine)."""
    for r in rows:
        vm.tr.read("x_resid", (r, slice(None)))
    for name, sp in parts:
        for r in rows:
            vm.tr.read(name, (layer, sp, r, slice(None)))
    if slots is not None:
        for j, r in enumerate(rows):
            vm.tr.read("route_slot", (layer, r, slice(None)))
            vm.tr.read("topk_w", (layer, r, slice(None)))
            vm.tr.read("moe_out", (layer, slots[j], slice(None)))
    for r in rows:
        vm.tr.write("x_resid", (r, slice(None)))
        vm.tr.write("x_norm", (gamma, r, slice(None)))


class AddRmsnorm(OpDef):
    op = Op.ADD_RMSNORM
    node_kinds = ("norm", "norm_attn")
    device_fn = "add_rmsnorm"
    warm_fn = "norm_warm"  # gamma toward L2 before the waits (MEGAC_NORM_WARM)

    def flags(self, nt, geo):
        if nt.kind == "norm_attn":
            f = Flag.ADD_ATTN
        elif geo.block == "sequential":
            f = Flag.ADD_FFN
        else:
            f = Flag.ADD_ATTN | Flag.ADD_FFN
        if nt.kind == "norm" and geo.fused_combine and geo.ffn[nt.layer] == "moe":
            f = (f & ~Flag.ADD_FFN) | Flag.ADD_MOE  # the combine's sum here, no MOE_COMBINE task
        if nt.kind == "norm" and nt.layer == geo.num_layers - 1:
            f |= Flag.LAST_LAYER
        return int(f)

    def check_tiles(self, F_, geo):
        if np.any((F_["GAMMA"] < 0) | (F_["GAMMA"] >= geo.norm_slots)):
            return "GAMMA outside the norm slots"
        return None

    def field_rules(self, lim):
        g = lim.geo
        return [
            ("ROW", 0, g.rows, False),
            ("ATTN_SPLITS", 0, BIG, False),
            ("FFN_SPLITS", 0, BIG, False),
            ("GAMMA", 0, 2 * g.num_layers + 1, False),
        ]

    def access(self, acc, w, ix, layer, geo):
        op, D = self.op, geo.hidden
        row = field(w, op, "ROW")
        flags = w[:, H.FLAGS].astype(np.int64)
        acc.add("x_resid", False, ix, at(row), span(D))
        a = (flags & abi.Flag.ADD_ATTN) != 0
        acc.add("o_part", False, ix[a], at(layer[a]), (0, field(w[a], op, "ATTN_SPLITS")), at(row[a]), span(D))
        f = (flags & abi.Flag.ADD_FFN) != 0
        acc.add("ffn_part", False, ix[f], at(layer[f]), (0, field(w[f], op, "FFN_SPLITS")), at(row[f]), span(D))
        m = (flags & abi.Flag.ADD_MOE) != 0
        if m.any():  # MOE_COMBINE's reads
            E, K = max(geo.num_experts, 1), max(geo.top_k, 1)
            acc.add("moe_out", False, ix[m], at(layer[m]), span(E), at(row[m]), span(K), span(D))
            acc.add("topk_w", False, ix[m], at(layer[m]), at(row[m]), span(K))
            acc.add("route_slot", False, ix[m], at(layer[m]), at(row[m]), span(K))
        acc.add("x_resid", True, ix, at(row), span(D))
        acc.add("x_norm", True, ix, at(field(w, op, "GAMMA")), at(row), span(D))

    def task_bytes(self, w, geo, params):
        D = geo.hidden
        splits = field(w, self.op, "ATTN_SPLITS") + field(w, self.op, "FFN_SPLITS")
        moe = (w[:, H.FLAGS].astype(np.int64) & Flag.ADD_MOE) != 0
        return D * (FP32 * 2 + BF16 * 2) + splits * D * FP32 + moe * max(geo.top_k, 1) * D * FP32

    def run(self, vm, words):
        op, st, geo = self.op, vm.st, vm.geo

        def build(words):
            groups = []
            for (layer, na, nf, gamma, flags), ti in vm.groups(words, op, ("ATTN_SPLITS", "FFN_SPLITS", "GAMMA"),
                                                               flags=True):
                rows = field(words[ti], op, "ROW")
                if ((rows < 0) | (rows >= vm.R)).any() or not 0 <= gamma < geo.norm_slots:
                    raise BadTaskError("ADD_RMSNORM: ROW or GAMMA out of range", layer=layer)
                parts = []
                if flags & Flag.ADD_ATTN:
                    if not 0 <= na <= st["o_part"].shape[1]:
                        raise BadTaskError("ADD_RMSNORM: ATTN_SPLITS outside o_part", layer=layer)
                    parts += [("o_part", sp) for sp in range(na)]
                if flags & Flag.ADD_FFN:
                    if not 0 <= nf <= st["ffn_part"].shape[1]:
                        raise BadTaskError("ADD_RMSNORM: FFN_SPLITS outside ffn_part", layer=layer)
                    parts += [("ffn_part", sp) for sp in range(nf)]
                moe = bool(flags & Flag.ADD_MOE)
                if moe and geo.ffn[layer] != "moe":
                    raise BadTaskError(f"ADD_RMSNORM with ADD_MOE on layer {layer}, which has no MoE FFN",
                                       layer=layer)
                groups.append((layer, gamma, [int(r) for r in rows], parts, moe,
                               _Rows(as_slice(rows), st["x_resid"], st["x_norm"][gamma],
                                     [st[name][layer, sp] for name, sp in parts]),
                               st["w_norm"][gamma]))
            return groups

        for layer, gamma, rows, parts, moe, io, gam in vm.plan(op.name, words, build):
            slots = routed_slots(vm, self, layer, np.asarray(rows), "moe_out") if moe else None
            if vm.tracking:
                track(vm, layer, gamma, rows, parts, slots)
            x = io.read(io.resid)
            for plane in io.parts:
                x = x + io.read(plane)
            if moe:  # MOE_COMBINE's sum, then added as its ffn_part plane would be
                x = x + routing.combine(st["topk_w"][layer, idx(rows)], st["moe_out"][layer][idx(slots)])
            io.write(io.resid, x)
            io.write(io.norm, rms_norm(x, gam, vm.eps, st.act))


NORM_OPS = (AddRmsnorm(),)

__all__ = ["AddRmsnorm", "NORM_OPS", "rms_norm"]

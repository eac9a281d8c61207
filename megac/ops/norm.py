"""ADD_RMSNORM: per row, ``x_resid += partials`` (the O-proj split-K partials
and/or the FFN partials, each set in index order; with ``ADD_MOE`` instead
of the FFN partials the row's expert outputs, score-weighted in k order:
MOE_COMBINE's sum, done here under the target's ``fused_combine``), then
RMSNorm with gamma ``GAMMA`` into ``x_norm[GAMMA]``.

The residual after each norm has its own slot: ADD_RMSNORM reads row ROW of
``x_resid[RESID_IN]`` (the previous norm's slot; 0 is the seeded embedding)
and writes ``x_resid[GAMMA]``, so each slot is written once per step and a
task that reads the old residual never races the next norm.

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
from megac.ops.routed import routed_slots


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float, act: torch.dtype) -> torch.Tensor:
    """``gamma * round(x * rsqrt(mean(x^2) + eps))`` (fp32 statistics, ``act``
    out): the one RMSNorm of the CPU semantics and the step's seed."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return cast(gamma * cast(y, act), act)


class _Rows:
    """The rows ``rs`` (a slice or an index tensor) of ADD_RMSNORM's ``[R, D]``
    planes: the residual read and written, the norm output and the partials.
    With a slice the row views are taken once (reads and writes are then
    plain tensors)."""

    def __init__(self, rs, resid_in: torch.Tensor, resid_out: torch.Tensor, norm: torch.Tensor,
                 parts: list[torch.Tensor]) -> None:
        self.rs = rs
        self.sliced = isinstance(rs, slice)
        pick = (lambda t: t[rs]) if self.sliced else (lambda t: t)
        self.resid_in, self.resid_out, self.norm = pick(resid_in), pick(resid_out), pick(norm)
        self.parts = [pick(t) for t in parts]

    def read(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.sliced else t[self.rs]

    def write(self, t: torch.Tensor, x: torch.Tensor) -> None:
        if self.sliced:
            t.copy_(x)
        else:
            t[self.rs] = x


def _read_experts(vm, layer: int, row: int, row_slots, cols: slice) -> None:
    """Checked mode: the reads of row ``row``'s MoE combine on layer
    ``layer`` by a norm or a fold that adds it itself: its slots, scores and
    columns ``cols`` of its routed slots' (``row_slots``) outputs."""
    vm.tr.read("route_slot", (layer, row, slice(None)))
    vm.tr.read("topk_w", (layer, row, slice(None)))
    vm.tr.read("moe_out", (layer, row_slots, cols))


def _experts_sum(vm, layer: int, rows, slots) -> torch.Tensor:
    """MOE_COMBINE's sum of ``rows`` of layer ``layer`` (``routing.combine``
    of their routed ``slots``' outputs, tile 0: no split_down where a norm
    or a fold adds it), the plane a norm adds last."""
    st = vm.st
    return routing.combine(st["topk_w"][layer, idx(rows)], st["moe_out"][layer][idx(slots)][..., :vm.geo.hidden])


def track(vm, layer: int, gamma: int, resid_in: int, rows: list[int], parts: list[tuple[str, int]],
          slots=None, normed: bool = True) -> None:
    """ADD_RMSNORM's accesses of ``rows`` (checked mode), in execution order
    (``slots``: the rows' routed slots where the norm does the MoE combine;
    ``normed`` False: RESID_ONLY, no x_norm row written)."""
    for r in rows:
        vm.tr.read("x_resid", (resid_in, r, slice(None)))
    for name, sp in parts:
        for r in rows:
            vm.tr.read(name, (layer, sp, r, slice(None)))
    if slots is not None:
        for j, r in enumerate(rows):
            _read_experts(vm, layer, r, slots[j], slice(0, vm.geo.hidden))
    for r in rows:
        vm.tr.write("x_resid", (gamma, r, slice(None)))
        if normed:
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
        if nt.kind == "norm" and nt.layer + 1 < geo.num_layers and geo.up_combined(nt.layer + 1):
            f |= Flag.RESID_ONLY  # every reader of its x_norm slot folds it (QKV, router, up claims)
        return int(f)

    def check_tiles(self, F_, geo):
        if np.any((F_["GAMMA"] < 0) | (F_["GAMMA"] >= geo.norm_slots)):
            return "GAMMA outside the norm slots"
        if np.any((F_["RESID_IN"] < 0) | (F_["RESID_IN"] >= geo.norm_slots) | (F_["RESID_IN"] == F_["GAMMA"])):
            return "RESID_IN outside the norm slots or equal to GAMMA"
        return None

    def field_rules(self, lim):
        g = lim.geo
        return [
            ("ROW", 0, g.rows, False),
            ("ATTN_SPLITS", 0, BIG, False),
            ("FFN_SPLITS", 0, BIG, False),
            ("GAMMA", 0, 2 * g.num_layers + 1, False),
            ("RESID_IN", 0, 2 * g.num_layers + 1, False),
        ]

    def access(self, acc, w, ix, layer, geo):
        op, D = self.op, geo.hidden
        row = field(w, op, "ROW")
        flags = w[:, H.FLAGS].astype(np.int64)
        acc.add("x_resid", False, ix, at(field(w, op, "RESID_IN")), at(row), span(D))
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
        acc.add("x_resid", True, ix, at(field(w, op, "GAMMA")), at(row), span(D))
        n = (flags & abi.Flag.RESID_ONLY) == 0
        acc.add("x_norm", True, ix[n], at(field(w[n], op, "GAMMA")), at(row[n]), span(D))

    def task_bytes(self, w, geo, params):
        D = geo.hidden
        splits = field(w, self.op, "ATTN_SPLITS") + field(w, self.op, "FFN_SPLITS")
        moe = (w[:, H.FLAGS].astype(np.int64) & Flag.ADD_MOE) != 0
        normed = (w[:, H.FLAGS].astype(np.int64) & Flag.RESID_ONLY) == 0  # gamma read, x_norm written
        return D * FP32 * 2 + normed * D * BF16 * 2 + splits * D * FP32 + moe * max(geo.top_k, 1) * D * FP32

    def run(self, vm, words):
        op, st, geo = self.op, vm.st, vm.geo

        def build(words):
            groups = []
            for (layer, na, nf, gamma, rin, flags), ti in vm.groups(
                    words, op, ("ATTN_SPLITS", "FFN_SPLITS", "GAMMA", "RESID_IN"), flags=True):
                rows = field(words[ti], op, "ROW")
                if ((rows < 0) | (rows >= vm.R)).any() or not 0 <= gamma < geo.norm_slots:
                    raise BadTaskError("ADD_RMSNORM: ROW or GAMMA out of range", layer=layer)
                if not 0 <= rin < geo.norm_slots or rin == gamma:
                    raise BadTaskError("ADD_RMSNORM: RESID_IN out of range or equal to GAMMA", layer=layer)
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
                groups.append((layer, gamma, rin, [int(r) for r in rows], parts, moe, bool(flags & Flag.RESID_ONLY),
                               _Rows(as_slice(rows), st["x_resid"][rin], st["x_resid"][gamma], st["x_norm"][gamma],
                                     [st[name][layer, sp] for name, sp in parts]),
                               st["w_norm"][gamma]))
            return groups

        for layer, gamma, rin, rows, parts, moe, resid_only, io, gam in vm.plan(op.name, words, build):
            slots = routed_slots(vm, self, layer, np.asarray(rows), "moe_out") if moe else None
            if vm.tracking:
                track(vm, layer, gamma, rin, rows, parts, slots, normed=not resid_only)
            x = io.read(io.resid_in)
            for plane in io.parts:
                x = x + io.read(plane)
            if moe:  # MOE_COMBINE's sum, then added as its ffn_part plane would be
                x = x + _experts_sum(vm, layer, rows, slots)
            io.write(io.resid_out, x)
            if not resid_only:
                io.write(io.norm, rms_norm(x, gam, vm.eps, st.act))


# ---------------------------------------------------------------------------
# NORM_IN: a GEMM tile that folds the norm writing its x_norm slot
# ---------------------------------------------------------------------------
NORM_IN_FIELDS = ("NORM_LAYER", "NORM_ATTN_SPLITS", "NORM_FFN_SPLITS", "NORM_RESID_IN")


def norm_in_rules(lim) -> list:
    """Field rules of the NORM_* fields (zeros where the tile does not fold)."""
    g = lim.geo
    return [
        ("NORM_LAYER", 0, g.num_layers, False),
        ("NORM_ATTN_SPLITS", 0, g.kv_heads + 1, False),
        ("NORM_FFN_SPLITS", 0, BIG, False),
        ("NORM_RESID_IN", 0, g.norm_slots, False),
    ]


def norm_in_access(acc, op, w, ix, geo, x_slot, k0, kl) -> None:
    """A GEMM tile's input reads: rows ``[k0, k0 + kl)`` of ``x_norm[x_slot]``,
    or, flagged NORM_IN, every row of what the folded norm reads (its
    residual slot and its partials: the whole row, for the row's scale;
    with ADD_MOE, a QKV tile's, layer NORM_LAYER's routed expert outputs
    with their slots and scores instead of an FFN partial)."""
    R, D = geo.rows, geo.hidden
    f = (w[:, H.FLAGS].astype(np.int64) & Flag.NORM_IN) != 0
    n = ~f
    acc.add("x_norm", False, ix[n], at(x_slot[n]), span(R), (k0[n], k0[n] + kl[n]))
    if not f.any():
        return
    wf, ixf = w[f], ix[f]
    nl = field(wf, op, "NORM_LAYER")
    acc.add("x_resid", False, ixf, at(field(wf, op, "NORM_RESID_IN")), span(R), span(D))
    na, nf = field(wf, op, "NORM_ATTN_SPLITS"), field(wf, op, "NORM_FFN_SPLITS")
    a, b = na > 0, nf > 0
    acc.add("o_part", False, ixf[a], at(nl[a]), (0, na[a]), span(R), span(D))
    acc.add("ffn_part", False, ixf[b], at(nl[b]), (0, nf[b]), span(R), span(D))
    m = (wf[:, H.FLAGS].astype(np.int64) & Flag.ADD_MOE) != 0
    if m.any():
        experts_access(acc, ixf[m], nl[m], geo, span(D))


def experts_access(acc, ix, layer, geo, cols) -> None:
    """The reads of a fold that adds layer ``layer``'s MoE combine itself:
    columns ``cols`` of every routed slot's output, with the rows' slots and
    scores (what MOE_COMBINE reads for those features)."""
    R, E, K = geo.rows, max(geo.num_experts, 1), max(geo.top_k, 1)
    acc.add("moe_out", False, ix, at(layer), span(E), span(R), span(K), cols)
    acc.add("topk_w", False, ix, at(layer), span(R), span(K))
    acc.add("route_slot", False, ix, at(layer), span(R), span(K))


def norm_in_of(vm, op, w) -> tuple[int, int, int, int, bool] | None:
    """The folded norm's (layer, attn splits, FFN splits, residual slot,
    whether it adds the layer's expert outputs (ADD_MOE)) of the tasks ``w``
    of one group (all flagged NORM_IN or none), or None. ADD_MOE: QKV_PROJ
    tiles and routed up claimers only, with NORM_FFN_SPLITS 0 and NORM_LAYER
    a MoE layer."""
    f = (w[:, H.FLAGS].astype(np.int64) & Flag.NORM_IN) != 0
    if not f.any():
        return None
    if not f.all():
        raise BadTaskError(f"{op.name}: the tiles of one input disagree on NORM_IN", opcode=int(op))
    vals = [field(w, op, name) for name in NORM_IN_FIELDS]
    if any((v != v[0]).any() for v in vals):
        raise BadTaskError(f"{op.name}: the tiles of one input disagree on the folded norm", opcode=int(op))
    nl, na, nf, rin = (int(v[0]) for v in vals)
    st = vm.st
    if not (0 <= nl < vm.geo.num_layers and 0 <= na <= st["o_part"].shape[1] and 0 <= nf <= st["ffn_part"].shape[1]
            and 0 <= rin < vm.geo.norm_slots):
        raise BadTaskError(f"{op.name}: NORM_* fields out of range", opcode=int(op))
    m = (w[:, H.FLAGS].astype(np.int64) & Flag.ADD_MOE) != 0
    if m.any() and not m.all():
        raise BadTaskError(f"{op.name}: the tiles of one input disagree on ADD_MOE", opcode=int(op))
    moe = bool(m.any())
    if moe and (op not in (Op.QKV_PROJ, Op.MOE_UPGATE_DRAIN) or nf != 0 or vm.geo.ffn[nl] != "moe"):
        raise BadTaskError(f"{op.name}: ADD_MOE with NORM_IN is a QKV_PROJ or MOE_UPGATE_DRAIN input with "
                           f"NORM_FFN_SPLITS 0 and NORM_LAYER a MoE layer", opcode=int(op))
    return nl, na, nf, rin, moe


def norm_in_input(vm, slot: int, fold: tuple[int, int, int, int, bool], d: OpDef | None = None) -> str:
    """The folded norm's output for x_norm slot ``slot`` (ADD_RMSNORM's
    arithmetic on the same planes in the same order, so the bits the norm
    task writes to ``x_norm[slot]``; with ADD_MOE the layer's expert outputs
    summed as MOE_COMBINE sums them, added last, as the norm adds that
    task's partial), into the VM's private ``x_fold[slot]`` once a step;
    returns that buffer's name for ``VM.products``. ``d``: the reader's
    OpDef (its errors' name)."""
    nl, na, nf, rin, moe = fold
    st = vm.st
    rows = np.arange(vm.R)
    slots = routed_slots(vm, d, nl, rows, "moe_out") if moe else None
    if vm.tracking:
        for r in range(vm.R):
            vm.tr.read("x_resid", (rin, r, slice(None)))
            for sp in range(na):
                vm.tr.read("o_part", (nl, sp, r, slice(None)))
            for sp in range(nf):
                vm.tr.read("ffn_part", (nl, sp, r, slice(None)))
            if moe:
                _read_experts(vm, nl, r, slots[r], slice(None))
    key = ("norm_in", slot, moe)
    if key not in vm.cache:
        x = st["x_resid"][rin]
        for sp in range(na):
            x = x + st["o_part"][nl, sp]
        for sp in range(nf):
            x = x + st["ffn_part"][nl, sp]
        if moe:
            x = x + _experts_sum(vm, nl, rows, slots)
        st["x_fold"][slot] = rms_norm(x, st["w_norm"][slot], vm.eps, st.act)
        vm.cache[key] = True
    return "x_fold"


NORM_OPS = (AddRmsnorm(),)

__all__ = ["AddRmsnorm", "NORM_IN_FIELDS", "NORM_OPS", "experts_access", "norm_in_access", "norm_in_input",
           "norm_in_of", "norm_in_rules", "rms_norm"]


# ---------------------------------------------------------------------------
# COMBINE_IN: a router tile that folds the previous layer's MoE combine
# ---------------------------------------------------------------------------
def combine_in_access(acc, op, w, ix, geo, x_slot, k0, kl) -> None:
    """A router tile's input reads: as ``norm_in_access``, except that a tile
    flagged COMBINE_IN reads only its K range ``[k0, k0 + kl)`` of the new
    residual's planes: the residual slot, the O-proj partials and layer
    NORM_LAYER's routed expert outputs with their slots and scores (what
    MOE_COMBINE reads for those features), and no FFN partial; with
    NORM_LAYER -1 (the residual form) the residual slot alone, which the
    norm writing its x_norm slot wrote."""
    c = (w[:, H.FLAGS].astype(np.int64) & Flag.COMBINE_IN) != 0
    norm_in_access(acc, op, w[~c], ix[~c], geo, x_slot[~c], k0[~c], kl[~c])
    if not c.any():
        return
    wc, ixc, a, b = w[c], ix[c], k0[c], k0[c] + kl[c]
    R = geo.rows
    nl, na = field(wc, op, "NORM_LAYER"), field(wc, op, "NORM_ATTN_SPLITS")
    acc.add("x_resid", False, ixc, at(field(wc, op, "NORM_RESID_IN")), span(R), (a, b))
    # NORM_LAYER -1 (the residual form): the norm's residual alone
    m = nl >= 0
    wc, ixc, a, b, nl, na = wc[m], ixc[m], a[m], b[m], nl[m], na[m]
    h = na > 0
    acc.add("o_part", False, ixc[h], at(nl[h]), (0, na[h]), span(R), (a[h], b[h]))
    experts_access(acc, ixc, nl, geo, (a, b))


def combine_in_of(vm, op, w) -> tuple[int, int, int] | None:
    """The folded combine's (layer, attn splits, residual slot) of the tasks
    ``w`` of one group (all flagged COMBINE_IN or none), or None."""
    f = (w[:, H.FLAGS].astype(np.int64) & Flag.COMBINE_IN) != 0
    if not f.any():
        return None
    if not f.all():
        raise BadTaskError(f"{op.name}: the tiles of one input disagree on COMBINE_IN", opcode=int(op))
    if op != Op.ROUTER_GEMM or (w[:, H.FLAGS].astype(np.int64) & Flag.NORM_IN).any():
        raise BadTaskError(f"{op.name}: COMBINE_IN is a ROUTER_GEMM input, not with NORM_IN", opcode=int(op))
    vals = [field(w, op, name) for name in ("NORM_LAYER", "NORM_ATTN_SPLITS", "NORM_FFN_SPLITS", "NORM_RESID_IN")]
    if any((v != v[0]).any() for v in vals):
        raise BadTaskError(f"{op.name}: the tiles of one input disagree on the folded combine", opcode=int(op))
    nl, na, nf, rin = (int(v[0]) for v in vals)
    st, geo = vm.st, vm.geo
    residual = nl == -1 and na == 0  # the residual form: the norm's residual slot alone
    if not (residual or (0 <= nl < geo.num_layers and geo.ffn[nl] == "moe" and 0 <= na <= st["o_part"].shape[1])) \
            or nf != 0 or not 0 <= rin < geo.norm_slots:
        raise BadTaskError(f"{op.name}: COMBINE_IN fields out of range (NORM_LAYER a MoE layer or -1 with no "
                           f"partials, NORM_FFN_SPLITS 0)", opcode=int(op))
    return nl, na, rin


def combine_in_input(vm, d, slot: int, comb: tuple[int, int, int], k0: int, kl: int) -> str:
    """A COMBINE_IN router tile's input for x_norm slot ``slot`` (its gamma):
    ``bf16(gamma * x)`` with ``x`` the new residual, added as ADD_RMSNORM with
    ADD_MOE adds it (the residual slot, the O-proj partials in index order,
    then MOE_COMBINE's sum), not normalised; into the VM's private
    ``x_comb[slot]`` once a step (every element: they depend on their own
    feature alone). NORM_LAYER -1 (the residual form): ``x`` is the residual
    slot as the norm task wrote it (the same bits). Reports the reads of
    columns ``[k0, k0 + kl)``; ``d``: the router's OpDef (its errors' name)."""
    nl, na, rin = comb
    st = vm.st
    rows = np.arange(vm.R)
    slots = routed_slots(vm, d, nl, rows, "moe_out") if nl >= 0 else None
    if vm.tracking:
        cs = slice(k0, k0 + kl)
        for r in range(vm.R):
            vm.tr.read("x_resid", (rin, r, cs))
            if nl < 0:  # the residual form
                continue
            for sp in range(na):
                vm.tr.read("o_part", (nl, sp, r, cs))
            _read_experts(vm, nl, r, slots[r], cs)
    key = ("combine_in", slot)
    if key not in vm.cache:
        x = st["x_resid"][rin]
        if nl >= 0:  # the norm's adds (the residual form: the norm task made them)
            for sp in range(na):
                x = x + st["o_part"][nl, sp]
            x = x + _experts_sum(vm, nl, rows, slots)
        st["x_comb"][slot] = cast(st["w_norm"][slot] * x, st.act)
        vm.cache[key] = True
    return "x_comb"

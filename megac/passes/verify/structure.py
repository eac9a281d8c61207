"""Check class 1, ``structure``: opcodes, padding, counter and target
ranges, descriptor fields (each opcode's ``OpDef.field_rules``), regions
inside their buffers, field pairs that must agree."""

from __future__ import annotations


import numpy as np

from megac import abi
from megac.abi import DYN_FLAG, DYN_INDEX_MASK, Op
from megac.passes.program import Program, access_tables, as_i64, box_str, fmt_target, isdyn, opname
from megac.passes.violations import Sink

from megac.ops import REGISTRY
from megac.ops.base import Limits as OpLimits

F = abi.field_index


def check_structure(p: Program, out: Sink) -> None:
    S, T, _ = p.tasks.shape
    C = p.num_counters
    L = p.geo.num_layers
    if len(p.task_counts) != S or (p.task_counts < 0).any() or (p.task_counts > T).any():
        out.add("padding", f"task_counts {p.task_counts.tolist()[:8]}... does not fit tasks [{S}, {T}, 32]")
    # padding after task_counts[sm] must be all zero (NOP)
    pad = np.arange(T)[None, :] >= p.task_counts[:, None]
    bad = pad & (p.tasks != 0).any(axis=2)
    for s, k in zip(*np.nonzero(bad)):
        out.add("padding", f"SM {s} slot {k}: non-zero words after task_counts[{s}]={p.task_counts[s]} ({opname(int(p.tasks[s, k, 0]))})")

    op = p.op
    badop = (op < 0) | (op > max(Op))
    for i in np.flatnonzero(badop):
        out.add("opcode", f"SM {p.sm[i]} slot {p.slot[i]}: invalid opcode {op[i]}")
    for i in np.flatnonzero(op == Op.NOP):
        out.add("nop_in_body", f"SM {p.sm[i]} slot {p.slot[i]}: NOP before task_counts[{p.sm[i]}]={p.task_counts[p.sm[i]]} (NOP is padding only)")
    real = ~badop & (op != Op.NOP)

    tw_total = p.target_words.total
    for wname, tname, w, t in (("WAIT0", "TARGET0", p.w0, p.t0), ("WAIT1", "TARGET1", p.w1, p.t1)):
        for i in np.flatnonzero(real & ((w < -1) | (w >= C))):
            out.add("counter_range", f"{p.where(i)}: {wname} counter {w[i]} outside [-1, {C})")
        has = real & (w >= 0) & (w < C)
        dyn = (t & DYN_FLAG) != 0
        for i in np.flatnonzero(has & ~dyn & (t < 1)):
            out.add("target_range", f"{p.where(i)}: {tname} {t[i]} on {p.cname(w[i])} (a static target must be >= 1)")
        for i in np.flatnonzero(has & dyn & (((t & DYN_INDEX_MASK) >= tw_total) | (t < 0))):
            out.add("dyn_range", f"{p.where(i)}: {tname} reads target word {t[i] & DYN_INDEX_MASK} outside the {tw_total} target words")
    for i in np.flatnonzero(real & ((p.sig < -1) | (p.sig >= C))):
        out.add("counter_range", f"{p.where(i)}: SIGNAL counter {p.sig[i]} outside [-1, {C})")

    # layer: < num_layers, LM_HEAD == num_layers
    lm = op == Op.LM_HEAD
    for i in np.flatnonzero(real & ~lm & ((p.layer < 0) | (p.layer >= L))):
        out.add("field_range", f"{p.where(i)}: LAYER {p.layer[i]} outside [0, {L})")
    for i in np.flatnonzero(lm & (p.layer != L)):
        out.add("field_range", f"{p.where(i)}: LM_HEAD LAYER must be num_layers={L}")
    ml = np.array(tuple(f == "moe" for f in p.geo.ffn) + (False,), dtype=bool)
    lay = np.clip(p.layer, 0, L)
    moe_ops = np.isin(op, [int(d.op) for d in REGISTRY.values() if d.ffn_kind == "moe"])
    dense_ops = np.isin(op, [int(d.op) for d in REGISTRY.values() if d.ffn_kind == "dense"])
    for i in np.flatnonzero(real & moe_ops & ~ml[lay]):
        out.add("field_range", f"{p.where(i)}: MoE opcode on a dense layer")
    for i in np.flatnonzero(real & dense_ops & ml[lay]):
        out.add("field_range", f"{p.where(i)}: dense FFN opcode on a MoE layer")

    for op_, rules in _field_rules(p).items():
        idx = np.flatnonzero(real & (op == op_))
        if not len(idx):
            continue
        sub = p.words[idx].astype(np.int64)
        for name, lo, hi, dyn_ok in rules:
            v = sub[:, F(op_, name)] if isinstance(name, str) else name(sub)
            label = name if isinstance(name, str) else getattr(name, "label", "field")
            isdyn = (v >= 0) & ((v & DYN_FLAG) != 0)
            hi_v = hi(sub) if callable(hi) else hi
            lo_v = lo(sub) if callable(lo) else lo
            bad = (v < lo_v) | (v >= hi_v)
            if dyn_ok:
                bad = np.where(isdyn, (v & DYN_INDEX_MASK) >= tw_total, bad)
            for j in np.flatnonzero(bad):
                h = hi_v[j] if isinstance(hi_v, np.ndarray) else hi_v
                lw = lo_v[j] if isinstance(lo_v, np.ndarray) else lo_v
                shown = fmt_target(int(v[j])) if dyn_ok and isdyn[j] else int(v[j])
                out.add("field_range", f"{p.where(idx[j])}: {label} = {shown} outside [{lw}, {h})")


def check_field_pairs(p: Program, out: Sink) -> None:
    """ATTN_COMBINE (and an O_PROJ that merges: MERGE_SPLITS != 0) merges
    NUM_SPLITS partials after waiting for TARGET0 split signals: it may merge
    no more than it waited for (a dynamic count counts as the largest value
    its target word can hold; two dynamic values must be the same word).
    Splits past a row's own count are empty, so merging fewer is exact."""
    for op, name in ((Op.ATTN_COMBINE, "NUM_SPLITS"), (Op.O_PROJ, "MERGE_SPLITS")):
        col = p.words[:, F(op, name)].astype(np.int64)
        idx = np.flatnonzero((p.op == op) & (p.w0 >= 0) & (col != 0))
        for i in idx:
            a, t = int(col[i]), int(p.t0[i])
            if isdyn(a) and isdyn(t):
                ok = a == t
            elif isdyn(t):
                ok = False  # the waited count may be smaller than a static merge
            else:
                ok = (p.geo.dyn_bound(a & DYN_INDEX_MASK) if isdyn(a) else a) <= t
            if not ok:
                out.add("field_mismatch", f"{p.where(i)}: {name} {fmt_target(a)} may exceed the "
                                          f"{fmt_target(t)} split signals it waits for on {p.cname(p.w0[i])}")


def _field_rules(p: Program) -> dict[int, list]:
    """(field or fn, lo, hi_exclusive, dyn_capable) per opcode: each opcode's
    ``OpDef.field_rules`` (``megac.ops``); an opcode this model cannot hold
    has none (the layer-kind check above catches it)."""
    lim = OpLimits(p.geo, p.num_counters)
    out = {}
    for op_, d in REGISTRY.items():
        rules = d.field_rules(lim)
        if rules:
            out[int(op_)] = rules
    return out




def check_regions(p: Program, out: Sink) -> None:
    """Every region lies inside its buffer's logical shape (a field that
    passed its own range check can still point outside, e.g. a split count)."""
    shapes = p.access.logical_shapes(p.geo)
    ignore = set(getattr(p.access, "STEP_INPUT_BUFFERS", ()))
    for buf, t in sorted(access_tables(p).items()):
        if buf in ignore:
            continue
        if buf not in shapes:
            out.add("region_range", f"{p.where(t.node[0])} touches unknown buffer {buf}")
            continue
        shp = as_i64(shapes[buf])
        if t.lo.shape[1] != len(shp):
            out.add("region_range", f"{p.where(t.node[0])}: {buf} region has {t.lo.shape[1]} dims, the buffer {len(shp)}")
            continue
        bad = ((t.lo < 0) | (t.hi > shp[None, :]) | (t.hi < t.lo)).any(axis=1)
        for e in np.flatnonzero(bad):
            what = "writes" if t.write[e] else "reads"
            out.add("region_range", f"{p.where(t.node[e])} {what} {buf}{box_str(t, int(e))} outside its shape {tuple(shp.tolist())}")



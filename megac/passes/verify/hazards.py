"""Check class 5, ``hazards``: every overlapping (writer, reader) and
(writer, writer) pair is ordered by counters."""

from __future__ import annotations


import numpy as np

from megac import abi
from megac.passes.program import Program, access_tables, as_i64, box_str
from megac.passes.violations import Sink

F = abi.field_index

from megac.passes.boxjoin import box_pairs
from megac.passes.hb import HappensBefore
from megac.passes.violations import STEP_OUTPUTS


def _step_input_mask(p: Program, buf: str, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Boxes lying inside one of the step-input regions of ``buf``."""
    ok = np.zeros(len(lo), dtype=bool)
    for r in p.access.step_inputs(p.geo):
        if r.buffer == buf:
            box = as_i64(r.box)
            ok |= np.all((lo >= box[None, :, 0]) & (hi <= box[None, :, 1]), axis=1)
    return ok


def check_hazards(p: Program, hb: HappensBefore, out: Sink) -> int:
    checked = 0
    ignore = set(getattr(p.access, "STEP_INPUT_BUFFERS", ()))
    for buf, t in sorted(access_tables(p).items()):
        if buf in ignore:
            continue
        wi = np.flatnonzero(t.write)
        ri = np.flatnonzero(~t.write)
        # ---- reads vs writes: ordered one way or the other
        a, b = box_pairs(t.lo[wi], t.hi[wi], t.lo[ri], t.hi[ri])
        W, R = wi[a], ri[b]
        keep = t.node[W] != t.node[R]
        W, R = W[keep], R[keep]
        checked += len(W)
        wn, rn = t.node[W], t.node[R]
        before = hb(wn, rn)
        after = np.zeros(len(W), dtype=bool)
        if (~before).any():
            after[~before] = hb(rn[~before], wn[~before])
        # a read entry that some writer precedes reads that writer's data; an
        # unordered writer then overwrites it (WAR); with none, RAW
        has_before = np.zeros(len(t.node), dtype=bool)
        has_before[R[before]] = True
        racy = ~before & ~after
        raced = np.zeros(len(t.node), dtype=bool)
        raced[R[racy]] = True
        for k in np.flatnonzero(racy):
            w_, r_ = int(W[k]), int(R[k])
            if has_before[r_]:
                out.add("war", f"{buf}{box_str(t, w_)}: writer {p.where(t.node[w_])} may overwrite data reader {p.where(t.node[r_])} still reads ({buf}{box_str(t, r_)}): no counter orders the reader before it{_wait_hint(p, int(t.node[w_]))}")
            else:
                out.add("raw", f"{buf}{box_str(t, r_)}: reader {p.where(t.node[r_])} is not ordered after writer {p.where(t.node[w_])} ({buf}{box_str(t, w_)}){_wait_hint(p, int(t.node[r_]))}")
        # reads no writer precedes must be step inputs
        lonely = np.flatnonzero(~t.write & ~has_before & ~raced)
        for e in lonely[~_step_input_mask(p, buf, t.lo[lonely], t.hi[lonely])]:
            out.add("unwritten_read", f"{buf}{box_str(t, int(e))}: {p.where(t.node[e])} reads data no task writes before it, and it is not a step input")
        # writes no other task reads (in any order) are wasted or misplaced
        if buf not in STEP_OUTPUTS:
            read = np.zeros(len(t.node), dtype=bool)
            read[W] = True
            for e in wi[~read[wi]]:
                out.add("dead_write", f"{buf}{box_str(t, int(e))}: {p.where(t.node[e])} writes data no task reads (not a step output)")
        # ---- writes vs writes
        a, b = box_pairs(t.lo[wi], t.hi[wi], t.lo[wi], t.hi[wi])
        m = t.node[wi[a]] < t.node[wi[b]]
        A, B = wi[a[m]], wi[b[m]]
        checked += len(A)
        an, bn = t.node[A], t.node[B]
        ordered = hb(an, bn)
        if (~ordered).any():
            ordered[~ordered] = hb(bn[~ordered], an[~ordered])
        for k in np.flatnonzero(~ordered):
            out.add("waw", f"{buf}{box_str(t, int(A[k]))}: writers {p.where(an[k])} and {p.where(bn[k])} ({buf}{box_str(t, int(B[k]))}) overlap and no counter orders them")
    return checked


def _wait_hint(p: Program, node: int) -> str:
    if node >= p.n:
        return ""
    ws = [p.cname(c) for c in (p.w0[node], p.w1[node]) if c >= 0]
    return f"; it waits {', '.join(ws)}" if ws else "; it waits nothing"



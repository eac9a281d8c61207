"""Check class 3, ``dynamic``: device-written target words have one
writer, ordered before every reader through the reader's WAIT0."""

from __future__ import annotations


import numpy as np

from megac import abi
from megac.abi import DYN_FLAG, DYN_INDEX_MASK, H, Op
from megac.passes.program import Program, as_i64, isdyn
from megac.passes.violations import Sink

F = abi.field_index

from megac.passes.hb import HappensBefore


def check_dynamic(p: Program, hb: HappensBefore, out: Sink) -> None:
    tw = p.target_words
    writer: dict[int, int] = {}
    for i in np.flatnonzero(p.op == Op.ROUTE_FINALIZE):
        for name in ("UP_COUNT_WORD", "DOWN_COUNT_WORD"):
            wd = int(p.words[i, F(Op.ROUTE_FINALIZE, name)])
            if wd < 0:  # UP_COUNT_WORD -1: no up queue (routed claims)
                continue
            if wd in writer:
                out.add("dyn_multi_writer", f"{p.where(i)}: {name} target word {wd} is also written by {p.where(writer[wd])}")
            writer[wd] = int(i)
    # readers: (task, word, where it is read)
    rt, rw, rl = [], [], []
    labels = ["TARGET0", "TARGET1", "TASK_WAIT_TARGET"]
    for lab, (col, wcol) in enumerate(((H.TARGET0, H.WAIT0), (H.TARGET1, H.WAIT1))):
        v = p.words[:, col].astype(np.int64)
        i = np.flatnonzero((p.words[:, wcol] >= 0) & (v >= 0) & ((v & DYN_FLAG) != 0))
        rt.append(i), rw.append(v[i] & DYN_INDEX_MASK), rl.append(np.full(len(i), lab))
    for op_, name in sorted(abi.DYN_CAPABLE):
        idx = np.flatnonzero(p.op == op_)
        v = p.words[idx, F(op_, name)].astype(np.int64)
        j = np.flatnonzero((v >= 0) & ((v & DYN_FLAG) != 0))
        labels.append(name)
        rt.append(idx[j]), rw.append(v[j] & DYN_INDEX_MASK), rl.append(np.full(len(j), len(labels) - 1))
    for g in p.groups:  # a claimer runs claimed tasks (and their targets) after its own waits
        for _, t in g.waits:
            if isdyn(t):
                rt.append(g.claimers), rw.append(np.full(len(g.claimers), t & DYN_INDEX_MASK))
                rl.append(np.full(len(g.claimers), 2))
    rt, rw, rl = (np.concatenate(x).astype(np.int64) for x in (rt, rw, rl))
    m = (rw >= tw.host_words) & (rw < tw.total)
    readers = list(zip(rt[m].tolist(), rw[m].tolist(), [labels[x] for x in rl[m].tolist()]))
    dev = [r for r in readers if tw.host_words <= r[1] < tw.total]
    for i, wd, lab in dev:
        if wd not in writer:
            out.add("dyn_unwritten", f"{p.where(i)}: {lab} reads device target word {wd}, which no task writes")
    chk = [r for r in dev if r[1] in writer]
    if not chk:
        return
    ri = as_i64([c[0] for c in chk])
    wi = as_i64([writer[c[1]] for c in chk])
    # the device reads TARGET1 and dynamic fields after WAIT0: order through WAIT0 only
    w0 = np.where(p.w0[ri] < p.num_counters, p.w0[ri], -1)
    ok = hb.cl.test(w0, hb.sig[wi])
    # TARGET0 is read before WAIT0 completes: nothing of the task orders it
    ok &= np.array([lab != "TARGET0" for _, _, lab in chk], dtype=bool)
    for k in np.flatnonzero(~ok):
        i, wd, lab = chk[k]
        if lab == "TARGET0":
            why = "TARGET0 is read before any wait"
        elif p.w0[i] < 0:
            why = "the task has no WAIT0"
        else:
            why = f"WAIT0 {p.cname(p.w0[i])} does not follow the writer"
        out.add("dyn_order", f"{p.where(i)}: {lab} reads target word {wd} before its writer {p.where(int(wi[k]))} is done: {why}")



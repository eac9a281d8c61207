"""Pass ``assign``: global list -> per-SM queues.

Static task k of the global list goes to SM ``(k - s_k) mod num_sms``, where
s_k is where the cursor restarts (``order``'s ``g_segment``). Under the wave
order's ``sm_cursor: layer`` (the default) s_k is the position of k's
layer's first task: every layer deals its tasks from SM 0, so an SM runs the
same opcodes layer after layer and finds their code warm. Under
``sm_cursor: global`` s_k = 0: the cursor is the global position and carries
across layers, so the small waves spread over the SMs.
A claimer wave has exactly ``num_sms`` claimers; claimer i of a node goes to
SM ``(p0 - s + i) mod num_sms`` where p0 is the position of the node's first
claimer, so the claimers of one queue cover every SM exactly once even when
interleaved with another wave. Each SM runs its tasks in global order (slot =
rank on that SM): a task waits only on tasks earlier in the global list, so
the earliest unfinished task always heads its SM's queue, however the SMs
are dealt.

Ensures: static task k is on SM (k - s_k) mod num_sms; every claimer node has
one claimer on each SM; slots are 0..count-1 per SM, in global order.
"""

from __future__ import annotations

import numpy as np

from megac.passes import Lowering, PassError

NAME = "assign"


def requires(lw: Lowering) -> None:
    if lw.g_node is None or lw.g_segment is None:
        raise PassError(NAME, "needs the global list (run order first)")


def run(lw: Lowering) -> str:
    S = lw.geo.num_sms
    n = len(lw.g_node)
    pos = np.arange(n, dtype=np.int64)
    rel = pos - lw.g_segment
    sm = rel % S
    cl = lw.g_claimer >= 0
    if cl.any():
        first = np.full(len(lw.nodes), n, dtype=np.int64)
        np.minimum.at(first, lw.g_node[cl], rel[cl])
        sm[cl] = (first[lw.g_node[cl]] + lw.g_claimer[cl]) % S
    order = np.lexsort((pos, sm))
    counts = np.bincount(sm, minlength=S)
    starts = np.cumsum(counts) - counts
    slot = np.empty(n, dtype=np.int64)
    slot[order] = np.arange(n) - np.repeat(starts, counts)
    lw.sm, lw.slot = sm, slot
    return f"{n} tasks on {S} SMs: {int(counts.min())}..{int(counts.max())} per SM"


def ensures(lw: Lowering) -> None:
    S = lw.geo.num_sms
    n = len(lw.g_node)
    pos = np.arange(n)
    static = lw.g_claimer < 0
    want = (pos - lw.g_segment) % S
    if (lw.sm[static] != want[static]).any():
        k = int(np.flatnonzero(static & (lw.sm != want))[0])
        raise PassError(NAME, f"static task {k} on SM {int(lw.sm[k])}, expected {int(want[k])}")
    for nt in lw.nodes:
        if nt.claimer:
            sms = np.sort(lw.sm[(lw.g_node == nt.index) & ~static])
            if len(sms) != S or (sms != np.arange(S)).any():
                raise PassError(NAME, f"{nt.name}: claimers do not cover every SM exactly once")
    key = lw.sm * n + lw.slot
    if len(np.unique(key)) != n:
        raise PassError(NAME, "two tasks share an (SM, slot)")
    order = np.lexsort((pos, lw.sm))
    counts = np.bincount(lw.sm, minlength=S)
    expect = np.arange(n) - np.repeat(np.cumsum(counts) - counts, counts)
    if (lw.slot[order] != expect).any():
        raise PassError(NAME, "slots are not the global order on each SM")


__all__ = ["NAME", "ensures", "requires", "run"]

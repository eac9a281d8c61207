"""Pass ``assign``: global list -> per-SM queues.

A dealt static task k goes to SM ``c_k mod num_sms``, where c_k is the SM
cursor (``order``'s ``g_cursor``): the count of dealt entries before k,
restarted at every layer's first task under the wave order's ``sm_cursor:
layer`` (the default), so an SM runs the same opcodes layer after layer and
finds their code warm; under ``sm_cursor: global`` it never restarts and
the small waves spread over the SMs. A claimer wave has exactly
``num_sms`` claimers; claimer i of a node goes to SM ``(c0 + i) mod
num_sms`` where c0 is the cursor at the node's first claimer, so the
claimers of one queue cover every SM exactly once even when interleaved
with another wave. A placed task (a wave ``{wave: a, sms_of: b}``) takes the SM
of its host entry (``order``'s ``g_host``), which precedes it in the list.

Each SM runs its tasks in global order (slot = rank on that SM): a task
waits only on tasks earlier in the global list, so the earliest unfinished
task always heads its SM's queue, however the SMs are dealt: placement can
slow a step, never deadlock it.

Ensures: a dealt static task k is on SM c_k mod num_sms; a placed task on
its host's SM; every claimer node has one claimer on each SM; slots are
0..count-1 per SM, in global order.
"""

from __future__ import annotations

import numpy as np

from megac.passes import Lowering, PassError

NAME = "assign"


def requires(lw: Lowering) -> None:
    if lw.g_node is None or lw.g_cursor is None or lw.g_host is None:
        raise PassError(NAME, "needs the global list (run order first)")


def run(lw: Lowering) -> str:
    S = lw.geo.num_sms
    n = len(lw.g_node)
    pos = np.arange(n, dtype=np.int64)
    sm = lw.g_cursor % S
    cl = lw.g_claimer >= 0
    if cl.any():
        first = np.full(len(lw.nodes), n, dtype=np.int64)
        np.minimum.at(first, lw.g_node[cl], lw.g_cursor[cl])
        sm[cl] = (first[lw.g_node[cl]] + lw.g_claimer[cl]) % S
    placed = lw.g_host >= 0
    # hosts are dealt entries (order checks), so one lookup settles them all
    sm[placed] = sm[lw.g_host[placed]]
    order = np.lexsort((pos, sm))
    counts = np.bincount(sm, minlength=S)
    starts = np.cumsum(counts) - counts
    slot = np.empty(n, dtype=np.int64)
    slot[order] = np.arange(n) - np.repeat(starts, counts)
    lw.sm, lw.slot = sm, slot
    extra = f", {int(placed.sum())} placed" if placed.any() else ""
    return f"{n} tasks on {S} SMs: {int(counts.min())}..{int(counts.max())} per SM{extra}"


def ensures(lw: Lowering) -> None:
    S = lw.geo.num_sms
    n = len(lw.g_node)
    pos = np.arange(n)
    placed = lw.g_host >= 0
    static = (lw.g_claimer < 0) & ~placed
    want = lw.g_cursor % S
    if (lw.sm[static] != want[static]).any():
        k = int(np.flatnonzero(static & (lw.sm != want))[0])
        raise PassError(NAME, f"static task {k} on SM {int(lw.sm[k])}, expected {int(want[k])}")
    if placed.any():
        host = lw.g_host[placed]
        if (host >= pos[placed]).any() or (lw.g_host[host] >= 0).any():
            raise PassError(NAME, "a placed task's host is not an earlier dealt entry")
        if (lw.sm[placed] != lw.sm[host]).any():
            k = int(np.flatnonzero(placed)[np.flatnonzero(lw.sm[placed] != lw.sm[host])[0]])
            raise PassError(NAME, f"placed task {k} on SM {int(lw.sm[k])}, its host on {int(lw.sm[lw.g_host[k]])}")
    for nt in lw.nodes:
        if nt.claimer:
            sms = np.sort(lw.sm[(lw.g_node == nt.index) & (lw.g_claimer >= 0)])
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

"""The one happens-before engine: counters ordered by the counter graph.

A wait on counter ``r`` means "every signaller of ``r`` is done" (the
verifier proves every target equals its counter's signal count), so task W
happens-before task R iff W's signal counter lies in the reflexive ancestor
closure of R's wait counters: the signallers of a counter waited on each
other's counters first, transitively. Program order on an SM orders no data
(the device overlaps consecutive tasks).

:func:`counter_closure` builds the closure of one :class:`~megac.passes.program.Program`
as a packed bit matrix; :class:`HappensBefore` answers the question for
tasks and claimed parts, vectorised (the verifier's hazard checks), and
:meth:`Closure.ordered` for a task in flight that has acquired some counters
so far (the CPU VM's checked mode).
"""

from __future__ import annotations

import numpy as np

from megac.passes.program import Program, as_i64, header_waits

class Closure:
    """Reflexive ancestor closure of every counter, as a packed bit matrix:
    bit s of row r is set iff every signaller of s is done once counter r is
    complete (rows >= C: merged wait sets of parts with more than two waits)."""

    def __init__(self, bits: np.ndarray) -> None:
        self.bits = bits

    def test(self, rows: np.ndarray, s: np.ndarray) -> np.ndarray:
        rows = as_i64(rows)
        s = as_i64(s)
        ok = (rows >= 0) & (s >= 0)
        r = np.where(ok, rows, 0)
        ss = np.where(ok, s, 0)
        return ok & (((self.bits[r, ss >> 3] >> (ss & 7)) & 1) == 1)

    def ordered(self, acquired, signal: int) -> bool:
        """A signaller of counter ``signal`` is done once counters ``acquired``
        (a task's satisfied waits so far) are complete."""
        if signal < 0:
            return False
        byte, bit = signal >> 3, signal & 7
        return any((int(self.bits[r, byte]) >> bit) & 1 for r in acquired)


def part_wait_sets(p: Program) -> list[list[int]]:
    """Wait counters of each part: its own plus its claimers' header waits
    (a claimer runs claimed tasks only after its own waits)."""
    C = p.num_counters
    hdr = [[c for c, _ in header_waits(p, int(g.claimers[0]))] for g in p.groups]
    out = []
    for j in range(p.num_parts):
        cs = [c for c, _ in p.part_waits[j]] + hdr[int(p.part_group[j])]
        out.append(sorted({c for c in cs if 0 <= c < C}))
    return out


def counter_closure(p: Program, part_waits: list[list[int]]):
    """Topological order of counters, the closure matrix, and the rows each
    part's waits map to."""
    C = p.num_counters
    src, dst = [], []
    for w in (p.w0, p.w1):
        m = (w >= 0) & (w < C) & (p.sig >= 0) & (p.sig < C)
        src.append(w[m])
        dst.append(p.sig[m])
    ps, pd = [], []
    for j in range(p.num_parts):
        for s in p.part_sigs[j]:
            if 0 <= s < C:
                for w in part_waits[j]:
                    ps.append(w)
                    pd.append(s)
    src.append(as_i64(ps))
    dst.append(as_i64(pd))
    src = np.concatenate(src)
    dst = np.concatenate(dst)
    e = np.unique(src * C + dst) if len(src) else np.zeros(0, dtype=np.int64)
    src, dst = e // C, e % C
    # Kahn order; counters on a cycle come last (the deadlock check reports it)
    indeg = np.bincount(dst, minlength=C).tolist()
    o = np.argsort(src, kind="stable")
    bounds = np.searchsorted(src[o], np.arange(C + 1)).tolist()
    succ = dst[o].tolist()
    od = np.argsort(dst, kind="stable")
    pbounds = np.searchsorted(dst[od], np.arange(C + 1)).tolist()
    pred = src[od].tolist()
    stack = [c for c in range(C) if indeg[c] == 0]
    order = []
    while stack:
        c = stack.pop()
        order.append(c)
        for d in succ[bounds[c]:bounds[c + 1]]:
            indeg[d] -= 1
            if indeg[d] == 0:
                stack.append(d)
    if len(order) < C:
        seen = np.zeros(C, bool)
        seen[order] = True
        order += np.flatnonzero(~seen).tolist()
    refl = [0] * C
    for c in order:
        a = 1 << c
        for q in pred[pbounds[c]:pbounds[c + 1]]:
            a |= refl[q]
        refl[c] = a
    # parts: two wait counters map to their rows; more get a merged row
    rows = list(refl)
    prow = np.full((p.num_parts, 2), -1, dtype=np.int64)
    merged: dict[tuple, int] = {}
    for j, ws in enumerate(part_waits):
        if len(ws) <= 2:
            prow[j, : len(ws)] = ws
        else:
            key = tuple(ws)
            if key not in merged:
                merged[key] = len(rows)
                a = 0
                for c in ws:
                    a |= refl[c]
                rows.append(a)
            prow[j, 0] = merged[key]
    nb = max(1, (C + 7) // 8)
    buf = b"".join(x.to_bytes(nb, "little") for x in rows)
    bits = np.frombuffer(buf, dtype=np.uint8).reshape(len(rows), nb) if rows else np.zeros((0, nb), np.uint8)
    return Closure(bits), prow, len(e)


class HappensBefore:
    """happens-before between nodes (live tasks 0..n-1, parts n..n+P-1)."""

    def __init__(self, p: Program, cl: Closure, prow: np.ndarray) -> None:
        self.p, self.cl = p, cl
        C = p.num_counters
        ok = lambda w: np.where((w >= 0) & (w < C), w, -1)  # noqa: E731
        self.row0 = np.concatenate([ok(p.w0), prow[:, 0]])
        self.row1 = np.concatenate([ok(p.w1), prow[:, 1]])
        psig = np.array([s[0] if len(s) == 1 and 0 <= s[0] < C else -1 for s in p.part_sigs], dtype=np.int64)
        self.sig = np.concatenate([ok(p.sig), psig])
        # parts with several signals precede b only when ALL of them do
        self.multi = {p.n + j: as_i64([c for c in s if 0 <= c < C]) for j, s in enumerate(p.part_sigs) if len(s) > 1}

    def __call__(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """a happens-before b, elementwise."""
        a, b = as_i64(a), as_i64(b)
        t = self.cl.test
        res = t(self.row0[b], self.sig[a]) | t(self.row1[b], self.sig[a])
        if self.multi:
            for node in np.unique(a[np.isin(a, list(self.multi))]):
                m = a == node
                bb = b[m]
                okk = np.ones(len(bb), dtype=bool)
                for s in self.multi[int(node)]:
                    ss = np.full(len(bb), s)
                    okk &= t(self.row0[bb], ss) | t(self.row1[bb], ss)
                res[m] = okk
        return res




__all__ = ["Closure", "HappensBefore", "counter_closure", "part_wait_sets"]

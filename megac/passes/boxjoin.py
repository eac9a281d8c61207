"""All pairs of overlapping boxes between two sets, vectorised (the
verifier's hazard and claimer-rule joins)."""

from __future__ import annotations

import numpy as np

def expand(lo_idx: np.ndarray, hi_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ranges [lo_idx[i], hi_idx[i]): (i repeated, every position)."""
    cnt = np.maximum(hi_idx - lo_idx, 0)
    total = int(cnt.sum())
    ai = np.repeat(np.arange(len(cnt)), cnt)
    pos = np.arange(total) - np.repeat(np.cumsum(cnt) - cnt, cnt) + np.repeat(lo_idx, cnt)
    return ai, pos


def box_pairs(lo_a, hi_a, lo_b, hi_b, max_candidates: int = 1 << 22) -> tuple[np.ndarray, np.ndarray]:
    """All (i, j) with box a_i overlapping box b_j (half-open, every dim).

    Candidates come from a join: dims where every box is one index form an
    exact composite key, and the most selective other dim an interval range
    join (b's whose lo lies within reach of a's interval); candidates are then
    filtered on every dim. Vectorised; no Python loop per box."""
    na, nb = len(lo_a), len(lo_b)
    empty = (np.zeros(0, np.int64), np.zeros(0, np.int64))
    if not na or not nb:
        return empty
    D = lo_a.shape[1]
    ext = np.maximum(hi_a.max(axis=0), hi_b.max(axis=0)) + 1
    one = [d for d in range(D) if (hi_a[:, d] - lo_a[:, d] == 1).all() and (hi_b[:, d] - lo_b[:, d] == 1).all()]
    key_a = np.zeros(na, np.int64)
    key_b = np.zeros(nb, np.int64)
    radix = 1
    for d in one:
        if radix * int(ext[d]) >= 1 << 40:
            break
        key_a = key_a * int(ext[d]) + lo_a[:, d]
        key_b = key_b * int(ext[d]) + lo_b[:, d]
        radix *= int(ext[d])
    best = None
    for d in [None] + [d for d in range(D) if d not in one]:
        if d is None:
            M, Lmax = 1, 0
            cb = key_b
            qa_lo, qa_hi = key_a, key_a
        else:
            Lmax = int((hi_b[:, d] - lo_b[:, d]).max())
            M = int(ext[d]) + Lmax + 2
            if radix * M >= 1 << 62:
                continue
            cb = key_b * M + lo_b[:, d] + Lmax
            qa_lo = key_a * M + lo_a[:, d] + 1
            qa_hi = key_a * M + hi_a[:, d] - 1 + Lmax
        ob = np.argsort(cb, kind="stable")
        cbs = cb[ob]
        lo_i = np.searchsorted(cbs, qa_lo, "left")
        hi_i = np.searchsorted(cbs, qa_hi, "right")
        n = int(np.maximum(hi_i - lo_i, 0).sum())
        if best is None or n < best[0]:
            best = (n, ob, lo_i, hi_i)
    _, ob, lo_i, hi_i = best
    out_i, out_j = [], []
    # chunk over a so the candidate arrays stay bounded
    cnt = np.maximum(hi_i - lo_i, 0)
    csum = np.cumsum(cnt)
    start = 0
    while start < na:
        base = csum[start - 1] if start else 0
        stop = int(np.searchsorted(csum, base + max_candidates, "right"))
        stop = max(stop, start + 1)
        ai, pos = expand(lo_i[start:stop], hi_i[start:stop])
        ai += start
        bj = ob[pos]
        ok = np.all((lo_a[ai] < hi_b[bj]) & (lo_b[bj] < hi_a[ai]), axis=1)
        out_i.append(ai[ok])
        out_j.append(bj[ok])
        start = stop
    return np.concatenate(out_i), np.concatenate(out_j)


__all__ = ["box_pairs", "expand"]

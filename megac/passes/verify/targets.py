"""Check class 2, ``targets``: every wait target equals the number of
signals its counter receives in a step."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from megac import abi
from megac.abi import DYN_FLAG, DYN_INDEX_MASK
from megac.passes.program import Program, as_i64, fmt_target, isdyn, opname
from megac.passes.violations import Sink

F = abi.field_index


def _signal_counts(p: Program):
    """Per counter: the static signal count, and the dynamic words adding to it."""
    C = p.num_counters
    ok = (p.sig >= 0) & (p.sig < C)
    static = np.bincount(p.sig[ok], minlength=C).astype(np.int64)
    dyn: dict[int, list[int]] = defaultdict(list)
    for g in p.groups:
        for c, n in g.signals:
            if not 0 <= c < C:
                continue
            if isdyn(n):
                dyn[c].append(n)
            else:
                static[c] += n
    return static, dyn


def _all_waits(p: Program):
    """(node, counter, target, which) for every wait: task headers (which 0/1)
    and claimed tasks (which 2, node = the group's first claimer)."""
    C = p.num_counters
    ns, cs, ts, ks = [], [], [], []
    for k, (w, t) in enumerate(((p.w0, p.t0), (p.w1, p.t1))):
        i = np.flatnonzero((w >= 0) & (w < C))
        ns.append(i)
        cs.append(w[i])
        ts.append(t[i])
        ks.append(np.full(len(i), k))
    gn, gc, gt = [], [], []
    for g in p.groups:
        for c, t in g.waits:
            if 0 <= c < C:
                gn.append(int(g.claimers[0]))
                gc.append(c)
                gt.append(t)
    ns.append(as_i64(gn))
    cs.append(as_i64(gc))
    ts.append(as_i64(gt))
    ks.append(np.full(len(gn), 2))
    return tuple(np.concatenate(x) for x in (ns, cs, ts, ks))


_WNAME = np.array(["WAIT0", "WAIT1", "claimed-task wait"])


def check_targets(p: Program, out: Sink) -> None:
    static, dyn = _signal_counts(p)
    node, cnt, tgt, which = _all_waits(p)
    isdyn = (tgt >= 0) & ((tgt & DYN_FLAG) != 0)
    has_dyn = np.zeros(p.num_counters, dtype=bool)
    has_dyn[list(dyn)] = True
    # purely static counters with static targets: exact equality, vectorised
    s = ~isdyn & ~has_dyn[cnt]
    exp = static[cnt]
    for i in np.flatnonzero(s & (tgt > exp)):
        c = cnt[i]
        out.add("target_high", f"{p.where(node[i])}: {_WNAME[which[i]]} {p.cname(c)} target {tgt[i]} > the {exp[i]} signals it receives: can never be satisfied (deadlock){_producers_hint(p, c)}")
    for i in np.flatnonzero(s & (tgt < exp)):
        c = cnt[i]
        out.add("target_low", f"{p.where(node[i])}: {_WNAME[which[i]]} {p.cname(c)} target {tgt[i]} < the {exp[i]} signals it receives: fires before all producers{_producers_hint(p, c)}")
    for i in np.flatnonzero(isdyn & ~has_dyn[cnt]):
        c = cnt[i]
        out.add("target_dyn_mismatch", f"{p.where(node[i])}: {_WNAME[which[i]]} {p.cname(c)} has dynamic target {fmt_target(tgt[i])} but receives a static {static[c]} signals")
    # counters fed by a dynamic group: exactly one dynamic word, nothing else
    for i in np.flatnonzero(has_dyn[cnt]):
        c = int(cnt[i])
        if static[c] != 0 or len(dyn[c]) != 1:
            desc = " + ".join([str(int(static[c]))] * bool(static[c]) + [fmt_target(x) for x in dyn[c]])
            out.add("target_dyn_mismatch", f"{p.where(node[i])}: {_WNAME[which[i]]} {p.cname(c)} receives {desc} signals, which no single target can equal")
            continue
        want = dyn[c][0]
        if not isdyn[i]:
            out.add("target_dyn_mismatch", f"{p.where(node[i])}: {_WNAME[which[i]]} {p.cname(c)} static target {tgt[i]} but its producers signal {fmt_target(want)} times")
        elif (tgt[i] & DYN_INDEX_MASK) != (want & DYN_INDEX_MASK):
            out.add("target_dyn_mismatch", f"{p.where(node[i])}: {_WNAME[which[i]]} {p.cname(c)} target {fmt_target(tgt[i])} but its producers signal {fmt_target(want)} times")
    _check_counter_table(p, static, dyn, out)


def _check_counter_table(p: Program, static, dyn, out: Sink) -> None:
    """The schedule's counter table (what diagnostics and the CPU VM read)
    must agree with the signals in the words."""
    if p.counters is None:
        return
    for c, ctr in enumerate(p.counters[: p.num_counters]):
        count = getattr(ctr, "count", None)
        word = getattr(ctr, "count_word", None)
        if count is None and word is None:
            continue  # not stated
        if count is not None:
            if c in dyn or static[c] != count:
                got = fmt_target(dyn[c][0]) if c in dyn else int(static[c])
                out.add("counter_table", f"{p.cname(c)}: counter table says {count} signals per step, the words give {got}")
        elif word is not None:
            if c not in dyn or len(dyn[c]) != 1 or (dyn[c][0] & DYN_INDEX_MASK) != word or static[c]:
                got = " + ".join([str(int(static[c]))] * bool(static[c]) + [fmt_target(x) for x in dyn.get(c, [])]) or "0"
                out.add("counter_table", f"{p.cname(c)}: counter table says dyn(word {word}) signals per step, the words give {got}")


def _producers_hint(p: Program, c: int) -> str:
    prod = np.flatnonzero(p.sig == c)
    gs = [g for g in p.groups if any(cc == c for cc, _ in g.signals)]
    if not len(prod) and not gs:
        return "; no task signals it"
    names = [p.where(i) for i in prod[:2]] + [f"the {opname(g.op)} queue of layer {g.layer}" for g in gs[:1]]
    more = len(prod) + len(gs) - len(names)
    return "; producers: " + ", ".join(names) + (f" and {more} more" if more > 0 else "")



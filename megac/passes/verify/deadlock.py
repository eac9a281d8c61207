"""Check class 4, ``deadlock``: the claimer rule, then a greedy walk of
the in-order SM queues (``megac.passes.walk``)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from megac import abi
from megac.passes.program import Program, access_tables, as_i64, box_str, fmt_target, header_waits, opname
from megac.passes.violations import Sink

from megac.passes.boxjoin import box_pairs, expand
from megac.passes.walk import Claim, Hooks, UnitCounters, Walker

F = abi.field_index


NEVER = np.iinfo(np.int64).max


def check_claimer_rule(p: Program, out: Sink) -> None:
    """Every input of a claimed task is produced before the first claimer of
    its queue on the producer's SM (else that claimer may claim the task and
    wait on work queued behind itself). Producers: the signallers of the
    counters the claimed tasks wait on (static tasks, or another queue)."""
    S, G = p.num_sms, len(p.groups)
    if not G:
        return
    first = np.full((G, S), NEVER)
    last = np.full((G, S), -1)
    for gi, g in enumerate(p.groups):
        np.minimum.at(first[gi], p.sm[g.claimers], p.slot[g.claimers])
        np.maximum.at(last[gi], p.sm[g.claimers], p.slot[g.claimers])
    # (group, counter) pairs joined with the static tasks signalling that counter
    pg, pc = [], []
    for gi, g in enumerate(p.groups):
        for c in sorted({c for c, _ in g.waits if 0 <= c < p.num_counters}):
            pg.append(gi)
            pc.append(c)
    pg, pc = as_i64(pg), as_i64(pc)
    o = np.argsort(p.sig, kind="stable")
    ss = p.sig[o]
    k, pos = expand(np.searchsorted(ss, pc, "left"), np.searchsorted(ss, pc, "right"))
    prod = o[pos]
    gk = pg[k]
    bad = np.flatnonzero(p.slot[prod] >= first[gk, p.sm[prod]])
    for j in bad:
        i, gi = int(prod[j]), int(gk[j])
        cl = p.start[p.sm[i]] + first[gi, p.sm[i]]
        out.add("claimer_rule", f"{p.where(cl)} claims tasks that wait {p.cname(pc[k[j]])}, but that counter's producer {p.where(i)} is queued behind it on the same SM")
    # ... and the writers of the regions the claimed tasks read (inputs the
    # claimed tasks reach only through other counters)
    reported = {(int(prod[j]), int(gk[j])) for j in bad}
    for buf, t in sorted(access_tables(p).items()):
        r = np.flatnonzero(~t.write & (t.node >= p.n))
        w = np.flatnonzero(t.write & (t.node < p.n))
        if not len(r) or not len(w):
            continue
        a, b = box_pairs(t.lo[w], t.hi[w], t.lo[r], t.hi[r])
        wi = t.node[w[a]]
        gi = p.part_group[t.node[r[b]] - p.n]
        late = np.flatnonzero(p.slot[wi] >= first[gi, p.sm[wi]])
        for j in late:
            key = (int(wi[j]), int(gi[j]))
            if key in reported:
                continue
            reported.add(key)
            i, g = key
            cl = p.start[p.sm[i]] + first[g, p.sm[i]]
            out.add("claimer_rule", f"{p.where(cl)} claims tasks that read {buf}{box_str(t, int(w[a[j]]))}, written by {p.where(i)} queued behind it on the same SM")
    # a queue fed by another queue: the producing queue's claimers come first on every SM holding both
    signalled_by: dict[int, set[int]] = defaultdict(set)
    for gi, g in enumerate(p.groups):
        for c, _ in g.signals:
            signalled_by[c].add(gi)
    seen: set[tuple[int, int]] = set()
    for gi, c in zip(pg.tolist(), pc.tolist()):
        for src in sorted(signalled_by.get(c, ())):
            if src == gi or (gi, src) in seen:
                continue
            seen.add((gi, src))
            f = first[gi]
            for s in np.flatnonzero((last[src] >= 0) & (f < NEVER) & (last[src] > f))[:3]:
                out.add("claimer_rule", f"{p.where(p.start[s] + f[s])} claims tasks that wait {p.cname(c)}, produced by the {opname(p.groups[src].op)} queue whose claimer {p.where(p.start[s] + last[src][s])} is queued behind it on the same SM")


@dataclass
class SimResult:
    done: np.ndarray  # per live task
    rounds: int
    critical_path: int
    stuck: list[tuple[int, int, int]]  # (sm, task index, counter) of blocked heads
    received: np.ndarray  # signals each counter got


class _GreedyHooks(Hooks):
    """The verifier's walk: a claimer group runs as ONE unit once all the
    group's waits are complete (every claimer of the group may hold a record
    until then, so each blocks on them; later claimers of a finished group
    pass); depth = the longest chain of counter waits."""

    def __init__(self, p: Program) -> None:
        C = p.num_counters
        self.p = p
        self.C = C
        self.g_sigs = [sorted({c for c, _ in g.signals if 0 <= c < C}) for g in p.groups]
        self.g_waits = [sorted({c for c, _ in g.waits if 0 <= c < C}) for g in p.groups]
        self.g_done = [False] * len(p.groups)
        self.g_taken = [False] * len(p.groups)
        self.claimed: set[int] = set()
        self.cdepth = [0] * C
        self.depth_max = 0
        self.w0 = [int(c) if 0 <= c < C else -1 for c in p.w0]
        self.w1 = [int(c) if 0 <= c < C else -1 for c in p.w1]
        self.sig = [int(c) if 0 <= c < C else -1 for c in p.sig]
        self.cg = p.claimer_group.tolist()

    def _d(self, k: int) -> int:
        a, b = self.w0[k], self.w1[k]
        return max(self.cdepth[a] if a >= 0 else 0, self.cdepth[b] if b >= 0 else 0)

    def _end(self, k: int) -> None:
        d = self._d(k) + 1
        if d > self.depth_max:
            self.depth_max = d
        c = self.sig[k]
        if c >= 0 and d > self.cdepth[c]:
            self.cdepth[c] = d

    def run_task(self, s, k, t):
        self._end(k)
        return t

    def finish(self, s, k, t):
        self._end(k)
        return t

    def claim(self, s, k, t):
        gi = self.cg[k]
        if self.g_done[gi] or k in self.claimed:
            return None
        self.claimed.add(k)
        if self.g_taken[gi]:
            # another claimer holds the group: this one may hold a record of
            # it too, so it waits until the group has run (its done counter)
            return Claim([(self.C + gi, 0)], [], (gi, False))
        self.g_taken[gi] = True
        return Claim([(c, 0) for c in self.g_waits[gi]], self.g_sigs[gi] + [self.C + gi], (gi, True))

    def run_claimed(self, s, k, claim, t):
        gi, first = claim.payload
        if first:
            self.g_done[gi] = True
            gd = 1 + max([self._d(k)] + [self.cdepth[c] for c in self.g_waits[gi]])
            if gd > self.depth_max:
                self.depth_max = gd
            for c in self.g_sigs[gi]:
                if gd > self.cdepth[c]:
                    self.cdepth[c] = gd
        return t


def greedy_walk(p: Program) -> SimResult:
    """Greedy in-order execution (``megac.passes.walk``): a head runs once
    every signaller of each of its wait counters is done; a claimer runs its
    whole group once all the group's waits are complete; later claimers of a
    finished group pass."""
    C = p.num_counters
    sig = np.where((p.sig >= 0) & (p.sig < C), p.sig, -1)
    units = np.bincount(sig[sig >= 0], minlength=C).astype(np.int64)
    hooks = _GreedyHooks(p)
    for ss in hooks.g_sigs:
        for c in ss:
            units[c] += 1  # a group signals as one unit
    # one more counter per group, complete once the group has run
    units = np.concatenate([units, np.ones(len(p.groups), dtype=np.int64)])
    counters = UnitCounters(units)
    walker = Walker(p.start, hooks.w0, p.t0, hooks.w1, p.t1, hooks.sig, p.claimer_group >= 0, counters, hooks)
    blocked = walker.run("greedy")
    done = walker.done_mask()
    stuck = []
    for b in blocked:
        c = b.counter
        if c >= C:  # waiting for its group: report the group's first incomplete wait
            c = next((w for w in hooks.g_waits[c - C] if counters.rem[w] > 0), (hooks.g_waits[c - C] or [c])[0])
        stuck.append((b.sm, b.task, c))
    received = np.bincount(sig[(sig >= 0) & done], minlength=C)
    return SimResult(done, walker.rounds, hooks.depth_max, stuck, received)


def report_deadlock(p: Program, sim: SimResult, out: Sink) -> None:
    """One violation per stuck SM head, the heads on a wait-for cycle first
    (SM a's head waits on a producer queued on SM b behind b's head, ...)."""
    heads = {s: k for s, k, _ in sim.stuck}
    info = {}
    nxt: dict[int, int] = {}
    for s, k, c in sim.stuck:
        tgt = next((t for cc, t in header_waits(p, k) if cc == c), None)
        gi = int(p.claimer_group[k])
        via = ""
        if tgt is None and gi >= 0:
            tgt = next((t for cc, t in p.groups[gi].waits if cc == c), None)
            via = " for its claimed tasks"
        prod = np.flatnonzero((p.sig == c) & ~sim.done)
        if len(prod):
            i = int(prod[0])
            hs = int(p.sm[i])
            behind = ""
            if hs in heads and heads[hs] <= i:
                nxt[s] = hs
                behind = (f", queued behind the blocked head of SM {hs} (slot {heads[hs] - p.start[hs]})"
                          if heads[hs] < i else " (a blocked head itself)")
            missing = f"; producer {p.where(i)} never arrived{behind}"
        else:
            gs = [g for g in p.groups if any(cc == c for cc, _ in g.signals)]
            missing = (f"; producer: the {opname(gs[0].op)} queue of layer {gs[0].layer}, never drained"
                       if gs else "; no task signals it")
        tshow = fmt_target(tgt) if tgt is not None else "?"
        info[s] = (f"SM {s} slot {k - p.start[s]} {opname(int(p.op[k]))} layer {int(p.layer[k])} waits{via} "
                   f"{p.cname(c)} (value {int(sim.received[c])}, target {tshow}){missing}")
    # cycles in the wait-for graph between SMs
    first: list[int] = []
    seen: set[int] = set()
    for s0 in sorted(nxt):
        path, s = [], s0
        while s in nxt and s not in seen and s not in path:
            path.append(s)
            s = nxt[s]
        if s in path:
            cyc = path[path.index(s):]
            ring = " -> ".join(f"SM {x}" for x in cyc + [cyc[0]])
            for x in cyc:
                info[x] += f" [wait cycle {ring}]"
            first += cyc
        seen.update(path)
    for s in first + [s for s in sorted(info) if s not in first]:
        out.add("deadlock", info[s])



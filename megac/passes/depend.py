"""Pass ``depend``: producer/consumer region overlap -> counters and targets.

Derived generically from the access model (``megac.access``), never from
op-specific rules:

1. Access units: every static task, every claimer template (its own reads:
   queue, QUEUE_LEN word) and every subtask a claimer queue may hold (worst
   case, ``access.queue_subtasks``).
2. For every buffer, join writer boxes with reader boxes (hash join on the
   dimensions where both sides are single indices, then an interval test on
   the rest). Readers are deduplicated per (node, box); writers are grouped
   into classes no reader can tell apart (same node, same box on every
   dimension where the readers differ), which keeps the join small (every
   MoE combine reads every expert's output). A writer counts for a reader
   only if its node comes earlier in program order; for
   ``access.MULTI_WRITTEN`` buffers only the latest such node counts. A read
   that no earlier task writes must lie in ``access.step_inputs``.
   Claimer queues contribute their subtasks merged by ABI offsets
   (``queue_subtasks(merged=True)``): same dependencies, far fewer units.
3. Per producer node: for every consumer, the set of that producer's units
   it overlaps; union-find those sets -> one counter per component (a
   producer unit signals exactly one counter; static target = component
   size). Components of a claimer's subtasks must map one-to-one onto the
   ABI's signal offsets (``TASK_SIGNAL_BASE + offset``); their counts come
   from ``access.queue_signal_count`` (dynamic for attention splits and MoE
   down tiles).
4. Per consumer: the counters of its components; a dynamic target read from a
   device-written target word forces a wait on that word's writer, placed
   FIRST (WAIT0: the device reads TARGET1 and dynamic fields after WAIT0);
   other waits implied transitively by the remaining ones are dropped (a wait
   on d implies c when every signaller of d waits, transitively, on c); more
   than two remaining waits is an error. Claimed tasks get their waits the
   same way, minus what the claimer's header waits already imply, as
   ``TASK_WAIT_BASE + offset`` (one counter per subtask, offset from the ABI).

Counters are named after the producer and the coordinates its component
shares (``NAME_KEYS``: ``qkv[3][1]``, ``combine[3][0][2]``, ``moe_up[5][17]``,
``norm[7]``; several unnamed components of one node are numbered:
``upgate[0][1]``) and numbered in program order (within a node by those
coordinates, so claimed-task counters are ``TASK_*_BASE + offset``).
Waits are reduced once per distinct "wait signature" (the candidate
counters of a task), in program order, so 30K tasks cost a few thousand
reductions.

Ensures: at most two waits per task, one signal per task; every static
counter's target equals its number of signallers and every wait on it uses
that target; dynamic counters are waited with their queue count; attention
(decode tasks and claimed tasks) waits per KV head on QKV; O-proj split s
waits only on the combine counter of KV head s (with o_proj_merge: on the
counter of KV head s's attention splits).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from megac import abi
from megac.abi import H, Op, Queue
from megac.access import (
    MULTI_WRITTEN,
    access_boxes,
    queue_signal_count,
    queue_subtasks,
    step_inputs,
    subtask_boxes,
)
from megac.passes import Lowering, PassError
from megac.schedule import Counter

NAME = "depend"

#: counter name prefix per producer node kind
PREFIX = {
    "qkv": "qkv",
    "attn": "combine",
    "attn_combine": "attn_done",
    "o_proj": "oproj",
    "ffn_upgate": "upgate",
    "ffn_down": "ffn_down",
    "router": "router",
    "topk": "topk",
    "route_finalize": "route",
    "moe_gather": "gather",
    "moe_upgate": "moe_up",
    "moe_down": "moe_down",
    "moe_combine": "moe_combine",
    "norm_attn": "norm_attn",
    "norm": "norm",
    "lm_head": "lm_head",
}


# ---------------------------------------------------------------------------
# Region join
# ---------------------------------------------------------------------------
def overlap_pairs(wlo, whi, rlo, rhi) -> tuple[np.ndarray, np.ndarray]:
    """All (writer box, reader box) index pairs whose boxes intersect."""
    nw, nr = len(wlo), len(rlo)
    if nw == 0 or nr == 0:
        e = np.zeros(0, dtype=np.int64)
        return e, e
    pt = np.nonzero(((whi - wlo) == 1).all(axis=0) & ((rhi - rlo) == 1).all(axis=0))[0]
    if len(pt):
        dims = np.maximum(wlo[:, pt].max(axis=0), rlo[:, pt].max(axis=0)) + 1
        wkey = np.ravel_multi_index(tuple(wlo[:, pt].T), tuple(dims))
        rkey = np.ravel_multi_index(tuple(rlo[:, pt].T), tuple(dims))
    else:
        wkey = np.zeros(nw, dtype=np.int64)
        rkey = np.zeros(nr, dtype=np.int64)
    ow = np.argsort(wkey, kind="stable")
    wks = wkey[ow]
    left = np.searchsorted(wks, rkey, "left")
    cnt = np.searchsorted(wks, rkey, "right") - left
    total = int(cnt.sum())
    ri = np.repeat(np.arange(nr, dtype=np.int64), cnt)
    start = np.cumsum(cnt) - cnt
    wi = ow[np.repeat(left, cnt) + (np.arange(total, dtype=np.int64) - np.repeat(start, cnt))]
    ok = np.ones(total, dtype=bool)
    for k in range(wlo.shape[1]):
        if k in pt:
            continue
        ok &= (wlo[wi, k] < rhi[ri, k]) & (rlo[ri, k] < whi[wi, k])
    return wi[ok], ri[ok]


def unique_rows(M: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``np.unique(M, axis=0, return_index=True, return_inverse=True)`` for int
    matrices, through a 1-D mixed-radix key (np.unique with ``axis`` sorts
    void views and is ~20x slower)."""
    M = np.asarray(M, dtype=np.int64)
    n, k = M.shape
    if n == 0:
        e = np.zeros(0, dtype=np.int64)
        return M, e, e
    M0 = M - M.min(axis=0)
    ranges = M0.max(axis=0) + 1
    key = np.zeros(n, dtype=np.int64)
    radix = 1
    for c in range(k):
        r = int(ranges[c])
        if r == 1:
            continue
        if radix * r >= (1 << 62):
            _, key = np.unique(key, return_inverse=True)
            key = key.ravel().astype(np.int64)
            radix = int(key.max()) + 1
        key = key * r + M0[:, c]
        radix *= r
    _, first, inv = np.unique(key, return_index=True, return_inverse=True)
    return M[first], first, inv.ravel()


def _components(n_units: int, pw: np.ndarray, gid: np.ndarray) -> np.ndarray:
    """Label (min unit id) of the component of every unit; units are joined
    when they share a group. Vectorised label propagation + pointer jumping."""
    label = np.arange(n_units, dtype=np.int64)
    if len(pw) == 0:
        return label
    og = np.argsort(gid, kind="stable")
    gs = np.flatnonzero(np.r_[True, gid[og][1:] != gid[og][:-1]])
    g_of_sorted = np.cumsum(np.r_[False, gid[og][1:] != gid[og][:-1]])
    ow = np.argsort(pw, kind="stable")
    ws = np.flatnonzero(np.r_[True, pw[ow][1:] != pw[ow][:-1]])
    wunits = pw[ow][ws]
    pair_group = np.empty(len(pw), dtype=np.int64)
    pair_group[og] = g_of_sorted
    while True:
        gmin = np.minimum.reduceat(label[pw[og]], gs)
        wmin = np.minimum.reduceat(gmin[pair_group[ow]], ws)
        new = label.copy()
        new[wunits] = np.minimum(label[wunits], wmin)
        while True:
            nn = new[new]
            if (nn == new).all():
                break
            new = nn
        if (new == label).all():
            return label
        label = new


def _unit_links(ew, gid, er, pnode, rd_unit, rd_id, n_nodes):
    """A consumer unit with several read boxes overlapping one producer joins
    the writer sets of all those boxes: returns extra (unit, group) members
    linking the representatives (min writer) of the per-box groups."""
    e = np.zeros(0, dtype=np.int64)
    if len(ew) == 0:
        return e, e
    # representative per group (ri, producer)
    og = np.lexsort((ew, gid))
    first = np.r_[True, gid[og][1:] != gid[og][:-1]]
    g_ri, g_p, g_rep = er[og][first], pnode[og][first], ew[og][first]
    # (unit, ri) rows x groups of that ri
    o = np.argsort(g_ri, kind="stable")
    g_ri, g_p, g_rep = g_ri[o], g_p[o], g_rep[o]
    left = np.searchsorted(g_ri, rd_id, "left")
    cnt = np.searchsorted(g_ri, rd_id, "right") - left
    tot = int(cnt.sum())
    pos = np.repeat(left, cnt) + (np.arange(tot) - np.repeat(np.cumsum(cnt) - cnt, cnt))
    unit = np.repeat(rd_unit, cnt)
    p, rep = g_p[pos], g_rep[pos]
    key = unit * n_nodes + p
    o = np.lexsort((rep, key))
    key, rep = key[o], rep[o]
    start = np.r_[True, key[1:] != key[:-1]]
    minrep = np.maximum.accumulate(np.where(start, np.arange(len(key)), 0))
    minrep = rep[minrep]
    m = rep != minrep
    links = np.unique(np.stack([minrep[m], rep[m]], axis=1), axis=0) if m.any() else np.zeros((0, 2), dtype=np.int64)
    idx = np.arange(len(links), dtype=np.int64)
    return links.T.ravel(), np.concatenate([idx, idx])


# ---------------------------------------------------------------------------
# The pass
# ---------------------------------------------------------------------------
class _Units:
    """Access units: static tasks (and claimer templates) then subtasks."""

    def __init__(self, lw: Lowering):
        nodes = lw.nodes
        self.node_words = [nt.words for nt in nodes]
        sizes = [nt.n for nt in nodes]
        self.task_start = np.cumsum([0] + sizes)
        self.n_tasks = int(self.task_start[-1])
        node = [np.full(s, i, dtype=np.int64) for i, s in enumerate(sizes)]
        local = [np.arange(s, dtype=np.int64) for s in sizes]
        self.subs: dict[int, object] = {}
        self.sub_start: dict[int, int] = {}
        cur = self.n_tasks
        for nt in nodes:
            if nt.claimer:
                sub = queue_subtasks(Queue(nt.queue), nt.layer, lw.geo, merged=True)
                self.subs[nt.index] = sub
                self.sub_start[nt.index] = cur
                node.append(np.full(len(sub), nt.index, dtype=np.int64))
                local.append(np.arange(len(sub), dtype=np.int64))
                cur += len(sub)
        self.n = cur
        self.node = np.concatenate(node)
        self.local = np.concatenate(local)
        self.is_sub = np.arange(self.n) >= self.n_tasks

    def boxes(self, lw: Lowering):
        words = np.concatenate(self.node_words)
        out = access_boxes(words, lw.geo)
        for ni, sub in self.subs.items():
            for b in subtask_boxes(sub, lw.geo):
                b.task = b.task + self.sub_start[ni]
                out.append(b)
        return out


def _reader_groups(units: _Units, boxes, lw: Lowering):
    """Join every buffer's writers and readers.

    Readers are deduplicated into distinct (reader node, box) entries ("rd").
    Writers are grouped into classes that no reader can tell apart (same
    node, same box on every dimension where the readers differ): a class
    overlaps exactly the same readers, so its members share a counter. The
    join runs on classes, which keeps it small (an MoE combine reads every
    expert's output, but all those writers form one class per layer).

    Returns ``(rep, rd)`` edges (class representative unit -> distinct
    reader), ``(member, class)`` rows of every class with an edge,
    ``(reader unit, rd)`` rows, per-rd forced flags (target-word reads) and
    the boxes by buffer.
    """
    by_buf: dict[str, list] = defaultdict(list)
    for b in boxes:
        by_buf[b.buffer].append(b)
    node_of = units.node
    e_rep, e_rd = [], []
    m_unit, m_cls = [], []
    rd_unit, rd_id = [], []
    rd_forced = []
    unread: list[str] = []
    inputs = defaultdict(list)
    for reg in step_inputs(lw.geo):
        inputs[reg.buffer].append(reg.box)
    next_rd = 0
    next_cls = 0
    for buf, bl in by_buf.items():
        W = [b for b in bl if b.write]
        R = [b for b in bl if not b.write]
        if not R:
            continue
        rt = np.concatenate([b.task for b in R])
        rlo = np.concatenate([b.lo for b in R])
        rhi = np.concatenate([b.hi for b in R])
        d = rlo.shape[1]
        # distinct (reader node, box)
        key = np.concatenate([node_of[rt][:, None], rlo, rhi], axis=1)
        uniq, _, inv = unique_rows(key)
        urnode, ulo, uhi = uniq[:, 0], uniq[:, 1:1 + d], uniq[:, 1 + d:]
        has_writer = np.zeros(len(uniq), dtype=bool)
        if W:
            wt = np.concatenate([b.task for b in W])
            wlo = np.concatenate([b.lo for b in W])
            whi = np.concatenate([b.hi for b in W])
            # dims every reader covers identically and every writer lies inside
            same = (ulo == ulo[0]).all(axis=0) & (uhi == uhi[0]).all(axis=0)
            inside = (wlo >= ulo[0]).all(axis=0) & (whi <= uhi[0]).all(axis=0)
            proj = np.flatnonzero(~(same & inside))
            wkey = np.concatenate([node_of[wt][:, None], wlo[:, proj], whi[:, proj]], axis=1)
            _, first, cls = unique_rows(wkey)
            wi, ri = overlap_pairs(wlo[first], whi[first], ulo, uhi)
            wnode = node_of[wt[first[wi]]]
            keep = wnode < urnode[ri]
            wi, ri, wnode = wi[keep], ri[keep], wnode[keep]
            if buf in MULTI_WRITTEN and len(ri):
                latest = np.full(len(uniq), -1, dtype=np.int64)
                np.maximum.at(latest, ri, wnode)
                keep = wnode == latest[ri]
                wi, ri = wi[keep], ri[keep]
            e_rep.append(wt[first[wi]])
            e_rd.append(ri + next_rd)
            has_writer[ri] = True
            used = np.zeros(len(first), dtype=bool)
            used[wi] = True
            mem = used[cls]
            m_unit.append(wt[mem])
            m_cls.append(cls[mem] + next_cls)
            next_cls += len(first)
        # reads nobody writes before them must be step inputs
        for i in np.flatnonzero(~has_writer):
            if not any(all(a0 <= lo and hi <= a1 for lo, hi, (a0, a1) in zip(ulo[i], uhi[i], box))
                       for box in inputs.get(buf, ())):
                unread.append(f"{lw.nodes[int(urnode[i])].name} reads {buf}"
                              f"{[tuple(x) for x in zip(ulo[i].tolist(), uhi[i].tolist())]} "
                              f"that no earlier task writes and is no step input")
        rd_unit.append(rt)
        rd_id.append(inv + next_rd)
        rd_forced.append(np.full(len(uniq), buf == "target_word"))
        next_rd += len(uniq)
    if unread:
        raise PassError(NAME, unread[0] + (f" (+{len(unread) - 1} more)" if len(unread) > 1 else ""))
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, dtype=np.int64)  # noqa: E731
    forced = np.concatenate(rd_forced) if rd_forced else np.zeros(0, dtype=bool)
    return cat(e_rep), cat(e_rd), cat(m_unit), cat(m_cls), cat(rd_unit), cat(rd_id), forced, by_buf


def _key_columns(lw: Lowering, units: _Units) -> dict[str, np.ndarray]:
    """Per unit, the coordinates that name its counter (-1: not applicable):
    kvh (QKV: the KV head a head belongs to), row, expert."""
    geo = lw.geo
    cols = {k: np.full(units.n, -1, dtype=np.int64) for k in ("row", "kvh", "expert")}
    for nt in lw.nodes:
        if nt.claimer:
            sub = units.subs[nt.index]
            sl = slice(units.sub_start[nt.index], units.sub_start[nt.index] + len(sub))
            F = sub.fields
        else:
            sl = slice(int(units.task_start[nt.index]), int(units.task_start[nt.index + 1]))
            F = nt.fields
        if nt.kind == "qkv":
            cols["kvh"][sl] = np.where(F["PART"] == abi.QkvPart.Q, F["HEAD"] // geo.heads_per_kv, F["HEAD"])
            continue
        for name, short in (("ROW", "row"), ("KV_HEAD", "kvh"), ("EXPERT", "expert")):
            if name in F:
                cols[short][sl] = F[name]
    return cols


_KEY_ORDER = ("row", "kvh", "expert")

#: Coordinates that name a producer's counters (when constant within the
#: component; otherwise, or for kinds not listed, components are numbered).
#: Names only: the components themselves come from the overlap.
NAME_KEYS = {
    "qkv": ("kvh",),
    "attn": ("row", "kvh"),
    "attn_combine": ("kvh",),
    "moe_upgate": ("expert",),
    "moe_combine": ("row",),
}


def _allocate_counters(lw: Lowering, units: _Units, sig_units: np.ndarray, label: np.ndarray):
    """One counter per component, numbered in program order of the producer
    node; within a node by the coordinates the component shares. Returns
    (counters, counter_node, counter_key, unit_signal, count per counter)."""
    geo = lw.geo
    nodes = lw.nodes
    keys = _key_columns(lw, units)
    labs, cinv = np.unique(label[sig_units], return_inverse=True)
    cinv = cinv.ravel()
    nc = len(labs)
    cnode = units.node[labs]  # label = min unit id, a member
    size = np.bincount(cinv, minlength=nc)
    const = {}
    for k in _KEY_ORDER:
        v = keys[k][sig_units]
        lo = np.full(nc, np.iinfo(np.int64).max)
        hi = np.full(nc, np.iinfo(np.int64).min)
        np.minimum.at(lo, cinv, v)
        np.maximum.at(hi, cinv, v)
        const[k] = np.where((lo == hi) & (lo >= 0), lo, -1)
    is_sub = units.is_sub[labs]
    # subtask components: the ABI's signal offset (one per component)
    off = np.full(nc, -1, dtype=np.int64)
    if is_sub.any():
        su = sig_units[units.is_sub[sig_units]]
        so = np.empty(len(su), dtype=np.int64)
        for ni, sub in units.subs.items():
            m = units.node[su] == ni
            so[m] = sub.signal_offset[units.local[su[m]]]
        sc = cinv[units.is_sub[sig_units]]
        lo = np.full(nc, np.iinfo(np.int64).max)
        hi = np.full(nc, np.iinfo(np.int64).min)
        np.minimum.at(lo, sc, so)
        np.maximum.at(hi, sc, so)
        if (lo[is_sub] != hi[is_sub]).any():
            ni = int(cnode[np.flatnonzero(is_sub & (lo != hi))[0]])
            raise PassError(NAME, f"{nodes[ni].name}: claimed-task components do not match the "
                                  f"{Queue(nodes[ni].queue).name} signal offsets")
        off[is_sub] = lo[is_sub]
    order = np.lexsort((labs, off, const["expert"], const["kvh"], const["row"], cnode))
    counters: list[Counter] = []
    counter_node: list[int] = []
    counter_key: list[dict] = []
    count: list[int] = []
    comp_counter = np.full(nc, -1, dtype=np.int64)
    bounds = np.flatnonzero(np.r_[True, cnode[order][1:] != cnode[order][:-1], True])
    for a, b in zip(bounds[:-1], bounds[1:]):
        idx = order[a:b]
        ni = int(cnode[idx[0]])
        nt = nodes[ni]
        prefix = f"{PREFIX.get(nt.kind, nt.kind)}[{nt.layer}]" if nt.kind != "lm_head" else "lm_head"
        nk = NAME_KEYS.get(nt.kind, ())
        kd = [{k: int(const[k][ci]) for k in _KEY_ORDER if k in nk and const[k][ci] >= 0} for ci in idx]
        if nt.claimer:
            offs = off[idx]
            if len(set(offs.tolist())) != len(offs):
                raise PassError(NAME, f"{nt.name}: two claimed-task components share a signal offset")
            base = len(counters)
            by_off = {int(o): j for j, o in enumerate(offs)}
            q = Queue(nt.queue)
            for o in range(int(offs.max()) + 1):
                j = by_off.get(o)
                key = kd[j] if j is not None else {}
                cnt = queue_signal_count(q, nt.layer, o, geo)
                dyn = cnt >= 0 and bool(cnt & abi.DYN_FLAG)
                note = "claimed tasks" if dyn or q == Queue.ATTN else "claimed tasks, per active expert"
                counters.append(Counter(base + o, prefix + "".join(f"[{v}]" for v in key.values()), nt.name,
                                        nt.layer, None if dyn else cnt,
                                        cnt & abi.DYN_INDEX_MASK if dyn else None, note))
                counter_node.append(ni)
                counter_key.append(key)
                count.append(int(cnt))
                if j is not None:
                    comp_counter[idx[j]] = base + o
        else:
            names = [prefix + "".join(f"[{v}]" for v in k.values()) for k in kd]
            dup: dict[str, int] = {}
            for n in names:
                dup[n] = dup.get(n, 0) + 1
            seen: dict[str, int] = defaultdict(int)
            for j, ci in enumerate(idx):
                name = names[j]
                if dup[name] > 1:
                    name = f"{name}[{seen[names[j]]}]"
                    seen[names[j]] += 1
                i = len(counters)
                counters.append(Counter(i, name, nt.name, nt.layer, int(size[ci])))
                counter_node.append(ni)
                counter_key.append(kd[j])
                count.append(int(size[ci]))
                comp_counter[ci] = i
    unit_signal = np.full(units.n, -1, dtype=np.int64)
    unit_signal[sig_units] = comp_counter[cinv]
    if (unit_signal[sig_units] < 0).any():
        raise PassError(NAME, "a signalling task got no counter")
    return counters, np.asarray(counter_node, dtype=np.int64), counter_key, unit_signal, \
        np.asarray(count, dtype=np.int64)


def run(lw: Lowering) -> str:
    geo = lw.geo
    nodes = lw.nodes
    tw = geo.target_words
    units = _Units(lw)
    boxes = units.boxes(lw)
    ew, er, m_unit, m_cls, rd_unit, rd_id, rd_forced, by_buf = _reader_groups(units, boxes, lw)

    # -------------------------------------------------- components (counters)
    pnode = units.node[ew]
    gid = er * len(nodes) + pnode
    lw_, lg_ = _unit_links(ew, gid, er, pnode, rd_unit, rd_id, len(nodes))
    g0 = int(gid.max()) + 1 if len(gid) else 0
    g1 = g0 + (int(lg_.max()) + 1 if len(lg_) else 0)
    label = _components(units.n, np.concatenate([ew, lw_, m_unit]),
                        np.concatenate([gid, lg_ + g0, m_cls + g1]))
    sig_units = np.unique(m_unit)  # units that signal something
    counters, counter_node, counter_key, unit_signal, count = _allocate_counters(lw, units, sig_units, label)
    C = len(counters)

    # ---------------------------------------------- candidate waits per unit
    # distinct reader -> counters it needs, then expanded to its units
    key = np.unique(er * (C + 1) + unit_signal[ew])
    k_rd, k_c = key // (C + 1), key % (C + 1)
    o_rd = np.argsort(rd_id, kind="stable")
    rd_sorted = rd_id[o_rd]
    left = np.searchsorted(rd_sorted, k_rd, "left")
    cnt = np.searchsorted(rd_sorted, k_rd, "right") - left
    tot = int(cnt.sum())
    pos = np.repeat(left, cnt) + (np.arange(tot) - np.repeat(np.cumsum(cnt) - cnt, cnt))
    cu_unit = rd_unit[o_rd[pos]]
    cu_counter = np.repeat(k_c, cnt)
    cu_forced = np.repeat(rd_forced[k_rd], cnt)
    # dedupe (unit, counter), forced if any; sorted by unit then counter
    uc = cu_unit * (C + 1) + cu_counter
    ouc = np.lexsort((~cu_forced, uc))
    uc_s = uc[ouc]
    first = np.r_[True, uc_s[1:] != uc_s[:-1]] if len(uc_s) else np.zeros(0, dtype=bool)
    cand_unit = cu_unit[ouc][first]
    cand_counter = cu_counter[ouc][first]
    cand_forced = cu_forced[ouc][first]
    bounds_u = np.searchsorted(cand_unit, np.arange(units.n + 1))
    # writer of each device-written target word (for dynamic targets)
    word_writer: dict[int, int] = {}
    for b in by_buf.get("target_word", []):
        if b.write:
            for t, lo in zip(b.task.tolist(), b.lo[:, 0].tolist()):
                word_writer[lo] = int(unit_signal[t])

    # ------------------------------------------- signatures of all units
    ncand = bounds_u[1:] - bounds_u[:-1]
    m = int(ncand.max()) if units.n else 0
    M = np.full((units.n, 2 * m + 2), -1, dtype=np.int64)
    if m:
        rows = np.repeat(np.arange(units.n), ncand)
        cols = np.arange(len(cand_unit)) - np.repeat(bounds_u[:-1], ncand)
        M[rows, cols] = cand_counter
        M[rows, m + cols] = np.where(cand_forced, cand_counter, -1)
    # claimer headers and subtasks are reduced in the context of their node
    is_hdr = np.zeros(units.n, dtype=bool)
    for nt in nodes:
        if nt.claimer:
            is_hdr[units.task_start[nt.index]] = True
    ctx = is_hdr | units.is_sub
    M[ctx, 2 * m] = units.node[ctx]
    M[:, 2 * m + 1] = np.where(units.is_sub, 1, np.where(is_hdr, 0, -1))
    sig_rows, _, sig_of = unique_rows(M)
    nsig = len(sig_rows)
    min_node = np.full(nsig, len(nodes), dtype=np.int64)
    np.minimum.at(min_node, sig_of, units.node)
    # counter -> signatures of its signallers (implication reads their waits)
    su = sig_units
    cs_pairs = unique_rows(np.stack([unit_signal[su], sig_of[su]], axis=1))[0]
    sigs_of_counter: dict[int, list[int]] = defaultdict(list)
    for c, sg in cs_pairs.tolist():
        sigs_of_counter[c].append(sg)

    result: list = [None] * nsig  # waits tuple of the unit (subtasks: header + task wait)
    header: dict[int, list] = {}
    memo: dict[tuple[int, int], bool] = {}

    def implies(d: int, c: int) -> bool:
        """Every signaller of d waited (transitively) on c."""
        if d == c:
            return True
        k = (d, c)
        r = memo.get(k)
        if r is not None:
            return r
        sgs = sigs_of_counter.get(d)
        res = bool(sgs)
        if res:
            nc = counter_node[c]
            for sg in sgs:
                tup = result[sg]
                if tup is None:
                    raise PassError(NAME, f"internal: waits of {counters[d].name}'s signallers unknown")
                if not any(w == c or (counter_node[w] > nc and implies(w, c)) for w in tup):
                    res = False
                    break
        memo[k] = res
        return res

    def reduce(cands: list[int], forced: list[int], what: str, hdr: tuple = ()) -> list[int]:
        """Final waits: forced first, those implied by the others dropped."""
        forced = list(dict.fromkeys(forced))
        for c in cands:
            t = int(count[c])
            if abi.is_dyn(t) and abi.dyn_index(t) >= tw.host_words:
                wc = word_writer.get(abi.dyn_index(t))
                if wc is None or wc < 0:
                    raise PassError(NAME, f"{what}: target word {abi.dyn_index(t)} has no writer")
                if wc not in forced:
                    forced.append(wc)
        if len(cands) == 1 and not forced and not hdr:
            return list(cands)
        forced = [c for c in forced if not any(implies(h, c) for h in hdr)]
        rest = [c for c in dict.fromkeys(cands) if c not in forced]
        keep = [c for c in rest
                if not any(implies(d, c) for d in forced + [x for x in rest if x != c] + list(hdr))]
        return forced + sorted(keep)

    for sg in np.lexsort((sig_rows[:, 2 * m + 1], min_node)).tolist():
        row = sig_rows[sg]
        cs = [int(c) for c in row[:m] if c >= 0]
        fs = [int(c) for c in row[m:2 * m] if c >= 0]
        kind = int(row[2 * m + 1])
        ni = int(min_node[sg])
        if kind == -1:
            ww = reduce(cs, fs, nodes[ni].name)
            if len(ww) > 2:
                raise PassError(NAME, f"{nodes[ni].name}: a task needs {len(ww)} waits (max 2): "
                                      f"{[counters[c].name for c in ww]}")
            result[sg] = tuple(ww)
        elif kind == 0:
            ww = reduce(cs, fs, nodes[ni].name)
            if len(ww) > 2:
                raise PassError(NAME, f"{nodes[ni].name}: the claimer needs {len(ww)} waits (max 2): "
                                      f"{[counters[c].name for c in ww]}")
            header[ni] = ww
            result[sg] = tuple(ww)
        else:
            if fs:
                raise PassError(NAME, f"{nodes[ni].name}: a claimed task reads a device target word")
            hdr = tuple(header.get(ni, ()))
            ww = [c for c in reduce(cs, [], nodes[ni].name, hdr) if c not in hdr]
            if len(ww) > 1:
                raise PassError(NAME, f"{nodes[ni].name}: a claimed task needs {len(ww)} waits (max 1): "
                                      f"{[counters[c].name for c in ww]}")
            result[sg] = hdr + tuple(ww)

    # --------------------------------------------------------- write words
    tab = np.full((nsig, 4), -1, dtype=np.int64)  # w0, t0, w1, t1
    for sg, ww in enumerate(result):
        for j, c in enumerate(ww[:2]):
            tab[sg, 2 * j] = c
            tab[sg, 2 * j + 1] = count[c]
    tab[tab[:, 0] < 0, 1] = 0
    tab[tab[:, 2] < 0, 3] = 0
    total_waits = 0
    for nt in nodes:
        ni = nt.index
        t0, t1 = int(units.task_start[ni]), int(units.task_start[ni + 1])
        w = nt.words.astype(np.int64)
        if not nt.claimer:
            w[:, [H.WAIT0, H.TARGET0, H.WAIT1, H.TARGET1]] = tab[sig_of[t0:t1]]
            w[:, H.SIGNAL] = unit_signal[t0:t1]
            total_waits += int((w[:, H.WAIT0] >= 0).sum() + (w[:, H.WAIT1] >= 0).sum())
            nt.words = w.astype(np.int32)
            continue
        hw = header.get(ni, [])
        w[0, [H.WAIT0, H.TARGET0, H.WAIT1, H.TARGET1]] = tab[sig_of[t0]]
        w[0, H.SIGNAL] = abi.NO_COUNTER
        total_waits += len(hw)
        op = nt.op
        sub = units.subs[ni]
        s0 = units.sub_start[ni]
        ss = slice(s0, s0 + len(sub))
        usg = set(sig_of[ss].tolist())
        lut = np.full(nsig, -1, dtype=np.int64)
        for sg in usg:
            r = result[sg]
            lut[sg] = r[len(hw)] if len(r) > len(hw) else -1
        task_wait = lut[sig_of[ss]]
        if (task_wait >= 0).any():
            if not (task_wait >= 0).all():
                raise PassError(NAME, f"{nt.name}: some claimed tasks wait and others do not")
            base = task_wait - sub.wait_offset
            targets = count[task_wait]
            if base.min() != base.max() or targets.min() != targets.max():
                raise PassError(NAME, f"{nt.name}: claimed-task waits are not TASK_WAIT_BASE + "
                                      f"{Queue(nt.queue).name} offset with one target")
            if abi.is_dyn(int(targets[0])):
                raise PassError(NAME, f"{nt.name}: TASK_WAIT_TARGET cannot be dynamic")
            w[0, abi.field_index(op, "TASK_WAIT_BASE")] = int(base[0])
            w[0, abi.field_index(op, "TASK_WAIT_TARGET")] = int(targets[0])
        sigs = unit_signal[ss]
        has = sigs >= 0
        if has.any():
            sbase = sigs[has] - sub.signal_offset[has]
            if sbase.min() != sbase.max():
                raise PassError(NAME, f"{nt.name}: claimed-task signals are not TASK_SIGNAL_BASE + offset")
            w[0, abi.field_index(op, "TASK_SIGNAL_BASE")] = int(sbase[0])
        nt.words = w.astype(np.int32)
    lw.counters = counters
    lw.counter_node = counter_node
    lw.scratch["counter_key"] = counter_key
    dyn = sum(1 for c in counters if c.count is None)
    return f"{C} counters ({dyn} dynamic), {total_waits} waits, {len(ew)} overlap pairs, {nsig} wait signatures"


def requires(lw: Lowering) -> None:
    if not lw.nodes or any(nt.words is None for nt in lw.nodes):
        raise PassError(NAME, "needs task words (run select first)")


# ---------------------------------------------------------------------------
# ensures
# ---------------------------------------------------------------------------
def ensures(lw: Lowering) -> None:
    geo = lw.geo
    C = len(lw.counters)
    if any(c.index != i for i, c in enumerate(lw.counters)):
        raise PassError(NAME, "counter table is not indexed 0..n-1")
    keys = lw.scratch.get("counter_key") or [{}] * C
    kind_of = np.array([lw.nodes[int(n)].kind for n in lw.counter_node]) if C else np.zeros(0, dtype=str)
    key_kvh = np.array([k.get("kvh", -1) for k in keys], dtype=np.int64)
    key_row = np.array([k.get("row", -1) for k in keys], dtype=np.int64)
    expect = np.array([c.count if c.count is not None else abi.dyn(c.count_word) for c in lw.counters],
                      dtype=np.int64)
    static_signals = np.zeros(C, dtype=np.int64)
    for nt in lw.nodes:
        if nt.claimer:
            continue
        sg = nt.words[:, H.SIGNAL].astype(np.int64)
        if (sg >= C).any():
            raise PassError(NAME, f"{nt.name}: signal counter out of range")
        np.add.at(static_signals, sg[sg >= 0], 1)
    for c in lw.counters:
        if c.count is not None and "claimed" not in c.note and static_signals[c.index] != c.count:
            raise PassError(NAME, f"counter {c.name}: {static_signals[c.index]} signallers, count {c.count}")

    def fail(nt, i, msg):
        raise PassError(NAME, f"{nt.name} task {int(i)}: {msg}")

    for nt in lw.nodes:
        w = nt.words.astype(np.int64)
        for wc, tc in ((H.WAIT0, H.TARGET0), (H.WAIT1, H.TARGET1)):
            c = w[:, wc]
            bad = (c < -1) | (c >= C)
            if bad.any():
                fail(nt, np.flatnonzero(bad)[0], f"counter {c[bad][0]} out of range")
            has = c >= 0
            wrong = has & (w[:, tc] != expect[np.where(has, c, 0)])
            if wrong.any():
                i = np.flatnonzero(wrong)[0]
                fail(nt, i, f"waits {lw.counters[c[i]].name} for {w[i, tc]}, it gets {expect[c[i]]} signals")
        op = nt.op
        c0, c1 = w[:, H.WAIT0], w[:, H.WAIT1]
        c0k = np.where(c0 >= 0, c0, 0)
        if op == Op.O_PROJ:
            split = nt.fields["SPLIT"]
            # a merging tile (o_proj_merge) waits on its KV head's splits themselves
            src = "attn" if geo.o_proj_merge else "attn_combine"
            bad = (c1 >= 0) | (c0 < 0) | (kind_of[c0k] != src) | (key_kvh[c0k] != split)
            if bad.any():
                i = np.flatnonzero(bad)[0]
                fail(nt, i, f"split {int(split[i])} waits {[lw.counters[c].name for c in (c0[i], c1[i]) if c >= 0]}, "
                            f"expected only the attention of KV head {int(split[i])}")
        if op == Op.ATTN_DECODE:
            bad = (c0 < 0) | (c1 >= 0) | (kind_of[c0k] != "qkv") | (key_kvh[c0k] != nt.fields["KV_HEAD"])
            bad |= w[:, H.TARGET0] != (geo.heads_per_kv + 2) * (geo.head_dim // geo.qkv_bn)
            if bad.any():
                fail(nt, np.flatnonzero(bad)[0], "attention does not wait per KV head (qkv[l][kvh], "
                                                 "(heads_per_kv+2) x QKV tiles per head)")
        if op == Op.ATTN_DRAIN:
            base = int(w[0, abi.field_index(op, "TASK_WAIT_BASE")])
            for h in range(geo.kv_heads):
                c = base + h
                if not (0 <= c < C) or kind_of[c] != "qkv" or key_kvh[c] != h:
                    raise PassError(NAME, f"{nt.name}: claimed attention of KV head {h} does not wait "
                                          f"qkv[{nt.layer}][{h}]")
        if op == Op.ATTN_COMBINE:
            bad = (c0 < 0) | (kind_of[c0k] != "attn") | (key_row[c0k] != nt.fields["ROW"]) | \
                (key_kvh[c0k] != nt.fields["KV_HEAD"])
            if bad.any():
                fail(nt, np.flatnonzero(bad)[0], "combine does not wait its own (row, kv head)")


__all__ = ["NAME", "ensures", "overlap_pairs", "requires", "run", "unique_rows"]

"""Attention: ATTN_DECODE (static split tasks of sliding layers), ATTN_DRAIN
(the claimer of full layers' split tasks, from the host-written attention
queue) and ATTN_COMBINE (the log-sum-exp merge of one (row, kv head)).

Split rule: ``abi.split_range`` (the device rule of opcodes/attention.cuh):
a row's visible span ``[lo, hi)``, ``hi = seq_pos + 1``, is cut on KV-block
boundaries into ``NUM_SPLITS`` chunks; an empty chunk (or ``SPLIT >=
NUM_SPLITS``) writes ``o = 0, lse = -inf``; partials are normalised by their
own sum, ``lse`` is the natural-log LSE of the scaled scores; the combine
merges splits in index order in fp32 (``f_s = exp(lse_s - max)``, ``out =
sum f_s o_s / sum f_s``). Inactive rows attend over an empty span.

Device: ``opcodes/attention.cuh`` (the warp-specialised flash-decode stream
and ``combine_core``).
"""

from __future__ import annotations

import numpy as np
import torch

from megac import abi
from megac.abi import Flag, H, Op, Queue
from megac.errors import BadTaskError
from megac.ops.base import BF16, BIG, FP32, ClaimerOp, OpDef, SubTasks, at, bound, field, last_of, resolve_dyn, span
from megac.ops.cpu import cast, idx

#: scalar fills of the combine's masks
_NINF = torch.tensor(float("-inf"))
_ZERO = torch.tensor(0.0)

#: claimed attention record fields
_R = {name: abi.record_index(Queue.ATTN, name) for name, _ in abi.QUEUE_RECORDS[Queue.ATTN]}


def _decode_access(acc, t, layer, row, kvh, split, geo, split_hi=None) -> None:
    """One (row, kv head, split): reads its query heads and the current
    token's K/V, writes its partials."""
    hpk, hd = geo.heads_per_kv, geo.head_dim
    acc.add("q", False, t, at(layer), at(row), (kvh * hpk * hd, (kvh + 1) * hpk * hd))
    acc.add("kv_new", False, t, at(layer), at(row), (kvh * hd, (kvh + 1) * hd))
    acc.add("kv_new", False, t, at(layer), at(row), (geo.kv_width + kvh * hd, geo.kv_width + (kvh + 1) * hd))
    heads = (kvh * hpk, (kvh + 1) * hpk)
    sp = at(split) if split_hi is None else (split, split_hi)
    acc.add("attn_o_part", True, t, at(layer), sp, at(row), heads, span(hd))
    acc.add("attn_lse_part", True, t, at(layer), sp, at(row), heads)


def _split_fixed_bytes(geo) -> int:
    """One split's bytes whatever its keys: the query heads read, the partial
    outputs written."""
    return geo.heads_per_kv * geo.head_dim * BF16 + geo.heads_per_kv * (geo.head_dim + 1) * FP32


def split_bytes(geo, span_tokens: np.ndarray, splits: np.ndarray) -> np.ndarray:
    """One (row, kv head, split): its share of K and V, the query heads, the
    partial outputs."""
    tokens = -(-np.maximum(span_tokens, 1) // np.maximum(splits, 1))
    return tokens * geo.head_dim * 2 * BF16 + _split_fixed_bytes(geo)


def _context(geo, params) -> int:
    return int(params.context or geo.context)


def layer_splits(w, geo, context: int) -> np.ndarray:
    """Each task's attention split count at ``context`` as the host writes it
    (``runtime.step``): ``attn_splits(min(context, window))`` in a windowed
    layer, ``attn_splits(context)`` in a full one (the fallback of a dynamic
    split count)."""
    window = np.asarray(geo.window, dtype=np.int64)[np.clip(w[:, H.LAYER].astype(np.int64), 0, len(geo.window) - 1)]
    span_tokens = np.where(window > 0, np.minimum(context, window), context)
    return np.vectorize(geo.attn_splits, otypes=[np.int64])(span_tokens)


def split_spans(vm, rows: np.ndarray, splits: np.ndarray, nss: np.ndarray, window: int):
    """``(begin, end)`` int64 key ranges of tasks (row, split, num_splits)
    (``abi.split_range``; inactive rows: empty)."""
    active, seq_pos = vm.st.np["row_active"], vm.st.np["seq_pos"]
    m = len(rows)
    begin = np.zeros(m, dtype=np.int64)
    end = np.zeros(m, dtype=np.int64)
    for i in range(m):
        if active[rows[i]]:
            begin[i], end[i] = abi.split_range(int(seq_pos[rows[i]]) + 1, window, int(nss[i]), int(splits[i]), vm.bs)
    return begin, end


def _attend_plan(vm, layer: int, rows: np.ndarray, kvhs: np.ndarray, splits: np.ndarray, nss: np.ndarray,
                 window: int) -> list[tuple]:
    """Tasks (row, kv head, split, num_splits) grouped by their number of keys
    ``L``: per group ``(L, rows, kv heads, splits, key block index [g, L],
    key offset [g, L], key row inside its block of the pool seen as [-1, hd]
    [g, L], flat query rows, flat partial rows)``. Everything here
    depends on the step's positions only, not on the layer, so it is built
    (and the fields checked) once per step for every layer running the same
    tasks."""
    key = ("attend", window, rows.tobytes(), kvhs.tobytes(), splits.tobytes(), nss.tobytes())
    plan = vm.cache.get(key)
    if plan is not None:
        return plan
    R, kvh, hpk, bs = vm.R, vm.geo.kv_heads, vm.hpk, vm.bs
    slots = vm.st["attn_o_part"].shape[1]
    if ((splits < 0) | (splits >= slots)).any():
        raise BadTaskError(f"attention SPLIT outside the {slots} partial slots", layer=layer)
    if ((rows < 0) | (rows >= R) | (kvhs < 0) | (kvhs >= kvh)).any():
        raise BadTaskError("attention ROW / KV_HEAD outside the batch / kv heads", layer=layer)
    begin, end = split_spans(vm, rows, splits, nss, window)
    n_keys = end - begin
    plan = []
    for L in np.unique(n_keys).tolist():
        gi = np.flatnonzero(n_keys == L)
        r, h, s = rows[gi], kvhs[gi], splits[gi]
        bi = off = in_block = None
        if L:
            p = begin[gi][:, None] + np.arange(L, dtype=np.int64)[None, :]  # [g, L]
            bi, off = p // bs, p % bs
            if (bi >= vm.st.np["page_table"].shape[2]).any():
                raise BadTaskError("attention span beyond the page table", layer=layer)
            in_block = off * kvh + h[:, None]
        heads = h[:, None] * hpk + np.arange(hpk)[None, :]  # [g, hpk]
        part_rows = (s[:, None] * R + r[:, None]) * (kvh * hpk) + heads  # rows of [S * R * heads, hd]
        plan.append((L, r, h, s, bi, off, in_block, idx(r * kvh + h), idx(part_rows.ravel())))
    vm.cache[key] = plan
    return plan


def _kv_blocks(vm, layer: int, rows: np.ndarray, bi: np.ndarray) -> np.ndarray:
    """Blocks ``[g, L]`` holding key blocks ``bi`` of ``rows`` in ``layer``'s
    page table, every one mapped."""
    blk = vm.st.np["page_table"][layer, rows[:, None], bi]
    if (blk < 0).any():
        j = int(np.argwhere(blk < 0)[0][0])
        raise BadTaskError(f"attention reads an unmapped KV page (row {int(rows[j])}, layer {layer})",
                           layer=layer, buffer="page_table")
    return blk


def _gather_rows(t: torch.Tensor, width: int, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of ``t`` seen as ``[-1, width]`` (a plain gather)."""
    return t.reshape(-1, width).index_select(0, rows)


def attend(vm, layer: int, rows: np.ndarray, kvhs: np.ndarray, splits: np.ndarray, nss: np.ndarray,
           window: int) -> None:
    """Split partials of tasks (row, kv head, split, num_splits) on the VM."""
    st, geo = vm.st, vm.geo
    hd, hpk, kvh = vm.hd, vm.hpk, geo.kv_heads
    op_buf, lse_buf = st["attn_o_part"], st["attn_lse_part"]
    plan = _attend_plan(vm, layer, rows, kvhs, splits, nss, window)
    if vm.tracking:
        for i in range(len(rows)):
            vm.tr.read("q", (layer, int(rows[i]), slice(int(kvhs[i]) * hpk * hd, (int(kvhs[i]) + 1) * hpk * hd)))
    qrows = st["q"][layer]
    o_rows, lse_rows = op_buf[layer].view(-1, hd), lse_buf[layer].view(-1)
    block_rows = vm.bs * kvh  # rows of one KV block in the pool seen as [-1, hd]
    for L, r, h, s, bi, off, in_block, qi, pi in plan:
        g = len(r)
        if L == 0:
            o = torch.zeros((g, hpk, hd), dtype=torch.float32)
            lse = torch.full((g, hpk), float("-inf"), dtype=torch.float32)
        else:
            blk = _kv_blocks(vm, layer, r, bi)
            if vm.tracking:
                for j in range(g):
                    vm.tr.read("k_pool", (blk[j], off[j], int(h[j])))
                    vm.tr.read("v_pool", (blk[j], off[j], int(h[j])))
            kv_rows = idx((blk * block_rows + in_block).ravel())
            K = cast(_gather_rows(st["k_pool"], hd, kv_rows).view(g, L, hd), torch.float32)  # [g, L, hd]
            V = cast(_gather_rows(st["v_pool"], hd, kv_rows).view(g, L, hd), torch.float32)
            q = cast(_gather_rows(qrows, hpk * hd, qi).view(g, hpk, hd), torch.float32)  # [g, hpk, hd]
            sc = (q[:, :, None, :] * K[:, None, :, :]).sum(-1) * vm.scale  # [g, hpk, L]
            mx = sc.amax(-1, keepdim=True)
            pr = torch.exp(sc - mx)
            den = pr.sum(-1)  # [g, hpk]
            o = (pr[:, :, None, :] * V.transpose(1, 2)[:, None, :, :]).sum(-1) / den[..., None]
            lse = mx[..., 0] + torch.log(den)
        if vm.tracking:
            for j in range(g):
                hs = slice(int(h[j]) * hpk, (int(h[j]) + 1) * hpk)
                vm.tr.write("attn_o_part", (layer, int(s[j]), int(r[j]), hs))
                vm.tr.write("attn_lse_part", (layer, int(s[j]), int(r[j]), hs))
        o_rows.index_copy_(0, pi, cast(o.reshape(-1, hd), o_rows.dtype))
        lse_rows.index_copy_(0, pi, cast(lse.reshape(-1), lse_rows.dtype))


class AttnDecode(OpDef):
    """One (row, kv head, KV split) of paged GQA flash-decode: static tasks
    sized for the context bucket (sliding layers: for the window; full ones
    where the geometry's ``full_static`` says: for the bucket's context)."""

    op = Op.ATTN_DECODE
    node_kinds = ("attn",)
    sliding = True
    header = "attention.cuh"
    device_fn = "attn_decode"
    warm_fn = "attn_warm"

    def flags(self, nt, geo):
        return int(Flag.SLIDING) if geo.sliding[nt.layer] else 0

    def check_tiles(self, F_, geo):
        if np.any(F_["SPLIT"] >= geo.max_splits):
            return "attention SPLIT >= max_splits"
        return None

    def field_rules(self, lim):
        g = lim.geo
        return [
            ("ROW", 0, g.rows, False),
            ("KV_HEAD", 0, g.kv_heads, False),
            ("SPLIT", 0, g.max_splits, False),
            ("NUM_SPLITS", 1, g.max_splits + 1, True),
            ("WINDOW", 0, BIG, False),
        ]

    def access(self, acc, w, ix, layer, geo):
        _decode_access(acc, ix, layer, field(w, self.op, "ROW"), field(w, self.op, "KV_HEAD"),
                       field(w, self.op, "SPLIT"), geo)

    def task_bytes(self, w, geo, params):
        ctx = _context(geo, params)
        window = field(w, self.op, "WINDOW")
        sp = np.where(window > 0, np.minimum(ctx, window), ctx)
        # a windowed layer's split count is the host's for its window (runtime.step writes
        # attn_splits(min(n, window)) to the sliding word), not the context's
        ns = resolve_dyn(field(w, self.op, "NUM_SPLITS"), layer_splits(w, geo, ctx))
        # a split past the row's count (a bucket's static tasks at a shorter context) reads no
        # keys: it writes its empty partials only
        empty = field(w, self.op, "SPLIT") >= ns
        return np.where(empty, _split_fixed_bytes(geo), split_bytes(geo, sp, ns))

    def run(self, vm, words):
        op = self.op
        for (layer, window), ti in vm.groups(words, op, ("WINDOW",)):
            w = words[ti]
            attend(vm, layer, field(w, op, "ROW"), field(w, op, "KV_HEAD"), field(w, op, "SPLIT"),
                   vm.values(field(w, op, "NUM_SPLITS")), window)


class AttnDrain(ClaimerOp):
    """Claimer of full-attention split tasks: pulls ``{row, kv_head, split,
    num_splits}`` records from the host-written attention queue (shared by
    every full layer, one claim head per layer). A claimed task waits
    ``TASK_WAIT_BASE + kv_head`` and signals ``TASK_SIGNAL_BASE + row *
    kv_heads + kv_head``."""

    op = Op.ATTN_DRAIN
    node_kinds = ("attn",)
    sliding = False
    header = "attention.cuh"
    device_fn = "attn_drain"
    queue = Queue.ATTN

    def field_rules(self, lim):
        g, C = lim.geo, lim.num_counters
        return [
            ("QUEUE", int(Queue.ATTN), int(Queue.ATTN) + 1, False),
            ("QUEUE_LEN", 0, BIG, True),
            ("TASK_WAIT_BASE", 0, C, False),
            (last_of(self.op, "TASK_WAIT_BASE", g.kv_heads), 0, C, False),
            ("TASK_WAIT_TARGET", 1, BIG, True),
            ("TASK_SIGNAL_BASE", 0, C, False),
            (last_of(self.op, "TASK_SIGNAL_BASE", g.rows * g.kv_heads), 0, C, False),
            ("WINDOW", 0, BIG, False),
        ]

    def subtasks(self, layer, geo, merged=False):
        S = geo.full_max_splits
        r, h, s = np.meshgrid(np.arange(geo.rows), np.arange(geo.kv_heads), np.arange(1 if merged else S),
                              indexing="ij")
        r, h, s = r.ravel(), h.ravel(), s.ravel()
        fields = {"ROW": r, "KV_HEAD": h, "SPLIT": s, "SPLIT_HI": np.full_like(s, S) if merged else s + 1}
        return SubTasks(self.queue, layer, fields, wait_offset=h.copy(), signal_offset=r * geo.kv_heads + h)

    def subtask_access(self, acc, sub, geo):
        m = len(sub)
        t = np.arange(m, dtype=np.int64)
        layer = np.full(m, sub.layer, dtype=np.int64)
        split = sub.fields["SPLIT"]
        _decode_access(acc, t, layer, sub.fields["ROW"], sub.fields["KV_HEAD"], split, geo,
                       split_hi=sub.fields.get("SPLIT_HI", split + 1))

    def offsets(self, records, geo):
        kvh = records[:, _R["KV_HEAD"]].astype(np.int64)
        row = records[:, _R["ROW"]].astype(np.int64)
        return kvh, row * geo.kv_heads + kvh

    def signal_span(self, geo):
        return geo.rows * geo.kv_heads

    def signal_count(self, layer, offset, geo):
        return abi.dyn(geo.target_words.attn_splits_full(offset // geo.kv_heads))

    def claimed_work(self, geo, params):
        ctx = _context(geo, params)
        ns = geo.attn_splits(ctx)
        n = geo.rows * geo.kv_heads * ns
        return n, float(split_bytes(geo, np.array([ctx]), np.array([ns]))[0])

    def run_claimed(self, vm, cw, records):
        window = int(cw[abi.field_index(self.op, "WINDOW")])
        layer = int(cw[abi.H.LAYER])
        r = np.asarray(records, dtype=np.int64)
        attend(vm, layer, r[:, _R["ROW"]], r[:, _R["KV_HEAD"]], r[:, _R["SPLIT"]], r[:, _R["NUM_SPLITS"]], window)


def merge_splits(lse: torch.Tensor, o: torch.Tensor, ns: np.ndarray) -> torch.Tensor:
    """The log-sum-exp merge of ATTN_COMBINE (and of a merging O_PROJ), fp32:
    ``lse [m, hpk, S]`` and ``o [m, hpk, S, hd]`` the partials of m (row, kv
    head) pairs, ``ns [m]`` the splits each merges (in index order; splits
    past it are masked out). Returns ``[m, hpk * hd]`` fp32 (the caller
    casts)."""
    ninf, zero = _NINF, _ZERO
    m, hpk, S, hd = o.shape
    # splits past a task's NUM_SPLITS are masked out (all-valid groups skip
    # the masks: where(True, a, b) == a, so the bits are the same)
    full = bool((ns == S).all())
    valid = None if full else torch.arange(S)[None, :] < idx(ns)[:, None]  # [m, S]
    M = (lse if full else torch.where(valid[:, None, :], lse, ninf)).amax(-1)  # [m, hpk]
    mfin = M != float("-inf")
    Lsum = torch.zeros_like(M)
    acc = torch.zeros(o.shape[:2] + (hd,), dtype=torch.float32)
    for sp in range(S):
        ls = lse[:, :, sp]
        ok = (ls != float("-inf")) & mfin
        if not full:
            ok = ok & valid[:, sp][:, None]
        f = torch.where(ok, torch.exp(ls - M), zero)
        if full:
            Lsum = Lsum + f
            acc = acc + f[..., None] * o[:, :, sp]
        else:
            v = valid[:, sp][:, None]
            Lsum = torch.where(v, Lsum + f, Lsum)
            acc = torch.where(v[..., None], acc + f[..., None] * o[:, :, sp], acc)
    inv = torch.where(Lsum > 0, 1.0 / Lsum, zero)
    return (acc * inv[..., None]).reshape(m, hpk * hd)


class AttnCombine(OpDef):
    """Log-sum-exp merge of one (row, kv head)'s NUM_SPLITS partials, in split
    order, into ``attn_out`` (activation dtype)."""

    op = Op.ATTN_COMBINE
    node_kinds = ("attn_combine",)
    header = "attention.cuh"
    device_fn = "attn_combine"

    def field_rules(self, lim):
        g = lim.geo
        return [
            ("ROW", 0, g.rows, False),
            ("KV_HEAD", 0, g.kv_heads, False),
            ("NUM_SPLITS", 1, g.max_splits + 1, True),
        ]

    def access(self, acc, w, ix, layer, geo):
        row, kvh = field(w, self.op, "ROW"), field(w, self.op, "KV_HEAD")
        ns = bound(field(w, self.op, "NUM_SPLITS"), geo)
        hpk, hd = geo.heads_per_kv, geo.head_dim
        heads = (kvh * hpk, (kvh + 1) * hpk)
        acc.add("attn_o_part", False, ix, at(layer), (0, ns), at(row), heads, span(hd))
        acc.add("attn_lse_part", False, ix, at(layer), (0, ns), at(row), heads)
        acc.add("attn_out", True, ix, at(layer), at(row), (kvh * hpk * hd, (kvh + 1) * hpk * hd))

    def task_bytes(self, w, geo, params):
        ns = resolve_dyn(field(w, self.op, "NUM_SPLITS"), layer_splits(w, geo, _context(geo, params)))
        return ns * geo.heads_per_kv * (geo.head_dim + 1) * FP32 + geo.heads_per_kv * geo.head_dim * BF16

    def run(self, vm, words):
        op, st = self.op, vm.st
        hd, hpk, kvh = vm.hd, vm.hpk, vm.geo.kv_heads

        def build(words):
            groups = []
            for (layer,), ti in vm.groups(words, op, ()):
                w = words[ti]
                rows, kvhs = field(w, op, "ROW"), field(w, op, "KV_HEAD")
                if ((rows < 0) | (rows >= vm.R) | (kvhs < 0) | (kvhs >= vm.geo.kv_heads)).any():
                    raise BadTaskError("ATTN_COMBINE: ROW / KV_HEAD out of range", layer=layer)
                # the tasks' (row, head) columns of the partials [S, R * heads (, hd)]
                # and their rows of attn_out seen as [R * kv heads, hpk * hd]
                heads = rows[:, None] * (kvh * hpk) + kvhs[:, None] * hpk + np.arange(hpk)[None, :]
                lse_part, o_part = st["attn_lse_part"][layer], st["attn_o_part"][layer]
                groups.append((layer, [int(r) for r in rows], [int(h) for h in kvhs], field(w, op, "NUM_SPLITS"),
                               idx(heads.ravel()), idx(rows * kvh + kvhs),
                               lse_part.view(lse_part.shape[0], -1), o_part.view(o_part.shape[0], -1, hd),
                               st["attn_out"][layer].view(vm.R * kvh, hpk * hd)))
            return groups

        for layer, rows, kvhs, nsw, heads, out_rows, lse_part, o_part, out_buf in vm.plan(op.name, words, build):
            ns = vm.values(nsw)
            S = int(ns.max())
            if S > st["attn_o_part"].shape[1] or (ns < 0).any():
                raise BadTaskError(f"ATTN_COMBINE: NUM_SPLITS {S} outside the partial slots", layer=layer)
            if vm.tracking:
                for r, h, n in zip(rows, kvhs, ns.tolist()):
                    hs = slice(h * hpk, (h + 1) * hpk)
                    vm.tr.read("attn_lse_part", (layer, slice(0, n), r, hs))
                    vm.tr.read("attn_o_part", (layer, slice(0, n), r, hs))
            m = len(rows)
            lse = lse_part[:S].index_select(1, heads).view(S, m, hpk).permute(1, 2, 0)  # [m, hpk, S]
            o = o_part[:S].index_select(1, heads).view(S, m, hpk, hd).permute(1, 2, 0, 3)  # [m, hpk, S, hd]
            out = merge_splits(lse, o, ns)
            if vm.tracking:
                for r, h in zip(rows, kvhs):
                    vm.tr.write("attn_out", (layer, r, slice(h * hpk * hd, (h + 1) * hpk * hd)))
            out_buf.index_copy_(0, out_rows, cast(out, out_buf.dtype))


ATTENTION_OPS = (AttnDecode(), AttnDrain(), AttnCombine())

__all__ = ["ATTENTION_OPS", "AttnCombine", "AttnDecode", "AttnDrain", "attend", "merge_splits", "split_bytes"]

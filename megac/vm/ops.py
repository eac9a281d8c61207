"""Per-opcode semantics of the CPU VM: one method per opcode over task words.

Every method takes ``words``: int ``[n, 32]`` tasks of ONE opcode (n = 1 in
checked mode; a coalesced run of consecutive tasks in fast mode) and reads
their fields exactly as the device does, through ``abi.H`` /
``abi.field_index`` (never a literal offset). Claimed work (attention splits
of full layers, MoE expert tiles) runs through :meth:`Ops.claimed`
(``claimer words``, ``records [m, 4]``); the claimer opcodes' own methods
drain their whole queue at once (fast mode: claimers executed in place).

Every buffer access goes through ``self.tr.read / write(buffer, index)``
first (a no-op in fast mode; the happens-before tracker in checked mode), so
a read of data no counter guarantees raises before the data is used.

Numerics (fp32 mode: fp32 everywhere; bf16 mode: bf16 weights, activations
and KV, fp32 accumulation, partials and softmax, one rounding at each store),
chosen so that a result depends only on its own task's data, never on how
tasks are grouped, on the batch size or on the interleaving (bit-identical
checked vs fast mode, batch invariance):

* **GEMM tiles** (QKV, O-proj, dense up/gate and down, router, LM head, expert
  tiles) are slices of the row's full product ``x_row @ W[:, K range].T``,
  computed once per step per (op, layer, K range, row) with one fixed-shape
  ``F.linear`` call on a fresh copy of the row (BLAS results depend on the
  shape of the call, so every tile of every mode slices the same call) and
  cached for the step. The K range is the task's split-K slice; split-K
  partials are fp32 and reduced by their consumer in split order.
* **Reductions** other than GEMMs run along a tensor's contiguous last
  dimension whose length is the task's own (keys of its split, hidden size),
  or as explicit sequential sums in index order (attention combine over
  splits, ADD_RMSNORM over partials, router split-K, MoE combine over k).
* **Attention split rule** is ``megac.abi.split_range`` (the device rule of
  opcodes/attention.cuh): a row's visible span
  ``[lo, hi)``, ``hi = seq_pos + 1``, is cut on KV-block boundaries into
  ``NUM_SPLITS`` chunks; an empty chunk (or ``SPLIT >= NUM_SPLITS``) writes
  ``o = 0, lse = -inf``; partials are normalised by their own sum, ``lse``
  is the natural-log LSE of the scaled scores; the combine merges splits in
  index order in fp32 (``f_s = exp(lse_s - max)``, ``out = sum f_s o_s / sum f_s``).
* **Routing**: top-k by logit (ties: lower expert id); sigmoid weights (fp64,
  rounded once), optionally renormalised (fp64 sum of the rounded weights in
  k order); softmax weights over the k selected logits (``MoESpec``);
  ROUTE_FINALIZE assigns slots in (row, k) order and writes one queue record
  ``{expert, n_tile, slot0, rows}`` per active expert (ascending) and tile.

Rows with ``row_active = 0`` compute everything but write nothing visible:
QKV skips their K/V pool writes and their attention reads no KV (an empty
partial).
"""

from __future__ import annotations


import numpy as np
import torch
import torch.nn.functional as F

from megac import abi, routing
from megac.abi import Flag, H, Op, Queue
from megac.errors import MegacError


class VMError(MegacError):
    """A task the VM cannot execute or a schedule that cannot run. Attributes
    name where: ``sm``, ``slot``, ``opcode``, ``layer``, ``counter``, ``buffer``
    (None when not applicable)."""

    def __init__(self, message: str, *, sm=None, slot=None, opcode=None, layer=None, counter=None,
                 buffer=None) -> None:
        super().__init__(message)
        self.sm, self.slot, self.opcode, self.layer = sm, slot, opcode, layer
        self.counter, self.buffer = counter, buffer


class BadTaskError(VMError):
    """A descriptor field the semantics cannot honour (range, layout, unmapped KV page)."""


class QueueOverflowError(VMError):
    """ROUTE_FINALIZE would write past a queue's capacity."""


class NullTracker:
    """Fast mode: accesses are not tracked."""

    __slots__ = ()

    def read(self, name, index) -> None:  # noqa: D401 - protocol
        pass

    def write(self, name, index) -> None:
        pass


NULL_TRACKER = NullTracker()

_QUEUE_BUFFER = {Queue.ATTN: "attn_queue", Queue.MOE_UP: "moe_up_queue", Queue.MOE_DOWN: "moe_down_queue"}


def queue_buffer(queue: int) -> str:
    try:
        return _QUEUE_BUFFER[Queue(int(queue))]
    except ValueError:
        raise BadTaskError(f"unknown queue id {queue}") from None


_FIELD_INDEX = {(int(op), name): abi.field_index(op, name) for op, fs in abi.OP_FIELDS.items() for name, _ in fs}


def fi(op: Op, name: str) -> int:
    """Word index of field ``name`` of ``op`` (``abi.field_index``, memoised)."""
    return _FIELD_INDEX[(int(op), name)]


def fld(words: np.ndarray, op: Op, name: str) -> np.ndarray:
    """Field ``name`` of ``op`` for every task of ``words`` (int64 ``[n]``)."""
    return words[:, _FIELD_INDEX[(int(op), name)]].astype(np.int64)


def rec(records: np.ndarray, queue: Queue, name: str) -> np.ndarray:
    return records[:, abi.record_index(queue, name)].astype(np.int64)


def _idx(a) -> torch.Tensor:
    return torch.as_tensor(np.asarray(a, dtype=np.int64))


def _cols(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(s, s + n)`` for every (s, n)."""
    starts = np.asarray(starts, dtype=np.int64)
    lens = np.asarray(lens, dtype=np.int64)
    if len(starts) == 1:
        return np.arange(starts[0], starts[0] + lens[0], dtype=np.int64)
    tot = int(lens.sum())
    off = np.repeat(starts - (np.cumsum(lens) - lens), lens)
    return off + np.arange(tot, dtype=np.int64)


def _ranges(sorted_idx: np.ndarray) -> list[tuple[int, int]]:
    """Maximal ``[a, b)`` runs of consecutive integers in a sorted array."""
    if len(sorted_idx) == 0:
        return []
    brk = np.flatnonzero(np.diff(sorted_idx) != 1) + 1
    starts = np.concatenate([[0], brk])
    ends = np.concatenate([brk, [len(sorted_idx)]])
    return [(int(sorted_idx[a]), int(sorted_idx[b - 1]) + 1) for a, b in zip(starts, ends)]


def _as_slice(cols: np.ndarray):
    """A slice when ``cols`` is one contiguous ascending range, else a tensor."""
    if len(cols) and cols[-1] - cols[0] + 1 == len(cols) and (len(cols) < 3 or (np.diff(cols) == 1).all()):
        return slice(int(cols[0]), int(cols[-1]) + 1)
    return _idx(cols)


def _group_rows(key: np.ndarray):
    """``(tuple(key row), indices)`` per distinct row of ``key [n, k]``, in
    order of first appearance."""
    n = len(key)
    if n == 1 or (key == key[0]).all():
        return [(tuple(int(v) for v in key[0]), np.arange(n, dtype=np.int64))]
    groups: dict[tuple, list[int]] = {}
    for i, row in enumerate(map(tuple, key.tolist())):
        groups.setdefault(row, []).append(i)
    return [(k, np.asarray(v, dtype=np.int64)) for k, v in groups.items()]


def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, half: bool) -> torch.Tensor:
    hd = x.shape[-1]
    if half:
        a, b = x[..., : hd // 2], x[..., hd // 2:]
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)


def rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, half: bool) -> torch.Tensor:
    """Rotate fp32 heads ``x [R, m, hd]`` by positions ``pos [R]``: pairs
    ``(2k, 2k+1)`` (interleaved) or ``(k, k + hd/2)`` (half); angle
    ``pos * inv_freq[k]`` in fp32; ``(a, b) -> (a cos - b sin, b cos + a sin)``."""
    ang = pos.to(torch.float32)[:, None] * inv_freq[None, :]  # [R, hd/2]
    return _rotate(x, ang.cos()[:, None, :], ang.sin()[:, None, :], half)


class Ops:
    """The per-opcode semantics over one :class:`~megac.vm.state.DeviceState`."""

    def __init__(self, state, tracker=None) -> None:
        self.st = state
        self.geo = state.geo
        self.tr = tracker if tracker is not None else NULL_TRACKER
        self.cache: dict = {}
        self.plans: dict = {}
        #: fast mode with check_order: called with (claimer words, records) before they run
        self.on_claimed = None
        self.handlers: dict = {
            Op.NOP: lambda w: None,
            Op.QKV_PROJ: self.qkv_proj,
            Op.ATTN_DECODE: self.attn_decode,
            Op.ATTN_DRAIN: self.drain,
            Op.ATTN_COMBINE: self.attn_combine,
            Op.O_PROJ: self.o_proj,
            Op.FFN_UPGATE_ACT: self.ffn_upgate_act,
            Op.FFN_DOWN: self.ffn_down,
            Op.ROUTER_GEMM: self.router_gemm,
            Op.ROUTER_TOPK: self.router_topk,
            Op.ROUTE_FINALIZE: self.route_finalize,
            Op.MOE_GATHER: self.moe_gather,
            Op.MOE_UPGATE_DRAIN: self.drain,
            Op.MOE_DOWN_DRAIN: self.drain,
            Op.MOE_COMBINE: self.moe_combine,
            Op.ADD_RMSNORM: self.add_rmsnorm,
            Op.LM_HEAD: self.lm_head,
        }
        self.handlers = {int(k): v for k, v in self.handlers.items()}
        st = state
        self.R = self.geo.rows
        self.hd = self.geo.head_dim
        self.hpk = self.geo.heads_per_kv
        self.scale = float(st["attn_scale"])
        self.eps = float(st["norm_eps"])
        self.bs = st.block_size
        self.inv_freq = st["rope_inv_freq"].to(torch.float32)
        self.targets = st.np["targets"]

    # ------------------------------------------------------------------ api
    def begin_step(self) -> None:
        """Forget the per-step GEMM row products (inputs change every step)."""
        self.cache.clear()

    def run(self, words: np.ndarray) -> None:
        """Execute tasks ``words [n, 32]`` of one opcode."""
        op = int(words[0, H.OPCODE])
        handler = self.handlers.get(op)
        if handler is None:
            raise BadTaskError(f"unknown opcode {op}")
        handler(words)

    def value(self, v: int) -> int:
        """A count field: itself, or the target word it names (DYN_FLAG)."""
        v = int(v)
        if abi.is_dyn(v):
            i = abi.dyn_index(v)
            if i >= len(self.targets):
                raise BadTaskError(f"dynamic reference to target word {i} outside the buffer")
            self.tr.read("targets", (i,))
            return int(self.targets[i])
        return v

    def values(self, vs: np.ndarray) -> np.ndarray:
        return np.array([self.value(v) for v in vs], dtype=np.int64)

    def _slot(self, layer: int) -> int:
        """Index of ``layer`` in its dense / MoE weight stack (``layer_slot``)."""
        if not 0 <= layer < len(self.st.layer_slot):
            raise BadTaskError(f"layer {layer} outside the model", layer=layer)
        return self.st.layer_slot[layer]

    # ------------------------------------------------------------------ GEMM core
    def _products(self, key, xbuf: str, xpre: tuple, k0: int, kl: int, W: torch.Tensor,
                  rows=None) -> torch.Tensor:
        """``[R, N]`` fp32: row r = ``x[r, k0:k0+kl] @ W[:, k0:k0+kl].T`` with
        ``x = st[xbuf][xpre]`` (``[R, K]``), one fixed-shape call per row,
        cached for the step. Only ``rows`` (default: all) are guaranteed."""
        ent = self.cache.get(key)
        if ent is None:
            ent = (torch.empty((self.R, W.shape[0]), dtype=torch.float32), np.zeros(self.R, dtype=bool))
            self.cache[key] = ent
        Y, done = ent
        need = range(self.R) if rows is None else rows
        if not all(done[r] for r in need):
            X = self.st[xbuf][xpre]
            Wk = W if (k0 == 0 and kl == W.shape[1]) else W[:, k0:k0 + kl]
            for r in need:
                if done[r]:
                    continue
                xr = torch.empty((1, kl), dtype=torch.float32)
                xr.copy_(X[r, k0:k0 + kl])
                Y[r] = F.linear(xr, Wk)[0]
                done[r] = True
        return Y

    def _groups(self, words: np.ndarray, op: Op, keys: tuple[str, ...], flags: bool = False):
        """Task indices grouped by (layer, *fields[, flags])."""
        cols = [words[:, H.LAYER]] + [words[:, fi(op, k)] for k in keys]
        if flags:
            cols.append(words[:, H.FLAGS])
        return _group_rows(np.stack(cols, axis=1).astype(np.int64))

    def _check_k(self, op: Op, k0: int, kl: int, kdim: int) -> None:
        if k0 < 0 or kl < 1 or k0 + kl > kdim:
            raise BadTaskError(f"{op.name}: K range [{k0}, {k0 + kl}) outside [0, {kdim})")

    def _check_n(self, op: Op, n0: np.ndarray, nl: np.ndarray, ndim: int) -> None:
        if (n0 < 0).any() or (nl < 1).any() or (n0 + nl > ndim).any():
            raise BadTaskError(f"{op.name}: N range outside [0, {ndim})")

    def _plan(self, tag: str, words: np.ndarray, build):
        """Static per-task-words data (index arrays, slices), built once per
        distinct ``words`` and reused every step (never depends on data)."""
        key = (tag, words.tobytes())
        p = self.plans.get(key)
        if p is None:
            p = build(words)
            self.plans[key] = p
        return p

    def _x_slot(self, op: Op, xs: int, layer: int) -> int:
        if not 0 <= xs < self.st["x_norm"].shape[0]:
            raise BadTaskError(f"{op.name}: X_SLOT {xs} outside the x_norm slots", layer=layer)
        return xs

    def _splitk(self, words: np.ndarray, op: Op, xbuf: str, xslot, W_of, out: str) -> None:
        """Split-K partial GEMM tiles: ``out[layer, split, :, n0:n0+nl]`` (fp32).
        ``xslot``: the input slot as a function of the layer, or the name of
        the field that holds it."""
        by_field = isinstance(xslot, str)

        def build(words):
            groups = []
            keys = ("K0", "K_LEN", "SPLIT") + ((xslot,) if by_field else ())
            for key, ti in self._groups(words, op, keys):
                layer, k0, kl, split = key[:4]
                xs = self._x_slot(op, key[4], layer) if by_field else xslot(layer)
                W = W_of(layer)
                self._check_k(op, k0, kl, W.shape[1])
                n0, nl = fld(words[ti], op, "N0"), fld(words[ti], op, "N_LEN")
                self._check_n(op, n0, nl, W.shape[0])
                if not 0 <= split < self.st[out].shape[1]:
                    raise BadTaskError(f"{op.name}: SPLIT {split} outside the {out} buffer "
                                       f"({self.st[out].shape[1]} slots)", layer=layer)
                ranges = [(int(a), int(b)) for a, b in zip(n0, n0 + nl)]
                groups.append((layer, k0, kl, split, xs, ranges, _as_slice(_cols(n0, nl))))
            return groups

        buf = self.st[out]
        for layer, k0, kl, split, xs, ranges, cols in self._plan(op.name, words, build):
            self.tr.read(xbuf, (xs, slice(None), slice(k0, k0 + kl)))
            Y = self._products((op, layer, k0, kl), xbuf, (xs,), k0, kl, W_of(layer))
            for a, b in ranges:
                self.tr.write(out, (layer, split, slice(None), slice(a, b)))
            buf[layer, split, :, cols] = Y[:, cols]

    def _rope_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[R, 1, hd/2]`` of the rows' positions (fp32), once per step."""
        t = self.cache.get("rope")
        if t is None:
            pos = _idx(self.st.np["seq_pos"][: self.R])
            ang = pos.to(torch.float32)[:, None] * self.inv_freq[None, :]
            t = (ang.cos()[:, None, :], ang.sin()[:, None, :])
            self.cache["rope"] = t
        return t

    # ------------------------------------------------------------------ opcodes
    def qkv_proj(self, words: np.ndarray) -> None:
        op, geo, st = Op.QKV_PROJ, self.geo, self.st
        hd, nq, nkv = self.hd, geo.num_heads, geo.kv_heads

        def build(words):
            groups = []
            for (layer, k0, kl), ti in self._groups(words, op, ("K0", "K_LEN")):
                if k0 != 0 or kl != geo.hidden:
                    raise BadTaskError("QKV_PROJ: the RoPE / KV epilogue needs the whole K range (no split-K)",
                                       opcode=int(op), layer=layer)
                w = words[ti]
                n0, nl = fld(w, op, "N0"), fld(w, op, "N_LEN")
                self._check_n(op, n0, nl, geo.qkv_width)
                if (n0 % hd).any() or (nl % hd).any():
                    raise BadTaskError("QKV_PROJ: a tile must hold whole heads", opcode=int(op), layer=layer)
                flags = w[:, H.FLAGS].astype(np.int64)
                heads = _cols(n0 // hd, nl // hd)
                hflags = np.repeat(flags, nl // hd)
                ropes = []
                ropem = ((hflags & Flag.ROPE) != 0) & (heads < nq + nkv)
                for half in (False, True):
                    sel = ropem & (((hflags & Flag.ROPE_HALF) != 0) == half)
                    if sel.any():
                        ropes.append((half, _as_slice(np.flatnonzero(sel))))
                isq = heads < nq
                q = None
                if isq.any():
                    qh = heads[isq]
                    q = ([(int(h) * hd, (int(h) + 1) * hd) for h in qh], _as_slice(qh),
                         _as_slice(np.flatnonzero(isq)))
                kvp = []
                for part, pool in ((0, "k_pool"), (1, "v_pool")):
                    sel = (heads >= nq + part * nkv) & (heads < nq + (part + 1) * nkv)
                    if sel.any():
                        kvh = heads[sel] - nq - part * nkv
                        kvp.append((pool, kvh, _as_slice(kvh), _as_slice(np.flatnonzero(sel))))
                groups.append((layer, kl, _as_slice(heads), ropes, q, kvp))
            return groups

        for layer, kl, hsel, ropes, q, kvp in self._plan(op.name, words, build):
            self.tr.read("x_norm", (layer, slice(None), slice(None)))
            Y = self._products((op, layer, 0, kl), "x_norm", (layer,), 0, kl, st.w("w_qkv")[layer])
            vals = Y.view(self.R, geo.qkv_width // hd, hd)[:, hsel].clone()  # [R, m, hd] fp32
            if ropes:
                c, s = self._rope_table()
                for half, si in ropes:
                    vals[:, si] = _rotate(vals[:, si], c, s, half)
            if q is not None:
                ranges, dst, src = q
                for a, b in ranges:
                    self.tr.write("q", (layer, slice(None), slice(a, b)))
                qv = st["q"][layer].view(self.R, nq, hd)
                qv[:, dst] = vals[:, src].to(qv.dtype)
            # K / V heads -> the paged pool (active rows only)
            for pool, kvh, dst, src in kvp:
                P = st[pool]
                for r in range(self.R):
                    if not st.np["row_active"][r]:
                        continue
                    blk, off = self._kv_slot(layer, r, int(st.np["seq_pos"][r]))
                    self.tr.write(pool, (blk, off, kvh))
                    P[blk, off, dst] = vals[r, src].to(P.dtype)

    def _kv_slot(self, layer: int, row: int, pos: int) -> tuple[int, int]:
        b = pos // self.bs
        pt = self.st.np["page_table"]
        if not 0 <= b < pt.shape[2] or pt[layer, row, b] < 0:
            raise BadTaskError(f"KV position {pos} of row {row} layer {layer} has no mapped block",
                               layer=layer, buffer="page_table")
        return int(pt[layer, row, b]), pos % self.bs

    # ---------------------------------------------------------------- attention
    def _attend(self, layer: int, rows: np.ndarray, kvhs: np.ndarray, splits: np.ndarray,
                nss: np.ndarray, window: int) -> None:
        """Split partials of tasks (row, kv head, split, num_splits)."""
        st, geo = self.st, self.geo
        hd, hpk = self.hd, self.hpk
        op_buf, lse_buf = st["attn_o_part"], st["attn_lse_part"]
        if ((splits < 0) | (splits >= op_buf.shape[3])).any():
            raise BadTaskError(f"attention SPLIT outside the {op_buf.shape[3]} partial slots", layer=layer)
        if ((rows < 0) | (rows >= self.R) | (kvhs < 0) | (kvhs >= geo.kv_heads)).any():
            raise BadTaskError("attention ROW / KV_HEAD outside the batch / kv heads", layer=layer)
        active = st.np["row_active"]
        seq_pos = st.np["seq_pos"]
        pt = st.np["page_table"]
        m = len(rows)
        begin = np.empty(m, dtype=np.int64)
        end = np.empty(m, dtype=np.int64)
        for i in range(m):
            if active[rows[i]]:
                begin[i], end[i] = abi.split_range(int(seq_pos[rows[i]]) + 1, window, int(nss[i]), int(splits[i]),
                                               self.bs)
            else:
                begin[i] = end[i] = 0
        n_keys = end - begin
        qv = st["q"][layer].view(self.R, geo.kv_heads, hpk, hd)
        for i in range(m):
            self.tr.read("q", (layer, int(rows[i]), slice(int(kvhs[i]) * hpk * hd, (int(kvhs[i]) + 1) * hpk * hd)))
        for L in np.unique(n_keys):
            gi = np.flatnonzero(n_keys == L)
            r, h, s = rows[gi], kvhs[gi], splits[gi]
            if L == 0:
                o = torch.zeros((len(gi), hpk, hd), dtype=torch.float32)
                lse = torch.full((len(gi), hpk), float("-inf"), dtype=torch.float32)
            else:
                p = begin[gi][:, None] + np.arange(L, dtype=np.int64)[None, :]  # [g, L]
                bi = p // self.bs
                if (bi >= pt.shape[2]).any():
                    raise BadTaskError("attention span beyond the page table", layer=layer)
                blk = pt[layer, r[:, None], bi]
                if (blk < 0).any():
                    j = int(np.argwhere(blk < 0)[0][0])
                    raise BadTaskError(f"attention reads an unmapped KV page (row {int(r[j])}, layer {layer})",
                                       layer=layer, buffer="page_table")
                off = p % self.bs
                for j in range(len(gi)):
                    self.tr.read("k_pool", (blk[j], off[j], int(h[j])))
                    self.tr.read("v_pool", (blk[j], off[j], int(h[j])))
                bt, ot, ht = _idx(blk), _idx(off), _idx(h)[:, None]
                K = st["k_pool"][bt, ot, ht].to(torch.float32)  # [g, L, hd]
                V = st["v_pool"][bt, ot, ht].to(torch.float32)
                q = qv[_idx(r), _idx(h)].to(torch.float32)  # [g, hpk, hd]
                sc = (q[:, :, None, :] * K[:, None, :, :]).sum(-1) * self.scale  # [g, hpk, L]
                mx = sc.amax(-1, keepdim=True)
                pr = torch.exp(sc - mx)
                den = pr.sum(-1)  # [g, hpk]
                o = (pr[:, :, None, :] * V.transpose(1, 2)[:, None, :, :]).sum(-1) / den[..., None]
                lse = mx[..., 0] + torch.log(den)
            for j in range(len(gi)):
                hs = slice(int(h[j]) * hpk, (int(h[j]) + 1) * hpk)
                self.tr.write("attn_o_part", (layer, int(r[j]), hs, int(s[j])))
                self.tr.write("attn_lse_part", (layer, int(r[j]), hs, int(s[j])))
            heads = _idx(h)[:, None] * hpk + torch.arange(hpk)[None, :]  # [g, hpk]
            rr, ss = _idx(r)[:, None], _idx(s)[:, None]
            op_buf[layer, rr, heads, ss] = o
            lse_buf[layer, rr, heads, ss] = lse

    def attn_decode(self, words: np.ndarray) -> None:
        op = Op.ATTN_DECODE
        for (layer, window), ti in self._groups(words, op, ("WINDOW",)):
            w = words[ti]
            self._attend(layer, fld(w, op, "ROW"), fld(w, op, "KV_HEAD"), fld(w, op, "SPLIT"),
                         self.values(fld(w, op, "NUM_SPLITS")), window)

    def attn_combine(self, words: np.ndarray) -> None:
        op, st = Op.ATTN_COMBINE, self.st
        hd, hpk = self.hd, self.hpk

        def build(words):
            groups = []
            for (layer,), ti in self._groups(words, op, ()):
                w = words[ti]
                rows, kvhs = fld(w, op, "ROW"), fld(w, op, "KV_HEAD")
                if ((rows < 0) | (rows >= self.R) | (kvhs < 0) | (kvhs >= self.geo.kv_heads)).any():
                    raise BadTaskError("ATTN_COMBINE: ROW / KV_HEAD out of range", layer=layer)
                heads = _idx(kvhs)[:, None] * hpk + torch.arange(hpk)[None, :]
                cols = _idx(kvhs)[:, None] * (hpk * hd) + torch.arange(hpk * hd)[None, :]
                groups.append((layer, [int(r) for r in rows], [int(h) for h in kvhs], fld(w, op, "NUM_SPLITS"),
                               _idx(rows)[:, None], heads, cols))
            return groups

        ninf = torch.tensor(float("-inf"))
        zero = torch.tensor(0.0)
        for layer, rows, kvhs, nsw, rr, heads, cols in self._plan(op.name, words, build):
            ns = self.values(nsw)
            S = int(ns.max())
            if S > st["attn_o_part"].shape[3] or (ns < 0).any():
                raise BadTaskError(f"ATTN_COMBINE: NUM_SPLITS {S} outside the partial slots", layer=layer)
            for r, h, n in zip(rows, kvhs, ns.tolist()):
                hs = slice(h * hpk, (h + 1) * hpk)
                self.tr.read("attn_lse_part", (layer, r, hs, slice(0, n)))
                self.tr.read("attn_o_part", (layer, r, hs, slice(0, n)))
            lse = st["attn_lse_part"][layer, rr, heads, :S]  # [m, hpk, S]
            o = st["attn_o_part"][layer, rr, heads, :S]  # [m, hpk, S, hd]
            # splits past a task's NUM_SPLITS are masked out (all-valid groups skip
            # the masks: where(True, a, b) == a, so the bits are the same)
            full = bool((ns == S).all())
            valid = None if full else torch.arange(S)[None, :] < _idx(ns)[:, None]  # [m, S]
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
            out = (acc * inv[..., None]).reshape(len(rows), hpk * hd)
            for r, h in zip(rows, kvhs):
                self.tr.write("attn_out", (layer, r, slice(h * hpk * hd, (h + 1) * hpk * hd)))
            buf = st["attn_out"]
            buf[layer, rr, cols] = out.to(buf.dtype)

    # ---------------------------------------------------------------- projections
    def o_proj(self, words: np.ndarray) -> None:
        self._splitk(words, Op.O_PROJ, "attn_out", lambda layer: layer,
                     lambda layer: self.st.w("w_o")[layer], "o_part")

    def ffn_down(self, words: np.ndarray) -> None:
        self._dense_check(words, Op.FFN_DOWN)
        self._splitk(words, Op.FFN_DOWN, "ffn_act", lambda layer: layer,
                     lambda layer: self.st.w("w_down")[self._slot(layer)], "ffn_part")

    def router_gemm(self, words: np.ndarray) -> None:
        self._moe_check(words, Op.ROUTER_GEMM)
        self._splitk(words, Op.ROUTER_GEMM, "x_norm", "X_SLOT",
                     lambda layer: self.st.w("w_router")[self._slot(layer)], "router_part")

    def _dense_check(self, words, op) -> None:
        for layer in np.unique(words[:, H.LAYER]):
            if not 0 <= layer < self.geo.num_layers or self.geo.ffn[int(layer)] != "dense":
                raise BadTaskError(f"{op.name} on layer {int(layer)}, which has no dense FFN", layer=int(layer))

    def _moe_check(self, words, op) -> None:
        for layer in np.unique(words[:, H.LAYER]):
            if not 0 <= layer < self.geo.num_layers or self.geo.ffn[int(layer)] != "moe":
                raise BadTaskError(f"{op.name} on layer {int(layer)}, which has no MoE FFN", layer=int(layer))

    def ffn_upgate_act(self, words: np.ndarray) -> None:
        op, st, geo = Op.FFN_UPGATE_ACT, self.st, self.geo
        chunk = st.weights.chunk

        def build(words):
            self._dense_check(words, op)
            groups = []
            for (layer, k0, kl, xs), ti in self._groups(words, op, ("K0", "K_LEN", "X_SLOT")):
                if k0 != 0 or kl != geo.hidden:
                    raise BadTaskError("FFN_UPGATE_ACT: the SiLU*up epilogue needs the whole K range", layer=layer)
                w = words[ti]
                n0, nl, out0 = fld(w, op, "N0"), fld(w, op, "N_LEN"), fld(w, op, "OUT0")
                self._check_n(op, n0, nl, 2 * geo.dense_width)
                h = nl // 2
                if (nl % 2).any() or (n0 != 2 * out0).any() or (out0 % chunk).any() or \
                        (h != np.minimum(chunk, geo.dense_width - out0)).any():
                    raise BadTaskError(f"FFN_UPGATE_ACT: tile does not match the gate/up interleave (chunk {chunk})",
                                       layer=layer)
                groups.append((layer, kl, self._x_slot(op, xs, layer),
                               [(int(a), int(b)) for a, b in zip(out0, out0 + h)],
                               _idx(_cols(n0, h)), _idx(_cols(n0 + h, h)), _as_slice(_cols(out0, h))))
            return groups

        buf = st["ffn_act"]
        for layer, kl, xs, ranges, g, u, oc in self._plan(op.name, words, build):
            self.tr.read("x_norm", (xs, slice(None), slice(None)))
            Y = self._products((op, layer, 0, kl), "x_norm", (xs,), 0, kl, st.w("w_upgate")[self._slot(layer)])
            for a, b in ranges:
                self.tr.write("ffn_act", (layer, slice(None), slice(a, b)))
            buf[layer, :, oc] = (F.silu(Y[:, g]) * Y[:, u]).to(buf.dtype)

    def lm_head(self, words: np.ndarray) -> None:
        op, st, geo = Op.LM_HEAD, self.st, self.geo
        W = st.w("w_lm_head")
        bn = geo.lm_bn
        for (layer, k0, kl), ti in self._groups(words, op, ("K0", "K_LEN")):
            if k0 != 0 or kl != geo.hidden:
                raise BadTaskError("LM_HEAD: needs the whole K range (logits have no split slots)", layer=layer)
            w = words[ti]
            n0, nl = fld(w, op, "N0"), fld(w, op, "N_LEN")
            self._check_n(op, n0, nl, geo.vocab)
            xs = geo.final_norm_slot
            self.tr.read("x_norm", (xs, slice(None), slice(None)))
            Y = self._products((op, layer, 0, kl), "x_norm", (xs,), 0, kl, W)
            logits, amax = st["logits"], st["argmax_part"]
            for a, b in zip(n0, n0 + nl):
                self.tr.write("logits", (slice(None), slice(int(a), int(b))))
                self.tr.write("argmax_part", (slice(None), slice(int(a) // bn, -(-int(b) // bn))))
            cols = _as_slice(_cols(n0, nl))
            logits[:, cols] = Y[:, cols]
            # one argmax record per vocab tile over the stored logits, by the
            # ABI's greedy rule (abi.argmax_select); the short last tile is
            # padded with -inf at higher indices, which never win
            tiles = np.unique(np.concatenate([np.arange(int(a) // bn, -(-int(b) // bn)) for a, b in
                                              zip(n0, n0 + nl)]))
            for t0, t1 in _ranges(tiles):
                c0, c1 = t0 * bn, min(t1 * bn, geo.vocab)
                seg = logits[:, c0:c1].numpy()
                pad = (t1 - t0) * bn - (c1 - c0)
                if pad:
                    seg = np.concatenate([seg, np.full((seg.shape[0], pad), -np.inf, dtype=np.float32)], axis=1)
                seg = seg.reshape(seg.shape[0], t1 - t0, bn)
                cols = np.arange(t0 * bn, t1 * bn).reshape(t1 - t0, bn)
                pos = abi.argmax_select(seg, cols)
                rec = amax[:, t0:t1].numpy()
                rec[..., 0] = np.take_along_axis(seg, pos[..., None], axis=-1)[..., 0].view(np.int32)
                rec[..., 1] = cols[:, 0] + pos

    # ---------------------------------------------------------------- norm
    def add_rmsnorm(self, words: np.ndarray) -> None:
        op, st, geo = Op.ADD_RMSNORM, self.st, self.geo

        def build(words):
            groups = []
            for (layer, na, nf, gamma, flags), ti in self._groups_norm(words):
                rows = fld(words[ti], op, "ROW")
                if ((rows < 0) | (rows >= self.R)).any() or not 0 <= gamma < geo.norm_slots:
                    raise BadTaskError("ADD_RMSNORM: ROW or GAMMA out of range", layer=layer)
                parts = []
                if flags & Flag.ADD_ATTN:
                    if not 0 <= na <= st["o_part"].shape[1]:
                        raise BadTaskError("ADD_RMSNORM: ATTN_SPLITS outside o_part", layer=layer)
                    parts += [("o_part", sp) for sp in range(na)]
                if flags & Flag.ADD_FFN:
                    if not 0 <= nf <= st["ffn_part"].shape[1]:
                        raise BadTaskError("ADD_RMSNORM: FFN_SPLITS outside ffn_part", layer=layer)
                    parts += [("ffn_part", sp) for sp in range(nf)]
                groups.append((layer, gamma, [int(r) for r in rows], _as_slice(rows), parts))
            return groups

        for layer, gamma, rows, rs, parts in self._plan(op.name, words, build):
            for r in rows:
                self.tr.read("x_resid", (r, slice(None)))
            x = st["x_resid"][rs]
            for name, sp in parts:
                for r in rows:
                    self.tr.read(name, (layer, sp, r, slice(None)))
                x = x + st[name][layer, sp, rs]
            for r in rows:
                self.tr.write("x_resid", (r, slice(None)))
                self.tr.write("x_norm", (gamma, r, slice(None)))
            st["x_resid"][rs] = x
            st["x_norm"][gamma, rs] = self.rms_norm(x, gamma)

    def _groups_norm(self, words):
        return self._groups(words, Op.ADD_RMSNORM, ("ATTN_SPLITS", "FFN_SPLITS", "GAMMA"), flags=True)

    def rms_norm(self, x: torch.Tensor, gamma: int) -> torch.Tensor:
        """``w * round(x * rsqrt(mean(x^2) + eps))`` (fp32 statistics, act dtype out)."""
        act = self.st.act
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        g = self.st["w_norm"][gamma]
        return (g * y.to(act)).to(act)

    # ---------------------------------------------------------------- routing
    def router_topk(self, words: np.ndarray) -> None:
        op, st, geo = Op.ROUTER_TOPK, self.st, self.geo
        self._moe_check(words, op)
        K = geo.top_k
        for (layer, nsp, flags), ti in self._groups_flags(words, op, ("NUM_SPLITS",)):
            rows = fld(words[ti], op, "ROW")
            if not 1 <= nsp <= st["router_part"].shape[1]:
                raise BadTaskError("ROUTER_TOPK: NUM_SPLITS outside router_part", layer=layer)
            rt = _idx(rows)
            for r in rows:
                self.tr.read("router_part", (layer, slice(0, nsp), int(r), slice(None)))
            logit = routing.sum_splits(st["router_part"][layer, :nsp][:, rt])
            ids, wts = routing.topk(logit, K, softmax=bool(flags & Flag.SOFTMAX_ROUTER),
                                    renormalize=bool(flags & Flag.RENORMALIZE))
            for r in rows:
                self.tr.write("topk_ids", (layer, int(r), slice(None)))
                self.tr.write("topk_w", (layer, int(r), slice(None)))
            st["topk_ids"][layer, rt] = ids.to(torch.int32)
            st["topk_w"][layer, rt] = wts

    def _groups_flags(self, words, op, keys):
        return self._groups(words, op, keys, flags=True)

    def route_finalize(self, words: np.ndarray) -> None:
        op, st, geo = Op.ROUTE_FINALIZE, self.st, self.geo
        self._moe_check(words, op)
        E, K = geo.experts, geo.top_k
        for i in range(len(words)):
            w = words[i: i + 1]
            layer = int(w[0, H.LAYER])
            n = int(fld(w, op, "NUM_ROWS")[0])
            up_t, down_t = int(fld(w, op, "UP_TILES")[0]), int(fld(w, op, "DOWN_TILES")[0])
            uq, dq = queue_buffer(fld(w, op, "UP_QUEUE")[0]), queue_buffer(fld(w, op, "DOWN_QUEUE")[0])
            uw, dw = int(fld(w, op, "UP_COUNT_WORD")[0]), int(fld(w, op, "DOWN_COUNT_WORD")[0])
            if not 0 <= n <= self.R:
                raise BadTaskError("ROUTE_FINALIZE: NUM_ROWS outside the batch", layer=layer)
            for word in (uw, dw):
                if not self.st.tw.host_words <= word < len(self.targets):
                    raise BadTaskError(f"ROUTE_FINALIZE: count word {word} outside the device target words",
                                       layer=layer)
            self.tr.read("topk_ids", (layer, slice(0, n), slice(None)))
            flat = st.np["topk_ids"][layer, :n].reshape(-1).astype(np.int64)
            if ((flat < 0) | (flat >= E)).any():
                raise BadTaskError("ROUTE_FINALIZE: expert id out of range", layer=layer, buffer="topk_ids")
            route = routing.finalize(flat.reshape(n, K), E)
            self.tr.write("route_slot", (layer, slice(0, n), slice(None)))
            st.np["route_slot"][layer, :n] = route.slot
            for qname, tiles, word in ((uq, up_t, uw), (dq, down_t, dw)):
                recs = routing.queue_records(route, tiles)
                qb = st.np[qname]
                if len(recs) > qb.shape[1]:
                    raise QueueOverflowError(f"ROUTE_FINALIZE layer {layer}: {len(recs)} records for "
                                             f"{qname} (capacity {qb.shape[1]})", layer=layer, buffer=qname)
                self.tr.write(qname, (layer, slice(0, len(recs))))
                self.tr.write("targets", (word,))
                qb[layer, : len(recs)] = recs
                self.targets[word] = len(recs)

    def moe_gather(self, words: np.ndarray) -> None:
        op, st = Op.MOE_GATHER, self.st
        self._moe_check(words, op)
        for (layer, xs), ti in self._groups(words, op, ("X_SLOT",)):
            rows = fld(words[ti], op, "ROW")
            xs = self._x_slot(op, xs, layer)
            for r in rows:
                self.tr.read("route_slot", (layer, int(r), slice(None)))
                self.tr.read("x_norm", (xs, int(r), slice(None)))
            slots = st.np["route_slot"][layer, rows].astype(np.int64)  # [m, K]
            if ((slots < 0) | (slots >= st["moe_x"].shape[1])).any():
                raise BadTaskError("MOE_GATHER: routed slot out of range", layer=layer, buffer="route_slot")
            for j in range(len(rows)):
                self.tr.write("moe_x", (layer, slots[j], slice(None)))
            x = st["x_norm"][xs, _idx(rows)]  # [m, D]
            st["moe_x"][layer, _idx(slots.reshape(-1))] = x.repeat_interleave(slots.shape[1], dim=0)

    def moe_combine(self, words: np.ndarray) -> None:
        op, st = Op.MOE_COMBINE, self.st
        self._moe_check(words, op)
        for (layer,), ti in self._groups(words, op, ()):
            rows = fld(words[ti], op, "ROW")
            for r in rows:
                self.tr.read("route_slot", (layer, int(r), slice(None)))
                self.tr.read("topk_w", (layer, int(r), slice(None)))
            slots = st.np["route_slot"][layer, rows].astype(np.int64)
            if ((slots < 0) | (slots >= st["moe_out"].shape[1])).any():
                raise BadTaskError("MOE_COMBINE: routed slot out of range", layer=layer, buffer="route_slot")
            for j in range(len(rows)):
                self.tr.read("moe_out", (layer, slots[j], slice(None)))
            wts = st["topk_w"][layer, _idx(rows)]  # [m, K]
            y = st["moe_out"][layer][_idx(slots)]  # [m, K, D]
            acc = routing.combine(wts, y)
            for r in rows:
                self.tr.write("ffn_part", (layer, 0, int(r), slice(None)))
            st["ffn_part"][layer, 0, _idx(rows)] = acc

    # ---------------------------------------------------------------- claimers
    def drain(self, words: np.ndarray) -> None:
        """Claimer tasks (fast mode): the first claimer of a queue claims every
        record (an atomic cursor that one claimer happens to win every time);
        the others find the queue empty (each claims one index past the end)."""
        op = Op(int(words[0, H.OPCODE]))
        key = np.stack([words[:, fi(op, "QUEUE")], words[:, H.LAYER]], axis=1).astype(np.int64)
        heads = self.st.queue_heads
        for (q, layer), ti in _group_rows(key):
            cw = words[ti[0]]
            qlen = self.value(cw[fi(op, "QUEUE_LEN")])
            head = int(heads[q, layer])
            heads[q, layer] = max(head, qlen) + len(ti)
            if head < qlen:
                recs = self.queue_records(q, layer, head, qlen)
                if self.on_claimed is not None:
                    self.on_claimed(cw, recs)
                self.claimed(cw, recs)

    def queue_records(self, queue: int, layer: int, lo: int, hi: int) -> np.ndarray:
        name = queue_buffer(queue)
        qb = self.st.np[name]
        if Queue(queue) == Queue.ATTN:
            if hi > qb.shape[0]:
                raise QueueOverflowError(f"attention queue length {hi} > capacity {qb.shape[0]}", buffer=name)
            self.tr.read(name, (slice(lo, hi),))
            return qb[lo:hi].astype(np.int64)
        if hi > qb.shape[1]:
            raise QueueOverflowError(f"{name} layer {layer}: length {hi} > capacity {qb.shape[1]}",
                                     layer=layer, buffer=name)
        self.tr.read(name, (layer, slice(lo, hi)))
        return qb[layer, lo:hi].astype(np.int64)

    def claimed(self, cw: np.ndarray, recs: np.ndarray) -> None:
        """Run claimed records ``recs [m, 4]`` of claimer ``cw``."""
        op = Op(int(cw[H.OPCODE]))
        layer = int(cw[H.LAYER])
        if len(recs) == 0:
            return
        if op == Op.ATTN_DRAIN:
            Q = Queue.ATTN
            window = int(cw[fi(op, "WINDOW")])
            self._attend(layer, rec(recs, Q, "ROW"), rec(recs, Q, "KV_HEAD"), rec(recs, Q, "SPLIT"),
                         rec(recs, Q, "NUM_SPLITS"), window)
        elif op == Op.MOE_UPGATE_DRAIN:
            self._moe_check(cw[None, :], op)
            self._moe_up(layer, int(cw[fi(op, "N_LEN")]), recs)
        elif op == Op.MOE_DOWN_DRAIN:
            self._moe_check(cw[None, :], op)
            self._moe_down(layer, int(cw[fi(op, "N_LEN")]), recs)
        else:
            raise BadTaskError(f"{op.name} is not a claimer")

    def _moe_rows(self, recs, Q, layer):
        e, t = rec(recs, Q, "EXPERT"), rec(recs, Q, "N_TILE")
        s0, nr = rec(recs, Q, "SLOT0"), rec(recs, Q, "ROWS")
        cap = self.st["moe_x"].shape[1]
        if ((e < 0) | (e >= self.geo.experts) | (s0 < 0) | (nr < 0) | (s0 + nr > cap) | (t < 0)).any():
            raise BadTaskError(f"{Q.name} record out of range", layer=layer)
        return e, t, s0, nr

    def _moe_up(self, layer: int, nlen: int, recs: np.ndarray) -> None:
        st, geo = self.st, self.geo
        ew = geo.expert_width
        if nlen != 2 * st.weights.moe_chunk:
            raise BadTaskError(f"MOE_UPGATE_DRAIN: N_LEN {nlen} does not match the expert gate/up interleave "
                               f"(chunk {st.weights.moe_chunk})", layer=layer)
        W = st.w("w_moe_upgate")[self._slot(layer)]  # [E, 2ew, D]
        e, t, s0, nr = self._moe_rows(recs, Queue.MOE_UP, layer)
        act = st["moe_act"]
        for i in range(len(recs)):
            n0 = int(t[i]) * nlen
            n1 = min(n0 + nlen, 2 * ew)
            if n0 >= n1:
                raise BadTaskError(f"MOE_UPGATE_DRAIN: N_TILE {int(t[i])} outside the expert", layer=layer)
            h, c0 = (n1 - n0) // 2, n0 // 2
            slots = range(int(s0[i]), int(s0[i] + nr[i]))
            self.tr.read("moe_x", (layer, slice(int(s0[i]), int(s0[i] + nr[i])), slice(None)))
            for s in slots:
                y = self._slot_product(("moe_up", layer, int(e[i]), s), "moe_x", layer, s, W[int(e[i])])
                act[layer, s, c0:c0 + h] = (F.silu(y[n0:n0 + h]) * y[n0 + h:n1]).to(act.dtype)
            self.tr.write("moe_act", (layer, slice(int(s0[i]), int(s0[i] + nr[i])), slice(c0, c0 + h)))

    def _moe_down(self, layer: int, nlen: int, recs: np.ndarray) -> None:
        st, geo = self.st, self.geo
        W = st.w("w_moe_down")[self._slot(layer)]  # [E, D, ew]
        e, t, s0, nr = self._moe_rows(recs, Queue.MOE_DOWN, layer)
        out = st["moe_out"]
        for i in range(len(recs)):
            n0 = int(t[i]) * nlen
            n1 = min(n0 + nlen, geo.hidden)
            if n0 >= n1:
                raise BadTaskError(f"MOE_DOWN_DRAIN: N_TILE {int(t[i])} outside the hidden size", layer=layer)
            self.tr.read("moe_act", (layer, slice(int(s0[i]), int(s0[i] + nr[i])), slice(None)))
            for s in range(int(s0[i]), int(s0[i] + nr[i])):
                y = self._slot_product(("moe_down", layer, int(e[i]), s), "moe_act", layer, s, W[int(e[i])])
                out[layer, s, n0:n1] = y[n0:n1]
            self.tr.write("moe_out", (layer, slice(int(s0[i]), int(s0[i] + nr[i])), slice(n0, n1)))

    def _slot_product(self, key, xbuf: str, layer: int, slot: int, W: torch.Tensor) -> torch.Tensor:
        y = self.cache.get(key)
        if y is None:
            x = self.st[xbuf][layer, slot]
            xr = torch.empty((1, x.shape[0]), dtype=torch.float32)
            xr.copy_(x)
            y = F.linear(xr, W)[0]
            self.cache[key] = y
        return y


__all__ = ["BadTaskError", "NULL_TRACKER", "NullTracker", "Ops", "QueueOverflowError", "VMError", "fld",
           "queue_buffer", "rec", "rope"]

"""The GEMM family: QKV_PROJ, O_PROJ, FFN_UPGATE_ACT, FFN_DOWN, ROUTER_GEMM,
LM_HEAD. One task is one tile ``Y[rows, N0:N0+N_LEN] = X[rows, K0:K0+K_LEN] .
W[N0:N0+N_LEN, K0:K0+K_LEN]^T`` with an opcode-specific epilogue.

Shared fields (``abi._GEMM``): N0, N_LEN, K0, K_LEN, SPLIT.

CPU numerics: every tile is a slice of one per-row product (op, layer, K
range, row) computed once per step by the VM (``VM.products``), so tasks
grouped any way give the same bits. Split-K partials are fp32, reduced by
their consumer in split order.

Device: ``opcodes/gemm_tile.cuh`` (the tiny-M MMA tile over tiled weights)
with the epilogues of ``opcodes/gemm_epilogues.cuh``.
"""

from __future__ import annotations

import numpy as np
import torch.nn.functional as F

from megac import abi
from megac.abi import Flag, H, Op
from megac.errors import BadTaskError
from megac.ops.attention import _context, layer_splits, merge_splits
from megac.ops.base import BF16, BIG, FP32, KV_PIECE, Limits, OpDef, at, bound, field, resolve_dyn, span, summed
from megac.ops.cpu import as_slice, cast, cols, idx, ranges, rotate
from megac.ops.norm import (combine_in_access, combine_in_input, combine_in_of, norm_in_access, norm_in_input,
                             norm_in_of, norm_in_rules)


class _ColumnStore:
    """``dst[:, cs] = Y[:, cs]`` for one plane ``dst [R, N]``, columns ``cs``
    (a slice or an index tensor) and products ``Y [R, n]``, with the views
    taken once."""

    def __init__(self, dst, cs, n: int) -> None:
        self.dst, self.cs = dst, cs
        sliced = isinstance(cs, slice)
        #: every column of a [R, n] product lands in a plane as wide: a plain copy
        self.whole = sliced and cs == slice(0, n) and n == dst.shape[1]
        self.view = dst[:, cs] if sliced else None

    def __call__(self, Y) -> None:
        if self.whole:
            self.dst.copy_(Y)
        elif self.view is not None:
            self.view.copy_(Y[:, self.cs])
        else:
            self.dst[:, self.cs] = Y[:, self.cs]


class GemmOp(OpDef):
    """What every GEMM-like opcode shares: the N/K/SPLIT fields, their rules,
    the bytes of a tile."""

    header = "gemm_tile.cuh"
    #: bytes of one output element the tile stores (fp32 partials unless overridden)
    out_bytes_per_n: float = FP32

    def dims(self, geo) -> tuple[int, int]:
        """(N, K) of the whole weight of one layer."""
        raise NotImplementedError

    def split_slots(self, lim: Limits) -> int:
        """Partial slots SPLIT may index."""
        return BIG

    def check_tiles(self, F_, geo):
        n_dim, k_dim = self.dims(geo)
        if np.any(F_["N0"] < 0) or np.any(F_["N_LEN"] < 1) or np.any(F_["N0"] + F_["N_LEN"] > n_dim):
            return f"N range outside [0, {n_dim})"
        if np.any(F_["K0"] < 0) or np.any(F_["K_LEN"] < 1) or np.any(F_["K0"] + F_["K_LEN"] > k_dim):
            return f"K range outside [0, {k_dim})"
        return None

    def field_rules(self, lim):
        op = self.op
        n_total, k_total = self.dims(lim.geo)
        return [
            ("N0", 0, n_total, False),
            ("N_LEN", 1, n_total + 1, False),
            (summed(op, "N0", "N_LEN"), 1, n_total + 1, False),
            ("K0", 0, k_total, False),
            ("K_LEN", 1, k_total + 1, False),
            (summed(op, "K0", "K_LEN"), 1, k_total + 1, False),
            ("SPLIT", 0, self.split_slots(lim), False),
        ]

    def task_bytes(self, w, geo, params):
        nl, kl = field(w, self.op, "N_LEN"), field(w, self.op, "K_LEN")
        return nl * kl * BF16 + geo.rows * kl * BF16 + geo.rows * self.out_elem(nl)

    def out_elem(self, nl: np.ndarray) -> np.ndarray:
        return FP32 * nl

    # -- CPU helpers ---------------------------------------------------------
    def run_splitk(self, vm, words, xbuf: str, xslot, W_of, out: str, track_x: bool = True) -> None:
        """Split-K partial GEMM tiles: ``out[layer, split, :, n0:n0+nl]`` (fp32).
        ``xslot``: the input slot as a function of the layer, or the name of
        the field that holds it; ``track_x`` False: the caller reported what
        the input was made from (a merging O_PROJ)."""
        op = self.op
        by_field = isinstance(xslot, str)

        def build(words):
            if self.ffn_kind:
                vm.require_ffn(words, self)
            groups = []
            keys = ("K0", "K_LEN", "SPLIT") + ((xslot,) if by_field else ())
            fold_ok = xbuf == "x_norm"  # NORM_IN: only an x_norm input folds its norm
            for key, ti in vm.groups(words, op, keys):
                layer, k0, kl, split = key[:4]
                xs = vm.x_slot(op, key[4], layer) if by_field else xslot(layer)
                W = W_of(layer)
                vm.check_k(op, k0, kl, W.shape[1])
                n0, nl = field(words[ti], op, "N0"), field(words[ti], op, "N_LEN")
                vm.check_n(op, n0, nl, W.shape[0])
                if not 0 <= split < vm.st[out].shape[1]:
                    raise BadTaskError(f"{op.name}: SPLIT {split} outside the {out} buffer "
                                       f"({vm.st[out].shape[1]} slots)", layer=layer)
                rngs = [(int(a), int(b)) for a, b in zip(n0, n0 + nl)]
                fold = norm_in_of(vm, op, words[ti]) if fold_ok else None
                comb = combine_in_of(vm, op, words[ti]) if fold_ok else None
                groups.append((layer, k0, kl, split, xs, rngs, W, _ColumnStore(vm.st[out][layer, split],
                                                                                as_slice(cols(n0, nl)), W.shape[0]),
                               fold, comb))
            return groups

        for layer, k0, kl, split, xs, rngs, W, store, fold, comb in vm.plan(op.name, words, build):
            xb = xbuf
            if comb is not None:
                xb = combine_in_input(vm, self, xs, comb, k0, kl)
            elif fold is not None:
                xb = norm_in_input(vm, xs, fold, self)
            elif vm.tracking and track_x:
                vm.tr.read(xbuf, (xs, slice(None), slice(k0, k0 + kl)))
            if vm.tracking:
                for a, b in rngs:
                    vm.tr.write(out, (layer, split, slice(None), slice(a, b)))
            store(vm.products((op, layer, k0, kl), xb, (xs,), k0, kl, W))


class QkvProj(GemmOp):
    """One head tile of the fused Q/K/V projection; RoPE on flagged heads;
    K/V of active rows appended to the paged cache at ``seq_pos``."""

    op = Op.QKV_PROJ
    node_kinds = ("qkv",)
    device_fn = "qkv_proj"
    weights_fn = "qkv_proj_weights"

    def dims(self, geo):
        return geo.qkv_width, geo.hidden

    def flags(self, nt, geo):
        flags = np.zeros(nt.n, dtype=np.int64)
        if geo.rope[nt.layer]:
            f = Flag.ROPE | (Flag.ROPE_HALF if geo.rope_half else 0)
            flags[nt.fields["PART"] != abi.QkvPart.V] = int(f)
        if geo.folded(nt.layer):
            flags |= int(Flag.NORM_IN)
        if geo.qkv_combined(nt.layer):  # the fold adds the MoE combine itself (qkv_combine)
            flags |= int(Flag.ADD_MOE)
        return flags

    def check_tiles(self, F_, geo):
        problem = super().check_tiles(F_, geo)
        if problem is None and np.any((F_["N0"] < geo.q_width) & (F_["N0"] + F_["N_LEN"] > geo.q_width)):
            return "a QKV tile straddles the Q/KV boundary"
        return problem

    def field_rules(self, lim):
        geo = lim.geo

        def head_hi(sub):
            return np.where(sub[:, abi.field_index(Op.QKV_PROJ, "PART")] == abi.QkvPart.Q, geo.num_heads,
                            geo.kv_heads)

        return super().field_rules(lim) + [("PART", 0, 3, False), ("HEAD", 0, head_hi, False)] + norm_in_rules(lim)

    def out_elem(self, nl):
        return BF16 * nl

    def access(self, acc, w, ix, layer, geo):
        n0, nl = field(w, self.op, "N0"), field(w, self.op, "N_LEN")
        k0, kl = field(w, self.op, "K0"), field(w, self.op, "K_LEN")
        R = geo.rows
        norm_in_access(acc, self.op, w, ix, geo, layer, k0, kl)
        isq = n0 < geo.q_width
        acc.add("q", True, ix[isq], at(layer[isq]), span(R), (n0[isq], n0[isq] + nl[isq]))
        kv = ~isq
        off = n0[kv] - geo.q_width
        acc.add("kv_new", True, ix[kv], at(layer[kv]), span(R), (off, off + nl[kv]))

    def run(self, vm, words):
        op, geo, st = self.op, vm.geo, vm.st
        hd, nq, nkv = vm.hd, geo.num_heads, geo.kv_heads

        def build(words):
            groups = []
            for (layer, k0, kl), ti in vm.groups(words, op, ("K0", "K_LEN")):
                if k0 != 0 or kl != geo.hidden:
                    raise BadTaskError("QKV_PROJ: the RoPE / KV epilogue needs the whole K range (no split-K)",
                                       opcode=int(op), layer=layer)
                w = words[ti]
                n0, nl = field(w, op, "N0"), field(w, op, "N_LEN")
                vm.check_n(op, n0, nl, geo.qkv_width)
                flags = w[:, H.FLAGS].astype(np.int64)
                fold = norm_in_of(vm, op, w)
                if (n0 % hd).any() or (nl % hd).any():
                    groups.append(self._part_head_group(vm, layer, kl, n0, nl, flags) + (fold,))
                    continue
                heads = cols(n0 // hd, nl // hd)
                hflags = np.repeat(flags, nl // hd)
                ropes = []
                ropem = ((hflags & Flag.ROPE) != 0) & (heads < nq + nkv)
                for half in (False, True):
                    sel = ropem & (((hflags & Flag.ROPE_HALF) != 0) == half)
                    if sel.any():
                        ropes.append((half, as_slice(np.flatnonzero(sel))))
                isq = heads < nq
                q = None
                if isq.any():
                    qh = heads[isq]
                    q = ([(int(h) * hd, (int(h) + 1) * hd) for h in qh], as_slice(qh),
                         as_slice(np.flatnonzero(isq)))
                kvp = []
                for part, pool in ((0, "k_pool"), (1, "v_pool")):
                    sel = (heads >= nq + part * nkv) & (heads < nq + (part + 1) * nkv)
                    if sel.any():
                        kvh = heads[sel] - nq - part * nkv
                        kvp.append((pool, kvh, as_slice(kvh), as_slice(np.flatnonzero(sel))))
                groups.append((layer, kl, as_slice(heads), ropes, q, kvp, st.w("w_qkv")[layer],
                               st["q"][layer].view(vm.R, nq, hd), fold))
            return groups

        for g in vm.plan(op.name, words, build):
            if g[0] == "part":
                self._run_part_heads(vm, g)
                continue
            layer, kl, hsel, ropes, q, kvp, W, qv, fold = g
            Y = vm.products((op, layer, 0, kl), self._input(vm, layer, fold), (layer,), 0, kl, W)
            vals = Y.view(vm.R, geo.qkv_width // hd, hd)[:, hsel].clone()  # [R, m, hd] fp32
            if ropes:
                c, s = vm.rope_table()
                for half, si in ropes:
                    vals[:, si] = rotate(vals[:, si], c, s, half)
            if q is not None:
                rngs, dst, src = q
                if vm.tracking:
                    for a, b in rngs:
                        vm.tr.write("q", (layer, slice(None), slice(a, b)))
                qv[:, dst] = cast(vals[:, src], qv.dtype)
            if kvp:
                self.append_kv(vm, layer, vals, kvp)

    # Tiles that hold part of a head (target tile qkv_bn < head_dim): each
    # touched head is computed whole (RoPE of a whole head gives every pair
    # the value the tile's own rotation gives: interleaved pairs are adjacent
    # columns inside the tile) and only the tiles' columns are written.
    def _part_head_group(self, vm, layer: int, kl: int, n0, nl, flags):
        op, geo, hd = self.op, vm.geo, vm.hd
        nq, nkv = geo.num_heads, geo.kv_heads
        if ((n0 % hd) + nl > hd).any():
            raise BadTaskError("QKV_PROJ: a tile must hold whole heads or lie inside one head", opcode=int(op),
                               layer=layer)
        if ((flags & Flag.ROPE_HALF) != 0).any():
            raise BadTaskError("QKV_PROJ: a half-style RoPE tile must hold whole heads", opcode=int(op), layer=layer)
        cover = np.zeros((geo.qkv_width // hd, hd), dtype=bool)
        hflag = np.full(geo.qkv_width // hd, -1, dtype=np.int64)
        for a, n, f in zip(n0.tolist(), nl.tolist(), flags.tolist()):
            h = a // hd
            cover[h, a % hd:a % hd + n] = True
            if hflag[h] not in (-1, f):
                raise BadTaskError("QKV_PROJ: the tiles of one head disagree on RoPE", opcode=int(op), layer=layer)
            hflag[h] = f
        heads = np.flatnonzero(cover.any(axis=1))
        rope = {int(h) for h in heads if (hflag[h] & Flag.ROPE) and h < nq + nkv}
        # per touched head: its covered column runs [lo, hi)
        runs = []
        for h in heads.tolist():
            c = np.flatnonzero(cover[h])
            cuts = np.flatnonzero(np.diff(c) != 1) + 1
            runs.append((h, [(int(r[0]), int(r[-1]) + 1) for r in np.split(c, cuts)]))
        return ("part", layer, kl, rope, runs, vm.st.w("w_qkv")[layer], vm.st["q"][layer].view(vm.R, nq, hd))

    def _input(self, vm, layer: int, fold) -> str:
        """The buffer a layer's tiles read their input from: x_norm, or with
        NORM_IN the folded norm's output (``norm_in_input``)."""
        if fold is not None:
            return norm_in_input(vm, layer, fold, self)
        if vm.tracking:
            vm.tr.read("x_norm", (layer, slice(None), slice(None)))
        return "x_norm"

    def _run_part_heads(self, vm, g) -> None:
        _, layer, kl, rope, runs, W, qv, fold = g
        geo, hd = vm.geo, vm.hd
        nq, nkv = geo.num_heads, geo.kv_heads
        Y = vm.products((self.op, layer, 0, kl), self._input(vm, layer, fold), (layer,), 0, kl, W)
        allv = Y.view(vm.R, geo.qkv_width // hd, hd)
        for h, segs in runs:
            vals = allv[:, h].clone()  # [R, hd] fp32
            if h in rope:
                c, s = vm.rope_table()
                vals = rotate(vals[:, None], c, s, False)[:, 0]
            if h < nq:
                for lo, hi in segs:
                    if vm.tracking:
                        vm.tr.write("q", (layer, slice(None), slice(h * hd + lo, h * hd + hi)))
                    qv[:, h, lo:hi] = cast(vals[:, lo:hi], qv.dtype)
                continue
            pool = "k_pool" if h < nq + nkv else "v_pool"
            kvh = h - nq - (0 if h < nq + nkv else nkv)
            for lo, hi in segs:
                self.append_kv(vm, layer, vals[:, None], [(pool, kvh, kvh, 0)], cols=(lo, hi))

    @staticmethod
    def append_kv(vm, layer: int, vals, kvp, cols: tuple[int, int] | None = None) -> None:
        """K / V heads ``vals[:, src]`` -> the paged pools at each active row's
        current position; ``cols``: only the head columns [lo, hi) (a QKV
        tile of part of a head)."""
        st = vm.st
        active, seq_pos = st.np["row_active"], st.np["seq_pos"]
        d = slice(None) if cols is None else slice(*cols)
        for r in range(vm.R):
            if not active[r]:
                continue
            blk, off = vm.kv_slot(layer, r, int(seq_pos[r]))
            for pool, kvh, dst, src in kvp:
                if vm.tracking:
                    vm.tr.write(pool, (blk, off, kvh) if cols is None else
                                (blk, off, kvh, slice(cols[0] // KV_PIECE, -(-cols[1] // KV_PIECE))))
                P = st[pool]
                P[blk, off, dst, d] = cast(vals[r, src, d], P.dtype)


class OProj(GemmOp):
    """One N tile of one split-K slice (= one KV head's query heads) of the
    output projection: fp32 partial ``o_part[layer, split]``. Its input is
    ``attn_out``, or, with MERGE_SPLITS (o_proj_merge, one row), the KV head's
    attention partials merged here exactly as ATTN_COMBINE merges them."""

    op = Op.O_PROJ
    node_kinds = ("o_proj",)
    device_fn = "o_proj"
    weights_fn = "o_proj_weights"

    def dims(self, geo):
        return geo.hidden, geo.q_width

    def split_slots(self, lim):
        return max(lim.geo.kv_heads, 1)

    def field_rules(self, lim):
        return super().field_rules(lim) + [("MERGE_SPLITS", 0, lim.geo.max_splits + 1, True)]

    def check_tiles(self, F_, geo):
        bad = super().check_tiles(F_, geo)
        if bad is None and np.any(F_["MERGE_SPLITS"] != 0):
            kw = geo.heads_per_kv * geo.head_dim
            if geo.rows != 1:
                return "MERGE_SPLITS in a schedule of more than one row"
            if np.any(F_["K0"] != F_["SPLIT"] * kw) or np.any(F_["K_LEN"] != kw):
                return "a merging tile's K range is not its KV head's query heads"
        return bad

    def access(self, acc, w, ix, layer, geo):
        op = self.op
        n0, nl = field(w, op, "N0"), field(w, op, "N_LEN")
        k0, kl = field(w, op, "K0"), field(w, op, "K_LEN")
        ms = field(w, op, "MERGE_SPLITS")
        m = ms != 0
        plain = ~m
        if plain.any():
            acc.add("attn_out", False, ix[plain], at(layer[plain]), span(geo.rows), (k0[plain], (k0 + kl)[plain]))
        if m.any():
            ns = bound(ms[m], geo)
            kvh = field(w, op, "SPLIT")[m]
            heads = (kvh * geo.heads_per_kv, (kvh + 1) * geo.heads_per_kv)
            acc.add("attn_o_part", False, ix[m], at(layer[m]), (0, ns), span(geo.rows), heads, span(geo.head_dim))
            acc.add("attn_lse_part", False, ix[m], at(layer[m]), (0, ns), span(geo.rows), heads)
        acc.add("o_part", True, ix, at(layer), at(field(w, op, "SPLIT")), span(geo.rows), (n0, n0 + nl))

    def task_bytes(self, w, geo, params):
        ms = field(w, self.op, "MERGE_SPLITS")
        ns = resolve_dyn(ms, layer_splits(w, geo, _context(geo, params)))  # a windowed layer's: its window's
        # a merging tile also reads its KV head's partials (o and lse, fp32)
        merged = np.where(ms != 0, ns * geo.heads_per_kv * (geo.head_dim + 1) * FP32, 0)
        return super().task_bytes(w, geo, params) + merged

    def run(self, vm, words):
        ms = field(words, self.op, "MERGE_SPLITS")
        if (ms == 0).all():
            self.run_splitk(vm, words, "attn_out", lambda layer: layer, lambda layer: vm.st.w("w_o")[layer], "o_part")
            return
        if (ms == 0).any():
            raise BadTaskError("O_PROJ: merging and plain tiles in one run")
        self._merge(vm, words)
        self.run_splitk(vm, words, "attn_out", lambda layer: layer, lambda layer: vm.st.w("w_o")[layer], "o_part",
                        track_x=False)

    def _merge(self, vm, words) -> None:
        """Each (layer, KV head) of ``words`` merged once a step into row 0 of
        ``attn_out`` (VM scratch here: no task of a merging schedule reads
        it), as ATTN_COMBINE's merge."""
        op, st = self.op, vm.st
        hd, hpk = vm.hd, vm.hpk
        if vm.R != 1:
            raise BadTaskError("O_PROJ: MERGE_SPLITS in a schedule of more than one row")
        for (layer, kvh, msw), ti in vm.groups(words, op, ("SPLIT", "MERGE_SPLITS")):
            k0, kl = field(words[ti], op, "K0"), field(words[ti], op, "K_LEN")
            if not 0 <= kvh < vm.geo.kv_heads or (k0 != kvh * hpk * hd).any() or (kl != hpk * hd).any():
                raise BadTaskError("O_PROJ: a merging tile's K range is not its KV head's query heads", layer=layer)
            n = int(vm.value(msw))
            if not 0 < n <= st["attn_o_part"].shape[1]:
                raise BadTaskError(f"O_PROJ: MERGE_SPLITS {n} outside the partial slots", layer=layer)
            hs = slice(kvh * hpk, (kvh + 1) * hpk)
            if vm.tracking:
                for _ in ti:  # every tile reads the partials
                    vm.tr.read("attn_lse_part", (layer, slice(0, n), 0, hs))
                    vm.tr.read("attn_o_part", (layer, slice(0, n), 0, hs))
            key = ("o_proj_merge", layer, kvh)
            if key in vm.cache:
                continue
            lse = st["attn_lse_part"][layer, :n, 0, hs].permute(1, 0)[None]  # [1, hpk, n]
            o = st["attn_o_part"][layer, :n, 0, hs].permute(1, 0, 2)[None]  # [1, hpk, n, hd]
            out = merge_splits(lse, o, np.array([n]))
            dst = st["attn_out"][layer, 0, kvh * hpk * hd:(kvh + 1) * hpk * hd]
            dst.copy_(cast(out[0], dst.dtype))
            vm.cache[key] = True


class FfnUpgateAct(GemmOp):
    """One tile of the dense gate+up GEMM (gate/up rows interleaved in chunks
    of N_LEN/2) with the SiLU(gate)*up epilogue into ``ffn_act``."""

    op = Op.FFN_UPGATE_ACT
    node_kinds = ("ffn_upgate",)
    ffn_kind = "dense"
    device_fn = "ffn_upgate_act"
    weights_fn = "ffn_upgate_act_weights"

    def dims(self, geo):
        return 2 * geo.dense_width, geo.hidden

    def field_rules(self, lim):
        if not lim.geo.dense_width:
            return None
        return super().field_rules(lim) + [("OUT0", 0, lim.geo.dense_width, False)]

    def out_elem(self, nl):
        return BF16 * nl // 2

    def access(self, acc, w, ix, layer, geo):
        k0, kl = field(w, self.op, "K0"), field(w, self.op, "K_LEN")
        nl, out0 = field(w, self.op, "N_LEN"), field(w, self.op, "OUT0")
        acc.add("x_norm", False, ix, at(field(w, self.op, "X_SLOT")), span(geo.rows), (k0, k0 + kl))
        acc.add("ffn_act", True, ix, at(layer), span(geo.rows), (out0, out0 + nl // 2))

    def run(self, vm, words):
        op, st, geo = self.op, vm.st, vm.geo
        chunk = st.weights.chunk

        def build(words):
            vm.require_ffn(words, self)
            groups = []
            for (layer, k0, kl, xs), ti in vm.groups(words, op, ("K0", "K_LEN", "X_SLOT")):
                if k0 != 0 or kl != geo.hidden:
                    raise BadTaskError("FFN_UPGATE_ACT: the SiLU*up epilogue needs the whole K range", layer=layer)
                w = words[ti]
                n0, nl, out0 = field(w, op, "N0"), field(w, op, "N_LEN"), field(w, op, "OUT0")
                vm.check_n(op, n0, nl, 2 * geo.dense_width)
                h = nl // 2
                if (nl % 2).any() or (n0 != 2 * out0).any() or (out0 % chunk).any() or \
                        (h != np.minimum(chunk, geo.dense_width - out0)).any():
                    raise BadTaskError(f"FFN_UPGATE_ACT: tile does not match the gate/up interleave (chunk {chunk})",
                                       layer=layer)
                groups.append((layer, kl, vm.x_slot(op, xs, layer),
                               [(int(a), int(b)) for a, b in zip(out0, out0 + h)],
                               idx(cols(n0, h)), idx(cols(n0 + h, h)), as_slice(cols(out0, h)),
                               st.w("w_upgate")[vm.slot(layer)], st["ffn_act"][layer]))
            return groups

        for layer, kl, xs, rngs, g, u, oc, W, dst in vm.plan(op.name, words, build):
            if vm.tracking:
                vm.tr.read("x_norm", (xs, slice(None), slice(None)))
                for a, b in rngs:
                    vm.tr.write("ffn_act", (layer, slice(None), slice(a, b)))
            Y = vm.products((op, layer, 0, kl), "x_norm", (xs,), 0, kl, W)
            dst[:, oc] = cast(F.silu(Y.index_select(1, g)) * Y.index_select(1, u), dst.dtype)


class FfnDown(GemmOp):
    """One N tile of one split-K slice of the dense down projection: fp32
    partial ``ffn_part[layer, split]``."""

    op = Op.FFN_DOWN
    node_kinds = ("ffn_down",)
    ffn_kind = "dense"
    device_fn = "ffn_down"
    weights_fn = "ffn_down_weights"

    def dims(self, geo):
        return geo.hidden, geo.dense_width

    def field_rules(self, lim):
        return super().field_rules(lim) if lim.geo.dense_width else None

    def access(self, acc, w, ix, layer, geo):
        n0, nl = field(w, self.op, "N0"), field(w, self.op, "N_LEN")
        k0, kl = field(w, self.op, "K0"), field(w, self.op, "K_LEN")
        acc.add("ffn_act", False, ix, at(layer), span(geo.rows), (k0, k0 + kl))
        acc.add("ffn_part", True, ix, at(layer), at(field(w, self.op, "SPLIT")), span(geo.rows), (n0, n0 + nl))

    def run(self, vm, words):
        self.run_splitk(vm, words, "ffn_act", lambda layer: layer,
                        lambda layer: vm.st.w("w_down")[vm.slot(layer)], "ffn_part")


class RouterGemm(GemmOp):
    """One split-K slice of the router logits: fp32 ``router_part[layer, split]``."""

    op = Op.ROUTER_GEMM
    node_kinds = ("router",)
    ffn_kind = "moe"
    device_fn = "router_gemm"
    weights_fn = "router_gemm_weights"

    def dims(self, geo):
        return geo.num_experts, geo.hidden

    def flags(self, nt, geo):
        if geo.router_combine:  # unnormalised (router_combine): the combine folded or the norm's residual
            return int(Flag.COMBINE_IN)
        return int(Flag.NORM_IN) if geo.folded(nt.layer) else 0

    def field_rules(self, lim):
        if not lim.geo.num_experts:
            return None
        # COMBINE_IN's residual form: NORM_LAYER -1
        rules = [r if r[0] != "NORM_LAYER" else ("NORM_LAYER", -1, r[2], r[3]) for r in norm_in_rules(lim)]
        return super().field_rules(lim) + rules

    def access(self, acc, w, ix, layer, geo):
        n0, nl = field(w, self.op, "N0"), field(w, self.op, "N_LEN")
        k0, kl = field(w, self.op, "K0"), field(w, self.op, "K_LEN")
        combine_in_access(acc, self.op, w, ix, geo, field(w, self.op, "X_SLOT"), k0, kl)
        acc.add("router_part", True, ix, at(layer), at(field(w, self.op, "SPLIT")), span(geo.rows), (n0, n0 + nl))

    def run(self, vm, words):
        self.run_splitk(vm, words, "x_norm", "X_SLOT", lambda layer: vm.st.w("w_router")[vm.slot(layer)],
                        "router_part")


class LmHead(GemmOp):
    """One vocab tile of the LM head: its slice of the fp32 logits and one
    argmax record per (row, ``lm_bn`` vocab tile) by the ABI's greedy rule."""

    op = Op.LM_HEAD
    node_kinds = ("lm_head",)
    device_fn = "lm_head"
    weights_fn = "lm_head_weights"

    def dims(self, geo):
        return geo.vocab, geo.hidden

    def access(self, acc, w, ix, layer, geo):
        n0, nl = field(w, self.op, "N0"), field(w, self.op, "N_LEN")
        k0, kl = field(w, self.op, "K0"), field(w, self.op, "K_LEN")
        R = geo.rows
        acc.add("x_norm", False, ix, at(geo.final_norm_slot), span(R), (k0, k0 + kl))
        acc.add("logits", True, ix, span(R), (n0, n0 + nl))
        acc.add("argmax_part", True, ix, span(R), (n0 // geo.lm_bn, -(-(n0 + nl) // geo.lm_bn)))

    def run(self, vm, words):
        op, st, geo = self.op, vm.st, vm.geo
        bn = geo.lm_bn
        xs = geo.final_norm_slot

        def build(words):
            groups = []
            for (layer, k0, kl), ti in vm.groups(words, op, ("K0", "K_LEN")):
                if k0 != 0 or kl != geo.hidden:
                    raise BadTaskError("LM_HEAD: needs the whole K range (logits have no split slots)", layer=layer)
                w = words[ti]
                n0, nl = field(w, op, "N0"), field(w, op, "N_LEN")
                vm.check_n(op, n0, nl, geo.vocab)
                spans = [(int(a), int(b)) for a, b in zip(n0, n0 + nl)]
                tiles = np.unique(np.concatenate([np.arange(a // bn, -(-b // bn)) for a, b in spans]))
                # per run of whole vocab tiles: its columns, padding and indices
                tile_runs = []
                for t0, t1 in ranges(tiles):
                    c0, c1 = t0 * bn, min(t1 * bn, geo.vocab)
                    tile_runs.append((t0, t1, c0, c1, (t1 - t0) * bn - (c1 - c0),
                                      np.arange(t0 * bn, t1 * bn).reshape(t1 - t0, bn)))
                groups.append((layer, kl, spans, as_slice(cols(n0, nl)), tile_runs))
            return groups

        W = st.w("w_lm_head")
        logits, amax = st["logits"], st["argmax_part"]
        for layer, kl, spans, cs, tile_runs in vm.plan(op.name, words, build):
            if vm.tracking:
                vm.tr.read("x_norm", (xs, slice(None), slice(None)))
                for a, b in spans:
                    vm.tr.write("logits", (slice(None), slice(a, b)))
                    vm.tr.write("argmax_part", (slice(None), slice(a // bn, -(-b // bn))))
            Y = vm.products((op, layer, 0, kl), "x_norm", (xs,), 0, kl, W)
            logits[:, cs] = Y[:, cs]
            # one argmax record per vocab tile over the stored logits, by the
            # ABI's greedy rule (abi.argmax_select); the short last tile is
            # padded with -inf at higher indices, which never win
            for t0, t1, c0, c1, pad, cidx in tile_runs:
                seg = logits[:, c0:c1].numpy()
                if pad:
                    seg = np.concatenate([seg, np.full((seg.shape[0], pad), -np.inf, dtype=np.float32)], axis=1)
                seg = seg.reshape(seg.shape[0], t1 - t0, bn)
                pos = abi.argmax_select(seg, cidx)
                rec = amax[:, t0:t1].numpy()
                rec[..., 0] = np.take_along_axis(seg, pos[..., None], axis=-1)[..., 0].view(np.int32)
                rec[..., 1] = cidx[:, 0] + pos


GEMM_OPS = (QkvProj(), OProj(), FfnUpgateAct(), FfnDown(), RouterGemm(), LmHead())

__all__ = ["FfnDown", "FfnUpgateAct", "GEMM_OPS", "GemmOp", "LmHead", "OProj", "QkvProj", "RouterGemm"]

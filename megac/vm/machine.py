"""The VM's machine: what executing any opcode on the CPU needs, beside the
opcode's own semantics (``megac.ops``: ``OpDef.run`` / ``run_claimed``).

``VM.run(words)`` executes tasks ``words [n, 32]`` of ONE opcode (n = 1 in
checked mode; a coalesced run of consecutive tasks in fast mode) by handing
them to the opcode's definition, which reads fields exactly as the device
does (``abi.field_index``, never a literal offset) and calls back here for
the shared pieces: the per-step GEMM row products, task grouping, static
per-words plans, dynamic count values, the claim cursor, RoPE.

In checked mode every buffer access goes through ``vm.tr.read /
write(buffer, index)`` first (the happens-before tracker), so a read of data
no counter guarantees raises before the data is used; in fast mode
``vm.tracking`` is False and the ops skip those calls.

Numerics (fp32 mode: fp32 everywhere; bf16 mode: bf16 weights, activations
and KV, fp32 accumulation, partials and softmax, one rounding at each store),
chosen so that a result depends only on its own task's data, never on how
tasks are grouped, on the batch size or on the interleaving (bit-identical
checked vs fast mode, batch invariance):

* **GEMM tiles** are slices of the row's full product ``x_row @ W[:, K
  range].T``, computed once per step per (op, layer, K range, row) with one
  fixed-shape ``torch.mm`` call on a copy of the row (BLAS results
  depend on the shape of the call, so every tile of every mode slices the
  same call) and cached for the step;
* **other reductions** run along a tensor's contiguous last dimension whose
  length is the task's own, or as explicit sequential sums in index order.

Rows with ``row_active = 0`` compute everything but write nothing visible.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from megac import abi
from megac.abi import H, Op, Queue
from megac.errors import BadTaskError, QueueOverflowError
from megac.ops import claimer_for_queue, opdef
from megac.ops.base import FIELD_INDEX, ClaimerOp, OpDef, dyn_mask
from megac.ops.cpu import group_rows, idx


class NullTracker:
    """Fast mode: accesses are not tracked."""

    __slots__ = ()

    def read(self, name, index) -> None:  # noqa: D401 - protocol
        pass

    def write(self, name, index) -> None:
        pass


NULL_TRACKER = NullTracker()


class VM:
    """Executes opcodes over one :class:`~megac.vm.state.DeviceState`."""

    def __init__(self, state, tracker=None) -> None:
        self.st = state
        self.geo = state.geo
        self.tr = tracker if tracker is not None else NULL_TRACKER
        self.cache: dict = {}
        #: per layer, a routed up claimer's (x_norm slot, row of each slot) for its claimed tiles
        self.routed_rows: dict[int, tuple[int, np.ndarray]] = {}
        self.plans: dict = {}
        #: the words of the run executing now and their plan key (``plan``)
        self._run_words: np.ndarray | None = None
        self._run_key = None
        #: per GEMM key and input: the buffers and views of ``products``
        self._ybufs: dict = {}
        #: per K length: the [1, K] row the GEMM reads (aligned, reused)
        self._xrows: dict[int, torch.Tensor] = {}
        #: fast mode with check_order: called with (claimer words, records) before they run
        self.on_claimed = None
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
    @property
    def tr(self):
        """The access tracker (``NULL_TRACKER`` in fast mode)."""
        return self._tr

    @tr.setter
    def tr(self, tracker) -> None:
        self._tr = tracker
        #: accesses are checked: ops call ``tr`` per task; else they skip those loops
        self.tracking = tracker is not NULL_TRACKER

    def begin_step(self) -> None:
        """Forget the per-step GEMM row products and routings (inputs change every step)."""
        self.cache.clear()
        self.routed_rows.clear()

    def run(self, words: np.ndarray, key=None) -> None:
        """Execute tasks ``words [n, 32]`` of one opcode. ``key``: a hashable
        that identifies ``words`` for the static plans (fast mode passes its
        run's index, so the words need not be hashed every step); default:
        their bytes."""
        self.execute(opdef(words[0, H.OPCODE]), words, key)

    def execute(self, d: OpDef, words: np.ndarray, key=None) -> None:
        """``run`` with the opcode's definition ``d`` already looked up."""
        self._run_words = words
        self._run_key = key
        d.run(self, words)

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
        """``value`` of every count field of ``vs`` (int64; ``vs`` itself when
        none is dynamic, so callers only read it)."""
        vs = np.asarray(vs, dtype=np.int64)
        if self.tracking:  # each target word read goes through the tracker
            return np.array([self.value(v) for v in vs], dtype=np.int64)
        dm = dyn_mask(vs)
        if not dm.any():
            return vs
        i = vs[dm] & abi.DYN_INDEX_MASK
        if (i >= len(self.targets)).any():
            raise BadTaskError(f"dynamic reference to target word {int(i.max())} outside the buffer")
        out = vs.copy()
        out[dm] = self.targets[i]
        return out

    def slot(self, layer: int) -> int:
        """Index of ``layer`` in its dense / MoE weight stack (``layer_slot``)."""
        if not 0 <= layer < len(self.st.layer_slot):
            raise BadTaskError(f"layer {layer} outside the model", layer=layer)
        return self.st.layer_slot[layer]

    def require_ffn(self, words: np.ndarray, d: OpDef) -> None:
        """Every task of ``words`` runs on a layer whose FFN is ``d.ffn_kind``."""
        for layer in np.unique(words[:, H.LAYER]):
            if not 0 <= layer < self.geo.num_layers or self.geo.ffn[int(layer)] != d.ffn_kind:
                what = "dense" if d.ffn_kind == "dense" else "MoE"
                raise BadTaskError(f"{d.name} on layer {int(layer)}, which has no {what} FFN", layer=int(layer))

    # ------------------------------------------------------------------ GEMM core
    def products(self, key, xbuf: str, xpre: tuple, k0: int, kl: int, W: torch.Tensor) -> torch.Tensor:
        """``[R, N]`` fp32: row r = ``x[r, k0:k0+kl] @ W[:, k0:k0+kl].T`` with
        ``x = st[xbuf][xpre]`` (``[R, K]``), one fixed-shape call per row on a
        copy of the row in an aligned buffer, cached for the step."""
        Y = self.cache.get(key)
        if Y is None:
            Y, xr, Wt, pairs = self._gemm_plan(key, xbuf, xpre, k0, kl, W)
            for x, y in pairs:
                xr.copy_(x)
                torch.mm(xr, Wt, out=y)
            self.cache[key] = Y
        return Y

    def _gemm_plan(self, key, xbuf: str, xpre: tuple, k0: int, kl: int, W: torch.Tensor):
        """The views one ``products`` call uses, built once: its ``[R, N]``
        output buffer (reused every step), the aligned ``[1, kl]`` row buffer,
        ``W[:, k0:k0+kl].T`` and per row (input row, output row)."""
        pkey = (key, xbuf, xpre)
        got = self._ybufs.get(pkey)
        if got is None:
            Y = torch.empty((self.R, W.shape[0]), dtype=torch.float32)
            xr = self._xrows.get(kl)
            if xr is None:
                xr = self._xrows[kl] = torch.empty((1, kl), dtype=torch.float32)
            X = self.st[xbuf][xpre]
            Wt = (W if (k0 == 0 and kl == W.shape[1]) else W[:, k0:k0 + kl]).t()
            got = self._ybufs[pkey] = (Y, xr, Wt, [(X[r, k0:k0 + kl], Y[r:r + 1]) for r in range(self.R)])
        return got

    def slot_product(self, key, xbuf: str, layer: int, slot: int, W: torch.Tensor) -> torch.Tensor:
        """``x[layer, slot] @ W.T`` (one routed MoE slot), cached for the step."""
        y = self.cache.get(key)
        if y is None:
            x = self.st[xbuf][layer, slot]
            xr = torch.empty((1, x.shape[0]), dtype=torch.float32)
            xr.copy_(x)
            y = F.linear(xr, W)[0]
            self.cache[key] = y
        return y

    def groups(self, words: np.ndarray, op: Op, keys: tuple[str, ...], flags: bool = False):
        """Task indices grouped by (layer, *fields[, flags])."""
        cols = [words[:, H.LAYER]] + [words[:, FIELD_INDEX[(int(op), k)]] for k in keys]
        if flags:
            cols.append(words[:, H.FLAGS])
        return group_rows(np.stack(cols, axis=1).astype(np.int64))

    def check_k(self, op: Op, k0: int, kl: int, kdim: int) -> None:
        if k0 < 0 or kl < 1 or k0 + kl > kdim:
            raise BadTaskError(f"{op.name}: K range [{k0}, {k0 + kl}) outside [0, {kdim})")

    def check_n(self, op: Op, n0: np.ndarray, nl: np.ndarray, ndim: int) -> None:
        if (n0 < 0).any() or (nl < 1).any() or (n0 + nl > ndim).any():
            raise BadTaskError(f"{op.name}: N range outside [0, {ndim})")

    def plan(self, tag: str, words: np.ndarray, build):
        """Static per-task-words data (index arrays, slices), built once per
        distinct ``words`` and reused every step (never depends on data)."""
        wk = self._run_key if (words is self._run_words and self._run_key is not None) else words.tobytes()
        key = (tag, wk)
        p = self.plans.get(key)
        if p is None:
            p = build(words)
            self.plans[key] = p
        return p

    def x_slot(self, op: Op, xs: int, layer: int) -> int:
        if not 0 <= xs < self.st["x_norm"].shape[0]:
            raise BadTaskError(f"{op.name}: X_SLOT {xs} outside the x_norm slots", layer=layer)
        return xs

    # ------------------------------------------------------------------ shared epilogue math
    def rope_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[R, 1, hd/2]`` of the rows' positions (fp32), once per step."""
        t = self.cache.get("rope")
        if t is None:
            pos = idx(self.st.np["seq_pos"][: self.R])
            ang = pos.to(torch.float32)[:, None] * self.inv_freq[None, :]
            t = (ang.cos()[:, None, :], ang.sin()[:, None, :])
            self.cache["rope"] = t
        return t

    def kv_slot(self, layer: int, row: int, pos: int) -> tuple[int, int]:
        """(block, offset) of position ``pos`` of ``row`` in ``layer``'s page table."""
        b = pos // self.bs
        pt = self.st.np["page_table"]
        if not 0 <= b < pt.shape[2] or pt[layer, row, b] < 0:
            raise BadTaskError(f"KV position {pos} of row {row} layer {layer} has no mapped block",
                               layer=layer, buffer="page_table")
        return int(pt[layer, row, b]), pos % self.bs

    # ------------------------------------------------------------------ claimers
    def drain(self, d: ClaimerOp, words: np.ndarray) -> None:
        """Claimer tasks (fast mode): the first claimer of a queue claims every
        record (an atomic cursor that one claimer happens to win every time);
        the others find the queue empty (each claims one index past the end)."""
        op = d.op

        def build(words):
            """Per (queue, layer): the first claimer's words, its QUEUE_LEN, the claimers."""
            key = np.stack([words[:, FIELD_INDEX[(int(op), "QUEUE")]], words[:, H.LAYER]], axis=1).astype(np.int64)
            return [(q, layer, words[ti[0]], int(words[ti[0], FIELD_INDEX[(int(op), "QUEUE_LEN")]]), len(ti))
                    for (q, layer), ti in group_rows(key)]

        heads = self.st.queue_heads
        for q, layer, cw, qlen_word, n in self.plan(f"drain {op.name}", words, build):
            routed = d.routed_queue(self, cw)  # a routed claimer's own records
            qlen = len(routed) if routed is not None else self.value(qlen_word)
            head = int(heads[q, layer])
            heads[q, layer] = max(head, qlen) + n
            if head < qlen:
                recs = routed[head:qlen] if routed is not None else self.queue_records(q, layer, head, qlen)
                if self.on_claimed is not None:
                    self.on_claimed(cw, recs)
                d.run_claimed(self, cw, recs)

    def queue_records(self, queue: int, layer: int, lo: int, hi: int) -> np.ndarray:
        """Records ``[lo, hi)`` of ``queue`` for ``layer`` (int64 ``[m, 4]``)."""
        try:
            name = claimer_for_queue(Queue(int(queue))).queue_buffer
        except ValueError:
            raise BadTaskError(f"unknown queue id {queue}") from None
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
        d = opdef(cw[H.OPCODE])
        if not d.claimer:
            raise BadTaskError(f"{d.name} is not a claimer")
        if len(recs) == 0:
            return
        d.run_claimed(self, cw, recs)


__all__ = ["NULL_TRACKER", "NullTracker", "VM"]

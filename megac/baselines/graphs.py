"""The ``graphs`` baseline: the decode step as ordinary per-op kernels, the
way vLLM runs it, captured in one CUDA graph per (batch size, page bucket).

::

    be = GraphsBackend(spec, weights, kv)          # the engine's weights and paged KV cache
    logits = be.decode(rows, tokens)               # fp32 [rows, vocab] on the host
    tokens, _ = be.decode_sample(rows, tokens, samples)   # sampled on the device

Per layer (9 kernels for an MoE layer): the residual sum + RMSNorm
(Triton), the fused QKV projection, RoPE + the K/V store into the paged
pools (Triton), split-K paged flash-decode + merge (Triton,
:mod:`megac.baselines.flash_decode`), the O projection, then the dense
SwiGLU (two projections around a fused SiLU*up) or the routed experts
(:mod:`megac.baselines.moe`: one Triton launch for the router projection
and the routing, Triton grouped GEMMs for gate/up (SiLU*up fused) and down; their weighted
sum is folded into the next residual RMSNorm). Projections run through cuBLAS or a Triton GEMV, whichever
measured faster for the shape and batch (:mod:`megac.baselines.gemv`).

Weights: the engine's :class:`~megac.weights.canonical.ModelWeights`, used
in place. Q/K/V (and gate/up, dense and per expert) are re-laid out once
into one fused tensor each, and the layer's fields are pointed at views of
it (``lw.q`` is rows ``[:q_width]`` of the fused QKV), so the originals are
not kept and every other reader of the weights sees the same values: one
copy in memory. A second backend over the same weights finds them fused.

Each step: the rows' slots reserved, their tokens, positions and page-table
rows (up to the bucket's page count) staged in pinned memory and copied up
in one transfer, the graph replayed, the rows advanced. No host
synchronisation inside the step; the one at the end brings the logits (or
the sampled tokens) back. The split counts of the attention kernels are
fixed at capture, the pages per split follow each row's position, so a
graph serves every context up to its bucket.

On the CPU (or with ``use_graphs=False``) the same step runs eagerly, each
fused kernel replaced by the plain-PyTorch ops it fuses: the tests check
that path against the reference backend and transformers.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np
import torch

from megac.baselines._triton import use_triton
from megac.baselines.elementwise import residual_rms_norm, rope_cos_sin_dev, rope_store, silu_mul
from megac.baselines.flash_decode import paged_decode_attention, splits_for
from megac.baselines.gemv import LinearPicker
from megac.baselines.moe import moe_ffn
from megac.errors import MegacError
from megac.runtime.backend import TorchPrefillMixin
from megac.runtime.step import page_rows
from megac.weights.layout import rope_inv_freq


def fuse_rows(owner, names: Sequence[str], dim: int) -> torch.Tensor:
    """The tensors ``owner.<names>`` concatenated along ``dim``; the fields are
    re-pointed at views of the result (the originals are dropped). Already
    fused (consecutive views of one tensor, in order): that tensor, as it is."""
    parts = [getattr(owner, n) for n in names]
    base = parts[0]._base
    if (base is not None and base.dim() == parts[0].dim() and all(p._base is base for p in parts)
            and base.shape[dim] == sum(p.shape[dim] for p in parts)):
        step = base.stride(dim) * base.element_size()
        at = base.data_ptr()
        if all(p.data_ptr() == at + step * sum(q.shape[dim] for q in parts[:i]) for i, p in enumerate(parts)):
            return base
    fused = torch.cat(parts, dim=dim)
    for name, view in zip(names, fused.split([p.shape[dim] for p in parts], dim=dim)):
        setattr(owner, name, view)
    return fused


class GraphsBackend(TorchPrefillMixin):
    """See the module docstring."""

    name = "graphs"

    def __init__(self, spec, weights, kv, *, max_batch_size: int = 64, device: str | None = None,
                 use_graphs: bool | None = None, triton: bool | None = None, min_pages: int = 16) -> None:
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dev.type == "cuda" and weights.embed.device.type != "cuda":
            weights = weights.to(torch.bfloat16, dev)  # as the cuda backend: bf16 on the GPU
        if weights.embed.device.type != dev.type:
            raise MegacError(f"graphs backend: weights on {weights.embed.device}, backend on {dev}")
        self.spec, self.weights, self.kv = spec, weights, kv
        self.dev = weights.embed.device
        self._place_kv()
        self.max_batch_size = max_batch_size
        self.triton = use_triton(self.dev) if triton is None else bool(triton)
        self.use_graphs = (self.dev.type == "cuda") if use_graphs is None else bool(use_graphs)
        if self.use_graphs and self.dev.type != "cuda":
            raise MegacError("graphs backend: CUDA graphs need a CUDA device")
        self.min_pages = min_pages
        self.sms = torch.cuda.get_device_properties(self.dev).multi_processor_count if self.dev.type == "cuda" else 8
        self.inv_freq = rope_inv_freq(spec).to(self.dev)
        self.qkv, self.gate_up = [], []
        for lw in weights.layers:
            self.qkv.append(fuse_rows(lw, ("q", "k", "v"), 0))
            if lw.is_moe:
                self.gate_up.append(fuse_rows(lw, ("experts_gate", "experts_up"), 1))
            else:
                self.gate_up.append(fuse_rows(lw, ("gate", "up"), 0))
        dense = [i for i, lw in enumerate(weights.layers) if not lw.is_moe]
        #: every projection through cuBLAS or a Triton GEMV, whichever measured faster (GPU only)
        self.linear = LinearPicker(self.triton and self.dev.type == "cuda", {
            "qkv": self.qkv, "o": [lw.o for lw in weights.layers],
            "dense_up": [self.gate_up[i] for i in dense], "dense_down": [weights.layers[i].down for i in dense],
            "lm_head": [weights.lm_head_weight]})
        self._sem = torch.zeros(1, dtype=torch.int32, device=self.dev)  # the routing kernel's arrival counter
        self._graphs: dict[tuple[int, int], tuple] = {}
        self._pool = None
        self._events = None
        self.kernel_ms: list[float] = []
        self.steps = 0

    def _place_kv(self) -> None:
        """The pools on the weights' device in their dtype (the engine builds
        them on the host for any backend but ``cuda``)."""
        kv, dt = self.kv, self.weights.dtype
        if kv.k_pool.device != self.dev or kv.k_pool.dtype != dt:
            kv.k_pool = kv.k_pool.to(self.dev, dt)
            kv.v_pool = kv.v_pool.to(self.dev, dt)
            kv.dtype = dt

    # ------------------------------------------------------------------ the step on the device
    def _forward(self, inp: torch.Tensor, B: int, pages: int) -> torch.Tensor:
        """The whole step over the staged inputs ``inp`` (int32: tokens [B],
        positions [B], page tables [L, B, pages]); fp32 logits [B, vocab]."""
        spec, w, kv, tri = self.spec, self.weights, self.kv, self.triton
        L, bs = spec.num_layers, kv.block_size
        H, KVH, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
        tok = inp[:B].long()
        pos = inp[B: 2 * B].long()
        table = inp[2 * B:].view(L, B, pages)
        blk = table.gather(2, (pos // bs).view(1, B, 1).expand(L, B, 1)).view(L, B).long()
        off = pos % bs
        cos_sin = None if tri else rope_cos_sin_dev(pos, self.inv_freq, spec.rope_style, w.dtype)
        scale = hd ** -0.5
        x = w.embed.index_select(0, tok)
        pending: list = []  # residual deltas the next RMSNorm adds
        for i, (ls, lw) in enumerate(zip(spec.layers, w.layers)):
            x, h = residual_rms_norm(x, pending, lw.input_norm, spec.norm_eps, tri)
            q = rope_store(self.linear("qkv", h, self.qkv[i]), H, KVH, hd, rotate=ls.rope, style=spec.rope_style, pos=pos,
                           inv_freq=self.inv_freq, cos_sin=cos_sin, k_pool=kv.k_pool, v_pool=kv.v_pool,
                           blk=blk[i], off=off, triton_ok=tri)
            window = ls.window or 0
            span = pages if not window else min(pages, -(-window // bs) + 1)
            a = paged_decode_attention(q, kv.k_pool, kv.v_pool, table[i], pos, window=window, scale=scale,
                                       num_splits=splits_for(B, KVH, span, self.sms), triton_ok=tri)
            a = self.linear("o", a, lw.o)
            if spec.block == "parallel":
                pending = [a, self._ffn(i, h)]
            else:
                x, h2 = residual_rms_norm(x, [a], lw.post_attn_norm, spec.norm_eps, tri)
                pending = [self._ffn(i, h2)]
        _, hn = residual_rms_norm(x, pending, w.final_norm, spec.norm_eps, tri)
        logits = self.linear("lm_head", hn, w.lm_head_weight)
        if spec.logit_scale != 1.0:
            logits = logits * spec.logit_scale
        return logits.float()

    def _ffn(self, i: int, h: torch.Tensor):
        """The FFN's residual delta: a tensor, or the routed experts' rows still to be summed."""
        lw = self.weights.layers[i]
        if lw.is_moe:
            return moe_ffn(h, lw.router, self.gate_up[i], lw.experts_down, self.spec.moe, self.triton, self._sem)
        up = self.linear("dense_up", h, self.gate_up[i])
        return self.linear("dense_down", silu_mul(up, self.triton), lw.down)

    # ------------------------------------------------------------------ graphs
    def _buffers(self, B: int, pages: int):
        """(pinned staging, device inputs, graph, logits) of one key; the
        graph is captured on the first step that uses the key."""
        key = (B, pages)
        got = self._graphs.get(key)
        if got is None:
            n = 2 * B + self.spec.num_layers * B * pages
            pin = self.dev.type == "cuda"
            got = [torch.zeros(n, dtype=torch.int32, pin_memory=pin), torch.zeros(n, dtype=torch.int32, device=self.dev),
                   None, None]
            self._graphs[key] = got
        return got

    def _capture(self, bufs, B: int, pages: int) -> None:
        """Warm up (compiles the Triton kernels, sets up cuBLAS) on a side
        stream, then capture. The warm-up runs the real step on the staged
        inputs: it stores the same K/V the replay stores again."""
        inp = bufs[1]
        side = torch.cuda.Stream(self.dev)
        side.wait_stream(torch.cuda.current_stream(self.dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(inp, B, pages)
        torch.cuda.current_stream(self.dev).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            out = self._forward(inp, B, pages)
        bufs[2], bufs[3] = g, out

    # ------------------------------------------------------------------ one step
    def _checked_tokens(self, rows: list[int], token_ids: Sequence[int]) -> np.ndarray:
        B = len(rows)
        if B != len(token_ids):
            raise MegacError(f"graphs: {len(token_ids)} tokens for {B} rows")
        if not 0 < B <= self.max_batch_size:
            raise MegacError(f"graphs: {B} rows (at most {self.max_batch_size})")
        toks = np.asarray([int(t) for t in token_ids], dtype=np.int64)
        if (toks < 0).any() or (toks >= self.spec.vocab_size).any():
            bad = int(toks[(toks < 0) | (toks >= self.spec.vocab_size)][0])
            raise MegacError(f"token id {bad} outside the vocabulary (0..{self.spec.vocab_size - 1})")
        return toks

    def _reserve(self, rows: list[int]) -> tuple[np.ndarray, int]:
        """The rows' slots for this step: (positions, page-table row length)."""
        kv = self.kv
        for r in rows:
            kv.append_slot(r)  # idempotent: the engine has usually reserved it
        pos = kv.seq_pos[rows].astype(np.int64)
        return pos, page_rows(pos.tolist(), kv.block_size, kv.max_blocks_per_seq, floor=self.min_pages)

    def _stage(self, bufs, rows: list[int], pos: np.ndarray, pages: int, toks: np.ndarray | None) -> None:
        """The step's input into the pinned staging buffer ``bufs[0]``: the
        tokens (``None``: left as they are), positions and page-table rows."""
        B = len(rows)
        st = bufs[0].numpy()
        if toks is not None:
            st[:B] = toks
        st[B: 2 * B] = pos
        np.take(self.kv.page_table[:, :, :pages], rows, axis=1,
                out=st[2 * B:].reshape(self.spec.num_layers, B, pages))

    def _step(self, rows: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor:
        rows = [int(r) for r in rows]
        B = len(rows)
        toks = self._checked_tokens(rows, token_ids)
        kv = self.kv
        pos, pages = self._reserve(rows)
        bufs = self._buffers(B, pages)
        self._stage(bufs, rows, pos, pages, toks)
        if not self.use_graphs:
            bufs[1].copy_(bufs[0])
            logits = self._forward(bufs[1], B, pages)
        else:
            bufs[1].copy_(bufs[0], non_blocking=True)
            if bufs[2] is None:
                self._capture(bufs, B, pages)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            bufs[2].replay()
            end.record()
            self._events = (start, end)
            logits = bufs[3]
        for r in rows:
            kv.advance(r, 1)
        self.steps += 1
        return logits

    def _note_time(self) -> None:
        """The last replay's device time (after the caller's synchronisation)."""
        if self._events is not None:
            a, b = self._events
            b.synchronize()
            self.kernel_ms.append(a.elapsed_time(b))
            self._events = None

    @torch.no_grad()
    def decode(self, rows: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor:
        t0 = time.perf_counter()
        logits = self._step(rows, token_ids).float().cpu()
        self._note_time()
        if not self.use_graphs:
            self.kernel_ms.append((time.perf_counter() - t0) * 1e3)
        return logits

    @torch.no_grad()
    def decode_sample(self, rows: Sequence[int], token_ids: Sequence[int], samples, *, keep_logits: bool = False):
        """One step, sampled where the logits are: only token ids cross."""
        from megac.sampling import sample_rows

        t0 = time.perf_counter()
        logits = self._step(rows, token_ids)
        tokens = sample_rows(logits, samples)
        self._note_time()
        if not self.use_graphs:
            self.kernel_ms.append((time.perf_counter() - t0) * 1e3)
        return tokens, (logits.float().cpu() if keep_logits else None)

    @torch.no_grad()
    def decode_greedy_run(self, rows: Sequence[int], token_ids: Sequence[int], steps: int, progress=None):
        """``steps`` greedy steps of the fixed ``rows``, pipelined as the
        megakernel's (:mod:`megac.gpu.pipeline`): step i+1 is staged, copied
        up and replayed before the host reads step i's tokens, which reach
        step i+1's input on the device (the argmax of the logits, as
        ``sample_rows`` takes it). Eager (no graphs): one by one."""
        from megac.gpu.pipeline import GreedyPipeline
        from megac.runtime.backend import run_greedy_steps

        rows = [int(r) for r in rows]
        B = len(rows)
        if not self.use_graphs or not B or steps <= 0:
            return run_greedy_steps(self, rows, token_ids, steps, progress)
        toks = self._checked_tokens(rows, token_ids)
        kv = self.kv
        fed = torch.empty(B, dtype=torch.int64, device=self.dev)
        uploaded = torch.cuda.Event()
        pipe = GreedyPipeline(B, torch.int64, self.kernel_ms, progress)
        for i in range(steps):
            pos, pages = self._reserve(rows)
            bufs = self._buffers(B, pages)
            if i > 0:
                uploaded.synchronize()  # the staging buffer's last copy is done with it
            # later steps' tokens are the last step's, copied in on the device
            self._stage(bufs, rows, pos, pages, toks if i == 0 else None)
            bufs[1].copy_(bufs[0], non_blocking=True)
            uploaded.record()
            if i > 0:
                bufs[1][:B].copy_(fed)
            if bufs[2] is None:
                self._capture(bufs, B, pages)
            slot = pipe.slot(i)
            slot.start.record()
            bufs[2].replay()
            slot.end.record()
            fed.copy_(torch.argmax(bufs[3][:B], dim=-1))
            slot.tok.copy_(fed, non_blocking=True)
            slot.done.record()
            for r in rows:
                kv.advance(r, 1)
            self.steps += 1
            pipe.queued(slot)
        return pipe.finish()

    def prefill(self, row: int, token_ids: Sequence[int]):
        """The last token's fp32 logits (on the device), through the shared PyTorch prefill."""
        return super().prefill(row, token_ids).float()


__all__ = ["GraphsBackend", "fuse_rows"]

"""The host side of one decode step around the kernel (CPU VM backend).

::

    step = DecodeStep(state, mode="fast")            # or mode="checked", policy=..., seed=...
    logits = step(kv, kv_rows, tokens)                # fp32 [len(kv_rows), vocab] * logit_scale

Row ``i`` of the schedule runs the current token ``tokens[i]`` of KV-cache row
``kv_rows[i]``; schedule rows past ``len(kv_rows)`` are inactive
(``row_active = 0``: they compute on a zero residual and write nothing
visible). One call:

1. reserves each row's slot in the paged cache (``append_slot``: maps the
   block of the new position, releases sliding-window blocks) and copies the
   page tables / positions into the descriptor (``page_table``,
   ``seq_pos`` = position of the current token, ``row_active``);
2. (checked mode) poisons every scratch buffer and the current token's K/V
   slots with NaN (int scratch with a sentinel);
3. the seed: embedding gather into ``x_resid`` (fp32) and the first RMSNorm
   into ``x_norm[0]``;
4. the per-step reset of every buffer in ``plan.reset`` (counters, queue heads);
5. host target words and the attention queue: per row the full-attention
   split count ``attn_splits(seq_len)`` and the sliding one
   ``attn_splits(min(seq_len, max window))`` (each from the row's own span:
   batch invariance), one record ``{row, kv_head, split, num_splits}`` per
   full-attention split, shared by every full layer, and its length;
6. runs the schedule (fast or checked);
7. returns ``logits[:n] * logit_scale`` and advances each row's ``seq_pos``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from megac import abi
from megac.errors import MegacError
from megac.vm.interp import Interpreter
from megac.vm.state import DeviceState


class DecodeStep:
    """One decode step of ``state.schedule`` (see the module docstring)."""

    def __init__(self, state: DeviceState, *, mode: str = "fast", policy: str = "round_robin",
                 seed: int = 0, check_order: bool = False) -> None:
        if mode not in ("fast", "checked"):
            raise MegacError(f"vm: mode must be 'fast' or 'checked' (got {mode!r})")
        self.st = state
        self.mode = mode
        self.policy = policy
        self.seed = seed
        self.check_order = check_order
        self.interp = Interpreter(state)
        self.last_run = None
        self.steps = 0

    @property
    def schedule(self):
        return self.st.schedule

    # ------------------------------------------------------------------ parts
    def load_rows(self, kv, kv_rows: Sequence[int]) -> list[int]:
        """Reserve the current slot of every row and fill the KV tables."""
        st, geo = self.st, self.st.geo
        n = len(kv_rows)
        if n > geo.rows:
            raise MegacError(f"vm: {n} rows for a schedule of {geo.rows}")
        st.bind_kv(kv)
        positions = [int(kv.append_slot(int(r))) for r in kv_rows]
        for r, p in zip(kv_rows, positions):
            if p + 1 > geo.context:
                raise MegacError(f"vm: row {r} reaches {p + 1} tokens, beyond the schedule's context bucket "
                                 f"({geo.context})")
        pt = st.np["page_table"]
        pt[...] = -1
        mb = min(pt.shape[2], kv.max_blocks_per_seq)
        if n:
            pt[:, :n, :mb] = kv.page_table[:, np.asarray(kv_rows, dtype=np.int64), :mb]
        sp, ra = st.np["seq_pos"], st.np["row_active"]
        sp[...] = 0
        ra[...] = 0
        sp[:n] = positions
        ra[:n] = 1
        return positions

    def poison_kv_slots(self, kv, positions: Sequence[int]) -> None:
        """NaN into the current token's K/V slot of every active row and layer
        (QKV_PROJ writes them this step; a read before that shows)."""
        st, geo = self.st, self.st.geo
        pt, bs = st.np["page_table"], st.block_size
        for i, p in enumerate(positions):
            for layer in range(geo.num_layers):
                blk = int(pt[layer, i, p // bs])
                if blk >= 0:
                    kv.k_pool[blk, p % bs] = float("nan")
                    kv.v_pool[blk, p % bs] = float("nan")

    def seed_rows(self, tokens: Sequence[int]) -> None:
        """Embedding gather into x_resid and the first RMSNorm into x_norm[0]."""
        st, geo = self.st, self.st.geo
        n = len(tokens)
        ids = torch.as_tensor([int(t) for t in tokens], dtype=torch.int64)
        if n and (int(ids.min()) < 0 or int(ids.max()) >= geo.vocab):
            raise MegacError(f"vm: token id outside the vocabulary (0..{geo.vocab - 1})")
        x = torch.zeros((geo.rows, geo.hidden), dtype=torch.float32)
        if n:
            x[:n] = st["w_embed"][ids].to(torch.float32)
        st["x_resid"].copy_(x)
        st["x_norm"][0] = self.interp.ops.rms_norm(x, 0)

    def host_words(self, positions: Sequence[int]) -> int:
        """Per-row split counts and the attention queue; returns its length."""
        st, geo = self.st, self.st.geo
        tw = geo.target_words
        T = st.np["targets"]
        T[: tw.host_words] = 0
        q = st.np["attn_queue"]
        n = 0
        for i in range(geo.rows):
            seq_len = int(positions[i]) + 1 if i < len(positions) else 1
            full = geo.attn_splits(seq_len)
            T[tw.attn_splits_full(i)] = full
            T[tw.attn_splits_sliding(i)] = geo.attn_splits(min(seq_len, geo.max_window)) if geo.max_window else 0
            if geo.full_layers:
                for h in range(geo.kv_heads):
                    for s in range(full):
                        if n >= q.shape[0]:
                            raise MegacError("vm: attention queue over capacity")
                        rec = q[n]
                        rec[abi.record_index(abi.Queue.ATTN, "ROW")] = i
                        rec[abi.record_index(abi.Queue.ATTN, "KV_HEAD")] = h
                        rec[abi.record_index(abi.Queue.ATTN, "SPLIT")] = s
                        rec[abi.record_index(abi.Queue.ATTN, "NUM_SPLITS")] = full
                        n += 1
        T[tw.attn_queue_len] = n
        return n

    # ------------------------------------------------------------------ call
    @torch.no_grad()
    def __call__(self, kv, kv_rows: Sequence[int], tokens: Sequence[int], *, policy: str | None = None,
                 seed: int | None = None) -> torch.Tensor:
        kv_rows = [int(r) for r in kv_rows]
        if len(tokens) != len(kv_rows):
            raise MegacError(f"vm: {len(tokens)} tokens for {len(kv_rows)} rows")
        st = self.st
        positions = self.load_rows(kv, kv_rows)
        if self.mode == "checked":
            st.poison()
            self.poison_kv_slots(kv, positions)
        self.seed_rows(tokens)
        st.reset()
        self.host_words(positions)
        if self.mode == "fast":
            self.interp.run_fast(check_order=self.check_order)
        else:
            s = self.seed + self.steps if seed is None else seed
            self.last_run = self.interp.run_checked(policy=policy or self.policy, seed=s)
        logits = st["logits"][: len(kv_rows)].clone()
        scale = float(st.spec.logit_scale)
        if scale != 1.0:
            logits = logits * scale
        for r in kv_rows:
            kv.advance(r, 1)
        self.steps += 1
        return logits


__all__ = ["DecodeStep"]

"""Geometry: every size one schedule needs, for one (spec, batch rows, context bucket).

Interface (stable; ``megac.access``, the passes and the verifier read it)::

    geo = Geometry.from_spec(spec, rows, context, **tile_overrides)

``context`` is the bucket's UPPER bound (a row's length, current token
included, never exceeds it). ``tile_overrides`` may set any of the tile
fields below (tests use it); values are clamped to the dimensions.

Model dimensions
    spec_name, block ("parallel"|"sequential"), rows, context, num_sms,
    num_layers, hidden, num_heads, kv_heads, head_dim, heads_per_kv, q_width,
    kv_width, qkv_width, vocab, dense_width (0: no dense layer), num_experts,
    top_k, expert_width (0: no MoE layer), norm_slots (= 2*num_layers + 1,
    the x_norm slots: GAMMA index).

Tiles (one task = one tile)
    qkv_bn         columns of the fused Q/K/V projection per tile: head_dim
                   (one head) or a divisor of it (part of one head)
    o_proj_bn      N tile of the O projection (split-K = kv_heads, split s =
                   the K range of KV head s's query heads)
    upgate_bn      rows of interleaved gate/up weights per dense tile
                   (upgate_bn/2 gate rows then upgate_bn/2 up rows ->
                   upgate_bn/2 hidden columns)
    down_bn, ffn_splits   dense down: N tile, split-K count (split boundaries
                   are aligned to upgate column tiles: ``ffn_split_bounds``)
    router_bn, router_splits   router GEMM: N tile over experts, split-K count
                   (``router_split_bounds``)
    moe_up_bn, moe_down_bn     expert tiles (interleaved gate/up rows; hidden)
    up_tiles, down_tiles       tiles per active expert
    moe_chunk      gate/up rows per interleave chunk of the expert weights
                   (``moe_chunk_rows``; every schedule's): a tile pairs them
                   chunk by chunk
    fused_topk, fused_gather   the top-k / the gather inside ROUTE_FINALIZE
    fused_combine  the MoE combine inside the layer's ADD_RMSNORM (one row)
    routed_claims  the up claimers rank the rows themselves (the target's
                   ``routed_claims`` row bound >= rows): ``routed_claims_at``
    split_down     the up claims run the expert down projection split-K
                   (``split_down_at``); moe_out_tiles: moe_out's tiles per slot
    o_proj_merge   the O-projection tiles merge the attention splits (one row,
                   ``o_proj_merge_at``): no ATTN_COMBINE
    qkv_combine    folded QKV tiles add the MoE combine themselves (one row,
                   ``qkv_combined``)
    up_combine     routed up claims stage the norm themselves, the MoE combine
                   added (one row, ``up_combined``)
    kv_head_major  the GPU backends' KV pools are [blocks][kv_heads][block_size]
                   [hd] (opcodes/kv_pool.cuh; token-major otherwise)
    lm_bn, lm_tiles            LM head vocab tile

Attention splits
    attn_split_tokens, attn_max_splits (from the target)
    attn_splits(span)          = min(attn_max_splits, max(1, ceil(span / attn_split_tokens)))
    sliding_static_splits      = attn_splits(min(context, max sliding window)),
                                 static ATTN_DECODE tasks per (row, kv head) of a
                                 sliding layer (0 when there is no sliding layer)
    max_splits                 partial slots per (row, head) =
                                 max(attn_splits(context), sliding_static_splits)
    split_signature            what distinguishes the task words of two buckets

Queues
    attn_queue_cap = rows * kv_heads * attn_max_splits
    moe_queue_cap  = min(num_experts, rows*top_k) * max(up_tiles, down_tiles)
    target_words   = abi.TargetWords(rows, num_layers)
    dyn_bound(word) the largest value target word ``word`` can hold this step

Per layer (tuples indexed by layer)
    sliding, window (0 for full), rope, ffn ("dense"|"moe"), layer_slot
    (index in the dense or the MoE weight stack); and the index lists
    dense_layers, moe_layers, full_layers, sliding_layers.
    ``norm_input_slot(l)``: the x_norm slot FFN inputs of layer l read
    (l for parallel blocks, L + l for sequential ones).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from functools import cached_property

from megac import abi

#: Default tile sizes (clamped to the model's dimensions by ``from_spec``).
DEFAULT_TILES = {
    # QKV columns per tile: head_dim or more = one whole head; a divisor of
    # head_dim = part of a head (interleaved RoPE or none: its rotation pairs
    # are adjacent columns). 64: half a head of North Mini Code, 80 tasks
    # instead of 40, so the attention splits' inputs are ready sooner at a
    # layer's start (at batch 8 ~90 SMs waited ~15 us a layer for them).
    # H200, 8K, kernel ms against whole heads (check tiles, two runs): batch
    # 1 even (1K +2 %), batch 2 -4.6 %, batch 4 -2.7 %, batch 8 -1.0 %; 32
    # columns slower (bs1 +9 %, bs8 +2 %). A model whose heads this default
    # cannot split (half-style RoPE, head_dim not a multiple of 64) keeps
    # whole heads; a spec that asks for such a split is refused.
    "qkv_bn": 64,
    # O-projection features per tile: 128 (a warp per 16-row group, 64 tiles
    # of 256 KB for North Mini Code) where it divides the hidden size, else
    # 64. The calibrated cost model's pick on the CPU (twenty-first session:
    # -3.0 % at batch 1, -1.0 % at batch 8); H200, North Mini Code, kernel ms
    # against 64 (check tiles): 8K batch 1 -1.4 %, batch 8 -1.9 %, 32K -1.3 /
    # -1.1 %. Other bits than 64's (there a row group's K is cut in two).
    "o_proj_bn": 128,
    "upgate_bn": 128,
    "down_bn": 64,
    "ffn_splits": 2,
    "router_bn": 128,
    # router GEMM split-K slices (tasks over SMs). One count for every
    # schedule of a model (the device indexes router_part with one
    # ROUTER_SPLITS). 8: the router ends ~0.7 us sooner at batch 1 (H200
    # profiles, thirty-third session); alone the step did not follow, but
    # with the batch-1 combine over 8, full-up-first waves at batch 1, the
    # one-row ranking on a warp, one read of a met claim's counter, one up
    # claim an SM and 1024-row LM head tiles (TILES s35, thirty-sixth
    # session) bs1 -1.7 % against 4 and the rest. Another split-K sum of the
    # logits than 4's: other bits
    "router_splits": 8,
    # expert tiles of 256 features: fewer, longer claims. A claim spends ~7 us
    # (up, routed) / ~4.6 us (down) before its first weight stage lands and
    # then streams ~65-78 GB/s per SM, so at 128 features two thirds of a
    # down claim were overhead. H200, North Mini Code 8K, kernel ms against
    # 128 / 128: bs1 even, bs2 -1.1 %, bs4 -4.7 %, bs8 -5.7 % (same bits);
    # 384 up or 512 down features leave too few claims at batch 1
    "moe_up_bn": 256,
    "moe_down_bn": 256,
    # LM head vocab rows per tile. -1: automatic, the largest of 1024 and 512
    # that still gives every SM a tile (num_sms tiles or more), else 256;
    # 256 where split_down applies (a GEMM tile's shared memory stages its
    # output, lm_bn x 8 fp32, beside the split claims' 64 KB of X: 1024 does
    # not fit in 227 KB).
    # Every tile pays a start (prime, wait, X) and an end (warp skew,
    # epilogue); North Mini Code's 262144 rows in 256 tiles of 4 MB instead
    # of 1024 of 1 MB (part of TILES s35: see router_splits); SmolLM2's
    # 49152 keep 256 (192 tiles: 512 would leave 36 SMs idle)
    "lm_bn": -1,
    # 1: ROUTE_FINALIZE ranks every row's experts itself (as ROUTER_TOPK does),
    # no ROUTER_TOPK tasks and one hop less per MoE layer; 0: a top-k task per row
    "fused_topk": 0,
    # 1: ROUTE_FINALIZE also copies the rows to their routed slots, no
    # MOE_GATHER tasks (the up claims wait on the finalize task itself)
    "fused_gather": 0,
    # 1: in schedules of one row (fused_combine_at) the layer's ADD_RMSNORM
    # adds the row's expert outputs, score-weighted in k order, itself
    # (MOE_COMBINE's sum, the same bits), no MOE_COMBINE task: a hop and a
    # single-CTA task less at the end of every MoE layer. The norm folds
    # (norm_fold) beside it only where both folding readers add the experts
    # themselves (router_combine and qkv_combine); elsewhere it does not fold
    "fused_combine": 0,
    # routed claims in schedules of at most this many rows (0: none): every
    # expert up claimer ranks the rows itself from the router partials and
    # derives its records, reading its rows from x_norm, so its first claim
    # waits on the router GEMM alone (no ROUTER_TOPK, no MOE_GATHER; the
    # finalize task ranks for the down claims and the combine, off the up
    # claims' path). Each claimer pays the ranking: worth it where the
    # routing hops are on the critical path (small batches). H200, North Mini
    # Code 8K: batch 1 -1.7 %, batch 2 even, batch 4 +3 %, batch 8 +2.8 %
    "routed_claims": 1,
    # the norm folded into its GEMM readers in schedules of at most this many
    # rows (0: none): a layer's QKV and router tiles add the norm's partials
    # and normalise the rows themselves (NORM_IN) instead of waiting for the
    # ADD_RMSNORM task, a hop and a single-CTA task less on both of a layer's
    # paths; the norm task still writes the residual and the slot the expert
    # claims read. Each reader loads every row's partials: small batches.
    # Parallel blocks whose layer and the layer before have MoE FFNs, with
    # routed claims (there the up claims read x_norm and order the residual
    # slot for the next fold; else the next norm would need a third wait).
    # H200, North Mini Code batch 1, kernel ms against no fold (same bits):
    # 8K -1.8 %, 32K -2.0 % (nineteenth session, check tiles)
    "norm_fold": 1,
    # split-K expert down projections in schedules of at most this many rows
    # (0: none): each claimed up tile (moe_up_bn interleaved gate/up rows)
    # also streams its features' columns of the expert's down matrix and
    # writes that partial of the expert's output (moe_out gains a tile axis,
    # MOE_COMBINE sums the tiles), so no MOE_DOWN_DRAIN: the down stream
    # starts as soon as its own up tile ends instead of after the expert's
    # slowest up tile, a claim's dispatch and wait less. Another summation
    # order than the down claims' (a split-K sum: other bits). Not with
    # fused_combine (the norm would sum every tile). -1: automatic, batch 1
    # for large MoE models that allow it (split_down_bound). With their own
    # O-projection tiles (split_o_proj_bn 256) and the wave order's
    # KIND_split waves. Timed at batch 1 with 128-row split up tiles beside
    # the plain 256-row ones (twenty-fourth, twenty-fifth sessions: 2.60
    # against 2.76-2.79 ms, -6 %), which paired the wrong gate/up rows (the
    # weights were interleaved in chunks of 128; the fp32 slice at one row
    # gave cosine 0.64). Valid, on 128-row up tiles in every schedule: -1.9 %
    # at batch 1, but batch 2-8 1-6 % slower on them (twenty-fifth session).
    # On its own 128-row tiles beside the plain 256 (split_up_bn 128, the
    # interleave in chunks of 64: moe_chunk_rows): not run on the GPU yet
    "split_down": 0,
    # MOE_COMBINE tasks per row, each summing a range of the row's features
    # over its slots. -1: 32 in split_down schedules (one CTA reading every
    # tile's partial of a whole row took up to ~9 us at batch 1; 32 ranges of
    # North Mini Code's 2048 features at 12 tiles x 8 slots are 24 KB each,
    # one round trip of 8 loads a thread), else 1 (one task, the whole row:
    # 64 KB at batch 1, ~2.4 us on one SM at the end of every MoE layer).
    # The same bits whatever the count (each feature sums its slots in k order)
    "combine_splits": -1,
    # MOE_COMBINE tasks per row in routed-claim schedules (batch 1; 0: as
    # combine_splits says): there the combine ends every MoE layer's expert
    # chain. 8 ranges of 8 KB: -0.3 .. -0.4 % at batch 1 alone (H200, North
    # Mini Code 8K, thirty-first and thirty-second sessions); part of TILES
    # s35 (see router_splits). The same bits whatever the count
    "routed_combine_splits": 8,
    # expert up tiles (gate/up rows) of the schedules that split the down
    # projection (0: moe_up_bn). Each split claim streams its up rows and
    # their down columns, so smaller tiles keep a claim's bytes near a plain
    # up claim's (the twenty-third session: 256-row split claims 3.11 ms at
    # batch 1 against 2.83 with 128). The expert weights are laid out once
    # for every batch size, gate/up interleaved in chunks every schedule's
    # tiles hold whole (moe_chunk_rows: 64 rows for 128 beside 256), each
    # tile pairing them chunk by chunk (the twenty-fifth session's split
    # timings ran 128-row tiles on chunks of 128: wrong pairs)
    "split_up_bn": 0,
    # O-projection features per tile in the schedules that split the down
    # projection (0: o_proj_bn): there the order puts a sliding layer's
    # O-projection on its attention SMs (the wave order's KIND_split waves),
    # one tile each at 256 features (North Mini Code: 32 splits, 32 tiles)
    "split_o_proj_bn": 256,
    # 1: in schedules of one row each O-projection tile merges its KV head's
    # attention splits into its input itself (O_PROJ.MERGE_SPLITS, the
    # ATTN_COMBINE arithmetic, the same bits), no ATTN_COMBINE task: a hop
    # and a single-CTA task less on a layer's attention chain; every tile of
    # a head re-reads the head's partials (KV heads x features / o_proj_bn
    # merges instead of KV heads). -1: automatic, batch 1 of MoE models of
    # hidden size >= 1024 (SPLIT_AUTO_MIN_HIDDEN: North Mini Code). H200,
    # North Mini Code 8K batch 1, engines alternating: the plain schedule
    # -1.6 %, the split one -1.7 % (twenty-fifth session); its bits are
    # ATTN_COMBINE's
    "o_proj_merge": -1,
    # 1: the GPU backends keep the paged KV pools head-major, [blocks]
    # [kv_heads][block_size][hd] (opcodes/kv_pool.cuh): one KV head's keys of
    # a block contiguous instead of 128-byte pieces a token row apart. The
    # twenty-fourth session's slow engines had one head's attention splits
    # ~50 % slower than the others', by where the pool landed, and those
    # splits ended the attention chain. Same values, same bits (the host
    # works through a token-major view; the CPU VM keeps token-major pools).
    # Not run on the GPU yet (twenty-sixth session: no device)
    "kv_head_major": 0,
    # 1: in the layers that fold their norm (norm_fold) the router tiles fold
    # the MoE combine instead (ROUTER_GEMM flag COMBINE_IN): each sums its K
    # range of the new residual itself (the residual slot, the O-proj
    # partials, the previous layer's expert outputs score-weighted in k
    # order) and multiplies gamma * x unnormalised. A range needs no other
    # range (no 1 / rms), so the router waits on the down claims and the
    # O-projection, not on MOE_COMBINE and its fold: the ranking (invariant to
    # the positive 1 / rms) comes two hops sooner. ROUTE_FINALIZE scales the
    # selected logits by 1 / rms of the norm task's residual for the weights.
    # Why (fortieth session's H200 trace, sliding layers, µs after the
    # previous combine ended): the router ends at 6.9, the first expert byte
    # lands at 12.8, the median claimer's at 16.9; the MoE chain is the
    # layer's. Not with split_down (moe_out's tiles). Other bits than the
    # folded norm's logits (bf16(gamma * x) against bf16(gamma * bf16(x / rms))):
    # the VM computes the same. Batch invariant: every router of the model
    # is unnormalised, and where none folds the combine (more rows, the
    # layer after a dense one, split_down) it reads the norm's residual
    # (NORM_LAYER -1), the x the fold sums bit for bit; ROUTER_TOPK scales
    # its weights as the finalize does. Measured (H100, forty-fourth session,
    # NMC 8K bs1, engines alternating, the batch-1 form): -2.1 % median,
    # -2.0 % mean (23 / 24 engines); checked as a default would be at one
    # row. The batch-invariant form (forty-fifth session, H100): the tiny
    # models' rows alone equal the same rows in a batch bit for bit and match
    # the VM; NMC bs1 8K -2.6 % median / -2.3 % mean (11 / 12 engines)
    "router_combine": 1,
    # 1: in the layers that fold their norm (norm_fold) at one row, without
    # split_down, the QKV tiles' folded norm adds the previous layer's
    # expert outputs itself (QKV_PROJ flagged NORM_IN and ADD_MOE:
    # MOE_COMBINE's sum, as the norm task's ADD_MOE adds it) instead of
    # MOE_COMBINE's partial, so they wait on the down claims and the
    # O-projection, not on MOE_COMBINE: a hop and a task less at the head of
    # the attention chain (the guess: router_combine left it the longer one). The
    # same bits as the norm task's x_norm (the same adds, the same vector
    # path on the device): the logits do not change, at any batch. Measured
    # (forty-fifth session, H100, NMC bs1 8K, engines alternating, beside
    # router_combine): -0.05 % median / -0.2 % mean against router_combine
    # alone (11 engines each, one standard error ~0.2 %): even. On by default
    # beside router_combine because that build keeps nothing in local memory
    # (router_combine alone spills 8 bytes of the dispatch loop at 255
    # registers). With fused_combine as well (the norm sums the experts, no
    # MOE_COMBINE at batch 1) +0.7 %: the norm that gates the up claims'
    # rows ends later
    "qkv_combine": 1,
    # 1: where the router folds the combine (router_combined) with routed
    # claims, the up claims fold the norm that writes their rows too: a
    # claimed tile stages that norm's row itself (MOE_UPGATE_DRAIN flagged
    # NORM_IN and ADD_MOE: the residual, the O-projection partials and the
    # experts added as on a qkv_combine tile, then normalised: the norm
    # task's x_norm bit for bit) instead of reading x_norm. The router's
    # counter, which the claimer waits on, already orders everything that
    # norm reads (the router tiles fold the combine), so the claims wait on
    # nothing: the norm task's hop and run (~2.9 us), and the claims' hop
    # to it, leave the path from a layer's last down claim to its next
    # layer's first expert byte; each claim's CTA sums the row instead
    # (~100 KB of L2 reads, while its ring primes). Measured (forty-sixth
    # session, H100, NMC bs1 8K, engines alternating): +7.0 % (3.1926 /
    # 2.9836 ms, 9 / 10 engines): the norm did not gate the claims (the
    # router and the ranking take as long), and each claim's staging of the
    # row (~4 us) delays its stream by more than its primed ring holds. Off
    "up_combine": 0,
    # full-attention layers' splits as static ATTN_DECODE tasks in schedules
    # of at most this many rows (0: none): sized for the context bucket
    # (attn_splits of the bucket's context per row and KV head, as a sliding
    # layer's are for its window), placed by the wave order and primed before
    # their waits, instead of ATTN_DRAIN claims of the host's attention queue
    # (then not written). Splits past a row's count (the host's split word)
    # write empty partials. Why (forty-seventh session's H100 trace, batch 1):
    # a full layer's claimed split lands its first chunk ~10 us after its
    # hand-off against ~3 for a sliding layer's primed static split, its SMs
    # claim it only after finding the up queue empty, and the full layers run
    # ~10 us longer than the sliding ones for ~2 us more KV. The same split
    # ranges and arithmetic: the same bits. Off: measured (forty-ninth
    # session, H100, NMC batch 1, schedules/experiments/full-static.yaml,
    # kernel ms against the default) 1K -0.4 %, 4K -1.1 %, 8K -0.1 %, 32K
    # +1.8 %, 128K +3.8 %: a static split waits for its KV head's slowest
    # QKV tile and stays on its SM, where claimed ones go to any SM that frees
    "full_static_attn": 0,
    # 1: moe_out (the experts' outputs) is bf16 in every schedule of the
    # model: the down claims round each output as they store it (as
    # transformers' bf16 experts do) and every combine widens it back to fp32
    # before the score-weighted sum. Why: at batch 1 each of a MoE layer's
    # ~80 QKV tiles folds the row's eight expert outputs (64 of its ~104 KB
    # of L2 loads, ~1.2 us of its ~2.7 us fold, fifty-second session) at the
    # head of the attention chain; bf16 halves them. Other bits than fp32's.
    # Not with split_down (its split-K partials stay fp32) nor the combine
    # that polls fp32 words (MEGAC_COMBINE_POLL). Off until measured
    "moe_out_bf16": 0,
}

#: The tiles that give the plain batch-1 schedule of the sessions before the
#: twenty-fifth (no split-K expert down projection, no attention merge in the
#: O-projection), with the router over 4 SMs, one combine task a row and LM
#: head tiles of 256 rows, and the routers and QKV tiles folding the norm
#: rather than the MoE combine (the forty-fifth session's defaults): what a
#: recorded trace or step that names no such key ran.
PLAIN_TILES = {"split_down": 0, "o_proj_merge": 0, "router_splits": 4, "routed_combine_splits": 0, "lm_bn": 256,
               "router_combine": 0, "qkv_combine": 0}

#: K ranges of split-K slices are multiples of this (16-byte bf16 vectors).
K_ALIGN = 8


def qkv_tile_problem(qkv_bn: int, spec) -> str | None:
    """Why ``qkv_bn`` (already clamped to head_dim) cannot tile ``spec``'s
    Q/K/V projection, or None. Part of a head: the tile must divide the head
    into whole 16-row weight stages, and RoPE must rotate pairs of adjacent
    columns (interleaved), since a half-style pair (x[k], x[k + head_dim/2])
    would straddle two tiles."""
    hd = spec.head_dim
    if qkv_bn >= hd:
        return None
    if hd % qkv_bn or qkv_bn % 16:
        return (f"target.tiles.qkv_bn: {qkv_bn} columns: a QKV tile smaller than a head must divide "
                f"head_dim ({hd}) into multiples of 16")
    if spec.rope_style == "half" and any(layer.rope for layer in spec.layers):
        return (f"target.tiles.qkv_bn: {qkv_bn} columns: half-style RoPE rotates x[k] with x[k + head_dim/2], "
                f"so a QKV tile must hold whole heads (qkv_bn >= head_dim {hd})")
    return None


def auto_lm_bn(vocab: int, num_sms: int) -> int:
    """The automatic LM head tile (DEFAULT_TILES lm_bn -1): the largest of
    1024 and 512 vocab rows whose tiles still cover every SM, else 256 (a
    tile's start and end paid fewer times, no SM left without one)."""
    for bn in (1024, 512):
        if _ceil_div(vocab, bn) >= num_sms:
            return bn
    return 256


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _even_bounds(total: int, parts: int, align: int) -> tuple[int, ...]:
    """``parts + 1`` boundaries splitting ``[0, total)`` into near-equal,
    ``align``-aligned, non-empty ranges (fewer parts if ``total`` is small)."""
    units = _ceil_div(total, align)
    parts = max(1, min(parts, units))
    bounds = [min(total, (units * i // parts) * align) for i in range(parts)] + [total]
    return tuple(bounds)


def tiles_of(spec, tiles: dict | None = None) -> dict:
    """``tiles`` where given, else ``spec``'s tile settings: DEFAULT_TILES
    with the target's ``tiles`` over them (what every ``*_at`` rule reads)."""
    return tiles if tiles is not None else {**DEFAULT_TILES, **(getattr(spec.target, "tiles", None) or {})}


def _combine_splits(t: dict, split: bool, routed: bool, hidden: int) -> int:
    """MOE_COMBINE tasks per row: ``routed_combine_splits`` in routed-claim
    schedules that name it, else ``combine_splits`` (-1: 32 with split_down,
    else 1), at most one per 4 features."""
    asked = t["combine_splits"]
    if routed and t["routed_combine_splits"] > 0:
        asked = t["routed_combine_splits"]
    n = (32 if split else 1) if asked < 0 else asked
    return max(1, min(n, hidden // 4))


def fused_combine_at(spec, rows: int, tiles: dict | None = None) -> bool:
    """Whether schedules of ``rows`` rows of ``spec`` do the MoE combine
    inside the norm (the target's ``fused_combine`` tile). One row only:
    there a row's top-k experts are the layer's active experts, so the down
    queue's length is known to the compiler (K x down tiles) and the norm's
    wait on the down claims needs no wait on the finalize task that writes
    it: the O-projection and the down claims are its two waits. With more
    rows that length is a target word, whose writer would be a third."""
    if not spec.moe:
        return False
    return bool(tiles_of(spec, tiles)["fused_combine"]) and rows == 1


def norm_fold_at(spec, rows: int, tiles: dict | None = None) -> bool:
    """Whether schedules of ``rows`` rows of ``spec`` fold norms into their
    GEMM readers (the target's ``norm_fold`` tile: a row bound, 0 none)."""
    if spec.block != "parallel" or not spec.moe:
        return False
    t = tiles_of(spec, tiles)
    # with routed claims the claimers' own wait on the norm orders the next
    # fold's residual slot; without them (a gather task, a per-row combine)
    # the next norm would need a third wait. With the combine inside the norm
    # only where both folding readers add the experts themselves (router_combine
    # and qkv_combine): there is no combine partial to fold then
    combine_ok = not fused_combine_at(spec, rows, t) or bool(t["router_combine"] and t["qkv_combine"])
    return 0 < rows <= t["norm_fold"] and combine_ok and routed_claims_at(spec, rows, t)


#: the automatic split_down (-1) applies to MoE models at least this wide
#: (their split claims stream >= 128 KB of down columns each); narrower
#: models' claims are latency, not bytes
SPLIT_AUTO_MIN_HIDDEN = 1024


def tiled_shapes(qkv_width: int, hidden: int, vocab: int, q_width: int, dense_width: int, experts: int,
                 expert_width: int) -> bool:
    """Whether every GEMM matrix of these widths can be read in the tiled
    device layout (opcodes/gemm_tc.cuh): rows in 16s, K in 32s. The shape
    half of codegen's ``gemm_tiled`` (which also checks each task's tile)."""
    rows = [qkv_width, hidden, vocab, 2 * dense_width, experts, 2 * expert_width]
    ks = [hidden, q_width, dense_width, expert_width]
    return not any(n % 16 for n in rows) and not any(k % 32 for k in ks)


def up_rows(bn: int, expert_width: int) -> int:
    """Gate/up rows of an expert up tile asked as ``bn``: clamped to the
    expert's 2 x width rows (none: a dense model) and even."""
    bn = min(bn, 2 * expert_width) if expert_width else bn
    return bn - bn % 2


def split_up_rows(t: dict, expert_width: int) -> tuple[int, str]:
    """(gate/up rows of a split schedule's up tiles, the tile that named
    them): split_up_bn, else moe_up_bn, clamped to the expert and even."""
    return (up_rows(t["split_up_bn"] or t["moe_up_bn"], expert_width),
            "split_up_bn" if t["split_up_bn"] else "moe_up_bn")


def moe_chunk_rows(t: dict, expert_width: int) -> int:
    """Gate/up rows per interleave chunk of the expert weights (the layout
    every schedule of tiles ``t`` reads: one copy serves every batch size):
    half the greatest common divisor of the plain up tiles and, where some
    schedule splits the down projection, the split's. Each tile then holds
    whole chunks (the last one of the expert may be shorter) and pairs gate
    and up rows chunk by chunk."""
    plain = up_rows(t["moe_up_bn"], expert_width)
    rows = math.gcd(plain, split_up_rows(t, expert_width)[0]) if t["split_down"] else plain
    return max(1, rows // 2)


def split_tile_problem(t: dict, expert_width: int) -> str | None:
    """Why tiles ``t`` cannot split the down projection of experts of
    ``expert_width`` features (None: they can)."""
    if t["fused_combine"]:
        return ("target.tiles: split_down and fused_combine exclude each other (the norm "
                "would have to sum every expert tile's partial)")
    bn, what = split_up_rows(t, expert_width)
    if bn > 256:
        return (f"target.tiles.split_down: up tiles of at most 256 rows (128 features: the "
                f"down slice's rows live in shared memory), got {what} {bn}")
    if (2 * expert_width) % bn:
        return (f"target.tiles.split_down: the up tiles ({what} {bn}) must divide the expert's "
                f"{2 * expert_width} gate/up rows (each tile's features are a down K slice)")
    if (bn // 2) % 32:
        return (f"target.tiles.split_down: an up tile's {bn // 2} features are the down "
                f"projection's K slice, which must be a multiple of 32 ({what} a multiple of 64)")
    return None


def split_down_bound(spec, tiles: dict | None = None) -> int:
    """The row bound of the split-K expert down projection (the target's
    ``split_down`` tile; 0 none). -1 is automatic: 1 (batch 1) for a MoE
    model of hidden size >= SPLIT_AUTO_MIN_HIDDEN whose GEMMs are tiled
    (``tiled_shapes``) and whose split tiles fit (``split_tile_problem``),
    else 0."""
    if not spec.moe:
        return 0
    t = tiles_of(spec, tiles)
    if t["split_down"] >= 0:
        return t["split_down"]
    ew = spec.moe.expert_intermediate_size
    ok = (spec.hidden_size >= SPLIT_AUTO_MIN_HIDDEN
          and tiled_shapes(spec.qkv_width, spec.hidden_size, spec.vocab_size, spec.q_width,
                           spec.dense_intermediate_size or 0, spec.moe.num_experts, ew)
          and split_tile_problem(t, ew) is None)
    return 1 if ok else 0


def split_down_at(spec, rows: int, tiles: dict | None = None) -> bool:
    """Whether schedules of ``rows`` rows of ``spec`` run the expert down
    projection split-K inside the up claims (``split_down_bound``)."""
    return 0 < rows <= split_down_bound(spec, tiles)


def kv_head_major_of(spec) -> bool:
    """Whether the GPU backends keep ``spec``'s KV pools head-major (its
    ``kv_head_major`` tile; every schedule of the model shares the pool)."""
    return bool(tiles_of(spec)["kv_head_major"])


def o_proj_merge_at(spec, rows: int, tiles: dict | None = None) -> bool:
    """Whether schedules of ``rows`` rows of ``spec`` merge the attention
    splits inside the O-projection tiles (the target's ``o_proj_merge``
    tile; -1: batch 1 of MoE models of hidden size >= SPLIT_AUTO_MIN_HIDDEN).
    One row only: a tile waits on its KV head's splits, which signal a
    counter per (row, KV head), and a task has two waits."""
    t = tiles_of(spec, tiles)
    if t["o_proj_merge"] < 0:
        return rows == 1 and bool(spec.moe) and spec.hidden_size >= SPLIT_AUTO_MIN_HIDDEN
    return bool(t["o_proj_merge"]) and rows == 1


def routed_claims_at(spec, rows: int, tiles: dict | None = None) -> bool:
    """Whether schedules of ``rows`` rows of ``spec`` use routed claims (the
    target's ``routed_claims`` tile: a row bound, 0 none)."""
    if not spec.moe:
        return False
    return 0 < rows <= tiles_of(spec, tiles)["routed_claims"]


@dataclass(frozen=True)
class Geometry:
    spec_name: str
    block: str
    rows: int
    context: int
    num_sms: int
    # model
    num_layers: int
    hidden: int
    num_heads: int
    kv_heads: int
    head_dim: int
    heads_per_kv: int
    q_width: int
    kv_width: int
    qkv_width: int
    vocab: int
    dense_width: int
    num_experts: int
    top_k: int
    expert_width: int
    # tiles
    qkv_bn: int
    o_proj_bn: int
    upgate_bn: int
    down_bn: int
    ffn_splits: int
    ffn_split_bounds: tuple[int, ...]
    router_bn: int
    router_splits: int
    router_split_bounds: tuple[int, ...]
    moe_up_bn: int
    moe_down_bn: int
    lm_bn: int
    # attention policy
    attn_split_tokens: int
    attn_max_splits: int
    # per layer
    sliding: tuple[bool, ...]
    window: tuple[int, ...]
    rope: tuple[bool, ...]
    ffn: tuple[str, ...]
    layer_slot: tuple[int, ...]
    rope_half: bool = False
    router_softmax: bool = False
    router_renormalize: bool = False
    #: ROUTE_FINALIZE does the top-k (DEFAULT_TILES' fused_topk)
    fused_topk: bool = False
    #: ROUTE_FINALIZE does the gather (DEFAULT_TILES' fused_gather)
    fused_gather: bool = False
    #: the up claimers rank the rows themselves (DEFAULT_TILES' routed_claims >= rows);
    #: implies fused_topk and no gather at all
    routed_claims: bool = False
    #: ADD_RMSNORM does the MoE combine (DEFAULT_TILES' fused_combine)
    fused_combine: bool = False
    #: layers fold the norm into their QKV and router tiles where ``folded``
    #: says (DEFAULT_TILES' norm_fold >= rows)
    norm_fold: bool = False
    #: the up claims run the down projection split-K (DEFAULT_TILES' split_down >= rows)
    split_down: bool = False
    #: MOE_COMBINE tasks per row (a feature range each): the combine_splits / routed_combine_splits tiles
    combine_splits: int = 1
    #: moe_out's tiles per slot: up_tiles wherever the model splits the down
    #: projection at some batch size (one kernel serves every schedule), else 1
    moe_out_tiles: int = 1
    #: the O-projection tiles merge the attention splits, no ATTN_COMBINE (DEFAULT_TILES' o_proj_merge)
    o_proj_merge: bool = False
    #: gate/up rows per interleave chunk of the expert weights (moe_chunk_rows):
    #: the same in every schedule of a model's tiles
    moe_chunk: int = 1
    #: the GPU backends' KV pools are head-major (DEFAULT_TILES' kv_head_major)
    kv_head_major: bool = False
    #: folded layers' router tiles fold the MoE combine instead (DEFAULT_TILES'
    #: router_combine; see ``router_combined``)
    router_combine: bool = False
    #: the folded QKV tiles add the MoE combine themselves (DEFAULT_TILES'
    #: qkv_combine; see ``qkv_combined``)
    qkv_combine: bool = False
    #: routed up claims fold the norm with the MoE combine (DEFAULT_TILES'
    #: up_combine; see ``up_combined``)
    up_combine: bool = False
    #: full-attention layers' splits are static ATTN_DECODE tasks (DEFAULT_TILES'
    #: full_static_attn >= rows; see ``static_attn``)
    full_static: bool = False
    #: moe_out is bf16 (DEFAULT_TILES' moe_out_bf16; every schedule of a model)
    moe_out_bf16: bool = False

    # ------------------------------------------------------------- builders
    @classmethod
    def from_spec(cls, spec, rows: int, context: int, **tile_overrides) -> "Geometry":
        unknown = set(tile_overrides) - set(DEFAULT_TILES)
        if unknown:
            raise ValueError(f"unknown tile override(s): {sorted(unknown)}")
        t = {**tiles_of(spec), **tile_overrides}
        if rows < 1:
            raise ValueError(f"rows must be >= 1 (got {rows})")
        if context < 1:
            raise ValueError(f"context must be >= 1 (got {context})")
        hidden = spec.hidden_size
        dense_width = spec.dense_intermediate_size or 0
        moe = spec.moe
        experts = moe.num_experts if moe else 0
        expert_width = moe.expert_intermediate_size if moe else 0
        layers = spec.layers

        t["split_down"] = split_down_bound(spec, t)  # -1 (automatic) resolved for this model
        # the split configuration's own tiles (split_up_bn, split_o_proj_bn) where it applies; its
        # up tiles size moe_out's tile axis in every schedule (one kernel serves every batch size)
        split = split_down_at(spec, rows, t)
        split_bn, _ = split_up_rows(t, expert_width)
        # the split's tile rules on the tiles as asked (before the split schedule takes its own)
        problem = split_tile_problem(t, expert_width) if experts and t["split_down"] else None
        if problem:
            raise ValueError(problem)
        if experts and t["moe_out_bf16"] and t["split_down"]:
            raise ValueError("moe_out_bf16 needs split_down 0: the split-K down projection's partials stay fp32")
        moe_chunk = moe_chunk_rows(t, expert_width)  # before the split takes its tiles
        if split:
            t = {**t, "moe_up_bn": split_bn, "o_proj_bn": t["split_o_proj_bn"] or t["o_proj_bn"]}

        # Clamp tiles to the dims they tile (a tile never exceeds its dim).
        qkv_bn = min(t["qkv_bn"], spec.head_dim)
        problem = qkv_tile_problem(qkv_bn, spec)
        if problem:
            asked = "qkv_bn" in tile_overrides or "qkv_bn" in (getattr(spec.target, "tiles", None) or {})
            if asked:
                raise ValueError(problem)
            qkv_bn = spec.head_dim  # the default does not fit this model: whole heads
        o_proj_bn = min(t["o_proj_bn"], hidden)
        named = {**(getattr(spec.target, "tiles", None) or {}), **tile_overrides}
        asked = "o_proj_bn" in named or (split and bool(named.get("split_o_proj_bn")))
        if not asked and hidden % o_proj_bn:
            o_proj_bn = min(64, hidden)  # the default does not divide this model's hidden size: as before
        upgate_bn = min(t["upgate_bn"], 2 * dense_width) if dense_width else t["upgate_bn"]
        upgate_bn -= upgate_bn % 2  # gate half + up half
        down_bn = min(t["down_bn"], hidden)
        router_bn = min(t["router_bn"], experts) if experts else t["router_bn"]
        moe_up_bn = up_rows(t["moe_up_bn"], expert_width)
        moe_down_bn = min(t["moe_down_bn"], hidden)
        lm_bn = t["lm_bn"]
        if lm_bn < 0:  # the LM head tile stages its whole output (lm_bn x 8 fp32) beside the X a split claim stages
            lm_bn = 256 if split_down_bound(spec, t) else auto_lm_bn(spec.vocab_size, spec.target.num_sms)
        lm_bn = min(lm_bn, spec.vocab_size)

        # Dense down split-K boundaries on upgate column-tile boundaries, so a
        # split waits only for the upgate tiles that produce its K range.
        if dense_width:
            half = upgate_bn // 2
            col_tiles = _ceil_div(dense_width, half)
            tb = _even_bounds(col_tiles, t["ffn_splits"], 1)
            ffn_bounds = tuple(min(dense_width, b * half) for b in tb)
        else:
            ffn_bounds = (0, 0)
        router_bounds = _even_bounds(hidden, t["router_splits"], K_ALIGN) if experts else (0, 0)

        slots, nd, nm = [], 0, 0
        for layer in layers:
            if layer.ffn == "dense":
                slots.append(nd)
                nd += 1
            else:
                slots.append(nm)
                nm += 1

        target = spec.target
        routed = routed_claims_at(spec, rows, t)
        return cls(
            spec_name=spec.name,
            block=spec.block,
            rows=rows,
            context=context,
            num_sms=target.num_sms,
            num_layers=spec.num_layers,
            hidden=hidden,
            num_heads=spec.num_heads,
            kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            heads_per_kv=spec.num_heads // spec.num_kv_heads,
            q_width=spec.q_width,
            kv_width=spec.num_kv_heads * spec.head_dim,
            qkv_width=spec.q_width + 2 * spec.num_kv_heads * spec.head_dim,
            vocab=spec.vocab_size,
            dense_width=dense_width,
            num_experts=experts,
            top_k=moe.top_k if moe else 0,
            expert_width=expert_width,
            qkv_bn=qkv_bn,
            o_proj_bn=o_proj_bn,
            upgate_bn=upgate_bn,
            down_bn=down_bn,
            ffn_splits=len(ffn_bounds) - 1,
            ffn_split_bounds=ffn_bounds,
            router_bn=router_bn,
            router_splits=len(router_bounds) - 1,
            router_split_bounds=router_bounds,
            moe_up_bn=moe_up_bn,
            moe_down_bn=moe_down_bn,
            lm_bn=lm_bn,
            attn_split_tokens=target.attn_split_tokens,
            attn_max_splits=target.attn_max_splits,
            sliding=tuple(l.attention == "sliding" for l in layers),
            window=tuple(l.window or 0 for l in layers),
            rope=tuple(bool(l.rope) for l in layers),
            ffn=tuple(l.ffn for l in layers),
            layer_slot=tuple(slots),
            rope_half=spec.rope_style == "half",
            router_softmax=bool(moe and moe.router == "softmax"),
            router_renormalize=bool(moe and moe.renormalize),
            fused_topk=bool(experts and (t["fused_topk"] or routed)),
            fused_gather=bool(experts and t["fused_gather"] and not routed),
            routed_claims=routed,
            fused_combine=fused_combine_at(spec, rows, t),
            norm_fold=norm_fold_at(spec, rows, t),
            split_down=split,
            combine_splits=_combine_splits(t, split, routed, hidden),
            moe_out_tiles=_ceil_div(2 * expert_width, split_bn) if experts and t["split_down"] else 1,
            o_proj_merge=o_proj_merge_at(spec, rows, t),
            moe_chunk=moe_chunk,
            kv_head_major=bool(t["kv_head_major"]),
            # the unnormalised router in every schedule of the model (batch invariance); the fold of
            # the combine where router_combined says
            router_combine=bool(t["router_combine"] and experts) and spec.block == "parallel",
            qkv_combine=bool(t["qkv_combine"] and experts) and spec.block == "parallel",
            up_combine=bool(t["up_combine"] and experts) and spec.block == "parallel",
            full_static=0 < rows <= t["full_static_attn"],
            moe_out_bf16=bool(t["moe_out_bf16"] and experts),
        )

    def with_context(self, context: int) -> "Geometry":
        return replace(self, context=context)

    # ------------------------------------------------------------ attention
    def attn_splits(self, span_tokens: int) -> int:
        """Splits of a row whose attention spans ``span_tokens`` keys. Depends
        only on that row (batch invariance)."""
        return min(self.attn_max_splits, max(1, _ceil_div(span_tokens, self.attn_split_tokens)))

    @cached_property
    def max_window(self) -> int:
        return max((w for w, s in zip(self.window, self.sliding) if s), default=0)

    @cached_property
    def sliding_static_splits(self) -> int:
        if not any(self.sliding):
            return 0
        return self.attn_splits(min(self.context, self.max_window))

    @cached_property
    def full_max_splits(self) -> int:
        return self.attn_splits(self.context)

    @cached_property
    def max_splits(self) -> int:
        return max(self.full_max_splits, self.sliding_static_splits)

    def static_attn(self, layer: int) -> bool:
        """Whether ``layer``'s attention splits are static ATTN_DECODE tasks
        (sliding layers always; full ones where ``full_static``), not claims."""
        return bool(self.sliding[layer] or self.full_static)

    def static_splits(self, layer: int) -> int:
        """Static split tasks per (row, kv head) of ``layer`` (``static_attn``)."""
        return self.sliding_static_splits if self.sliding[layer] else self.full_max_splits

    @cached_property
    def split_signature(self) -> tuple:
        """Two buckets with the same signature compile to the same task words
        (``max_splits`` only sizes a buffer: take the largest bucket's); static
        full-layer splits are sized for the bucket's context."""
        return (self.sliding_static_splits,) + ((self.full_max_splits,) if self.full_static else ())

    @cached_property
    def attn_queue_cap(self) -> int:
        return self.rows * self.kv_heads * self.attn_max_splits

    # ------------------------------------------------------------------ FFN
    @cached_property
    def upgate_col_tiles(self) -> int:
        return _ceil_div(self.dense_width, self.upgate_bn // 2) if self.dense_width else 0

    @cached_property
    def up_tiles(self) -> int:
        return _ceil_div(2 * self.expert_width, self.moe_up_bn) if self.num_experts else 0

    @cached_property
    def down_tiles(self) -> int:
        return _ceil_div(self.hidden, self.moe_down_bn) if self.num_experts else 0

    @cached_property
    def moe_queue_cap(self) -> int:
        if not self.num_experts:
            return 0
        return min(self.num_experts, self.rows * self.top_k) * max(self.up_tiles, self.down_tiles)

    @cached_property
    def lm_tiles(self) -> int:
        return _ceil_div(self.vocab, self.lm_bn)

    # --------------------------------------------------------------- layers
    @cached_property
    def norm_slots(self) -> int:
        return 2 * self.num_layers + 1

    @cached_property
    def final_norm_slot(self) -> int:
        return 2 * self.num_layers

    def norm_input_slot(self, layer: int) -> int:
        """x_norm slot the FFN (and router, gather) of ``layer`` read."""
        return layer if self.block == "parallel" else self.num_layers + layer

    def folded(self, layer: int) -> bool:
        """Whether layer ``layer``'s QKV and router tiles fold the norm that
        writes their x_norm slot (norm_fold; see DEFAULT_TILES)."""
        return (self.norm_fold and self.block == "parallel" and 2 <= layer < self.num_layers
                and self.ffn[layer] == "moe" and self.ffn[layer - 1] == "moe")

    def router_combined(self, layer: int) -> bool:
        """Whether layer ``layer``'s router tiles fold the previous layer's MoE
        combine (COMBINE_IN with NORM_LAYER >= 0, the router_combine tile)
        instead of its norm: a folded layer (``folded``) of a one-row schedule
        (the down claims' count is then the compiler's, so the router's waits
        are the down claims' and the O-projection's) without split_down.
        Elsewhere a router_combine model's routers read the norm's residual
        (NORM_LAYER -1): the same unnormalised input, the same bits."""
        return self.router_combine and self.rows == 1 and not self.split_down and self.folded(layer)

    def qkv_combined(self, layer: int) -> bool:
        """Whether layer ``layer``'s QKV tiles add the previous layer's expert
        outputs in their folded norm themselves (NORM_IN with ADD_MOE, the
        qkv_combine tile): a folded layer of a one-row schedule (the down
        claims' count is the compiler's there) without split_down. Their
        x_norm has the norm task's bits, so no other schedule changes."""
        return self.qkv_combine and self.rows == 1 and not self.split_down and self.folded(layer)

    def up_combined(self, layer: int) -> bool:
        """Whether layer ``layer``'s routed up claims fold the norm that writes
        their rows, the previous layer's MoE combine added (MOE_UPGATE_DRAIN
        flagged NORM_IN and ADD_MOE, the up_combine tile): where the router
        folds the combine (``router_combined``: its counter, the claimer's
        header wait, then orders every plane that norm adds) and the claims
        are routed. The norm task's x_norm bits, so no other schedule
        changes."""
        return self.up_combine and self.routed_claims and self.router_combined(layer)

    def resid_in_slot(self, kind: str, layer: int) -> int:
        """x_resid slot the norm of node ``kind`` ("norm" or "norm_attn") on
        ``layer`` adds its partials to: the previous norm's GAMMA (each norm
        writes its own slot, so every slot is written once per step and a
        reader of the old residual never races the next norm's write)."""
        return layer if kind == "norm_attn" else self.norm_input_slot(layer)

    @property
    def finalize_topk_splits(self) -> int:
        """ROUTE_FINALIZE's TOPK_SPLITS: the router's split count when it
        ranks the rows itself (fused_topk), else 0."""
        return self.router_splits if self.fused_topk else 0

    def finalize_x_slot(self, layer: int) -> int:
        """ROUTE_FINALIZE's X_SLOT on ``layer``: the slot it gathers from
        (fused_gather), else -1."""
        return self.norm_input_slot(layer) if self.fused_gather else -1

    @cached_property
    def dense_layers(self) -> list[int]:
        return [i for i, f in enumerate(self.ffn) if f == "dense"]

    @cached_property
    def moe_layers(self) -> list[int]:
        return [i for i, f in enumerate(self.ffn) if f == "moe"]

    @cached_property
    def full_layers(self) -> list[int]:
        return [i for i, s in enumerate(self.sliding) if not s]

    @cached_property
    def sliding_layers(self) -> list[int]:
        return [i for i, s in enumerate(self.sliding) if s]

    # --------------------------------------------------------- target words
    @cached_property
    def target_words(self) -> abi.TargetWords:
        return abi.TargetWords(self.rows, self.num_layers)

    def dyn_bound(self, word: int) -> int:
        """Upper bound of the value target word ``word`` holds in a step."""
        tw = self.target_words
        if word == tw.attn_queue_len:
            return self.attn_queue_cap
        if 1 <= word < 1 + self.rows:
            return self.full_max_splits
        if 1 + self.rows <= word < tw.host_words:
            return self.sliding_static_splits
        if tw.host_words <= word < tw.total:
            return self.moe_queue_cap
        raise ValueError(f"target word {word} outside the layout (0..{tw.total - 1})")

    def summary(self) -> dict:
        """Plain-data view (manifest, dumps)."""
        out = {}
        for f in fields(self):
            if f.name.startswith("_"):
                continue
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        for name in ("sliding_static_splits", "max_splits", "attn_queue_cap", "up_tiles",
                     "down_tiles", "moe_queue_cap", "lm_tiles", "upgate_col_tiles"):
            out[name] = getattr(self, name)
        return out


__all__ = ["DEFAULT_TILES", "Geometry", "K_ALIGN"]

// Device side of the GEMM family (megac/ops/gemm.py): QKV_PROJ, O_PROJ,
// FFN_UPGATE_ACT, FFN_DOWN, ROUTER_GEMM, LM_HEAD, and the expert tiles the
// MoE claimers run (megac/ops/moe.py). Each reads its fields through the
// generated field indices and runs one tile (gemm_tc.cuh over tiled
// weights, else gemm_rows.cuh) with its epilogue; only rows < the
// schedule's rows (or an expert tile's routed rows) are written.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "attention.cuh"
#include "gemm_ring.cuh"
#include "gemm_rows.cuh"
#include "gemm_tc.cuh"
#include "mk_core.cuh"
#include "mk_layout.cuh"
#include "moe_out.cuh"
#include "ops_norm.cuh"

namespace megac {
namespace mk {

using bf16 = __nv_bfloat16;

// 1: GEMM tiles read their weights through the bulk-copy ring
// (gemm_ring.cuh) wherever a K row fits a stage; 0: the register-fed loop
// of gemm_rows.cuh everywhere. Off: on the H200 the ring ran North Mini
// Code at 10.28 ms (16 x 8 KB stages), 9.14 (8 x 16 KB), 14.0 (32 x 4 KB)
// against 7.86 ms register-fed (batch 1, 8K; docs/perf-notes.md), though
// bit-identical.
#ifndef MEGAC_GEMM_RING
#define MEGAC_GEMM_RING 0
#endif

// 1 (default): a model whose every GEMM tile allows it (M::GEMM_TILED: rows
// in 16s, K in 32s) reads its weights in the tiled device layout on the
// tensor cores (gemm_tc.cuh); 0: row-major weights and the CUDA-core row
// loop (gemm_rows.cuh). The host lays the weights out as the cubin's
// megakernel_weight_layout says (megac/weights/layout.py).
#ifndef MEGAC_TC_GEMM
#define MEGAC_TC_GEMM 1
#endif
template <class M>
constexpr bool kTiled = MEGAC_TC_GEMM && M::GEMM_TILED;

// 1: ROUTER_GEMM tiles flagged COMBINE_IN (abi.py _COMBINE_IN, the
// router_combine tile) stage gamma * x of their K range, x the new residual
// with the previous layer's MoE combine added, unnormalised (ops_norm.cuh
// stage_combine_in), and a ranking ROUTE_FINALIZE so flagged scales the
// selected logits by the row's 1 / rms before the weights (moe_routing.cuh
// rows_inv_rms). Why: the router then waits on the down claims and the
// O-projection, not on MOE_COMBINE and a norm: two hops fewer before the up
// claims rank (geometry.py router_combine). The build exports
// megakernel_router_combine (end of this file). 0: none of it is compiled
// and the default build's machine code is the one before it. It has no
// device check of the flag either: one test of it (a report, or a bare
// __trap) re-scheduled about half of the kernel's SASS, and a report that
// drained the primed ring added 31 KB of code; so a host must not load
// COMBINE_IN tasks into a build without the symbol (such a router would
// stage x_norm, which nothing ordered before it, and the finalize would
// leave the weights unscaled: megac/gpu/backend.py use_cubin refuses
// such a build). Measured (H100, forty-fourth session, TILES rcomb against
// the default, engines alternating, NMC bs1 8K): -2.1 % median / -2.0 %
// mean (23 / 24 engines), with the claims waiting on the norm themselves;
// -1.0 % with that wait in the claimer's header. Every router of such a
// model is unnormalised (NORM_LAYER -1: the norm's residual, where no fold
// applies), so it is batch invariant (checked on an H100, forty-fifth
// session: -2.6 % there), and the tile is on by default (its header
// default, 0, in common.cuh).

// MEGAC_QKV_COMBINE (its default in norm.cuh): 1: QKV_PROJ tiles flagged
// NORM_IN and ADD_MOE (the qkv_combine tile) add the previous layer's
// expert outputs in their folded norm themselves (ops_norm.cuh
// stage_norm_in, norm.cuh moe_add_vec), so they wait on the down claims and
// the O-projection, not on MOE_COMBINE: a hop and a task less at the head
// of the attention chain. The same bits as the norm task's x_norm (the
// same adds, the same vector path). The build exports
// megakernel_qkv_combine (end of this file); as with the router's switch
// the default build has no device check of the flag, and the host refuses
// to load such tasks into a build without the symbol. Codegen sets it where
// a schedule has the tile (on by default since the forty-fifth session,
// with router_combine: even there on an H100, and that build keeps nothing
// in local memory). 0: a build without the tile has the machine code from
// before it.

// MEGAC_UP_COMBINE (its default in norm.cuh): 1: a routed up claimer
// flagged NORM_IN and ADD_MOE (the up_combine tile, one row) has each
// claimed tile stage the norm that writes its rows itself, the previous
// layer's experts added (stage_norm_in's QKV path: the norm task's x_norm
// bits), its ring primed first so the weights stream while the row is
// summed; no claimed task waits (the router, which folds that combine,
// waited on every plane the norm adds, and the claimer waits on the
// router). The norm task's hop and run leave the path to a layer's first
// expert byte. The build exports megakernel_up_combine; as with the other
// folds the default build has no device check of the flag, and the host
// refuses such tasks without the symbol. 0: the code from before it.
// Measured (H100, forty-sixth session, NMC bs1 8K, engines alternating):
// +7.0 %: each claim's staging (~4 us) delays its stream more than the
// norm's hop it saves (the tile stays off: geometry.py up_combine). Its
// build keeps 16 bytes in local memory where MAX_ROWS is 8 (none at 1).

// Where the tensor-core tile's bulk-copy ring starts in the scratch: after
// the partials, aligned up to MEGAC_TC_RING_ALIGN bytes (the scratch itself
// is 1024-aligned, mk_core.cuh). The ring's place moved whole steps (its
// 1 KB copies 16 or 64 bytes past a 128-byte line ran 6-9 % slower at
// batch 8 than on one: eighteenth session); 1024 is a switch, unmeasured.
#ifndef MEGAC_TC_RING_ALIGN
#define MEGAC_TC_RING_ALIGN 128
#endif

// Scratch of a GEMM tile: X staging [8][MAX_KLEN (+ padding)] bf16, ys
// [MAX_NLEN][8] fp32, then the tensor-core tile's K-slice partials, the
// warps' cp.async rings (rows::kStages > 0) or the bulk-copy ring's stages
// when the model uses one. A model whose up claims may run the down
// projection split-K (M::MOE_OUT_TILES > 1) also has the slice's SiLU*up
// rows after the partials, and its X staging holds at least the down
// slice's ys [HIDDEN][8] (the staged X is spent by then).
template <class M>
struct GemmScratch {
  static constexpr bool kTc = kTiled<M>;
  static constexpr bool kSplitDown = kTc && tc::kBulk && M::MOE_OUT_TILES > 1;
  static constexpr bool kRing = !kTc && MEGAC_GEMM_RING && M::MAX_KLEN * 2 <= rows::kRingStageBytes;
  static constexpr int kXBytes =
      (cmax(8 * tc::x_pitch(M::MAX_KLEN) * 2, kSplitDown ? M::HIDDEN * 8 * 4 : 0) + 127) / 128 * 128;
  static constexpr int kYBytes = (M::MAX_NLEN * 8 * 4 + 127) / 128 * 128;
  static constexpr bool kPiped = !kTc && !kRing && rows::kStages > 0;
  // the split-K slice's rows: at most 128 features (geometry: moe_up_bn <= 256)
  static constexpr int kHBytes = kSplitDown ? 8 * tc::x_pitch(128) * 2 : 0;
  static constexpr int kPartBytes = (kTc ? tc::part_bytes(M::THREADS / 32) : 0) + kHBytes;
  static constexpr int kRingOffset =
      (kXBytes + kYBytes + kPartBytes + MEGAC_TC_RING_ALIGN - 1) / MEGAC_TC_RING_ALIGN * MEGAC_TC_RING_ALIGN;
  static constexpr int kBytes = kRingOffset + (kTc ? tc::ring_bytes(M::THREADS / 32) : 0) +
                                (kRing ? rows::kRingBytes : 0) + (kPiped ? rows::pipe_bytes(M::THREADS / 32) : 0);
  __device__ static bf16* xs(const Ctx& c) { return reinterpret_cast<bf16*>(c.scratch); }
  __device__ static float* ys(const Ctx& c) { return reinterpret_cast<float*>(c.scratch + kXBytes); }
  __device__ static uint8_t* ring(const Ctx& c) { return c.scratch + kXBytes + kYBytes; }
  __device__ static uint8_t* pipes(const Ctx& c) { return c.scratch + kXBytes + kYBytes; }
  __device__ static float* part(const Ctx& c) { return reinterpret_cast<float*>(c.scratch + kXBytes + kYBytes); }
  __device__ static bf16* hs(const Ctx& c) {
    return reinterpret_cast<bf16*>(c.scratch + kXBytes + kYBytes + (kTc ? tc::part_bytes(M::THREADS / 32) : 0));
  }
  __device__ static uint8_t* tc_ring(const Ctx& c) { return c.scratch + kRingOffset; }
};

// Rows [n0, n0 + nlen) x columns [k0, k0 + klen) of an [N, K] weight matrix
// at `mat`, in the model's device layout.
template <class M>
__device__ __forceinline__ rows::WeightSpan span(const bf16* mat, int n0, int k0, int nlen, int klen, int k) {
  if constexpr (kTiled<M>)
    return {mat + (int64_t(n0 / 16) * (k / 32) + k0 / 32) * tc::kBlockElems, nlen, klen, k, true};
  else
    return {mat + int64_t(n0) * k + k0, nlen, klen, k, false};
}

// One tile: stage X [rows, k0:k0+klen] from x (row pitch ldx), multiply
// with w (the tile's first weight row at column k0, pitch ldw); the result
// is in GemmScratch::ys.
template <class M>
__device__ __forceinline__ float* gemm(const Ctx& c, const bf16* w, int64_t ldw, const bf16* x, int64_t ldx, int rows,
                                       int nlen, int klen, const int32_t* rowof = nullptr) {
  bf16* xs = GemmScratch<M>::xs(c);
  float* ys = GemmScratch<M>::ys(c);
  rows::stage_x(x, ldx, rows, klen, xs, rowof);
  rows::tile(w, ldw, xs, rows, nlen, klen, ys);
  return ys;
}

#define MK_F(op, name) (c.ts->w[f_##op::name])
#define MK_W(op, name) (w[f_##op::name])

using rows::WeightSpan;

// Where each opcode's tile of weights lies, from its task words `w` (only
// static words: callable before the task's waits, on the next task's words).
template <class M>
__device__ __forceinline__ WeightSpan qkv_proj_weights(const Ctx& c, const int32_t* w) {
  return span<M>(ptr<const bf16>(c.d->w_qkv) + Layout<M>::w_qkv(w[H_LAYER]), MK_W(qkv_proj, N0), MK_W(qkv_proj, K0),
                 MK_W(qkv_proj, N_LEN), MK_W(qkv_proj, K_LEN), M::HIDDEN);
}

template <class M>
__device__ __forceinline__ WeightSpan o_proj_weights(const Ctx& c, const int32_t* w) {
  return span<M>(ptr<const bf16>(c.d->w_o) + Layout<M>::w_o(w[H_LAYER]), MK_W(o_proj, N0), MK_W(o_proj, K0),
                 MK_W(o_proj, N_LEN), MK_W(o_proj, K_LEN), M::Q_WIDTH);
}

template <class M>
__device__ __forceinline__ WeightSpan ffn_upgate_act_weights(const Ctx& c, const int32_t* w) {
  const int slot = ptr<const int32_t>(c.d->layer_slot)[w[H_LAYER]];
  return span<M>(ptr<const bf16>(c.d->w_upgate) + Layout<M>::w_upgate(slot), MK_W(ffn_upgate_act, N0),
                 MK_W(ffn_upgate_act, K0), MK_W(ffn_upgate_act, N_LEN), MK_W(ffn_upgate_act, K_LEN), M::HIDDEN);
}

template <class M>
__device__ __forceinline__ WeightSpan ffn_down_weights(const Ctx& c, const int32_t* w) {
  const int slot = ptr<const int32_t>(c.d->layer_slot)[w[H_LAYER]];
  return span<M>(ptr<const bf16>(c.d->w_down) + Layout<M>::w_down(slot), MK_W(ffn_down, N0), MK_W(ffn_down, K0),
                 MK_W(ffn_down, N_LEN), MK_W(ffn_down, K_LEN), M::DENSE_WIDTH);
}

template <class M>
__device__ __forceinline__ WeightSpan router_gemm_weights(const Ctx& c, const int32_t* w) {
  const int slot = ptr<const int32_t>(c.d->layer_slot)[w[H_LAYER]];
  return span<M>(ptr<const bf16>(c.d->w_router) + Layout<M>::w_router(slot), MK_W(router_gemm, N0),
                 MK_W(router_gemm, K0), MK_W(router_gemm, N_LEN), MK_W(router_gemm, K_LEN), M::HIDDEN);
}

template <class M>
__device__ __forceinline__ WeightSpan lm_head_weights(const Ctx& c, const int32_t* w) {
  return span<M>(ptr<const bf16>(c.d->w_lm_head), MK_W(lm_head, N0), MK_W(lm_head, K0), MK_W(lm_head, N_LEN),
                 MK_W(lm_head, K_LEN), M::HIDDEN);
}

// A claimed expert record's N_TILE with this bit covers its tile and the
// next, one tile twice as long: the up claims' pairs (MEGAC_UP_PAIRS,
// ops_moe.cuh UpPairs) and the down claims' (MEGAC_DOWN_PAIRS, ops_moe.cuh
// DownPairSource); the records' N_TILE is one word (moe_routing.cuh).
constexpr int32_t kClaimPair = 1 << 24;
constexpr int32_t kUpPair = kClaimPair, kDownPair = kClaimPair;

// The first row of a claimed record's tile (N_TILE `n_tile` of tiles of
// `nlen_full` rows), how many rows it covers and how many records: kPaired,
// where the queue's claims may be pairs.
template <bool kPaired>
__device__ __forceinline__ int claim_n0(int32_t n_tile, int nlen_full) {
  if constexpr (kPaired) return (n_tile & (kClaimPair - 1)) * nlen_full;
  return n_tile * nlen_full;
}
template <bool kPaired>
__device__ __forceinline__ int claim_nlen(int32_t n_tile, int nlen_full) {
  if constexpr (kPaired) return (n_tile & kClaimPair) ? 2 * nlen_full : nlen_full;
  return nlen_full;
}
__device__ __forceinline__ int32_t claim_count(int32_t n_tile) { return (n_tile & kClaimPair) ? 2 : 1; }

// The first gate/up row of a claimed up record, and how many it covers.
__device__ __forceinline__ int up_n0(const int32_t* rec, int nlen_full) {
  return claim_n0<(MEGAC_UP_PAIRS > 0)>(rec[rec_moe_up::N_TILE], nlen_full);
}
__device__ __forceinline__ int up_nlen(const int32_t* rec, int nlen_full) {
  return claim_nlen<(MEGAC_UP_PAIRS > 0)>(rec[rec_moe_up::N_TILE], nlen_full);
}

// A claimed expert tile's weights (record {expert, n_tile, slot0, rows}).
template <class M>
__device__ __forceinline__ WeightSpan moe_up_weights(const Ctx& c, const int32_t* rec) {
  const int slot = ptr<const int32_t>(c.d->layer_slot)[c.ts->w[H_LAYER]];
  const int nlen_full = MK_F(moe_upgate_drain, N_LEN);
  const int n0 = up_n0(rec, nlen_full);
  return span<M>(ptr<const bf16>(c.d->w_moe_upgate) + Layout<M>::w_moe_upgate(slot, rec[rec_moe_up::EXPERT]), n0, 0,
                 min(up_nlen(rec, nlen_full), 2 * M::EXPERT_WIDTH - n0), M::HIDDEN, M::HIDDEN);
}

// The first output feature of a claimed down record, and how many it covers.
__device__ __forceinline__ int down_n0(const int32_t* rec, int nlen_full) {
  return claim_n0<(MEGAC_DOWN_PAIRS > 0)>(rec[rec_moe_down::N_TILE], nlen_full);
}
__device__ __forceinline__ int down_nlen(const int32_t* rec, int nlen_full) {
  return claim_nlen<(MEGAC_DOWN_PAIRS > 0)>(rec[rec_moe_down::N_TILE], nlen_full);
}

template <class M>
__device__ __forceinline__ WeightSpan moe_down_weights(const Ctx& c, const int32_t* rec) {
  const int slot = ptr<const int32_t>(c.d->layer_slot)[c.ts->w[H_LAYER]];
  const int nlen_full = MK_F(moe_down_drain, N_LEN);
  const int n0 = down_n0(rec, nlen_full);
  return span<M>(ptr<const bf16>(c.d->w_moe_down) + Layout<M>::w_moe_down(slot, rec[rec_moe_down::EXPERT]), n0, 0,
                 min(down_nlen(rec, nlen_full), M::HIDDEN - n0), M::EXPERT_WIDTH, M::EXPERT_WIDTH);
}

// 1: while the task before an O-projection tile runs (its attention split
// on the split configuration's attention SMs), one warp pulls the tile's
// whole weight span into L2 (cp.async.bulk.prefetch.L2, 32 KB a 16-row
// group), so the tile streams it from L2 after its waits instead of from
// HBM at the end of the layer (needs MEGAC_PREFETCH 2: the next task's
// words in shared memory). 0: off.
#ifndef MEGAC_OPROJ_L2
#define MEGAC_OPROJ_L2 0
#endif

// A tiled weight span into L2, one 16-row group (its K slice: one
// contiguous run) a lane of 32 at a time; kEvictLast: with an evict_last
// policy. Untiled spans are left alone.
template <bool kEvictLast = false>
__device__ __forceinline__ void tiled_span_l2(const WeightSpan& s, int lane) {
  if (!s.tiled) return;
  uint64_t policy = 0;
  if constexpr (kEvictLast) policy = l2_evict_last_policy();
  for (int rg = lane; rg < (s.rows + 15) / 16; rg += 32) {
    if constexpr (kEvictLast) {
      prefetch_l2_hint(s.p + int64_t(rg) * 16 * s.ld, uint32_t(s.cols) * 32u, policy);
    } else {
      prefetch_l2(s.p + int64_t(rg) * 16 * s.ld, uint32_t(s.cols) * 32u);
    }
  }
}

#if MEGAC_SLOTS_EARLY && MEGAC_UP_COMBINE
// stage_norm_in marks a folding up claim's row as preloaded, which slots_early never loads
#error "MEGAC_SLOTS_EARLY preloads no up claim's slots: not with MEGAC_UP_COMBINE"
#endif
#if MEGAC_SLOTS_EARLY
// MEGAC_SLOTS_EARLY (norm.cuh; a timing probe, unordered): lane `lane` of
// warp 1 loads entry `lane` of row 0's slots and scores of a task that
// reads them (`w`: a QKV tile with NORM_IN and ADD_MOE, a router tile with
// COMBINE_IN and NORM_LAYER >= 0, a MOE_COMBINE) into the words it reads
// them from, before the task's waits (the header-wait barrier publishes them).
template <class M>
__device__ __forceinline__ void slots_early(const Ctx& c, const int32_t* w, int lane) {
  if constexpr (M::NUM_EXPERTS > 0) {
    using Lay = Layout<M>;
    if (c.d->rows != 1 || lane >= M::TOP_K) return;
    const int op = w[H_OPCODE], flags = w[H_FLAGS];
    float* ys = GemmScratch<M>::ys(c);
    int32_t* rs;
    float* rw;
    int layer;
    if (op == OP_QKV_PROJ && (flags & FLAG_NORM_IN) && (flags & FLAG_ADD_MOE)) {
      layer = w[f_qkv_proj::NORM_LAYER];
      rs = reinterpret_cast<int32_t*>(ys + 64);
      rw = ys + 64 + norm::kMoeMaxK;
    } else if (op == OP_ROUTER_GEMM && (flags & FLAG_COMBINE_IN) && w[f_router_gemm::NORM_LAYER] >= 0) {
      layer = w[f_router_gemm::NORM_LAYER];
      rs = reinterpret_cast<int32_t*>(ys);
      rw = ys + M::MAX_ROWS * M::TOP_K;
    } else if (op == OP_MOE_COMBINE && !(flags & FLAG_SPLIT_DOWN) && !MEGAC_COMBINE_POLL) {
      layer = w[H_LAYER];  // moe::combine_row's words: slots at scratch[0..k), scores at scratch[32..]
      rs = reinterpret_cast<int32_t*>(c.scratch);
      rw = reinterpret_cast<float*>(c.scratch) + 32;
    } else {
      return;
    }
    const int32_t slot = __ldcg(ptr<const int32_t>(c.d->route_slot) + Lay::topk(layer, 0) + lane);
    const float wt = __ldcg(ptr<const float>(c.d->topk_w) + Lay::topk(layer, 0) + lane);
    rs[lane] = slot;
    rw[lane] = wt;
  }
}
#endif

// The O-projection tile of words `w` into L2, spread over 32 lanes.
template <class M>
__device__ __forceinline__ void oproj_l2(const Ctx& c, const int32_t* w, int lane) {
  tiled_span_l2(o_proj_weights<M>(c, w), lane);
}

// 1: a QKV tile, as it starts (after its prime's copies, before its waits:
// at batch 1 that is the previous layer's tail, where its SM's down claim or
// O-projection tile ended), has warp 1 pull its whole weight span into L2
// (cp.async.bulk.prefetch.L2, one 16-row group a lane); 2: the same with an
// evict_last policy. Why (fortieth session's H200 trace): a sliding layer's last ~10 us
// carry under 1 TB/s while its first ~4 us stream the next layer's 21 MB
// of QKV weights at ~4 TB/s from HBM, on the QKV SMs whose up claims end the
// up phase; from L2 that head is shorter. Unlike the L2 prefetches that
// lost (tenth, eleventh, thirteenth, twenty-first sessions), these bytes
// go out while HBM idles, not beside the critical stream. Weights are
// read-only during a launch: no effect on any value. Measured (H200, NMC 8K
// bs1, engines alternating, forty-first session): +1.2 % (8 engines a side;
// evict_last +0.4 % in one): a fifth prefetch lost, even into the idle
// tail. 0: off.
#ifndef MEGAC_QKV_L2
#define MEGAC_QKV_L2 0
#endif

// The QKV tile of words `w` (as compiled) into L2, spread over 32 lanes.
template <class M>
__device__ __forceinline__ void qkv_l2(const Ctx& c, const int32_t* w, int lane) {
  tiled_span_l2<MEGAC_QKV_L2 == 2>(qkv_proj_weights<M>(c, w), lane);
}

// Stages per warp a merging O-projection tile (O_PROJ.MERGE_SPLITS) primes
// before its waits (at most tc::kStages): its merge's small partial loads,
// issued after the waits, queue behind whatever of its own weight copies is
// still in flight (twenty-fifth session: with the whole ring primed the
// slowest KV head's merge took ~7 us, one round trip elsewhere).
#ifndef MEGAC_MERGE_PRIME
#define MEGAC_MERGE_PRIME 1
#endif

// Stages per warp a QKV tile primes before its waits (-1: the whole ring,
// as every other static GEMM task; 0: none, the tile's ring streams after
// its fold). Why fewer: at a MoE layer's head ~80 QKV tiles prime 128 KB
// each (~10 MB of HBM reads) as the previous layer's down claims end, the
// moment the layer's folds and routing, all round trips, start; a QKV
// tile's fold takes ~2.5 us in the megakernel against ~1.5 us for the same
// bytes on a quiet machine (fifty-second session: fold_l2, MEGAC_FOLD_MARKS).
// Measured (H100, NMC 8K, engines alternating, three calls, 9-12 engines a
// side): 1 stage bs1 -0.59 / -0.73 / -0.57 % (median), bs8 +0.03 %; none
// +1.4 % (the GEMM then starts a round trip late). The generated source sets
// 1 where the QKV tiles fold the combine (megac/codegen/megakernel.py
// switch_defaults), -1 elsewhere (the builds measured before it).
#ifndef MEGAC_QKV_PRIME
#define MEGAC_QKV_PRIME -1
#endif

// How many stages per warp the dispatcher primes for the static task `w`
// (its words as compiled: MERGE_SPLITS may still be a target-word reference).
template <class M>
__device__ __forceinline__ int prime_stages(const int32_t* w) {
#if MEGAC_QKV_PRIME >= 0
  static_assert(MEGAC_QKV_PRIME <= tc::kStages, "a QKV tile primes at most its ring");
  if (w[H_OPCODE] == OP_QKV_PROJ) return MEGAC_QKV_PRIME;
#endif
  return w[H_OPCODE] == OP_O_PROJ && w[f_o_proj::MERGE_SPLITS] != 0 ? MEGAC_MERGE_PRIME : tc::kStages;
}

// The first chunks of a static GEMM task's tile into its warps' pipelines,
// before the task's waits (every thread; the generated Dispatch::prime).
// True when it primed: the task's gemm() then goes on from there (Ctx::primed).
template <class M>
__device__ __forceinline__ bool prime_gemm(const Ctx& c, const WeightSpan& s, int stages = tc::kStages) {
#if MEGAC_QKV_PRIME == 0
  if (stages == 0) return false;  // not primed: the tile issues its ring itself
#endif
  if constexpr (GemmScratch<M>::kTc && tc::kBulk) {
    tc::prime(s, GemmScratch<M>::tc_ring(c), &c.ts->tc, stages);
#if MEGAC_TC_WARM
    // tile_bulk's prologue run once before the waits, its code fetched (gemm_tc.cuh MEGAC_TC_WARM)
    tc::tile_bulk(s, nullptr, -1, nullptr, nullptr, GemmScratch<M>::tc_ring(c), &c.ts->tc, true);
#endif
    return true;
  } else if constexpr (GemmScratch<M>::kPiped && rows::kEarly) {
    rows::prime(s, GemmScratch<M>::pipes(c));
    return true;
  }
  return false;
}

// A merging O-projection tile's input (O_PROJ.MERGE_SPLITS, schedules of one
// row): the n attention splits of KV head kvh of `layer`, merged here (n 0:
// the tile reads attn_out). Passed by value, like NormIn.
struct MergeIn {
  int n, kvh, layer;
};

// Where a merge may work in a GEMM tile's scratch: after the staged row, up
// to what the weight pipelines use (the tensor-core ring, primed before the
// task's waits, starts at kRingOffset; else the X staging's end).
template <class M>
struct MergeScratch {
  static constexpr int kEnd =
      GemmScratch<M>::kTc && tc::kBulk ? GemmScratch<M>::kRingOffset : GemmScratch<M>::kXBytes;
  static constexpr int kRowBytes = (tc::x_pitch(M::GQA * M::HEAD_DIM) * 2 + 127) / 128 * 128;
  static constexpr bool kFits = kEnd - kRowBytes >= attn::combine_min_bytes<M::HEAD_DIM, M::GQA>(M::MAX_SPLITS);
};

// Row 0 of the staged input (pitch elements a row) = the merge of `mi`'s
// splits, the bits ATTN_COMBINE writes to attn_out (attn::merge_into); the
// whole CTA, ending with a barrier. Its scratch: after the staged row.
template <class M>
__device__ __forceinline__ void stage_merge(const Ctx& c, const MergeIn& mi, int pitch, bf16* xs) {
  using Lay = Layout<M>;
  static_assert(MergeScratch<M>::kFits, "a merging O-projection's scratch holds the merge");
  const int start = (pitch * 2 + 127) / 128 * 128;
  attn::merge_into<M::HEAD_DIM, M::GQA, M::THREADS, 0>(
      ptr<const float>(c.d->attn_o_part) + Lay::o_part_attn(mi.layer, 0, 0, 0),
      ptr<const float>(c.d->attn_lse_part) + Lay::lse_part(mi.layer, 0, 0, 0), xs, M::MAX_ROWS, M::NUM_HEADS, 0,
      mi.kvh, mi.n, reinterpret_cast<char*>(c.scratch) + start, MergeScratch<M>::kEnd - start, threadIdx.x);
}

// gemm() over a WeightSpan: its rows are the tile's features, its columns
// K; on the tensor cores over tiled weights (default where the model allows),
// else through the register-fed loop, the warps' cp.async pipelines
// (MEGAC_GEMM_STAGES) or the bulk-copy ring (MEGAC_GEMM_RING). A task's one tile continues
// what the dispatcher primed (c.primed).
template <class M>
__device__ __forceinline__ float* gemm(const Ctx& c, const WeightSpan& s, const bf16* x, int64_t ldx, int rows,
                                       const int32_t* rowof = nullptr, bool folded = false, NormIn fold = {},
                                       MergeIn merge = {}) {
  if constexpr (GemmScratch<M>::kTc) {
    bf16* xs = GemmScratch<M>::xs(c);
    float* ys = GemmScratch<M>::ys(c);
    bool primed = c.primed;
    if (tc::kBulk && c.x_issued) {  // its X copies and ring stages went out before the claim loop
      asm volatile("cp.async.wait_all;\n" ::: "memory");
      MEGAC_MARK(9);  // thread 0's X load returned
      __syncthreads();
    } else if (folded) {
      stage_norm_in<M>(c, fold, rows, s.cols, xs, tc::x_pitch(s.cols), ys);
    } else if (merge.n > 0) {
      if (tc::kBulk && !primed) {  // the weights stream while the partials are merged
        tc::prime(s, GemmScratch<M>::tc_ring(c), &c.ts->tc);
        primed = true;
      }
      MEGAC_MARK(10);  // thread 0's ring stages issued (or primed before the waits)
      stage_merge<M>(c, merge, tc::x_pitch(s.cols), xs);
    } else if (tc::kBulk && MEGAC_X_THEN_PRIME && !primed) {
      tc::stage_x_prime(x, ldx, rows, s.cols, xs, rowof, s, GemmScratch<M>::tc_ring(c), &c.ts->tc);
      primed = true;
    } else {
      tc::stage_x(x, ldx, rows, s.cols, xs, rowof);
    }
    MEGAC_MARK(2);  // the activations staged in shared memory
    if constexpr (tc::kBulk)
      tc::tile_bulk(s, xs, rows, ys, GemmScratch<M>::part(c), GemmScratch<M>::tc_ring(c), &c.ts->tc, primed);
    else
      tc::tile(s.p, int(s.ld / 32), xs, rows, s.rows, s.cols, ys, GemmScratch<M>::part(c));
    return ys;
  } else if constexpr (GemmScratch<M>::kPiped) {
    bf16* xs = GemmScratch<M>::xs(c);
    float* ys = GemmScratch<M>::ys(c);
    if (folded)
      stage_norm_in<M>(c, fold, rows, s.cols, xs, s.cols, ys);
    else if (merge.n > 0)
      stage_merge<M>(c, merge, s.cols, xs);
    else
      rows::stage_x(x, ldx, rows, s.cols, xs, rowof);
    rows::tile_piped(s, xs, rows, ys, GemmScratch<M>::pipes(c), c.primed);
    return ys;
  } else if constexpr (GemmScratch<M>::kRing) {
    bf16* xs = GemmScratch<M>::xs(c);
    float* ys = GemmScratch<M>::ys(c);
    // this thread's earlier generic writes to the scratch (another opcode's)
    // before the copy engine writes the ring there; stage_x's barrier follows
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    if (folded)
      stage_norm_in<M>(c, fold, rows, s.cols, xs, s.cols, ys);
    else if (merge.n > 0)
      stage_merge<M>(c, merge, s.cols, xs);
    else
      rows::stage_x(x, ldx, rows, s.cols, xs, rowof);
    rows::tile_ring(s, xs, rows, ys, GemmScratch<M>::ring(c), &c.ts->ring, &c.ts->ok, c.site);
    return ys;
  } else {
    if (folded || merge.n > 0) {
      bf16* xs = GemmScratch<M>::xs(c);
      float* ys = GemmScratch<M>::ys(c);
      if (folded)
        stage_norm_in<M>(c, fold, rows, s.cols, xs, s.cols, ys);
      else
        stage_merge<M>(c, merge, s.cols, xs);
      rows::tile(s.p, s.ld, xs, rows, s.rows, s.cols, ys);
      return ys;
    }
    return gemm<M>(c, s.p, s.ld, x, ldx, rows, s.rows, s.cols, rowof);
  }
}

// The folded norm of a QKV_PROJ / ROUTER_GEMM task (op: the field
// namespace): its NORM_* fields, the x_norm slot the norm writes and the
// task's K0; gemm() stages it where the task is flagged NORM_IN (passed by
// value: a pointer to it would put it in local memory).
#define MK_NORM_IN(op, slot_)                                                                            \
  NormIn{MK_F(op, NORM_LAYER), MK_F(op, NORM_ATTN_SPLITS), MK_F(op, NORM_FFN_SPLITS), MK_F(op, NORM_RESID_IN), \
         (slot_), MK_F(op, K0)}

template <class M>
__device__ __forceinline__ void qkv_proj(const Ctx& c) {
  using Lay = Layout<M>;
  const LaunchDesc* d = c.d;
  const int layer = c.ts->w[H_LAYER], flags = c.ts->w[H_FLAGS];
  const int n0 = MK_F(qkv_proj, N0), nlen = MK_F(qkv_proj, N_LEN);
  const bf16* x = ptr<const bf16>(d->x_norm) + Lay::x_norm(layer, 0) + MK_F(qkv_proj, K0);
#if MEGAC_QKV_COMBINE
  // NORM_IN with ADD_MOE: the folded norm adds the MoE combine itself
  // (ops_norm.cuh stage_norm_in; its slots, scores and MoeRow in ys)
  static_assert((64 + 2 * norm::kMoeMaxK) * 4 + sizeof(norm::MoeRow) <= GemmScratch<M>::kYBytes,
                "the folded combine's words fit ys");
  NormIn fold = MK_NORM_IN(qkv_proj, layer);
  fold.moe = (flags & FLAG_ADD_MOE) != 0;
#else
  const NormIn fold = MK_NORM_IN(qkv_proj, layer);
#endif
  const float* ys = gemm<M>(c, qkv_proj_weights<M>(c, c.ts->w), x, M::HIDDEN, d->rows, nullptr,
                            (flags & FLAG_NORM_IN) != 0, fold);
  rows::QkvOut a;
  a.seq_pos = ptr<const int32_t>(d->seq_pos);
  a.row_active = ptr<const int32_t>(d->row_active);
  a.inv_freq = ptr<const float>(d->rope_inv_freq);
  a.page_table = ptr<const int32_t>(d->page_table) + int64_t(layer) * M::MAX_ROWS * d->max_blocks_per_seq;
  a.max_pages = d->max_blocks_per_seq;
  a.block_size = d->kv_block_size;
  a.q_heads = M::NUM_HEADS;
  a.kv_heads = M::KV_HEADS;
  a.hd = M::HEAD_DIM;
  a.rope = (flags & FLAG_ROPE) != 0;
  a.rope_half = (flags & FLAG_ROPE_HALF) != 0;
  a.q = ptr<bf16>(d->q) + Lay::q(layer, 0);
  a.q_ld = M::Q_WIDTH;
  a.k_pool = ptr<bf16>(d->k_pool);
  a.v_pool = ptr<bf16>(d->v_pool);
  a.head_major = M::KV_HEAD_MAJOR;
  rows::qkv(ys, n0, nlen, d->rows, a);
}

template <class M>
__device__ __forceinline__ void o_proj(const Ctx& c) {
  using Lay = Layout<M>;
  const LaunchDesc* d = c.d;
  const int layer = c.ts->w[H_LAYER];
  const int n0 = MK_F(o_proj, N0), nlen = MK_F(o_proj, N_LEN), split = MK_F(o_proj, SPLIT);
  const bf16* x = ptr<const bf16>(d->attn_out) + Lay::attn_out(layer, 0) + MK_F(o_proj, K0);
  // MERGE_SPLITS (resolved): the KV head's splits merged into the input here, no ATTN_COMBINE
  const MergeIn merge{MK_F(o_proj, MERGE_SPLITS), split, layer};
  const float* ys = gemm<M>(c, o_proj_weights<M>(c, c.ts->w), x, M::Q_WIDTH, d->rows, nullptr, false, {}, merge);
  rows::store<float>(ys, ptr<float>(d->o_part) + Lay::o_part(layer, split, 0) + n0, M::HIDDEN, d->rows, nlen);
}

template <class M>
__device__ __forceinline__ void ffn_upgate_act(const Ctx& c) {
  using Lay = Layout<M>;
  const LaunchDesc* d = c.d;
  const int layer = c.ts->w[H_LAYER];
  const int nlen = MK_F(ffn_upgate_act, N_LEN);
  const int out0 = MK_F(ffn_upgate_act, OUT0), xslot = MK_F(ffn_upgate_act, X_SLOT);
  const bf16* x = ptr<const bf16>(d->x_norm) + Lay::x_norm(xslot, 0) + MK_F(ffn_upgate_act, K0);
  const float* ys = gemm<M>(c, ffn_upgate_act_weights<M>(c, c.ts->w), x, M::HIDDEN, d->rows);
  rows::silu_mul(ys, ptr<bf16>(d->ffn_act) + Lay::ffn_act(layer, 0) + out0, M::DENSE_WIDTH, d->rows, nlen);
}

template <class M>
__device__ __forceinline__ void ffn_down(const Ctx& c) {
  using Lay = Layout<M>;
  const LaunchDesc* d = c.d;
  const int layer = c.ts->w[H_LAYER];
  const int n0 = MK_F(ffn_down, N0), nlen = MK_F(ffn_down, N_LEN), split = MK_F(ffn_down, SPLIT);
  const bf16* x = ptr<const bf16>(d->ffn_act) + Lay::ffn_act(layer, 0) + MK_F(ffn_down, K0);
  const float* ys = gemm<M>(c, ffn_down_weights<M>(c, c.ts->w), x, M::DENSE_WIDTH, d->rows);
  rows::store<float>(ys, ptr<float>(d->ffn_part) + Lay::ffn_part(layer, split, 0) + n0, M::HIDDEN, d->rows, nlen);
}

template <class M>
__device__ __forceinline__ void router_gemm(const Ctx& c) {
  using Lay = Layout<M>;
  const LaunchDesc* d = c.d;
  const int layer = c.ts->w[H_LAYER];
  const int n0 = MK_F(router_gemm, N0), nlen = MK_F(router_gemm, N_LEN), split = MK_F(router_gemm, SPLIT);
  const int xslot = MK_F(router_gemm, X_SLOT);
  const bf16* x = ptr<const bf16>(d->x_norm) + Lay::x_norm(xslot, 0) + MK_F(router_gemm, K0);
#if MEGAC_ROUTER_COMBINE
  // COMBINE_IN: the MoE combine and the residual folded, gamma * x staged
  // unnormalised (ops_norm.cuh stage_combine_in); its slots and scores in ys
  static_assert(2 * M::MAX_ROWS * M::TOP_K * 4 <= GemmScratch<M>::kYBytes, "the combine's slots fit ys");
  NormIn fold = MK_NORM_IN(router_gemm, xslot);
  fold.combine = (c.ts->w[H_FLAGS] & FLAG_COMBINE_IN) != 0;
  const bool folded = (c.ts->w[H_FLAGS] & (FLAG_NORM_IN | FLAG_COMBINE_IN)) != 0;
#else
  const NormIn fold = MK_NORM_IN(router_gemm, xslot);
  const bool folded = (c.ts->w[H_FLAGS] & FLAG_NORM_IN) != 0;
#endif
  const float* ys = gemm<M>(c, router_gemm_weights<M>(c, c.ts->w), x, M::HIDDEN, d->rows, nullptr, folded, fold);
  rows::store<float>(ys, ptr<float>(d->router_part) + Lay::router_part(layer, split, 0) + n0, M::NUM_EXPERTS,
                     d->rows, nlen);
}

template <class M>
__device__ __forceinline__ void lm_head(const Ctx& c) {
  using Lay = Layout<M>;
  const LaunchDesc* d = c.d;
  const int n0 = MK_F(lm_head, N0), nlen = MK_F(lm_head, N_LEN);
  const bf16* x = ptr<const bf16>(d->x_norm) + Lay::x_norm(M::NORM_SLOTS - 1, 0) + MK_F(lm_head, K0);
  const float* ys = gemm<M>(c, lm_head_weights<M>(c, c.ts->w), x, M::HIDDEN, d->rows);
  rows::lm_head(ys, ptr<float>(d->logits), M::VOCAB, n0, nlen, d->rows, M::LM_BN,
                ptr<ArgmaxRecord>(d->argmax_part), M::LM_TILES);
}

// SPLIT_DOWN: the up tile's SiLU*up features (nlen / 2 from feature n0 / 2,
// rounded to bf16 as moe_act holds them) times their columns of the expert's
// down matrix, every hidden feature: the tile's split-K partial of the
// expert's output, into moe_out tile N_TILE. The down slice's first stages
// go out before the SiLU (the ring is free once the up tile's stages are
// consumed), so its stream follows the up stream without a round trip.
template <class M>
__device__ __forceinline__ void moe_split_down(const Ctx& c, const float* ys, int nlen, int n0, int s0, int nr) {
  using Lay = Layout<M>;
  const LaunchDesc* d = c.d;
  const int layer = c.ts->w[H_LAYER], tile = c.ts->rec[rec_moe_up::N_TILE];
  const int slot = ptr<const int32_t>(d->layer_slot)[layer];
  const WeightSpan ds = span<M>(ptr<const bf16>(d->w_moe_down) + Lay::w_moe_down(slot, c.ts->rec[rec_moe_up::EXPERT]),
                                0, n0 / 2, M::HIDDEN, nlen / 2, M::EXPERT_WIDTH);
  uint8_t* ring = GemmScratch<M>::tc_ring(c);
  tc::prime_packed(ds, ring, &c.ts->tc);
  bf16* hs = GemmScratch<M>::hs(c);
  rows::silu_mul(ys, hs, tc::x_pitch(nlen / 2), nr, nlen, M::MOE_CHUNK);
  __syncthreads();
  float* yd = reinterpret_cast<float*>(GemmScratch<M>::xs(c));  // the up tile's staged X is spent
  tc::tile_packed(ds, hs, nr, yd, ring, &c.ts->tc, true);
  rows::store<float>(yd, ptr<float>(d->moe_out) + Lay::moe_out(layer, s0) + int64_t(tile) * M::HIDDEN,
                     int64_t(M::MOE_OUT_TILES) * M::HIDDEN, nr, M::HIDDEN);
}

#if MEGAC_UP_COMBINE
// The norm a folding up claimer's tiles stage (its words `w`): its NORM_*
// fields, x_norm slot `xslot`, the whole row (an expert tile's K), the
// experts of NORM_LAYER added.
__device__ __forceinline__ NormIn up_fold_of(const int32_t* w, int xslot) {
  NormIn f{w[f_moe_upgate_drain::NORM_LAYER], w[f_moe_upgate_drain::NORM_ATTN_SPLITS],
           w[f_moe_upgate_drain::NORM_FFN_SPLITS], w[f_moe_upgate_drain::NORM_RESID_IN], xslot, 0};
  f.moe = true;
  return f;
}

// A folding up claim's input (NORM_IN with ADD_MOE on a routed claimer of
// one row): its ring primed first, so the weights stream while the row is
// summed, then the norm that writes x_norm slot `xslot` staged into the
// tile's X by the QKV fold's path (stage_norm_in with the experts of the
// claimer's NORM_LAYER added: the norm task's bits); the router's counter
// (the claimer's header wait) ordered every plane it adds. Whole CTA, ends
// with stage_norm_in's barrier. Not inlined: inlined into the claim loop it
// pushed the megakernel (255 registers) into 84 bytes of spills; its Ctx
// rebuilt from pieces (a reference to the caller's would put that in local
// memory).
template <class M>
__device__ __noinline__ void up_fold_stage(const LaunchDesc* d, TaskShared* ts, uint8_t* scratch,
                                           const rows::WeightSpan s, int xslot, int rows) {
  const Ctx c{d, ts, scratch, 0, WaitSite{}, false};
  // the ranking's generic writes to the scratch before the copy engine writes the ring there
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  tc::prime(s, GemmScratch<M>::tc_ring(c), &ts->tc);
  MEGAC_MARK(10);  // thread 0's ring stages issued
  stage_norm_in<M>(c, up_fold_of(ts->w, xslot), rows, s.cols, GemmScratch<M>::xs(c), tc::x_pitch(s.cols),
                   GemmScratch<M>::ys(c));
}
#endif

// A claimed expert tile: record {expert, n_tile, slot0, rows}; the routed
// rows are slots slot0 .. slot0 + rows - 1 of moe_x / moe_act / moe_out.
// A routed claim (MOE_UPGATE_DRAIN with ROUTE_SPLITS > 0, ops_moe.cuh) reads
// them where they lie instead: row m of the tile is batch row
// rowof[slot0 + m] of x_norm slot `xslot`. Never primed (the claimer task's
// own c.primed is false).
template <class M>
__device__ __forceinline__ void moe_up_tile(const Ctx& c, const int32_t* rowof = nullptr, int xslot = 0) {
  using Lay = Layout<M>;
  const LaunchDesc* d = c.d;
  const int layer = c.ts->w[H_LAYER];
  const int s0 = c.ts->rec[rec_moe_up::SLOT0], nr = c.ts->rec[rec_moe_up::ROWS];
  const int n0 = up_n0(c.ts->rec, MK_F(moe_upgate_drain, N_LEN));
  const WeightSpan ws = moe_up_weights<M>(c, c.ts->rec);
  MEGAC_MARK(11);  // the claimed tile's weight span known
  const bf16* x = rowof != nullptr ? ptr<const bf16>(d->x_norm) + Lay::x_norm(xslot, 0)
                                   : ptr<const bf16>(d->moe_x) + Lay::moe_x(layer, s0);
#if MEGAC_UP_COMBINE
  // NORM_IN with ADD_MOE (a routed claimer of one row, abi.py): the tile
  // stages the norm that writes x_norm slot xslot itself; on the bulk-copy
  // ring through up_fold_stage, then as a claim whose X and first stages
  // were issued early; else through gemm()'s folded staging
  const bool folded = rowof != nullptr && (c.ts->w[H_FLAGS] & FLAG_NORM_IN) != 0;
  const float* ys;
  if constexpr (GemmScratch<M>::kTc && tc::kBulk) {
    Ctx g = c;
    if (folded) {
      up_fold_stage<M>(c.d, c.ts, c.scratch, ws, xslot, nr);
      g.primed = true;
      g.x_issued = true;
    }
    ys = gemm<M>(g, ws, x, M::HIDDEN, nr, rowof != nullptr ? rowof + s0 : nullptr);
  } else {
    ys = gemm<M>(c, ws, x, M::HIDDEN, nr, rowof != nullptr ? rowof + s0 : nullptr, folded,
                 up_fold_of(c.ts->w, xslot));
  }
#else
  const float* ys = gemm<M>(c, ws, x, M::HIDDEN, nr, rowof != nullptr ? rowof + s0 : nullptr);
#endif
  if constexpr (GemmScratch<M>::kSplitDown) {
    if (c.ts->w[H_FLAGS] & FLAG_SPLIT_DOWN) {
      moe_split_down<M>(c, ys, ws.rows, n0, s0, nr);
      return;
    }
  }
  rows::silu_mul(ys, ptr<bf16>(d->moe_act) + Lay::moe_act(layer, s0) + n0 / 2, M::EXPERT_WIDTH, nr, ws.rows,
                 M::MOE_CHUNK);
}

template <class M>
__device__ __forceinline__ void moe_down_tile(const Ctx& c) {
  using Lay = Layout<M>;
  const LaunchDesc* d = c.d;
  const int layer = c.ts->w[H_LAYER];
  const int s0 = c.ts->rec[rec_moe_down::SLOT0], nr = c.ts->rec[rec_moe_down::ROWS];
  const int n0 = down_n0(c.ts->rec, MK_F(moe_down_drain, N_LEN));
  const WeightSpan ws = moe_down_weights<M>(c, c.ts->rec);
  const bf16* x = ptr<const bf16>(d->moe_act) + Lay::moe_act(layer, s0);
  const float* ys = gemm<M>(c, ws, x, M::EXPERT_WIDTH, nr);
  moe_out_t* y = ptr<moe_out_t>(d->moe_out) + Lay::moe_out(layer, s0) + n0;
  if constexpr (MEGAC_COMBINE_POLL)  // the combine polls these words (fp32 moe_out: moe_out.cuh refuses bf16)
    rows::store_relaxed(ys, reinterpret_cast<float*>(y), M::MOE_OUT_TILES * M::HIDDEN, nr, ws.rows);
  else
    rows::store<moe_out_t>(ys, y, M::MOE_OUT_TILES * M::HIDDEN, nr, ws.rows);  // bf16: rounded to nearest
}

}  // namespace mk
}  // namespace megac

#if MEGAC_ROUTER_COMBINE
// A cubin symbol: this build runs COMBINE_IN tasks (MEGAC_ROUTER_COMBINE).
// The default build has no such symbol and no check of the flag on the
// device (a check there would change the default's code: see the switch),
// so a host that loads COMBINE_IN tasks asks for it, as it reads
// megakernel_weight_layout.
extern "C" __device__ const int megakernel_router_combine = 1;
#endif
#if MEGAC_UP_COMBINE
// A cubin symbol: this build runs routed MOE_UPGATE_DRAIN tasks flagged
// NORM_IN | ADD_MOE (MEGAC_UP_COMBINE); without it their claims would read
// x_norm, which nothing ordered before them.
extern "C" __device__ const int megakernel_up_combine = 1;
#endif
#if MEGAC_QKV_COMBINE
// A cubin symbol: this build runs QKV_PROJ tasks flagged NORM_IN | ADD_MOE
// (MEGAC_QKV_COMBINE); without it such a tile would add no experts.
extern "C" __device__ const int megakernel_qkv_combine = 1;
#endif

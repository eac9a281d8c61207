// Device side of the MoE family (megac/ops/moe.py) through moe_routing.cuh:
// ROUTER_TOPK, ROUTE_FINALIZE, MOE_GATHER, MOE_COMBINE, and the expert
// claimers MOE_UPGATE_DRAIN / MOE_DOWN_DRAIN (their tiles: ops_gemm.cuh).
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "moe_routing.cuh"
#include "mk_core.cuh"
#include "mk_layout.cuh"
#include "ops_gemm.cuh"

namespace megac {
namespace mk {

// Routed claims (MOE_UPGATE_DRAIN with ROUTE_SPLITS > 0): every up claimer
// ranks the layer's rows itself from the router partials and derives the up
// queue's records (the ones ROUTE_FINALIZE writes: one per active expert,
// ascending, and tile; the same slots), so its first claim waits on the
// router GEMM alone instead of top-k -> finalize -> gather (~4 serial hops,
// ~12 us a MoE layer in which no expert byte moves; docs/perf-notes.md).
// The claims read their rows from x_norm. The compiler emits them for
// schedules of at most the target's `routed_claims` rows (megac/geometry.py);
// 0: a build without them, which ignores the field.
#ifndef MEGAC_ROUTED_CLAIMS
#define MEGAC_ROUTED_CLAIMS 1
#endif

template <class M>
struct RoutedScratch {
  static constexpr int kEntries = M::MAX_ROWS * M::TOP_K > 0 ? M::MAX_ROWS * M::TOP_K : 1;
  // the ranking's words (finalize's counts, then the top-k's), from scratch offset 0
  static constexpr int kWorkBytes =
      (moe::finalize_smem_words(M::NUM_EXPERTS, kEntries) + moe::topk_smem_words(M::MAX_ROWS, M::NUM_EXPERTS, M::TOP_K)) * 4;
  // what the claims read, past the GEMM's scratch and the ranking's words:
  // nact, then per active expert (e, first slot, rows), then each slot's row
  static constexpr int kOffset = (cmax(GemmScratch<M>::kBytes, kWorkBytes) + 15) / 16 * 16;
  static constexpr int kBytes = MEGAC_ROUTED_CLAIMS && M::NUM_EXPERTS > 0 ? kOffset + (1 + 4 * kEntries) * 4 : 0;
  __device__ static int32_t* work(const Ctx& c) { return reinterpret_cast<int32_t*>(c.scratch); }
  __device__ static int32_t* summary(const Ctx& c) { return reinterpret_cast<int32_t*>(c.scratch + kOffset); }
};

template <class M>
struct MoeScratch {
  // finalize_cta: 3 E + 1 + entries words, + the top-k's words when it
  // ranks the rows itself; top-k: its words for one row; gather / combine: 64;
  // a routed claimer: RoutedScratch
  static constexpr int kBytes =
      cmax((3 * M::NUM_EXPERTS + 1 + M::MAX_ROWS * M::TOP_K +
            moe::topk_smem_words(M::MAX_ROWS, M::NUM_EXPERTS, M::TOP_K) + 64) * 4,
           RoutedScratch<M>::kBytes, M::MOE_OUT_TILES > 1 ? 256 + moe::kCombineStageBytes : 0);
};

// Expert weights toward L2 from ROUTER_TOPK, as soon as a row's experts are
// known: the first MEGAC_TOPK_PREFETCH_UP_KB of every 16-row group of each
// selected expert's gate/up matrix (each warp of an up claim streams one row
// group from its start) and MEGAC_TOPK_PREFETCH_DOWN_KB of each down row
// group. HBM then fetches the claims' first stages while ROUTE_FINALIZE and
// MOE_GATHER run (~8 us per layer on the critical path during which no expert
// byte moves). The TMA unit does the fetching: a few bulk-prefetch
// instructions per thread, nothing waits for them. 0: off.
#ifndef MEGAC_TOPK_PREFETCH_UP_KB
#define MEGAC_TOPK_PREFETCH_UP_KB 0
#endif
#ifndef MEGAC_TOPK_PREFETCH_DOWN_KB
#define MEGAC_TOPK_PREFETCH_DOWN_KB 0
#endif

// Whole CTA: `ids` (shared memory) holds the row's TOP_K experts.
template <class M>
__device__ __forceinline__ void prefetch_expert_heads(const Ctx& c, const int32_t* ids) {
  constexpr int kUpKb = MEGAC_TOPK_PREFETCH_UP_KB, kDownKb = MEGAC_TOPK_PREFETCH_DOWN_KB;
  if constexpr (kTiled<M> && (kUpKb > 0 || kDownKb > 0)) {
    using Lay = Layout<M>;
    // a 16-row group is one contiguous run in the tiled layout (ops_gemm.cuh span)
    constexpr int kUpGroups = kUpKb > 0 ? 2 * M::EXPERT_WIDTH / 16 : 0;
    constexpr int kDownGroups = kDownKb > 0 ? M::HIDDEN / 16 : 0;
    constexpr uint32_t kUpGroupBytes = 16u * M::HIDDEN * 2u, kDownGroupBytes = 16u * M::EXPERT_WIDTH * 2u;
    constexpr uint32_t kUp = kUpKb * 1024u < kUpGroupBytes ? kUpKb * 1024u : kUpGroupBytes;
    constexpr uint32_t kDown = kDownKb * 1024u < kDownGroupBytes ? kDownKb * 1024u : kDownGroupBytes;
    constexpr int kPer = kUpGroups + kDownGroups;
    const int slot = ptr<const int32_t>(c.d->layer_slot)[c.ts->w[H_LAYER]];
    for (int i = threadIdx.x; i < M::TOP_K * kPer; i += blockDim.x) {
      const int e = ids[i / kPer], g = i % kPer;
      if (g < kUpGroups)
        prefetch_l2(ptr<const bf16>(c.d->w_moe_upgate) + Lay::w_moe_upgate(slot, e) + int64_t(g) * 16 * M::HIDDEN,
                    kUp);
      else
        prefetch_l2(ptr<const bf16>(c.d->w_moe_down) + Lay::w_moe_down(slot, e) +
                        int64_t(g - kUpGroups) * 16 * M::EXPERT_WIDTH,
                    kDown);
    }
  }
}

template <class M>
__device__ __forceinline__ void router_topk(const Ctx& c) {
  using Lay = Layout<M>;
  if constexpr (M::NUM_EXPERTS > 0) {
    const LaunchDesc* d = c.d;
    const int layer = c.ts->w[H_LAYER], row = c.ts->w[f_router_topk::ROW];
    int32_t* smem = reinterpret_cast<int32_t*>(c.scratch);  // the row's experts end up first, for the prefetch
#if MEGAC_ROUTER_COMBINE
    // COMBINE_IN (a router_combine model's rows past the one-row schedule): the
    // partials are unnormalised, the weights take 1 / rms of the norm's residual
    // row (as ROUTE_FINALIZE's), reduced by warps 1.. while warp 0 ranks, into
    // the scratch's last words (the ranking uses its first)
    float* rinv = nullptr;
    if (c.ts->w[H_FLAGS] & FLAG_COMBINE_IN) {
      rinv = reinterpret_cast<float*>(c.scratch + c.scratch_bytes) - 1;
      moe::rows_inv_rms(ptr<const float>(d->x_resid) + Lay::x_resid(c.ts->w[f_router_topk::RESID_SLOT], row),
                        M::HIDDEN, d->norm_eps, 1, rinv, blockDim.x > 32 ? 1 : 0);
    }
    moe::topk_rows_cta(ptr<const float>(d->router_part) + Lay::router_part(layer, 0, row),
                       size_t(M::MAX_ROWS) * M::NUM_EXPERTS, c.ts->w[f_router_topk::NUM_SPLITS], 1, M::NUM_EXPERTS,
                       M::TOP_K, c.ts->w[H_FLAGS], ptr<int32_t>(d->topk_ids) + Lay::topk(layer, row),
                       ptr<float>(d->topk_w) + Lay::topk(layer, row), smem, moe::NeverStop{}, rinv);
#else
    moe::topk_rows_cta(ptr<const float>(d->router_part) + Lay::router_part(layer, 0, row),
                       size_t(M::MAX_ROWS) * M::NUM_EXPERTS, c.ts->w[f_router_topk::NUM_SPLITS], 1, M::NUM_EXPERTS,
                       M::TOP_K, c.ts->w[H_FLAGS], ptr<int32_t>(d->topk_ids) + Lay::topk(layer, row),
                       ptr<float>(d->topk_w) + Lay::topk(layer, row), smem);
#endif
    if constexpr (MEGAC_TOPK_PREFETCH_UP_KB > 0 || MEGAC_TOPK_PREFETCH_DOWN_KB > 0) prefetch_expert_heads<M>(c, smem);
  }
}

template <class M>
__device__ __forceinline__ bool route_finalize(const Ctx& c) {
  using Lay = Layout<M>;
  const LaunchDesc* d = c.d;
  const int layer = c.ts->w[H_LAYER];
  moe::FinalizeArgs a;
  a.topk_ids = ptr<const int32_t>(d->topk_ids) + Lay::topk(layer, 0);
  a.rows = c.ts->w[f_route_finalize::NUM_ROWS];
  a.k = M::TOP_K;
  a.num_experts = M::NUM_EXPERTS;
  a.up_tiles = c.ts->w[f_route_finalize::UP_TILES];
  a.down_tiles = c.ts->w[f_route_finalize::DOWN_TILES];
  a.queue_cap = d->moe_queue_cap;
  a.route_slot = ptr<int32_t>(d->route_slot) + Lay::topk(layer, 0);
  a.up_queue = ptr<int4>(d->moe_up_queue) + int64_t(layer) * d->moe_queue_cap;
  // DOWN_QUEUE -1 (split_down): the count alone, no down claims read a queue
  a.down_queue = c.ts->w[f_route_finalize::DOWN_QUEUE] >= 0
                     ? ptr<int4>(d->moe_down_queue) + int64_t(layer) * d->moe_queue_cap
                     : nullptr;
  // -1: no up queue (routed claims derive it themselves)
  const int up_word = c.ts->w[f_route_finalize::UP_COUNT_WORD];
  a.up_len = up_word >= 0 ? ptr<int32_t>(d->targets) + up_word : nullptr;
  a.down_len = ptr<int32_t>(d->targets) + c.ts->w[f_route_finalize::DOWN_COUNT_WORD];
  a.topk_splits = c.ts->w[f_route_finalize::TOPK_SPLITS];
  a.router_part = ptr<const float>(d->router_part) + Lay::router_part(layer, 0, 0);
  a.split_stride = size_t(M::MAX_ROWS) * M::NUM_EXPERTS;
  a.flags = c.ts->w[H_FLAGS];
  a.topk_w = ptr<float>(d->topk_w) + Lay::topk(layer, 0);
  a.topk_ids_out = a.topk_splits > 0 ? ptr<int32_t>(d->topk_ids) + Lay::topk(layer, 0) : nullptr;
  const int xslot = c.ts->w[f_route_finalize::X_SLOT];
  if (xslot >= 0) {  // the gather inside (fused_gather)
    a.x = ptr<const __nv_bfloat16>(d->x_norm) + Lay::x_norm(xslot, 0);
    a.moe_x = ptr<__nv_bfloat16>(d->moe_x) + Lay::moe_x(layer, 0);
    a.hidden = M::HIDDEN;
  }
#if MEGAC_ROUTER_COMBINE
  if (a.flags & FLAG_COMBINE_IN) {
    // the router's partials are unnormalised (ops_gemm.cuh MEGAC_ROUTER_COMBINE):
    // the weights take 1 / rms of the norm task's residual. Only a ranking
    // finalize writes weights (ROUTER_TOPK's would be unscaled): else a bad
    // task, reported as the dispatch reports one (never primed: no drain)
    if (a.topk_splits <= 0) {
      if (threadIdx.x == 0)
        report_error(c.site.status, c.site.task, c.site.opcode, -1, a.flags, FLAG_COMBINE_IN, c.site.layer,
                     kErrBadTask);
      return false;
    }
    a.resid = ptr<const float>(d->x_resid) + Lay::x_resid(c.ts->w[f_route_finalize::RESID_SLOT], 0);
    a.resid_d = M::HIDDEN;
    a.eps = d->norm_eps;
  }
#endif
  bool ok = true;
  if constexpr (M::NUM_EXPERTS > 0)  // a dense model has no MoE task (and no top-k to size)
    ok = moe::finalize_cta(a, reinterpret_cast<int32_t*>(c.scratch), c.site);
#if MEGAC_ROUTER_POLL
  if constexpr (M::NUM_EXPERTS > 0) {
    // the layer before's router partials (the first MoE layer: the last's,
    // of the step before) back to unlanded for the claimers' next poll; every
    // reader of them is done (common.cuh; tests/test_router_poll.py)
    static_assert(M::MOE_LAYERS_CONTIGUOUS, "the layer before a MoE layer's is the MoE layer before it");
    // one MoE layer: its finalize would unland the partials its own claimers still poll
    static_assert(M::FIRST_MOE_LAYER < M::LAST_MOE_LAYER, "MEGAC_ROUTER_POLL needs two MoE layers or more");
    // the generated masks hold layers 0-63 (megac/codegen/megakernel.py full_layer_masks)
    static_assert(!MEGAC_ROUTER_POLL_FULL || M::NUM_LAYERS <= 64, "MEGAC_ROUTER_POLL_FULL: a model of 64 layers or fewer");
    static_assert((M::ROUTER_SPLITS * M::MAX_ROWS * M::NUM_EXPERTS) % 4 == 0, "a layer's partials in 16-byte words");
    const int prev = layer == M::FIRST_MOE_LAYER ? M::LAST_MOE_LAYER : layer - 1;
    uint4* part = reinterpret_cast<uint4*>(ptr<float>(d->router_part) + Lay::router_part(prev, 0, 0));
    const uint4 unlanded = make_uint4(UNLANDED_F32, UNLANDED_F32, UNLANDED_F32, UNLANDED_F32);
    for (int i = threadIdx.x; i < M::ROUTER_SPLITS * M::MAX_ROWS * M::NUM_EXPERTS / 4; i += blockDim.x)
      __stcg(part + i, unlanded);
  }
#endif
  __syncthreads();
  return ok;
}

template <class M>
__device__ __forceinline__ void moe_gather(const Ctx& c) {
  using Lay = Layout<M>;
  const LaunchDesc* d = c.d;
  const int layer = c.ts->w[H_LAYER], row = c.ts->w[f_moe_gather::ROW], xslot = c.ts->w[f_moe_gather::X_SLOT];
  moe::gather_row(ptr<const __nv_bfloat16>(d->x_norm) + Lay::x_norm(xslot, 0),
                  ptr<__nv_bfloat16>(d->moe_x) + Lay::moe_x(layer, 0), ptr<const int32_t>(d->route_slot) + Lay::topk(layer, 0),
                  row, M::TOP_K, M::HIDDEN, reinterpret_cast<int32_t*>(c.scratch));
}

template <class M>
__device__ __forceinline__ bool moe_combine(const Ctx& c) {
  using Lay = Layout<M>;
  const LaunchDesc* d = c.d;
  const int layer = c.ts->w[H_LAYER], row = c.ts->w[f_moe_combine::ROW];
  const moe_out_t* y = ptr<const moe_out_t>(d->moe_out) + Lay::moe_out(layer, 0);
  // the split-K and polled forms read fp32 words (geometry.py and moe_out.cuh refuse them beside bf16)
  const float* y32 = reinterpret_cast<const float*>(y);
  const int32_t* slot = ptr<const int32_t>(d->route_slot) + Lay::topk(layer, 0);
  const float* w = ptr<const float>(d->topk_w) + Lay::topk(layer, 0);
  float* out = ptr<float>(d->ffn_part) + Lay::ffn_part(layer, 0, 0);
  int32_t* smem = reinterpret_cast<int32_t*>(c.scratch);
  constexpr int64_t ld = int64_t(M::MOE_OUT_TILES) * M::HIDDEN;
  const int c0 = c.ts->w[f_moe_combine::COL0], cols = c.ts->w[f_moe_combine::COLS];
  if constexpr (M::MOE_OUT_TILES > 1) {
    if (c.ts->w[H_FLAGS] & FLAG_SPLIT_DOWN) {  // every slot's split-K partials summed first
      moe::combine_tiles(y32, slot, w, out, row, M::TOP_K, M::HIDDEN, smem, reinterpret_cast<float4*>(c.scratch + 256),
                         M::MOE_OUT_TILES, ld, c0, cols);
      return true;
    }
  }
  if constexpr (MEGAC_COMBINE_POLL && M::TOP_K > 0) {  // header_waits left the down claims' counter unread
    // the report names that counter: the wait the poll stands for
    auto expired = [&]() {
      const int32_t* hw = c.ts->w;
      report_error(c.site.status, c.site.task, c.site.opcode, hw[H_WAIT1],
                   static_cast<int32_t>(ld_relaxed_gpu(ptr<const uint32_t>(d->counters) + hw[H_WAIT1])),
                   resolve(d, hw[H_TARGET1]), c.site.layer, kErrCounterTimeout);
    };
    return moe::combine_row_polled<M::TOP_K>(const_cast<float*>(y32), slot, w, out, row, M::HIDDEN, smem, ld, c0, cols,
                                             c.site, expired);
  }
#if MEGAC_SLOTS_EARLY
  if (d->rows == 1) {  // slots_early loaded row 0's slots and scores before the waits (a timing probe)
    moe::combine_row<true>(y, slot, w, out, row, M::TOP_K, M::HIDDEN, smem, ld, c0, cols);
    return true;
  }
#endif
  moe::combine_row(y, slot, w, out, row, M::TOP_K, M::HIDDEN, smem, ld, c0, cols);
  return true;
}

// Expert records {expert, n_tile, slot0, rows}. Up: waits TASK_WAIT_BASE,
// signals TASK_SIGNAL_BASE + expert (SPLIT_DOWN: TASK_SIGNAL_BASE, the
// combine's one counter). Down: waits TASK_WAIT_BASE + expert, signals
// TASK_SIGNAL_BASE.
struct MoeUpOffsets {
  bool split;
  __device__ void operator()(const int32_t* rec, int32_t& wo, int32_t& so) const {
    wo = 0;
    so = split ? 0 : rec[rec_moe_up::EXPERT];
  }
#if MEGAC_UP_PAIRS
  // up tiles the claim covers (a pair: MEGAC_UP_PAIRS), each one arrival on its expert's counter
  __device__ int32_t count(const int32_t* rec) const { return claim_count(rec[rec_moe_up::N_TILE]); }
#endif
};

// MEGAC_UP_PAIRS (mk_core.cuh): of a layer's `len` routed up tiles
// (active experts x UP_TILES), claims i < np = (len - T) / 2 cover tiles
// 2i and 2i + 1, claim i >= np tile i + np alone (T rounded up to len's
// parity). Index p is tile p % UP_TILES of the (p / UP_TILES)-th active
// expert, and UP_TILES is even where pairs are taken, so a pair's two tiles
// are one expert's, adjacent: one GEMM over both (N_TILE with kUpPair).
// Not with the split-K down (its moe_out tile is the up tile) nor where a
// pair's output does not fit the GEMM's staging (2 N_LEN > MAX_NLEN).
struct UpPairs {
  int32_t np;  // pair claims
  __device__ UpPairs(int32_t len, int tiles, int nlen, bool split, int max_nlen) {
    np = 0;
    if (MEGAC_UP_PAIRS > 0 && !split && tiles % 2 == 0 && 2 * nlen <= max_nlen) {
      const int32_t singles = min(len, MEGAC_UP_PAIRS + ((len - MEGAC_UP_PAIRS) & 1));
      np = (len - singles) / 2;
    }
  }
  __device__ int32_t claims(int32_t len) const { return len - np; }
  // claim i's first tile (its index p), and whether it covers p + 1 too
  __device__ int32_t first(int32_t i) const { return i < np ? 2 * i : i + np; }
  __device__ bool pair(int32_t i) const { return i < np; }
};

// The pairs of a routed claimer's `len` up tiles, `tiles` an expert (its words' N_LEN and flags).
template <class M>
__device__ __forceinline__ UpPairs up_pairs(const Ctx& c, int32_t len, int tiles) {
  return UpPairs(len, tiles, MK_F(moe_upgate_drain, N_LEN), (c.ts->w[H_FLAGS] & FLAG_SPLIT_DOWN) != 0, M::MAX_NLEN);
}
struct MoeDownOffsets {
  __device__ void operator()(const int32_t* rec, int32_t& wo, int32_t& so) const {
    wo = rec[rec_moe_down::EXPERT];
    so = 0;
  }
  // queue records the claim covers (a pair: MEGAC_DOWN_PAIRS)
  __device__ int32_t count(const int32_t* rec) const { return claim_count(rec[rec_moe_down::N_TILE]); }
};

// MEGAC_DOWN_PAIRS (mk_core.cuh): claim i of a layer's down queue of `len`
// records covers records 2i and 2i+1 while i < np = (len - T) / 2 (T
// rounded up to len's parity), then record i + np alone: one atomic a
// claim, as before. Two adjacent tiles of one expert (route finalize writes
// an expert's tiles in order, and an expert has an even number of them at
// the tile sizes this is used with) run as one tile (the record's N_TILE
// with kDownPair); two that are not (never seen; checked) run one after the
// other, the second kept in `pending` for this claimer's next claim.
struct DownPairSource {
  QueueSource queue;  // the down queue's head and records
  int32_t* pending;   // thread 0's: a claimed record not yet run (pending[0] < 0: none)
  bool pairs;  // a pair's tile fits the GEMM's output staging (2 x N_LEN <= MAX_NLEN); else all singles
  __device__ bool operator()(int32_t* rec) const {
    if (pending[0] >= 0) {
      for (int i = 0; i < QUEUE_RECORD_WORDS; ++i) rec[i] = pending[i];
      pending[0] = -1;
      return true;
    }
    const int32_t* w = queue.c.ts->w;
    const int32_t layer = w[H_LAYER], q = w[f_moe_down_drain::QUEUE], len = w[f_moe_down_drain::QUEUE_LEN];
    const int32_t idx = static_cast<int32_t>(atomicAdd(queue.head(layer, q), 1u));
    const int32_t singles = min(len, MEGAC_DOWN_PAIRS + ((len - MEGAC_DOWN_PAIRS) & 1));
    const int32_t np = pairs ? (len - singles) / 2 : 0;
    if (idx >= len - np) return false;  // np claims of two, len - 2 np of one
    queue.load(layer, q, uint32_t(idx < np ? 2 * idx : idx + np), rec);
    if (idx < np) {
      int32_t b[QUEUE_RECORD_WORDS];
      queue.load(layer, q, uint32_t(2 * idx + 1), b);
      if (b[rec_moe_down::EXPERT] == rec[rec_moe_down::EXPERT] && b[rec_moe_down::N_TILE] == rec[rec_moe_down::N_TILE] + 1 &&
          b[rec_moe_down::SLOT0] == rec[rec_moe_down::SLOT0] && b[rec_moe_down::ROWS] == rec[rec_moe_down::ROWS])
        rec[rec_moe_down::N_TILE] |= kDownPair;
      else
        for (int i = 0; i < QUEUE_RECORD_WORDS; ++i) pending[i] = b[i];
    }
    return true;
  }
};

// 1: a routed claimer of one row (batch 1) places its K experts by
// comparing their ids (K threads, K compares each) instead of counting them
// over all E experts and scanning (two barriers and a warp's walk of E
// counts); the same summary. 0: the count and the scan for every batch.
// Why: the twenty-eighth session's stamps put ~1 us between the ranking and
// the records at batch 1, on the path to every layer's first expert byte.
// Measured with the cursor, the same bits: the ranked -> records span 1.06 ->
// 0.16 us; NMC bs1 -1.8 % and bs8 -1.5 % together (twenty-ninth session).
#ifndef MEGAC_ROUTED_ONE_ROW
#define MEGAC_ROUTED_ONE_ROW 1
#endif

// 1: a routed claimer whose first index (taken as it starts) is past every
// claim the step can have (min(E, rows * K) experts of UP_TILES tiles; at
// batch 1 exactly K) stops once the router partials are summed: the queue
// is drained, nothing to rank for. 0: it ranks, then finds the queue
// drained. Why: the twenty-ninth session's profile has 84 of a layer's 132
// up claimers drained, 3.1-3.2 us each (sums 0.8, ranking 1.5, records and
// the empty claim), ahead of the O-projection tiles of a full layer (their
// attention done at 27 us, the tiles start at 32) and of the late down
// claims. The index's atomic returns while the partials load, so a claimer
// that does get work waits for nothing new. Measured (H200, thirty-first
// session, one engine, 5 interleaved rounds, medians, the same bits): NMC 8K
// bs1 2.5967 against 2.6227 ms (-1.0 %), bs8 -0.1 %; in the order runs of
// the same session -0.2 .. -0.9 % at bs1 in three engines. Checked as the
// default: tiny models equal to the VM, the watchdog, the one-row fp32 slice
// (min cosine 0.99997).
#ifndef MEGAC_UP_DRAINED_STOP
#define MEGAC_UP_DRAINED_STOP 1
#endif

// 1 (with MEGAC_TOPK_WARP, one row): warp 0, having ranked, also derives
// the claimer's first record (thread 0's index, taken as it started), and
// the whole CTA issues that claim's X copies and its ring's first stages
// before the claim loop hands the record over; the claim then waits for X
// alone. 0: the claim loop hands the record to the CTA first (a barrier and
// thread 0's derivation, ~0.6 us in the thirty-third session's stamps 7 ->
// 11), then the tile stages X and primes. The same claims and bits.
#ifndef MEGAC_UP_FIRST_EARLY
#define MEGAC_UP_FIRST_EARLY 0
#endif
// Where the router folds the MoE combine the claims wait on the norm that
// writes their rows (TASK_WAIT_BASE) after the ranking; the early X copies
// would read those rows before that wait.
#if MEGAC_UP_FIRST_EARLY && MEGAC_UP_PAIRS
#error "MEGAC_UP_FIRST_EARLY derives the first record from the index one tile a claim: not with MEGAC_UP_PAIRS"
#endif
#if MEGAC_UP_FIRST_EARLY && MEGAC_ROUTER_COMBINE
#error "MEGAC_UP_FIRST_EARLY issues the claim's X before its wait on the norm: not with MEGAC_ROUTER_COMBINE"
#endif

// 1: a routed up claimer stops after its first claim where the layer's
// claims (the active experts' tiles) fit one an SM (mk_core.cuh
// one_claim_each_covers). 0: after each claim it takes another index (the
// head's atomic) until the queue is drained. Why: at batch 1 no SM takes a
// second up claim (48 claims, 132 claimers), so every claimer that ran one
// pays that last atomic before its next task (about half of the 1.2 us
// from its tile's end to its task's end, the claim's signal the rest); on
// 23 QKV SMs that is the O-projection tile that ends the layer with the
// late down claims, and on the router SMs it is one of those late down
// claims (thirty-fifth session's per-SM view). Unlike MEGAC_DOWN_ONE_CLAIM (a down claimer's
// next task is the next layer's QKV tile, which waits anyway). The default
// since the thirty-sixth session (the batch-1 set s35: docs/perf-notes.md).
#ifndef MEGAC_UP_ONE_CLAIM
#define MEGAC_UP_ONE_CLAIM 1
#endif

struct UpDrainedStop {
  static constexpr bool kOn = MEGAC_UP_DRAINED_STOP != 0;
  uint32_t idx;  // thread 0's first index (a register: read at the compare, not before)
  int bound;    // claims the step can have at most
  __device__ bool operator()() const { return static_cast<int32_t>(idx) >= bound; }
};

// A routed claimer's claim loop, its summary written (and the barrier after
// it passed): records derived, index p is tile p % UP_TILES of the
// (p / UP_TILES)-th active expert; the words' TASK_WAIT_BASE is -1 (no
// claimed-task wait) or, under COMBINE_IN, the norm's counter. `idx`:
// thread 0's first index, taken as it started.
template <class M>
__device__ __forceinline__ bool moe_up_claims(const Ctx& c, uint32_t* head, uint32_t idx, const int32_t* sum,
                                              const int32_t* rowof, int tiles, int xslot, bool first_issued = false) {
  bool first = true;
#if MEGAC_UP_PAIRS
  const UpPairs pairs = up_pairs<M>(c, sum[0] * tiles, tiles);
  const int32_t nclaims = pairs.claims(sum[0] * tiles);
  auto source = [&](int32_t* rec) {
    if (!first) {
      if (MEGAC_UP_ONE_CLAIM && one_claim_each_covers(nclaims)) return false;
      idx = atomicAdd(head, 1u);
    }
    first = false;
    if (static_cast<int32_t>(idx) >= nclaims) return false;
    const int p = pairs.first(static_cast<int32_t>(idx));
    const int a = p / tiles;
    rec[rec_moe_up::EXPERT] = sum[1 + 3 * a];
    rec[rec_moe_up::N_TILE] = (p - a * tiles) | (pairs.pair(static_cast<int32_t>(idx)) ? kUpPair : 0);
    rec[rec_moe_up::SLOT0] = sum[2 + 3 * a];
    rec[rec_moe_up::ROWS] = sum[3 + 3 * a];
    return true;
  };
#else
  auto source = [&](int32_t* rec) {
    if (!first) {
      if (MEGAC_UP_ONE_CLAIM && one_claim_each_covers(sum[0] * tiles)) return false;
      idx = atomicAdd(head, 1u);
    }
    first = false;
    if (static_cast<int32_t>(idx) >= sum[0] * tiles) return false;
    const int a = static_cast<int>(idx) / tiles;
    rec[rec_moe_up::EXPERT] = sum[1 + 3 * a];
    rec[rec_moe_up::N_TILE] = static_cast<int>(idx) - a * tiles;
    rec[rec_moe_up::SLOT0] = sum[2 + 3 * a];
    rec[rec_moe_up::ROWS] = sum[3 + 3 * a];
    return true;
  };
#endif
  return claim_loop(c, source, f_moe_upgate_drain::TASK_WAIT_BASE, f_moe_upgate_drain::TASK_WAIT_TARGET,
                    f_moe_upgate_drain::TASK_SIGNAL_BASE, MoeUpOffsets{(c.ts->w[H_FLAGS] & FLAG_SPLIT_DOWN) != 0}, [](const int32_t*) {},
                    [&]() {
                      if (first_issued) {  // its X copies and first stages are out (MEGAC_UP_FIRST_EARLY)
                        first_issued = false;
                        Ctx issued = c;
                        issued.primed = true;
                        issued.x_issued = true;
                        moe_up_tile<M>(issued, rowof, xslot);
                        return;
                      }
                      moe_up_tile<M>(c, rowof, xslot);
                    });
}

// 1: a one-row routed up claimer reads its claims' wait counter (the norm
// task's, where the router folds the combine) with warp 1 while warp 0
// ranks, and where it is met clears the wait from the task's words in
// shared memory, so the first claim goes to its tile without another
// acquire round trip. Why: the profiles put ~0.8 us between a claimer's
// ranking and its claim handed to the CTA, most of it that read, on the
// MoE chain every layer, and the norm had ended before the ranking in 87 %
// of the layers (fifty-second session's H100 trace). 0: the claim loop
// waits after the ranking. The counter is met for the rest of the launch
// once seen met (its target is its whole count), so clearing it holds for
// every later claim of the task.
#ifndef MEGAC_UP_WAIT_EARLY
#define MEGAC_UP_WAIT_EARLY 0
#endif

// Routed claims, whole CTA: rank, count and scan as finalize_cta does, then
// the claim loop over the records derived from that (the queue head's atomic
// as for a queue in memory); no claimed task waits (the router's counter,
// the claimer's header wait, orders the partials and, through the norm
// before the router, x_norm), but where the router folds the MoE combine
// (COMBINE_IN: the norm ends after it) the claims wait on the norm that
// writes x_norm themselves (TASK_WAIT_BASE, after the ranking; no early
// L1 pull then: gemm_tc.cuh MEGAC_UP_X_L1). Built where MEGAC_ROUTED_CLAIMS
// is on, for MoE models only (moe_upgate_drain).
template <class M>
__device__ __forceinline__ bool moe_upgate_routed(const Ctx& c) {
  using Lay = Layout<M>;
  using RS = RoutedScratch<M>;
  TaskShared* ts = c.ts;
  const LaunchDesc* d = c.d;
  const int layer = ts->w[H_LAYER];
  const int rows = MK_F(moe_upgate_drain, NUM_ROWS), tiles = MK_F(moe_upgate_drain, UP_TILES);
  const int xslot = MK_F(moe_upgate_drain, X_SLOT);
  const int E = M::NUM_EXPERTS, K = M::TOP_K, n = rows * K;
  uint32_t* head = ptr<uint32_t>(d->queue_heads) + ts->w[f_moe_upgate_drain::QUEUE] * M::NUM_LAYERS + layer;
  // the first index is taken now: its atomic's round trip overlaps the ranking
  uint32_t idx = 0;
  if (threadIdx.x == 0) idx = atomicAdd(head, 1u);
#if MEGAC_UP_X_L1
  // every row's x_norm toward this SM's L1 while it ranks (gemm_tc.cuh
  // stage_x reads them with ld.ca): after the header's acquire, and nothing
  // writes them again before the layer's claims are done
  {
    constexpr int kLines = (M::HIDDEN * 2 + 127) / 128;  // 128-byte lines per row
    const bf16* xn = ptr<const bf16>(d->x_norm) + Layout<M>::x_norm(xslot, 0);
    for (int i = threadIdx.x; i < rows * kLines; i += blockDim.x)
      asm volatile("prefetch.global.L1 [%0];" ::"l"(xn + int64_t(i / kLines) * M::HIDDEN + (i % kLines) * 64));
  }
#endif
  int32_t* work = RS::work(c);
  int32_t* cnt = work;         // [E]
  int32_t* off = cnt + E;      // [E]
  int32_t* act = off + E;      // [E]
  int32_t* nact = act + E;     // [1]
  int32_t* rank = nact + 1;    // [n]
  int32_t* ids = work + moe::finalize_smem_words(E, RS::kEntries);
#if MEGAC_UP_PAIRS
  const UpDrainedStop stop{idx, up_pairs<M>(c, min(E, n) * tiles, tiles).claims(min(E, n) * tiles)};
#else
  const UpDrainedStop stop{idx, min(E, n) * tiles};
#endif
  int32_t* sum = RS::summary(c);  // [0] nact, [1 + 3a ..] (e, slot0, rows), [1 + 3 entries + slot] row
  int32_t* rowof = sum + 1 + 3 * RS::kEntries;
#if MEGAC_ROUTER_POLL
  // as header_waits decided it (it left the router's counter unread): read
  // before warp 1 may clear TASK_WAIT_BASE (MEGAC_UP_WAIT_EARLY)
  const bool polls = router_polls(ts->w);
#if MEGAC_PROBE_UP_NO_NORM || MEGAC_ROUTER_POLL == 2
  // the probe: the claims' wait dropped; MEGAC_ROUTER_POLL 2: met in the
  // header already (mk_core.cuh header_waits; its acquire and the barrier
  // after the header order every thread's x_norm reads)
  __syncthreads();  // every thread has read the task word before thread 0 drops the claims' wait
  if (polls && threadIdx.x == 0) ts->w[f_moe_upgate_drain::TASK_WAIT_BASE] = -1;
#endif
#if MEGAC_UP_WAIT_EARLY
  // a polling claimer's warp 1 reads the claims' wait until warp 0 has
  // ranked (up_ranked), not once: it starts before the norm can have ended
  // (it waits on nothing, and the norm ends ~with the router)
  __shared__ int up_ranked;
  if (threadIdx.x == 0) up_ranked = 0;
  __syncthreads();
#endif
#endif
  if constexpr (MEGAC_TOPK_WARP && MEGAC_ROUTED_ONE_ROW) {
    if (rows == 1 && moe::one_row_warp_fits(E, K)) {
      // warp 0 sums, ranks and places the row's K experts (the one-row
      // placement below, from registers): one barrier from the partials to
      // the claim loop, none in between
      bool halted = false;  // thread 0's
      if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        int e;
        float v;
#if MEGAC_ROUTER_POLL
        if (polls) {  // the partials polled, not the router's counter (common.cuh)
          static_assert(M::ROUTER_SPLITS <= 8, "a lane polls every split of its experts at once");
          moe::RouterPoll poll{&c.site, ptr<const uint32_t>(d->counters) + ts->w[H_WAIT0], ts->w[H_WAIT0],
                               uint32_t(ts->w[H_TARGET0]), 0};
          halted = !moe::rank_one_row_warp<false, UpDrainedStop, M::ROUTER_SPLITS>(
              ptr<const float>(d->router_part) + Lay::router_part(layer, 0, 0), size_t(M::MAX_ROWS) * M::NUM_EXPERTS,
              MK_F(moe_upgate_drain, ROUTE_SPLITS), E, K, stop, e, v, &poll);
          if (poll.verdict == 2 && lane == 0) ts->ok = 0;  // the watchdog's, or another CTA's abort
        } else
#endif
          halted = !moe::rank_one_row_warp<false>(ptr<const float>(d->router_part) + Lay::router_part(layer, 0, 0),
                                                  size_t(M::MAX_ROWS) * M::NUM_EXPERTS,
                                                  MK_F(moe_upgate_drain, ROUTE_SPLITS), E, K, stop, e, v);
        if (!halted) {
          int pos = 0;
          for (int j = 0; j < K; ++j) pos += __shfl_sync(moe::kFullMask, e, j) < e;
          if (lane < K) {
            sum[1 + 3 * pos] = e;
            sum[2 + 3 * pos] = pos;
            sum[3 + 3 * pos] = 1;
            rowof[pos] = 0;
          }
          if (lane == 0) sum[0] = K;
          if constexpr (MEGAC_UP_FIRST_EARLY) {
            // the first claim's record (not halted: thread 0's index is below K * tiles), as the
            // claim loop's source derives it: the a-th active expert ascending is the one placed at a
            const int a0 = __shfl_sync(moe::kFullMask, int(idx) / tiles, 0);
            const int e0 = __shfl_sync(moe::kFullMask, e, __ffs(__ballot_sync(moe::kFullMask, lane < K && pos == a0)) - 1);
            if (lane == 0) {
              ts->rec[rec_moe_up::EXPERT] = e0;
              ts->rec[rec_moe_up::N_TILE] = int(idx) - a0 * tiles;
              ts->rec[rec_moe_up::SLOT0] = a0;
              ts->rec[rec_moe_up::ROWS] = 1;
            }
          }
        }
#if MEGAC_ROUTER_POLL && MEGAC_UP_WAIT_EARLY
        __syncwarp();
        if (lane == 0) *reinterpret_cast<volatile int*>(&up_ranked) = 1;  // ranked or halted: warp 1 stops
#endif
      }
#if MEGAC_UP_WAIT_EARLY
      else if (threadIdx.x == 32) {
        // while warp 0 ranks: the claims' own wait (the norm that writes
        // x_norm, ROUTER_COMBINE) read once (a polling claimer: until it is
        // met or warp 0 has ranked); met, its word is cleared so the claim
        // loop does not wait again (this acquire, then the barrier below,
        // orders every thread's x_norm reads as the loop's wait did)
        const int32_t wb = ts->w[f_moe_upgate_drain::TASK_WAIT_BASE];
        if (wb >= 0) {
          const uint32_t* ctr = ptr<const uint32_t>(d->counters) + wb;
          const uint32_t target = static_cast<uint32_t>(resolve(d, ts->w[f_moe_upgate_drain::TASK_WAIT_TARGET]));
          for (;;) {
            if (ld_acquire_gpu(ctr) >= target) {
              ts->w[f_moe_upgate_drain::TASK_WAIT_BASE] = -1;
              break;
            }
#if MEGAC_ROUTER_POLL
            if (!polls || *reinterpret_cast<volatile int*>(&up_ranked)) break;
            __nanosleep(20);
#else
            break;
#endif
          }
        }
      }
#endif
#if MEGAC_ROUTER_POLL
      // drained: as the claim loop's empty claim (a failed poll: the task fails)
      if (__syncthreads_or(threadIdx.x == 0 && halted)) return ts->ok != 0;
#else
      if (__syncthreads_or(threadIdx.x == 0 && halted)) return true;  // drained: as the claim loop's empty claim
#endif
      MEGAC_MARK(7);  // ranked, the claims' summary written (after rank_one_row_warp's 0 and 1)
      if constexpr (MEGAC_UP_FIRST_EARLY && GemmScratch<M>::kTc && tc::kBulk) {
        if (!(ts->w[H_FLAGS] & FLAG_SPLIT_DOWN)) {
          const int32_t* rec = ts->rec;
          const WeightSpan ws = moe_up_weights<M>(c, rec);
          MEGAC_MARK(11);  // the claimed tile's weight span known
          // this thread's generic writes to the scratch before the copy engine writes the ring there
          asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
          tc::issue_x_prime(ptr<const bf16>(d->x_norm) + Lay::x_norm(xslot, 0), M::HIDDEN, 1, ws.cols,
                            GemmScratch<M>::xs(c), rowof + rec[rec_moe_up::SLOT0], ws, GemmScratch<M>::tc_ring(c),
                            &ts->tc);
          return moe_up_claims<M>(c, head, idx, sum, rowof, tiles, xslot, true);
        }
      }
      return moe_up_claims<M>(c, head, idx, sum, rowof, tiles, xslot);
    }
  }
  if (!moe::topk_rows_cta<false>(ptr<const float>(d->router_part) + Lay::router_part(layer, 0, 0),
                                 size_t(M::MAX_ROWS) * M::NUM_EXPERTS, MK_F(moe_upgate_drain, ROUTE_SPLITS), rows, E,
                                 K, ts->w[H_FLAGS], ids, nullptr, ids, stop))
    return true;  // drained before it ranked: as the claim loop's empty claim ends

  if (MEGAC_ROUTED_ONE_ROW && rows == 1) {
    // one row: its K experts are distinct, one slot each, so the active
    // experts ascending are its ids sorted and an expert's slot is its place
    // there (what the count and the scan below give), K threads at once
    if (threadIdx.x < K) {
      const int e = ids[threadIdx.x];
      int pos = 0;
#pragma unroll
      for (int j = 0; j < K; ++j) pos += ids[j] < e;
      sum[1 + 3 * pos] = e;
      sum[2 + 3 * pos] = pos;
      sum[3 + 3 * pos] = 1;
      rowof[pos] = 0;
    }
    if (threadIdx.x == 0) sum[0] = K;
  } else {
    for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    if (threadIdx.x < 32) {
      moe::rank_entries(ids, true, n, cnt, rank);
      moe::scan_experts(cnt, E, off, act, nact);
    }
    __syncthreads();
    const int na = *nact;
    for (int a = threadIdx.x; a < na; a += blockDim.x) {
      const int e = act[a];
      sum[1 + 3 * a] = e;
      sum[2 + 3 * a] = off[e];
      sum[3 + 3 * a] = cnt[e];
    }
    for (int i = threadIdx.x; i < n; i += blockDim.x) rowof[off[ids[i]] + rank[i]] = i / K;
    if (threadIdx.x == 0) sum[0] = na;
  }
  MEGAC_MARK(7);  // ranked, counted, the claims' summary written (after topk_rows_cta's 0 and 1)
  __syncthreads();
  return moe_up_claims<M>(c, head, idx, sum, rowof, tiles, xslot);
}

template <class M>
__device__ __forceinline__ bool moe_upgate_drain(const Ctx& c) {
#if MEGAC_ROUTED_CLAIMS
  if constexpr (M::NUM_EXPERTS > 0)
    if (MK_F(moe_upgate_drain, ROUTE_SPLITS) > 0) return moe_upgate_routed<M>(c);
#endif
  // (a build without routed claims ignores ROUTE_SPLITS: the verifier holds it at 0)
  return claim_loop(c, f_moe_upgate_drain::QUEUE, f_moe_upgate_drain::QUEUE_LEN, f_moe_upgate_drain::TASK_WAIT_BASE,
                    f_moe_upgate_drain::TASK_WAIT_TARGET, f_moe_upgate_drain::TASK_SIGNAL_BASE, MoeUpOffsets{(c.ts->w[H_FLAGS] & FLAG_SPLIT_DOWN) != 0},
                    [&](const int32_t* rec) { rows::prefetch_head(moe_up_weights<M>(c, rec), 0, 1); },
                    [&]() { moe_up_tile<M>(c); }, M::NUM_LAYERS);
}

// A down claim whose expert's up tiles are still running pulls its whole
// tile toward L2 before its wait (thread 0: one bulk prefetch per 16-row
// group). At batch 1 the down claimers claim ~20 us before their inputs
// are ready (fifteenth session's trace: claimed at ~15 us into a sliding
// layer, up tiles done at ~35), their SMs idle meanwhile; after the wait the
// tile then streams from L2, and the O-projection queued behind the claim
// (the layer's tail) starts sooner. Only where the wait is not yet met: an
// SM about to stream would queue its ring's copies behind the prefetches
// (eleventh session). 1: normal priority; 2: evict_last (the expert
// streams between are evict_first); 0: off.
#ifndef MEGAC_DOWN_CLAIM_L2
#define MEGAC_DOWN_CLAIM_L2 0
#endif

template <class M>
__device__ __forceinline__ void down_claim_l2(const Ctx& c, const int32_t* rec) {
  if constexpr (MEGAC_DOWN_CLAIM_L2 > 0) {
    const int32_t* w = c.ts->w;
    const int32_t wb = w[f_moe_down_drain::TASK_WAIT_BASE];
    if (wb < 0) return;
    const uint32_t* ctr = ptr<const uint32_t>(c.d->counters) + wb + rec[rec_moe_down::EXPERT];
    if (ld_relaxed_gpu(ctr) >= static_cast<uint32_t>(resolve(c.d, w[f_moe_down_drain::TASK_WAIT_TARGET]))) return;
    const WeightSpan s = moe_down_weights<M>(c, rec);
    if (!s.tiled && s.cols != s.ld) return;  // a 16-row group is one contiguous run in these layouts
    const uint32_t row_bytes = uint32_t(s.cols) * 2u;
    [[maybe_unused]] uint64_t policy = 0;
    if constexpr (MEGAC_DOWN_CLAIM_L2 == 2) policy = l2_evict_last_policy();
    for (int r0 = 0; r0 < s.rows; r0 += 16) {
      const uint32_t bytes = uint32_t(min(16, s.rows - r0)) * row_bytes;
      if constexpr (MEGAC_DOWN_CLAIM_L2 == 2)
        prefetch_l2_hint(s.p + int64_t(r0) * s.ld, bytes, policy);
      else
        prefetch_l2(s.p + int64_t(r0) * s.ld, bytes);
    }
  }
}

// 1: a down claim whose expert's up tiles are still running primes its
// ring (kStages stages a warp, 128 KB of its 384 KB at batch 1 in North
// Mini Code) before its wait, so its first stages have landed when the up
// tiles end and the tile streams the rest (claim_loop's Early). Only where
// the wait is not met when the claim is made: an SM that would idle, not
// one about to stream. 0: the ring starts after the wait (with the X
// staging, MEGAC_X_THEN_PRIME). Why it may win where the tenth session's
// claim prime and the fifteenth's L2 prefetch (MEGAC_DOWN_CLAIM_L2) lost:
// those requested bytes for every claim, or 25 MB of them, ahead of the up
// streams; this asks 128 KB per waiting claimer, issued by the whole CTA
// after thread 0's one read of the counter. 2: every down claim primes
// before its wait, the counter unread until then: the late claims, whose
// counters are met (the critical ones at batch 1, twenty-ninth session's
// profile), issue their first copies a round trip sooner. Measured (H200, twenty-ninth
// session, ten interleaved rounds, means, the same bits) with the cursor,
// the one-row placement and X by cp.async: NMC bs1 2.659 -> 2.636 ms (-0.9 %;
// -2.6 % against the twenty-eighth session's default), bs8 8.391 -> 8.444
// (+0.6 %, still -0.9 % against that default).
#ifndef MEGAC_DOWN_PRIME
#define MEGAC_DOWN_PRIME 1
#endif

template <class M>
struct DownEarly {
  static constexpr bool kOn = MEGAC_DOWN_PRIME && M::NUM_EXPERTS > 0 && GemmScratch<M>::kTc && tc::kBulk;
  static constexpr bool kAlways = MEGAC_DOWN_PRIME == 2;
  const Ctx& c;
  __device__ void operator()(const int32_t* rec) const {
    if constexpr (kOn) tc::prime(moe_down_weights<M>(c, rec), GemmScratch<M>::tc_ring(c), &c.ts->tc);
  }
  __device__ void drain() const {}  // the GEMM ring: claim_loop drains it
};

// 1: a down claimer takes one claim at most where the layer's down queue
// holds no more claims than there are SMs (mk_core.cuh
// one_claim_each_covers); 0: it claims until the queue is drained. Why:
// with 128-row up tiles at batch 1 every QKV SM streams an up claim until
// ~24 us, the ~35 SMs free before that claim the 64 down tiles, and those
// done first take a second, ending ~5 us after the rest (thirty-fourth
// session's profile). Measured (H200, thirty-fifth session, engines
// alternating, bs1 8K): no gain, with the 256-row up tiles (2.571-2.668
// against the default's 2.574-2.671) or the 128-row ones (+4 %): the
// claims the early SMs leave go to SMs that arrive late anyway.
#ifndef MEGAC_DOWN_ONE_CLAIM
#define MEGAC_DOWN_ONE_CLAIM 0
#endif

template <class M>
__device__ __forceinline__ bool moe_down_drain(const Ctx& c) {
  auto prefetch = [&](const int32_t* rec) {
    rows::prefetch_head(moe_down_weights<M>(c, rec), 0, 1);
    down_claim_l2<M>(c, rec);
  };
  auto run = [&]() {
    if constexpr (DownEarly<M>::kOn) {
      if (c.ts->early) {  // the claim's ring was primed before its wait
        Ctx primed = c;
        primed.primed = true;
        moe_down_tile<M>(primed);
        return;
      }
    }
    moe_down_tile<M>(c);
  };
  if constexpr (MEGAC_DOWN_PAIRS > 0) {
    int32_t pending[QUEUE_RECORD_WORDS] = {-1, 0, 0, 0};
    const QueueSource queue{c, f_moe_down_drain::QUEUE, f_moe_down_drain::QUEUE_LEN, M::NUM_LAYERS};
    return claim_loop(c, DownPairSource{queue, pending, 2 * MK_F(moe_down_drain, N_LEN) <= M::MAX_NLEN},
                      f_moe_down_drain::TASK_WAIT_BASE, f_moe_down_drain::TASK_WAIT_TARGET,
                      f_moe_down_drain::TASK_SIGNAL_BASE, MoeDownOffsets{}, prefetch, run, DownEarly<M>{c});
  }
  if constexpr (MEGAC_DOWN_ONE_CLAIM) {
    const QueueSource queue{c, f_moe_down_drain::QUEUE, f_moe_down_drain::QUEUE_LEN, M::NUM_LAYERS};
    bool taken = false;  // thread 0's: this claimer took a claim
    auto source = [&](int32_t* rec) {
      if (taken && one_claim_each_covers(c.ts->w[f_moe_down_drain::QUEUE_LEN])) return false;
      taken = queue(rec);
      return taken;
    };
    return claim_loop(c, source, f_moe_down_drain::TASK_WAIT_BASE, f_moe_down_drain::TASK_WAIT_TARGET,
                      f_moe_down_drain::TASK_SIGNAL_BASE, MoeDownOffsets{}, prefetch, run, DownEarly<M>{c});
  }
  return claim_loop(c, f_moe_down_drain::QUEUE, f_moe_down_drain::QUEUE_LEN, f_moe_down_drain::TASK_WAIT_BASE,
                    f_moe_down_drain::TASK_WAIT_TARGET, f_moe_down_drain::TASK_SIGNAL_BASE, MoeDownOffsets{}, prefetch,
                    run, M::NUM_LAYERS, DownEarly<M>{c});
}

}  // namespace mk
}  // namespace megac

// Device-side MoE routing: ROUTER_TOPK (per row), ROUTE_FINALIZE (one CTA,
// after every row's top-k), MOE_GATHER and MOE_COMBINE (per row).
//
// Semantics are the CPU VM's (megac/vm/ops.py), whose routing math lives in
// megac/routing.py; the GPU battery (megac/gpu/blocks/moe_routing.py) checks
// this header against that module.
//   TOPK      logits = the NUM_SPLITS router partials added in split order
//             (fp32). The k largest in descending order, ties to the lower
//             expert id, NaN first (the VM's stable descending torch.sort).
//             Weight, in fp64 and rounded once: sigmoid(logit), or with
//             FLAG_SOFTMAX_ROUTER a softmax over the k SELECTED logits
//             (exp(l_j - l_0), summed in k order). FLAG_RENORMALIZE (either
//             mode): divide by the fp64 sum, in k order, of the rounded fp32
//             weights and round once more.
//   FINALIZE  with topk_splits > 0 it first ranks rows 0..rows-1 as TOPK does
//             (warp w takes rows w, w + warps, ...; ids kept in shared memory,
//             weights written to topk_w); with x set it copies every row to
//             its slots at the end, as GATHER does. The routing itself:
//             counts per expert, exclusive offsets; expert e's entries take
//             slots offsets[e] + 0, 1, ... in (row, k) order (route_slot).
//             Each queue gets one record {expert, n_tile, slot0, rows} per
//             (active expert ascending, n tile ascending), rows = every entry
//             of the expert, and its length goes to its target word. A queue
//             holds queue_cap records (the plan's worst case,
//             min(E, entries) * tiles); a routing that needs more writes no
//             record and raises kErrQueueOverflow.
//   GATHER    moe_x[slot[row, j]] = x_norm[row] for j < k (bf16, 16-byte copies).
//   COMBINE   out[row] = w_0 * y_0, then out += w_j * y_j for j in order, with
//             y = moe_out (fp32) and every product and sum rounded to fp32:
//             the VM's arithmetic, so the result is bit-exact.
//   GATHER and COMBINE need 64 words of shared memory.
//
// Everything is deterministic: no result depends on which CTA ran what or
// when (ranks come from a warp match over entries in index order, not from
// atomics).
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "common.cuh"
#include "moe_out.cuh"
#include "profile_marks.cuh"

namespace megac {
namespace moe {

constexpr unsigned kFullMask = 0xffffffffu;

// 1: topk_rows_cta counts each logit's rank on two threads (the even and
// the odd keys of its row), half the dependent compare-adds of the one-
// thread count (1.65 us of the task's 3.9 on the H200); 0: one thread per
// logit. Not yet run on a GPU (gpu check variants: rank_halves).
#ifndef MEGAC_TOPK_RANK_HALVES
#define MEGAC_TOPK_RANK_HALVES 0
#endif

// Router split-K partials whose loads are issued before the first add: the
// partials come from other SMs through L2, and one split at a time left
// ROUTER_TOPK at ~10 us on every MoE layer's critical path (a loaded L2
// round trip per split).
constexpr int kSplitsAtOnce = 8;
// Sum of x over lanes 0..K-1 in lane (= k) order, the VM's order; every lane
// gets it.
__device__ __forceinline__ double ordered_sum(double x, int K) {
  double tot = __shfl_sync(kFullMask, x, 0);
  for (int r = 1; r < K; ++r) tot += __shfl_sync(kFullMask, x, r);
  return tot;
}

// Weight of the entry on this lane (lane < K); all 32 lanes call it.
__device__ __forceinline__ float routing_weight(float logit, int K, int32_t flags) {
  const double l = logit;
  double w;
  if (flags & FLAG_SOFTMAX_ROUTER) {
    // Lane 0 holds the largest selected logit: exp never overflows.
    const double e = exp(l - (double)__shfl_sync(kFullMask, logit, 0));
    w = e / ordered_sum(e, K);
  } else {
    w = 1.0 / (1.0 + exp(-l));
  }
  float wf = (float)w;
  if (flags & FLAG_RENORMALIZE) wf = (float)((double)wf / ordered_sum((double)wf, K));
  return wf;
}

// Total order key of (logit, expert id) in the selection order of the VM's
// torch.sort(descending=True, stable=True): NaN above every number, then the
// larger value, then the lower id; a larger key is better. The high word maps the float's order onto
// unsigned order (NaN above +inf, every NaN equal, -0 equal to +0), the low
// word the id reversed (the lower id wins a tie).
__device__ __forceinline__ uint32_t order_hi(float v) {
  const uint32_t u = __float_as_uint(v);
  if (isnan(v)) return 0xffffffffu;
  if (v == 0.f) return 0x80000000u;  // -0 and +0 compare equal
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // -inf: 0x007fffff, the least: never 0
}
__device__ __forceinline__ unsigned long long order_key(float v, int e) {
  return (static_cast<unsigned long long>(order_hi(v)) << 32) | (0xffffffffu - static_cast<uint32_t>(e));
}

// 1: one row (batch 1) is summed and ranked by warp 0 alone, its logits in
// registers (lane l: experts l, l + 32, ...): K rounds of a warp max over the
// keys' high words (redux.sync), then a warp min over the ids that hold it
// (the lower id wins a tie), the winner's key cleared. The same selection
// and order as the count below (order_key's). 0: every logit's rank counted
// over the row's E keys in shared memory. Why: the count is 128 dependent
// generic 64-bit loads and conditional adds a thread (16 batches of 8 in
// the SASS), behind a barrier after the sums and before another; the
// thirty-third session's stamps put ~1.5 us between a routed up claimer's
// partials summed and its rows ranked (ROUTE_FINALIZE 1.6), on the path to
// every MoE layer's first expert byte. Here: one barrier, ~K x 2 warp
// reductions. Rows > 1 and E > 32 * kWarpKeys keep the count. The default
// since the thirty-sixth session (the batch-1 set s35: docs/perf-notes.md).
#ifndef MEGAC_TOPK_WARP
#define MEGAC_TOPK_WARP 1
#endif
// Router partials a key loads at once (4: 16 loads a lane in flight). At
// batch 1 the router has 8 splits (router_splits), so 4 is two dependent L2
// round trips on every MoE layer's path to its first expert byte (the
// fortieth session's H200 trace: partials summed 1.38 us after a routed
// claimer's wait); 8 issues all 32 at once.
#ifndef MEGAC_TOPK_WARP_SPLITS
#define MEGAC_TOPK_WARP_SPLITS 4
#endif
constexpr int kWarpKeys = 4;  // logits a lane holds: E <= 128
constexpr int kWarpSplits = MEGAC_TOPK_WARP_SPLITS;

__host__ __device__ constexpr bool one_row_warp_fits(int E, int K) {
  return E <= 32 * kWarpKeys && K <= 32 && K <= E;
}

// MEGAC_ROUTER_POLL (common.cuh): warp 0 (all 32 lanes) reads row 0's
// router partials (split s of expert e at parts + s * split_stride + e; all
// kSplits of a lane's experts in flight at once) until no word holds
// UNLANDED_F32, then sums them as rank_one_row_warp does (split order: the
// same logits, bit for bit) into v. 0: summed. 1: while a word was still
// unlanded, thread 0's stop() said the claimer is drained (it never ranks:
// the words may already be the next write-back's). 2: the watchdog fired
// (its record names `counter_index`, the router's counter, and its value)
// or another CTA aborted. num_splits <= kSplits.
template <int kSplits, class Stop>
__device__ __forceinline__ int poll_one_row_warp(const float* parts, size_t split_stride, int num_splits, int E,
                                                 Stop stop, float (&v)[kWarpKeys], const WaitSite& site,
                                                 const uint32_t* counter, int32_t counter_index, uint32_t target) {
  const int lane = threadIdx.x & 31;
  uint32_t q[kWarpKeys][kSplits];
  SpinBound bound;
  uint32_t polls = 0;
  for (;;) {
    bool landed = true;
#pragma unroll
    for (int j = 0; j < kWarpKeys; ++j)
#pragma unroll
      for (int s = 0; s < kSplits; ++s) {
        q[j][s] = lane + 32 * j < E && s < num_splits
                      ? ld_relaxed_gpu(reinterpret_cast<const uint32_t*>(parts + s * split_stride + lane + 32 * j))
                      : 0u;
      }
#pragma unroll
    for (int j = 0; j < kWarpKeys; ++j)
#pragma unroll
      for (int s = 0; s < kSplits; ++s) landed = landed && q[j][s] != UNLANDED_F32;
    if (__all_sync(kFullMask, landed)) break;
    if (__shfl_sync(kFullMask, lane == 0 && stop() ? 1 : 0, 0)) return 1;
    // the abort flag and the clock every 8th poll (as the polled combine)
    int go = 1;
    if (lane == 0 && (++polls & 7u) == 0u && !bound.keep_going(site)) {
      go = 0;
      if (bound.expired)
        report_error(site.status, site.task, site.opcode, counter_index, static_cast<int32_t>(ld_relaxed_gpu(counter)),
                     static_cast<int32_t>(target), site.layer, kErrCounterTimeout);
    }
    if (!__shfl_sync(kFullMask, go, 0)) return 2;
  }
#pragma unroll
  for (int j = 0; j < kWarpKeys; ++j) {
    v[j] = 0.f;
#pragma unroll
    for (int s = 0; s < kSplits; ++s)
      if (s < num_splits) v[j] = s == 0 ? __uint_as_float(q[j][s]) : __fadd_rn(v[j], __uint_as_float(q[j][s]));
  }
  MEGAC_MARK(0);  // thread 0's partials landed and summed
  return 0;
}

// Warp 0 (all 32 lanes): row 0's E logits summed over num_splits router
// partials (parts + s * split_stride + e, added in split order as the count's
// sums), then, unless thread 0's stop() says so (after the sums: returns
// false, warp-uniform), ranked: lane j < K gets entry j's expert id (and,
// kValues, its logit). one_row_warp_fits(E, K) must hold.
//
// kPollSplits > 0 (MEGAC_ROUTER_POLL): the partials polled until landed
// (poll_one_row_warp, every split at once), then stop() asked as above;
// `poll` names the router's counter for the watchdog's record and takes the
// verdict: 1 drained, 2 failed (the call then returns false, nothing ranked).
struct RouterPoll {
  const WaitSite* site;
  const uint32_t* counter;
  int32_t counter_index;
  uint32_t target;
  int verdict;
};
template <bool kValues, class Stop, int kPollSplits = 0>
__device__ __forceinline__ bool rank_one_row_warp(const float* __restrict__ parts, size_t split_stride, int num_splits,
                                                  int E, int K, Stop stop, int& id_out, float& v_out,
                                                  RouterPoll* poll = nullptr) {
  const int lane = threadIdx.x & 31;
  float v[kWarpKeys];
  if constexpr (kPollSplits > 0) {
    poll->verdict = poll_one_row_warp<kPollSplits>(parts, split_stride, num_splits, E, stop, v, *poll->site,
                                                   poll->counter, poll->counter_index, poll->target);
    if (poll->verdict != 0) return false;
    if constexpr (Stop::kOn) {  // landed, but a drained claimer still ranks nothing
      if (__shfl_sync(kFullMask, lane == 0 && stop() ? 1 : 0, 0)) {
        poll->verdict = 1;
        return false;
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < kWarpKeys; ++j) v[j] = 0.f;
    for (int s0 = 0; s0 < num_splits; s0 += kWarpSplits) {
      // partials come from other tasks of this launch: coherent loads, all at once
      float q[kWarpKeys][kWarpSplits];
#pragma unroll
      for (int j = 0; j < kWarpKeys; ++j)
#pragma unroll
        for (int s = 0; s < kWarpSplits; ++s)
          q[j][s] = lane + 32 * j < E && s0 + s < num_splits ? __ldcg(parts + (s0 + s) * split_stride + lane + 32 * j)
                                                             : 0.f;
#pragma unroll
      for (int j = 0; j < kWarpKeys; ++j)
#pragma unroll
        for (int s = 0; s < kWarpSplits; ++s)
          if (s0 + s < num_splits) v[j] = s0 + s == 0 ? q[j][s] : __fadd_rn(v[j], q[j][s]);
    }
    MEGAC_MARK(0);  // thread 0's partials summed (an L2 round trip)
    if constexpr (Stop::kOn) {
      if (__shfl_sync(kFullMask, lane == 0 && stop() ? 1 : 0, 0)) return false;
    }
  }
  uint32_t hi[kWarpKeys];  // 0: no key (past E, or taken): below every logit's
#pragma unroll
  for (int j = 0; j < kWarpKeys; ++j) hi[j] = lane + 32 * j < E ? order_hi(v[j]) : 0u;
  int id = 0;
  float val = 0.f;
#pragma unroll 1
  for (int r = 0; r < K; ++r) {
    uint32_t m = hi[0];
#pragma unroll
    for (int j = 1; j < kWarpKeys; ++j) m = max(m, hi[j]);
    m = __reduce_max_sync(kFullMask, m);
    uint32_t cand = 0xffffffffu;  // this lane's lowest id holding the max
#pragma unroll
    for (int j = kWarpKeys - 1; j >= 0; --j)
      if (hi[j] == m) cand = uint32_t(lane + 32 * j);
    const uint32_t best = __reduce_min_sync(kFullMask, cand);
    float bv = 0.f;
#pragma unroll
    for (int j = 0; j < kWarpKeys; ++j)
      if (uint32_t(lane + 32 * j) == best) {
        hi[j] = 0u;
        bv = v[j];
      }
    if constexpr (kValues) bv = __shfl_sync(kFullMask, bv, int(best & 31u));
    if (lane == r) {
      id = int(best);
      val = bv;
    }
  }
  MEGAC_MARK(1);  // every logit ranked
  id_out = id;
  v_out = val;
  return true;
}

// Shared memory of topk_rows_cta, in int32 words (ids first: rows * k of them).
__host__ __device__ constexpr int topk_smem_words(int rows, int num_experts, int k) {
  return 2 * rows * k + 3 * rows * num_experts + 2;  // + 2: the keys' 8-byte alignment
}

// ROUTER_TOPK's ranking for rows 0..rows-1, by the whole CTA (kWeights false:
// the ranking alone, the selected ids in smem, nothing written to global) (any size >= 32;
// K <= min(E, 32)): row r's split-s logits at parts + s * split_stride + r *
// E. Every (row, expert) logit is summed by one thread (its splits' loads
// issued at once, added in split order), then its rank is counted against
// the row's E keys in shared memory: rank < K selects it as entry `rank`.
// One pass of E compares per logit, all rows and experts at once, instead of
// K dependent arg-max rounds on one warp per row (~4.4 us of the ~6.6 a
// top-k task ran, measured with MEGAC_MARK on the H200). Then warp w weighs
// rows w, w + warps, ... (lane j < K: entry j) and writes ids_out / w_out
// [rows * K]. On return smem[0 .. rows * K) holds the selected ids (row
// major), for the caller (the finalize's ranking, the expert prefetch).
// `stop` (thread 0's, asked once the partials are summed): true ends the
// call there for the whole CTA, nothing ranked (returns false).
struct NeverStop {
  static constexpr bool kOn = false;
  __device__ bool operator()() const { return false; }
};
// `rinv` (MEGAC_ROUTER_COMBINE; null: none): the logits are unnormalised
// (COMBINE_IN): ranked as they are (1 / rms > 0 keeps the order, and the
// routed up claimers rank the same unscaled sums: their ids must agree),
// and each row's selected logits times rinv[r] (fp32, one rounding) before
// routing_weight, as megac/routing.py topk's `scale`. In shared memory,
// written by the caller's other warps before the call (finalize_cta): the
// call's first barrier shows it to the weighing warps.
template <bool kWeights = true, class Stop = NeverStop>
__device__ __forceinline__ bool topk_rows_cta(const float* __restrict__ parts, size_t split_stride,
                                              int num_splits, int rows, int E, int K, int32_t flags,
                                              int32_t* __restrict__ ids_out, float* __restrict__ w_out,
                                              int32_t* smem, Stop stop = {}
#if MEGAC_ROUTER_COMBINE
                                              , const float* rinv = nullptr
#endif
) {
  int32_t* sel_id = smem;                                       // [rows * K]
  if constexpr (MEGAC_TOPK_WARP) {
#if MEGAC_ROUTER_COMBINE
    if constexpr (kWeights && !Stop::kOn) {
      if (rinv != nullptr && rows == 1 && one_row_warp_fits(E, K)) {
        // warp 0 ranks as below; the weights wait for the barrier that
        // shows rinv[0] (the caller's other warps reduce it meanwhile)
        const int lane = threadIdx.x & 31;
        int id = 0;
        float v = 0.f;
        if (threadIdx.x < 32) {
          rank_one_row_warp<true>(parts, split_stride, num_splits, E, K, stop, id, v);
          if (lane < K) sel_id[lane] = id;
        }
        __syncthreads();
        if (threadIdx.x < 32) {
          const float w = routing_weight(__fmul_rn(v, rinv[0]), K, flags);  // all 32 lanes: it shuffles
          if (lane < K) {
            ids_out[lane] = id;
            w_out[lane] = w;
          }
          MEGAC_MARK(2);  // weights and stores
        }
        __syncthreads();
        return true;
      }
    }
#endif
    if (rows == 1 && one_row_warp_fits(E, K)) {
      bool halted = false;  // thread 0's
      if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        int id;
        float v;
        halted = !rank_one_row_warp<kWeights>(parts, split_stride, num_splits, E, K, stop, id, v);
        if (!halted) {
          if (lane < K) sel_id[lane] = id;
          if constexpr (kWeights) {
            const float w = routing_weight(v, K, flags);  // all 32 lanes: it shuffles
            if (lane < K) {
              ids_out[lane] = id;
              w_out[lane] = w;
            }
            MEGAC_MARK(2);  // weights and stores
          }
        }
      }
      if constexpr (Stop::kOn) {
        if (__syncthreads_or(threadIdx.x == 0 && halted)) return false;
      } else {
        __syncthreads();
      }
      return true;
    }
  }
  float* sel_v = reinterpret_cast<float*>(smem + rows * K);     // [rows * K]
  float* vals = sel_v + rows * K;                               // [rows * E]
  unsigned long long* keys = reinterpret_cast<unsigned long long*>(
      (reinterpret_cast<uintptr_t>(vals + rows * E) + 7) & ~uintptr_t(7));  // [rows * E]
  const int items = rows * E;
  for (int i = threadIdx.x; i < items; i += blockDim.x) {
    const float* p = parts + i;  // row i / E, expert i % E
    float v = 0.f;
    for (int s0 = 0; s0 < num_splits; s0 += kSplitsAtOnce) {
      // partials come from other tasks of this launch: coherent loads, all at once
      float q[kSplitsAtOnce];
#pragma unroll
      for (int s = 0; s < kSplitsAtOnce; ++s) q[s] = s0 + s < num_splits ? __ldcg(p + (s0 + s) * split_stride) : 0.f;
#pragma unroll
      for (int s = 0; s < kSplitsAtOnce; ++s)
        if (s0 + s < num_splits) v = s0 + s == 0 ? q[s] : __fadd_rn(v, q[s]);
    }
    vals[i] = v;
    keys[i] = order_key(v, i % E);
  }
  MEGAC_MARK(0);  // thread 0's partials summed (an L2 round trip)
  if constexpr (Stop::kOn) {
    if (__syncthreads_or(threadIdx.x == 0 && stop())) return false;
  } else {
    __syncthreads();
  }
#if MEGAC_TOPK_RANK_HALVES
  // two threads per logit: lanes l and l + 16 of a warp count the even and
  // the odd keys of the row (adjacent words: one shared-memory wavefront),
  // then add their counts
  const int half = (threadIdx.x >> 4) & 1;
  const int slot = (threadIdx.x >> 5) * 16 + (threadIdx.x & 15);
  for (int i0 = 0; i0 < items; i0 += int(blockDim.x) / 2) {
    const int i = i0 + slot;
    const bool valid = i < items;
    const int r = valid ? i / E : 0;
    const unsigned long long mine = valid ? keys[i] : ~0ull;
    const unsigned long long* row = keys + r * E;
    int rank = 0;
#pragma unroll 8
    for (int e = half; e < E; e += 2) rank += row[e] > mine;
    rank += __shfl_xor_sync(kFullMask, rank, 16);
    if (valid && half == 0 && rank < K) {
      sel_id[r * K + rank] = i - r * E;
      sel_v[r * K + rank] = vals[i];
    }
  }
#else
  for (int i = threadIdx.x; i < items; i += blockDim.x) {
    const int r = i / E;
    const unsigned long long mine = keys[i];
    const unsigned long long* row = keys + r * E;
    int rank = 0;
#pragma unroll 8
    for (int e = 0; e < E; ++e) rank += row[e] > mine;  // the same address across a warp: a broadcast
    if (rank < K) {
      sel_id[r * K + rank] = i - r * E;
      sel_v[r * K + rank] = vals[i];
    }
  }
#endif
  __syncthreads();
  MEGAC_MARK(1);  // every logit ranked
  if constexpr (!kWeights) return true;  // the ids alone (a routed claimer: sel_id is what it needs)
  const int lane = threadIdx.x & 31;
  for (int r = threadIdx.x >> 5; r < rows; r += blockDim.x >> 5) {
#if MEGAC_ROUTER_COMBINE
    const float sel = lane < K ? sel_v[r * K + lane] : 0.f;
    const float logit = rinv != nullptr ? __fmul_rn(sel, rinv[r]) : sel;  // rinv: the sums' barrier showed it
#else
    const float logit = lane < K ? sel_v[r * K + lane] : 0.f;
#endif
    const float w = routing_weight(logit, K, flags);  // all 32 lanes: it shuffles
    if (lane < K) {
      ids_out[r * K + lane] = sel_id[r * K + lane];
      w_out[r * K + lane] = w;
    }
  }
  MEGAC_MARK(2);  // weights and stores
  __syncthreads();
  return true;
}

struct FinalizeArgs {
  const int32_t* topk_ids;  // [rows * k] (unused when topk_splits > 0)
  int32_t rows, k, num_experts;
  int32_t up_tiles, down_tiles;  // records per active expert in each queue
  int32_t queue_cap;             // records each queue holds
  int32_t* route_slot;           // [rows * k]
  int4* up_queue;                // [queue_cap]
  int4* down_queue;              // [queue_cap]; null: none (split_down: the count alone)
  int32_t* up_len;               // target word: up-queue length; null: no up queue (routed claims)
  int32_t* down_len;             // target word: down-queue length
  // the top-k inside (topk_splits > 0): row r's split s logits at
  // router_part + s * split_stride + r * num_experts
  const float* router_part = nullptr;
  size_t split_stride = 0;
  int32_t topk_splits = 0, flags = 0;
  float* topk_w = nullptr;  // [rows * k]
  // a ranking finalize's ids also here ([rows * k], as ROUTER_TOPK writes
  // them: the buffer the host reads a step's routing from); null: not
  int32_t* topk_ids_out = nullptr;
  // the gather inside (x != nullptr): row r of x ([rows, hidden] bf16) to
  // each of its routed slots of moe_x ([slots, hidden])
  const __nv_bfloat16* x = nullptr;
  __nv_bfloat16* moe_x = nullptr;
  int32_t hidden = 0;
#if MEGAC_ROUTER_COMBINE
  // COMBINE_IN (topk_splits > 0): the router partials are unnormalised; the
  // weights take row r's selected logits times 1 / rms of row r of resid
  // ([rows, resid_d] fp32: the norm task's residual, rsqrt(mean(x^2) +
  // eps)); null: the logits as they are
  const float* resid = nullptr;
  int32_t resid_d = 0;
  float eps = 0.f;
#endif
};

// Shared memory for finalize_cta, in int32 words (the ranked ids of a
// top-k-ranking finalize take `entries` more, after these).
__host__ __device__ constexpr int finalize_smem_words(int num_experts, int entries) {
  return 3 * num_experts + 1 + entries;
}

// An expert id of the routing: in shared memory (ranked by this CTA) or in
// global memory (written by other tasks of this launch: a coherent load).
__device__ __forceinline__ int load_id(const int32_t* p, bool shared) { return shared ? *p : __ldcg(p); }

// Both expert queues share one record layout, so one builder serves both.
static_assert(rec_moe_up::EXPERT == rec_moe_down::EXPERT && rec_moe_up::N_TILE == rec_moe_down::N_TILE &&
                  rec_moe_up::SLOT0 == rec_moe_down::SLOT0 && rec_moe_up::ROWS == rec_moe_down::ROWS,
              "MoE up and down records differ");

__device__ __forceinline__ int4 expert_record(int expert, int n_tile, int slot0, int rows) {
  int32_t r[QUEUE_RECORD_WORDS];
  r[rec_moe_up::EXPERT] = expert;
  r[rec_moe_up::N_TILE] = n_tile;
  r[rec_moe_up::SLOT0] = slot0;
  r[rec_moe_up::ROWS] = rows;
  return make_int4(r[0], r[1], r[2], r[3]);
}

// Warp 0: rank[i] = index of entry i among the entries of its expert (index
// order), cnt[e] = entries of expert e. A warp match over 32 entries at a
// time; cnt carries the counts across chunks. cnt starts at zero.
__device__ __forceinline__ void rank_entries(const int32_t* ids, bool ids_shared, int n, int32_t* cnt,
                                             int32_t* rank) {
  const int lane = threadIdx.x & 31;
  const unsigned lt = (1u << lane) - 1u;
  for (int c = 0; c < n; c += 32) {
    const int i = c + lane;
    const int e = i < n ? load_id(ids + i, ids_shared) : -1 - lane;  // unique: never matches
    const unsigned same = __match_any_sync(kFullMask, e);
    const int base = i < n ? cnt[e] : 0;
    __syncwarp();
    if (i < n) {
      rank[i] = base + __popc(same & lt);
      if ((same & lt) == 0) cnt[e] = base + __popc(same);  // group leader
    }
    __syncwarp();
  }
}

// Warp 0: off = exclusive scan of cnt, act[0..*nact) = active experts
// ascending, 32 experts at a time.
__device__ __forceinline__ void scan_experts(const int32_t* cnt, int E, int32_t* off, int32_t* act,
                                             int32_t* nact) {
  const int lane = threadIdx.x & 31;
  const unsigned lt = (1u << lane) - 1u;
  int carry = 0, acarry = 0;
  for (int c = 0; c < E; c += 32) {
    const int e = c + lane;
    const int x = e < E ? cnt[e] : 0;
    int ix = x;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(kFullMask, ix, o);
      if (lane >= o) ix += y;
    }
    const unsigned hit = __ballot_sync(kFullMask, x > 0);
    if (e < E) off[e] = carry + ix - x;
    if (x > 0) act[acarry + __popc(hit & lt)] = e;
    carry += __shfl_sync(kFullMask, ix, 31);
    acarry += __popc(hit);
  }
  if (lane == 0) *nact = acarry;
}

// One record per (active expert, tile), expert-major: record p is tile
// p % tiles of the (p / tiles)-th active expert. Whole CTA.
__device__ __forceinline__ void write_queue(int4* q, int tiles, int nact, const int32_t* act,
                                            const int32_t* off, const int32_t* cnt) {
  for (int p = threadIdx.x; p < nact * tiles; p += blockDim.x) {
    const int a = p / tiles;
    const int e = act[a];
    q[p] = expert_record(e, p - a * tiles, off[e], cnt[e]);
  }
}

#if MEGAC_ROUTER_COMBINE
// rinv[r] = rsqrt(ss / D + eps) for rows r < rows of x ([rows, D] fp32,
// written by other CTAs of this launch: coherent loads), ss the row's sum of
// squares; rinv in shared memory. One row a warp, warps first_warp.. of the
// CTA (the others return at once). The sum's order is fixed: each lane over
// its elements (float4 c = lane, lane + 32, ... ascending, a float4's four in
// order; D % 4 != 0: elements lane, lane + 32, ...), then an xor tree over
// the lanes (every lane ends with the same bits), so neither timing nor the
// warp that takes a row changes the bits; they may differ from the VM's mean
// by the order of the sum (a few ulp, as norm.cuh's inv_rms). Each lane's
// loads of a row go out at once where D <= 32 * 4 * kRmsAtOnce (one round
// trip; North Mini Code's 2048).
constexpr int kRmsAtOnce = 16;

__device__ __forceinline__ void rows_inv_rms(const float* __restrict__ x, int D, float eps, int rows, float* rinv,
                                             int first_warp) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  if (warp < first_warp) return;
  for (int r = warp - first_warp; r < rows; r += nwarps - first_warp) {
    const float* row = x + size_t(r) * D;
    float ss = 0.f;
    if (D % 4 == 0) {
      const float4* p = reinterpret_cast<const float4*>(row);
      const int n4 = D / 4;
      for (int c0 = lane; c0 < n4; c0 += 32 * kRmsAtOnce) {
        float4 q[kRmsAtOnce];
#pragma unroll
        for (int j = 0; j < kRmsAtOnce; ++j) {
          const int c = c0 + 32 * j;
          q[j] = c < n4 ? __ldcg(p + c) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int j = 0; j < kRmsAtOnce; ++j) {
          if (c0 + 32 * j < n4) {
            ss = fmaf(q[j].x, q[j].x, ss);
            ss = fmaf(q[j].y, q[j].y, ss);
            ss = fmaf(q[j].z, q[j].z, ss);
            ss = fmaf(q[j].w, q[j].w, ss);
          }
        }
      }
    } else {
      for (int i = lane; i < D; i += 32) {
        const float v = __ldcg(row + i);
        ss = fmaf(v, v, ss);
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(kFullMask, ss, o);
    if (lane == 0) rinv[r] = rsqrtf(ss / float(D) + eps);
  }
}
#endif

// ROUTE_FINALIZE, by one whole CTA (any size >= 32). Returns false, having
// written nothing and raised kErrQueueOverflow (reported as `site`'s task),
// when a queue would need more than queue_cap records. A ranking finalize
// (topk_splits > 0) needs topk_smem_words(rows, E, k) more shared words.
__device__ __forceinline__ bool finalize_cta(const FinalizeArgs& a, int32_t* smem, const WaitSite& site) {
  const int E = a.num_experts;
  const int n = a.rows * a.k;
  int32_t* cnt = smem;        // [E]
  int32_t* off = cnt + E;     // [E]
  int32_t* act = off + E;     // [E]
  int32_t* nact = act + E;    // [1]
  int32_t* rank = nact + 1;   // [n]
  const bool ranked = a.topk_splits > 0;
  const int32_t* ids = a.topk_ids;
  if (ranked) {
    // one hop less per MoE layer: no ROUTER_TOPK tasks, every row's top-k
    // here; the ranked ids stay in shared memory after the finalize's words
    int32_t* ids_s = smem + finalize_smem_words(E, n);
#if MEGAC_ROUTER_COMBINE
    // COMBINE_IN: the rows' 1 / rms, by warps 1.. while warp 0 ranks one
    // row (more rows: before the CTA sums them), into `rank`: free until
    // the ranking has returned
    float* rinv = nullptr;
    if (a.resid != nullptr) {
      rinv = reinterpret_cast<float*>(rank);
      rows_inv_rms(a.resid, a.resid_d, a.eps, a.rows, rinv, blockDim.x > 32 ? 1 : 0);
    }
    topk_rows_cta(a.router_part, a.split_stride, a.topk_splits, a.rows, E, a.k, a.flags, ids_s, a.topk_w,
                  ids_s, NeverStop{}, rinv);
#else
    topk_rows_cta(a.router_part, a.split_stride, a.topk_splits, a.rows, E, a.k, a.flags, ids_s, a.topk_w,
                  ids_s);
#endif
    ids = ids_s;
  }
  for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  if (ranked && a.topk_ids_out != nullptr)
    for (int i = threadIdx.x; i < n; i += blockDim.x) a.topk_ids_out[i] = ids[i];
  if (threadIdx.x < 32) {
    rank_entries(ids, ranked, n, cnt, rank);
    scan_experts(cnt, E, off, act, nact);
  }
  __syncthreads();

  const int na = *nact;
  const int need = na * max(a.up_tiles, a.down_tiles);
  if (need > a.queue_cap) {
    if (threadIdx.x == 0)
      report_error(site.status, site.task, site.opcode, -1, need, a.queue_cap, site.layer, kErrQueueOverflow);
    return false;
  }
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int slot = off[load_id(ids + i, ranked)] + rank[i];
    a.route_slot[i] = slot;
    rank[i] = slot;  // its rank is spent: the gather below reads the slot here
  }
  if (a.x != nullptr) {
    // MOE_GATHER for every row: entry i's row (i / k) to its slot (rank[i]
    // now), 16 bytes a thread, consecutive threads along one row (coalesced)
    __syncthreads();
    const int nv = a.hidden / 8;
    for (int t = threadIdx.x; t < n * nv; t += blockDim.x) {
      const int i = t / nv, c = t - i * nv;
      const int slot = rank[i];
      const uint4 v = __ldcg(reinterpret_cast<const uint4*>(a.x + size_t(i / a.k) * a.hidden) + c);
      reinterpret_cast<uint4*>(a.moe_x + size_t(slot) * a.hidden)[c] = v;
    }
  }
  MEGAC_MARK(3);  // ranked and counted, slots written (and rows gathered)
  if (a.up_len != nullptr) write_queue(a.up_queue, a.up_tiles, na, act, off, cnt);
  if (a.down_queue != nullptr) write_queue(a.down_queue, a.down_tiles, na, act, off, cnt);
  if (threadIdx.x == 0) {
    if (a.up_len != nullptr) *a.up_len = na * a.up_tiles;
    *a.down_len = na * a.down_tiles;
  }
  return true;
}

// MOE_GATHER for one row, whole CTA: copy x[row] (bf16, D % 8 == 0) to its
// k slots (k <= 32). The slots are staged in shared memory first so every
// thread issues its loads and stores without a dependent index load each.
__device__ __forceinline__ void gather_row(const __nv_bfloat16* x, __nv_bfloat16* moe_x,
                                           const int32_t* slot, int row, int k, int D,
                                           int32_t* smem) {
  if (threadIdx.x < k) smem[threadIdx.x] = __ldcg(slot + row * k + threadIdx.x);
  __syncthreads();
  const int nv = D / 8;
  const uint4* src = reinterpret_cast<const uint4*>(x + (size_t)row * D);
  for (int c = threadIdx.x; c < nv; c += blockDim.x) {
    const uint4 v = __ldcg(src + c);
    for (int j = 0; j < k; ++j) reinterpret_cast<uint4*>(moe_x + (size_t)smem[j] * D)[c] = v;
  }
  __syncthreads();
}

// acc = w * y (first), or acc + w * y, rounding the product and the sum
// separately as the VM does (an FMA would round once and differ).
__device__ __forceinline__ float4 weighted_add(float4 acc, float w, float4 y, bool first) {
  const float4 p = make_float4(__fmul_rn(w, y.x), __fmul_rn(w, y.y), __fmul_rn(w, y.z), __fmul_rn(w, y.w));
  if (first) return p;
  return make_float4(__fadd_rn(acc.x, p.x), __fadd_rn(acc.y, p.y), __fadd_rn(acc.z, p.z),
                     __fadd_rn(acc.w, p.w));
}

// MOE_COMBINE for one row, whole CTA: y = moe_out (moe_out_t [rows * k, ld],
// D % 4 == 0), out fp32 [rows, D], k <= 32, features [c0, c0 + cols)
// (multiples of 4; cols 0: all D). Slots and weights are staged in shared
// memory; up to 8 expert outputs are loaded before the first add.
// kPre: the row's slots and scores are in smem / ws already (ops_gemm.cuh
// slots_early, a timing probe).
template <bool kPre = false>
__device__ __forceinline__ void combine_row(const moe_out_t* y, const int32_t* slot, const float* w,
                                            float* out, int row, int k, int D, int32_t* smem, int64_t ld = 0,
                                            int c0 = 0, int cols = 0) {
  if (ld == 0) ld = D;
  if (cols == 0) cols = D;
  float* ws = reinterpret_cast<float*>(smem + 32);
  if (!kPre && threadIdx.x < k) {
    smem[threadIdx.x] = __ldcg(slot + row * k + threadIdx.x);
    ws[threadIdx.x] = __ldcg(w + row * k + threadIdx.x);
  }
  __syncthreads();
  const int nv = (c0 + cols) / 4;
  for (int c = c0 / 4 + threadIdx.x; c < nv; c += blockDim.x) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int j0 = 0; j0 < k; j0 += 8) {
      float4 u[8];
#pragma unroll
      for (int jj = 0; jj < 8; ++jj)
        if (j0 + jj < k) u[jj] = ld4_moe_out(y + smem[j0 + jj] * ld, c);
#pragma unroll
      for (int jj = 0; jj < 8; ++jj)
        if (j0 + jj < k) acc = weighted_add(acc, ws[j0 + jj], u[jj], j0 + jj == 0);
    }
    reinterpret_cast<float4*>(out + (size_t)row * D)[c] = acc;
  }
  __syncthreads();
}

// MEGAC_COMBINE_POLL (common.cuh): a combine that polls its inputs.

__device__ __forceinline__ bool landed4(uint4 v) {
  return v.x != UNLANDED_F32 && v.y != UNLANDED_F32 && v.z != UNLANDED_F32 && v.w != UNLANDED_F32;
}

// One CTA-wide round of a bounded poll: 1 once `landed` holds in every
// thread, 0 to poll again, -1 when the watchdog fired (thread 0 then calls
// expired(), which writes the report) or another CTA aborted. Thread 0
// keeps the bound; the second barrier hands its verdict to the CTA.
template <class Expired>
__device__ __forceinline__ int poll_round(bool landed, SpinBound& bound, const WaitSite& site, Expired expired) {
  if (__syncthreads_and(landed)) return 1;
  int go = 1;
  if (threadIdx.x == 0 && !bound.keep_going(site)) {
    go = 0;
    if (bound.expired) expired();
  }
  return __syncthreads_and(go) ? 0 : -1;
}

// combine_row (the same adds in the same order, so the same bits) over
// outputs it polls (MEGAC_COMBINE_POLL, common.cuh); false: the watchdog
// fired, and `expired()` (thread 0) wrote the report. K <= 8 slots: a
// thread a column of float4 at a time (batch 1: 64 columns a range, one
// round), summed as soon as its K values have landed, only the sum kept
// across polls; more slots: the poll checks, then combine_row loads again.
// (The polled values kept across the loop, or the whole as a call, spilled
// the megakernel's 255 registers.)
template <int K, class Expired>
__device__ __forceinline__ bool combine_row_polled(float* y, const int32_t* slot, const float* w, float* out, int row,
                                                   int D, int32_t* smem, int64_t ld, int c0, int cols,
                                                   const WaitSite& site, Expired expired) {
  if (ld == 0) ld = D;
  if (cols == 0) cols = D;
  const uint4 unlanded = make_uint4(UNLANDED_F32, UNLANDED_F32, UNLANDED_F32, UNLANDED_F32);
  float* ws = reinterpret_cast<float*>(smem + 32);
  if (threadIdx.x < K) {
    smem[threadIdx.x] = __ldcg(slot + row * K + threadIdx.x);
    ws[threadIdx.x] = __ldcg(w + row * K + threadIdx.x);
  }
  __syncthreads();
  const int q0 = c0 / 4, nq = cols / 4;
  SpinBound bound;
  if constexpr (K <= 8) {
    // every thread polls its own columns, bounded on its own: no barrier
    // between polls; the CTA agrees once at the end
    bool ok = true;
    uint32_t polls = 0;
    for (int i = threadIdx.x; ok && i < nq; i += blockDim.x) {
      const int c = q0 + i;
      for (;;) {
        uint4 u[K];
#pragma unroll
        for (int j = 0; j < K; ++j) u[j] = ld_relaxed_gpu_v4(reinterpret_cast<const float4*>(y + smem[j] * ld) + c);
        bool have = true;
#pragma unroll
        for (int j = 0; j < K; ++j) have = have && landed4(u[j]);
        if (have) {
          float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
          for (int j = 0; j < K; ++j)
            acc = weighted_add(acc, ws[j],
                               make_float4(__uint_as_float(u[j].x), __uint_as_float(u[j].y), __uint_as_float(u[j].z),
                                           __uint_as_float(u[j].w)),
                               j == 0);
          reinterpret_cast<float4*>(out + (size_t)row * D)[c] = acc;
#pragma unroll
          for (int j = 0; j < K; ++j) st_relaxed_gpu_v4(reinterpret_cast<float4*>(y + smem[j] * ld) + c, unlanded);
          break;
        }
        // the abort flag and the clock every 8th poll: read at every poll,
        // the flag's round trip would double the poll's period
        if ((++polls & 7u) == 0u && !bound.keep_going(site)) {
          ok = false;
          break;
        }
      }
    }
    // every thread whose own deadline passed reports (report_error keeps the first record)
    if (!ok && bound.expired) expired();
    if (!__syncthreads_and(ok)) return false;
  } else {
    for (;;) {  // poll, then combine_row's loads, then the bits back
      bool landed = true;
      for (int i = threadIdx.x; i < K * nq; i += blockDim.x)
        landed = landed && landed4(ld_relaxed_gpu_v4(reinterpret_cast<const float4*>(y + smem[i / nq] * ld) + q0 + i % nq));
      const int v = poll_round(landed, bound, site, expired);
      if (v < 0) return false;
      if (v > 0) break;
    }
    combine_row(reinterpret_cast<const moe_out_t*>(y), slot, w, out, row, K, D, smem, ld, c0, cols);  // fp32 here
    for (int i = threadIdx.x; i < K * nq; i += blockDim.x)
      st_relaxed_gpu_v4(reinterpret_cast<float4*>(y + smem[i / nq] * ld) + q0 + i % nq, unlanded);
  }
  __syncthreads();
  return true;
}

// Shared bytes combine_tiles stages at most (a chunk of columns at a time).
constexpr int kCombineStageBytes = 32 * 1024;

// combine_row over split-K partials (split_down): a slot's output is the sum
// of its `tiles` partials y[slot * ld + t * D + f], added in tile order (as
// the VM). A chunk of columns at a time, every (tile, slot, 16 bytes) of it
// copied at once across the CTA into shared memory `stage` (cp.async: one round trip
// instead of one per tile: a thread summing its tiles from L2 in order took
// ~9 us for 96 partials of a row at batch 1), then each (slot, column) summed
// over the tiles, then the slots weighted in k order.
__device__ __forceinline__ void combine_tiles(const float* y, const int32_t* slot, const float* w, float* out,
                                              int row, int k, int D, int32_t* smem, float4* stage, int tiles,
                                              int64_t ld, int c0, int cols) {
  float* ws = reinterpret_cast<float*>(smem + 32);
  if (threadIdx.x < k) {
    smem[threadIdx.x] = __ldcg(slot + row * k + threadIdx.x);
    ws[threadIdx.x] = __ldcg(w + row * k + threadIdx.x);
  }
  __syncthreads();
  const int per = tiles * k;  // float4s a column needs
  const int chunk = max(1, kCombineStageBytes / 16 / per);
  for (int q0 = c0 / 4; q0 < (c0 + cols) / 4; q0 += chunk) {
    const int nc = min(chunk, (c0 + cols) / 4 - q0);
    const int n = per * nc;
    // cp.async: every 16 bytes of the chunk in flight at once without a
    // register each (loads into registers spilled the megakernel's dispatch)
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const int c = i % nc, tj = i / nc, j = tj % k, t = tj / k;
      const float* src = y + smem[j] * ld + int64_t(t) * D + (q0 + c) * 4;
      const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(stage + i));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
    for (int i = threadIdx.x; i < k * nc; i += blockDim.x) {  // (slot j, column c): its tiles in order
      float4 s = stage[i];
      for (int t = 1; t < tiles; ++t) {
        const float4 p = stage[t * k * nc + i];
        s = make_float4(__fadd_rn(s.x, p.x), __fadd_rn(s.y, p.y), __fadd_rn(s.z, p.z), __fadd_rn(s.w, p.w));
      }
      stage[i] = s;
    }
    __syncthreads();
    for (int c = threadIdx.x; c < nc; c += blockDim.x) {
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int j = 0; j < k; ++j) acc = weighted_add(acc, ws[j], stage[j * nc + c], j == 0);
      reinterpret_cast<float4*>(out + (size_t)row * D)[q0 + c] = acc;
    }
    __syncthreads();
  }
}

}  // namespace moe
}  // namespace megac

// Device-side MoE routing: ROUTER_TOPK (per row), ROUTE_FINALIZE (one CTA,
// after every row's top-k), MOE_GATHER and MOE_COMBINE (per row).
//
// Semantics (mirrored by the numpy reference in megac/gpu/blocks/moe_routing.py):
//   TOPK      the k largest logits of the row, ties to the lower expert id,
//             in selection order (descending). Weight: sigmoid(logit), or
//             softmax over the full row (then optionally renormalised so the
//             k weights sum to 1, summed in k order). Computed in fp64 and
//             rounded once, so the weight is the correctly rounded fp32 value
//             in practice (the reference allows 1 ulp).
//   FINALIZE  counts[e] = entries routed to e; offsets = exclusive scan;
//             the slots of expert e are offsets[e] + 0.. in (row, k) order;
//             slot[row*k + j] is the slot of entry (row, j), slot_entry[slot]
//             the inverse. Task queues: for every active expert (ascending
//             id), every row tile of `row_tile` slots, every n tile: one
//             int4 {expert, n_tile, first_slot, n_rows}; `up` gets n_tiles_up
//             records per row tile, `down` n_tiles_down. qcount = {up length,
//             down length, active experts, routed entries}.
//             Queues are sized by the host for the worst case
//             (queue_capacity_rows below); a record that would land past the
//             capacity is not written and raises kErrQueueOverflow.
//   GATHER    moe_x[slot[row, j]] = x[row] for j < k (16-byte copies).
//             GATHER and COMBINE need 64 words of shared memory.
//   COMBINE   out[row] = sum_j w[row, j] * y[slot[row, j]] in fp32, j in order.
//
// Everything is deterministic: no result depends on which CTA ran what or
// when (ranks come from a warp match over entries in index order, not from
// atomics).
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "common.cuh"

namespace megac {
namespace moe {

constexpr int kModeSigmoid = 0;
constexpr int kModeSoftmax = 1;

// Selection key: larger value first, then lower id.
__device__ __forceinline__ bool better(float va, int ia, float vb, int ib) {
  return va > vb || (va == vb && ia < ib);
}

// ROUTER_TOPK for one row, by ONE warp (all 32 lanes). MAX_E is the largest
// expert count the kernel is built for (<= 32 * 8); E <= MAX_E at run time,
// K <= 32. Lane j < K writes entry j.
template <int MAX_E>
__device__ __forceinline__ void topk_row_warp(const float* __restrict__ logits, int E, int K,
                                              int mode, bool renorm, int32_t* __restrict__ ids_out,
                                              float* __restrict__ w_out) {
  constexpr int VPL = (MAX_E + 31) / 32;
  static_assert(VPL <= 8, "at most 256 experts");
  const int lane = threadIdx.x & 31;
  float v[VPL];
  bool taken[VPL];
#pragma unroll
  for (int j = 0; j < VPL; ++j) {
    const int e = lane + 32 * j;
    taken[j] = e >= E;
    // Logits come from another task of this launch: coherent loads.
    v[j] = e < E ? __ldcg(logits + e) : -INFINITY;
  }

  // Softmax statistics over the whole row, fp64, fixed xor-tree order.
  double row_max = 0.0, row_sum = 1.0;
  if (mode == kModeSoftmax) {
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < VPL; ++j)
      if (!taken[j]) m = fmaxf(m, v[j]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    row_max = m;
    double s = 0.0;
#pragma unroll
    for (int j = 0; j < VPL; ++j)
      if (!taken[j]) s += exp((double)v[j] - row_max);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    row_sum = s;
  }

  int my_id = -1;
  float my_logit = 0.f;
  for (int r = 0; r < K; ++r) {
    float bv = -INFINITY;
    int bi = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < VPL; ++j) {
      const int e = lane + 32 * j;
      if (!taken[j] && better(v[j], e, bv, bi)) {
        bv = v[j];
        bi = e;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (better(ov, oi, bv, bi)) {
        bv = ov;
        bi = oi;
      }
    }
#pragma unroll
    for (int j = 0; j < VPL; ++j)
      if (lane + 32 * j == bi) taken[j] = true;
    if (lane == r) {
      my_id = bi;
      my_logit = bv;
    }
  }

  double w = 0.0;
  if (lane < K) {
    if (mode == kModeSoftmax) {
      w = exp((double)my_logit - row_max) / row_sum;
    } else {
      w = 1.0 / (1.0 + exp(-(double)my_logit));
    }
  }
  float wf = (float)w;
  if (mode == kModeSoftmax && renorm) {
    // Sum of the rounded fp32 weights, fp64, in k order: every lane the same.
    double tot = 0.0;
    for (int r = 0; r < K; ++r) tot += (double)__shfl_sync(0xffffffffu, wf, r);
    wf = (float)((double)wf / tot);
  }
  if (lane < K) {
    ids_out[lane] = my_id;
    w_out[lane] = wf;
  }
}

struct FinalizeArgs {
  const int32_t* topk_ids;  // [rows * k]
  int32_t rows, k, num_experts;
  int32_t row_tile;         // slots per queue record (>= 1)
  int32_t n_tiles_up, n_tiles_down;
  int32_t cap_up, cap_down; // queue capacities in records
  int32_t* expert_counts;   // [E]
  int32_t* expert_offsets;  // [E + 1]
  int32_t* slot;            // [rows * k]
  int32_t* slot_entry;      // [rows * k]
  int4* queue_up;           // [cap_up]
  int4* queue_down;         // [cap_down]
  int32_t* qcount;          // [4]
};

// Worst-case records per n tile: every active expert (at most min(E, n)) has
// one partial row tile, plus every full tile of row_tile entries.
__host__ __device__ __forceinline__ int queue_capacity_rows(int num_experts, int entries, int row_tile) {
  const int active = num_experts < entries ? num_experts : entries;
  return active + entries / row_tile;
}

// Shared memory for finalize_cta, in int32 words.
__host__ __device__ __forceinline__ int finalize_smem_words(int num_experts, int entries) {
  return 3 * num_experts + 2 + entries;
}

// ROUTE_FINALIZE, by one whole CTA (any size >= 32). Returns false (and
// raises the error) when a queue would overflow.
__device__ __forceinline__ bool finalize_cta(const FinalizeArgs& a, int32_t* smem, int32_t* status) {
  const int tid = threadIdx.x;
  const int nt = blockDim.x;
  const int E = a.num_experts;
  const int n = a.rows * a.k;
  int32_t* cnt = smem;               // [E]
  int32_t* off = cnt + E;            // [E + 1]
  int32_t* tbase = off + E + 1;      // [E + 1] first row tile of each expert
  int32_t* rank = tbase + E + 1;     // [n]
  for (int e = tid; e < E; e += nt) cnt[e] = 0;
  __syncthreads();

  if (tid < 32) {
    // Rank of each entry among the entries of its expert, in index order:
    // warp-wide match over 32 entries at a time, carried in cnt[].
    const unsigned lt = (1u << tid) - 1u;
    for (int c = 0; c < n; c += 32) {
      const int i = c + tid;
      const int e = i < n ? __ldcg(a.topk_ids + i) : -1 - tid;  // unique: never matches
      const unsigned same = __match_any_sync(0xffffffffu, e);
      int base = 0;
      if (i < n) base = cnt[e];
      __syncwarp();
      if (i < n) {
        rank[i] = base + __popc(same & lt);
        if ((same & lt) == 0) cnt[e] = base + __popc(same);  // group leader
      }
      __syncwarp();
    }
    // Exclusive scans of counts and of row tiles, 32 experts at a time.
    int carry = 0, tcarry = 0, active = 0;
    for (int c = 0; c < E; c += 32) {
      const int e = c + tid;
      const int x = e < E ? cnt[e] : 0;
      const int t = (x + a.row_tile - 1) / a.row_tile;
      active += __popc(__ballot_sync(0xffffffffu, x > 0));
      int ix = x, it = t;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int yx = __shfl_up_sync(0xffffffffu, ix, o);
        const int yt = __shfl_up_sync(0xffffffffu, it, o);
        if (tid >= o) {
          ix += yx;
          it += yt;
        }
      }
      if (e < E) {
        off[e] = carry + ix - x;
        tbase[e] = tcarry + it - t;
      }
      carry += __shfl_sync(0xffffffffu, ix, 31);
      tcarry += __shfl_sync(0xffffffffu, it, 31);
    }
    if (tid == 0) {
      off[E] = carry;
      tbase[E] = tcarry;
      a.qcount[2] = active;
    }
  }
  __syncthreads();

  const int total_tiles = tbase[E];
  bool ok = true;
  for (int e = tid; e < E; e += nt) {
    a.expert_counts[e] = cnt[e];
    a.expert_offsets[e] = off[e];
  }
  if (tid == 0) {
    a.expert_offsets[E] = off[E];
    a.qcount[0] = total_tiles * a.n_tiles_up;
    a.qcount[1] = total_tiles * a.n_tiles_down;
    a.qcount[3] = n;
  }
  for (int i = tid; i < n; i += nt) {
    const int e = __ldcg(a.topk_ids + i);
    const int s = off[e] + rank[i];
    a.slot[i] = s;
    a.slot_entry[s] = i;
  }
  // Records: one thread per (expert, n tile) pair, looping over row tiles.
  const int ntu = a.n_tiles_up, ntd = a.n_tiles_down;
  const int nmax = ntu > ntd ? ntu : ntd;
  for (int p = tid; p < E * nmax; p += nt) {
    const int e = p / nmax;
    const int t = p % nmax;
    const int c = cnt[e];
    for (int rt = 0; rt * a.row_tile < c; ++rt) {
      const int4 rec = make_int4(e, t, off[e] + rt * a.row_tile,
                                 min(a.row_tile, c - rt * a.row_tile));
      const int tile = tbase[e] + rt;
      if (t < ntu) {
        const int idx = tile * ntu + t;
        if (idx < a.cap_up) a.queue_up[idx] = rec; else ok = false;
      }
      if (t < ntd) {
        const int idx = tile * ntd + t;
        if (idx < a.cap_down) a.queue_down[idx] = rec; else ok = false;
      }
    }
  }
  if (!ok) report_error(status, -1, 10, -1, total_tiles, a.cap_up, 0, kErrQueueOverflow);
  return __syncthreads_and(ok) != 0;
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

// MOE_COMBINE for one row, whole CTA: fp32 sum over k in order (k <= 32).
// Slots and weights are staged in shared memory; the expert outputs of up
// to 8 slots are loaded before the first add.
__device__ __forceinline__ void combine_row(const __nv_bfloat16* y, const int32_t* slot,
                                            const float* w, float* out, int row, int k, int D,
                                            int32_t* smem) {
  float* ws = reinterpret_cast<float*>(smem + 32);
  if (threadIdx.x < k) {
    smem[threadIdx.x] = __ldcg(slot + row * k + threadIdx.x);
    ws[threadIdx.x] = __ldcg(w + row * k + threadIdx.x);
  }
  __syncthreads();
  const int nv = D / 8;
  for (int c = threadIdx.x; c < nv; c += blockDim.x) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int j0 = 0; j0 < k; j0 += 8) {
      uint4 u[8];
#pragma unroll
      for (int jj = 0; jj < 8; ++jj)
        if (j0 + jj < k)
          u[jj] = __ldcg(reinterpret_cast<const uint4*>(y + (size_t)smem[j0 + jj] * D) + c);
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
        if (j0 + jj >= k) break;
        const float wj = ws[j0 + jj];
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u[jj]);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float2 f = __bfloat1622float2(h[q]);
          acc[2 * q] = fmaf(wj, f.x, acc[2 * q]);
          acc[2 * q + 1] = fmaf(wj, f.y, acc[2 * q + 1]);
        }
      }
    }
    float4* o = reinterpret_cast<float4*>(out + (size_t)row * D + c * 8);
    o[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    o[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
  }
  __syncthreads();
}

}  // namespace moe
}  // namespace megac

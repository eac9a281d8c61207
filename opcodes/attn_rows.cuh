// One attention split on the CUDA cores, any head_dim and GQA ratio: the
// partial (normalised output and log-sum-exp) of the query heads of one
// (row, kv head) over the keys [begin, end) of one split, paged K/V bf16.
//
// The first megakernel's ATTN_DECODE / claimed attention: plain and shape
// agnostic, so the ABI's split rule (attention.cuh split_range, the VM's
// abi.split_range) and the partials' layout are proven before the
// tensor-core stream (attention.cuh DecodeStream) takes the shapes it is
// built for.
//
// Warp w takes keys begin + w, begin + w + nwarps, ... (a fixed assignment,
// loaded kKeys at a time)
// and keeps, per query head, an online softmax (max, sum, weighted V) in
// fp32; lanes hold head dims lane, lane + 32, ...; dot products reduce over
// a fixed xor tree. The warps' states are merged in warp order. An empty
// split (or an inactive row) writes o = 0, lse = -inf, which merges exactly.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "attention.cuh"
#include "common.cuh"
#include "kv_pool.cuh"

namespace megac {
namespace attn_rows {

using bf16 = __nv_bfloat16;

struct Split {
  const bf16* q;              // [GQA][hd] query heads of this (row, kv head)
  const bf16* k_pool;         // kv_pool.cuh's layout (head_major below)
  const bf16* v_pool;
  const int32_t* pt;          // the row's page-table row
  int kv_heads, kvh, hd, gqa, block_size;
  bool head_major;
  int begin, end;             // keys; empty when begin >= end
  float scale;
  float* o;                   // [GQA][hd] of this (split, row, kv head), row pitch hd
  float* lse;                 // [GQA]
};

// Shared memory (floats): q [gqa][hd], then per warp [gqa] max, [gqa] sum,
// [gqa][hd] acc.
__host__ __device__ constexpr int smem_floats(int nwarps, int gqa, int hd) {
  return gqa * hd + nwarps * gqa * (2 + hd);
}

template <int MAX_DPL, int MAX_GQA>
__device__ __forceinline__ void split(const Split& a, float* sm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int hd = a.hd, G = a.gqa;
  float* qs = sm;
  float* wm = qs + G * hd;
  float* wl = wm + nwarps * G;
  float* wacc = wl + nwarps * G;
  for (int i = threadIdx.x; i < G * hd; i += blockDim.x) qs[i] = __bfloat162float(a.q[i]);
  __syncthreads();

  float m[MAX_GQA], l[MAX_GQA], acc[MAX_GQA][MAX_DPL];
#pragma unroll
  for (int h = 0; h < MAX_GQA; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.f;
#pragma unroll
    for (int j = 0; j < MAX_DPL; ++j) acc[h][j] = 0.f;
  }
  // kKeys keys of the warp's sequence are loaded before any is used (one key
  // at a time left a warp with 512 bytes in flight: latency bound); they are
  // then folded in in key order, as one at a time would.
  constexpr int kKeys = 4;
  for (int key0 = a.begin + warp; key0 < a.end; key0 += kKeys * nwarps) {
    float kf[kKeys][MAX_DPL], vf[kKeys][MAX_DPL];
#pragma unroll
    for (int u = 0; u < kKeys; ++u) {
      const int key = key0 + u * nwarps;
      const bool live = key < a.end;
      const int64_t block = live ? a.pt[key / a.block_size] : 0;
      const int64_t tok = kvpool::row(block, key % a.block_size, a.block_size, a.kv_heads, a.kvh, a.head_major);
      const bf16* kr = a.k_pool + tok * hd;
      const bf16* vr = a.v_pool + tok * hd;
#pragma unroll
      for (int j = 0; j < MAX_DPL; ++j) {
        const int d = lane + 32 * j;
        kf[u][j] = (live && d < hd) ? __bfloat162float(kr[d]) : 0.f;
        vf[u][j] = (live && d < hd) ? __bfloat162float(vr[d]) : 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < kKeys; ++u) {
      if (key0 + u * nwarps >= a.end) break;
#pragma unroll
      for (int h = 0; h < MAX_GQA; ++h) {
        if (h < G) {
          float s = 0.f;
#pragma unroll
          for (int j = 0; j < MAX_DPL; ++j) {
            const int d = lane + 32 * j;
            if (d < hd) s = fmaf(qs[h * hd + d], kf[u][j], s);
          }
#pragma unroll
          for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
          s *= a.scale;
          const float mn = fmaxf(m[h], s);
          const float corr = expf(m[h] - mn);  // exp(-inf) = 0 on the first key
          const float p = expf(s - mn);
          l[h] = l[h] * corr + p;
#pragma unroll
          for (int j = 0; j < MAX_DPL; ++j) acc[h][j] = acc[h][j] * corr + p * vf[u][j];
          m[h] = mn;
        }
      }
    }
  }
#pragma unroll
  for (int h = 0; h < MAX_GQA; ++h) {
    if (h < G) {
      if (lane == 0) {
        wm[warp * G + h] = m[h];
        wl[warp * G + h] = l[h];
      }
#pragma unroll
      for (int j = 0; j < MAX_DPL; ++j) {
        const int d = lane + 32 * j;
        if (d < hd) wacc[(warp * G + h) * hd + d] = acc[h][j];
      }
    }
  }
  __syncthreads();
  // merge the warps in warp order: one thread per (head, dim)
  for (int i = threadIdx.x; i < G * hd; i += blockDim.x) {
    const int h = i / hd, d = i % hd;
    float M = -INFINITY;
    for (int w = 0; w < nwarps; ++w) M = fmaxf(M, wm[w * G + h]);
    float L = 0.f, O = 0.f;
    if (M != -INFINITY) {
      for (int w = 0; w < nwarps; ++w) {
        const float f = expf(wm[w * G + h] - M);  // a warp that saw no key: exp(-inf) = 0
        L += wl[w * G + h] * f;
        O += wacc[(w * G + h) * hd + d] * f;
      }
    }
    a.o[h * hd + d] = L > 0.f ? O / L : 0.f;
    if (d == 0) a.lse[h] = L > 0.f ? M + logf(L) : -INFINITY;
  }
  __syncthreads();
}

}  // namespace attn_rows
}  // namespace megac

// One attention split on the CUDA cores in key tiles: the partial
// (normalised output and log-sum-exp) of the G query heads of one (row, kv
// head) over the keys [begin, end) of one split, paged K/V bf16. Same
// contract as attn_rows::split (an empty split or an inactive row writes
// o = 0, lse = -inf, which merges exactly); this is its fast form.
//
// Why tiles: attn_rows gives each warp a key at a time, and per key and
// query head a 5-level shuffle reduction and two expf, so a split of 512
// keys took ~60 us on the H200 (issue-bound at ~120 ns per key), most of a
// sliding layer's critical path. Here the CTA moves T keys at a time:
//
//   1. the T keys' K and V rows are copied into shared memory with 16-byte
//      cp.async, kStages - 1 tiles ahead of the one computed (all of a
//      tile's bytes in flight at once; keys past the split read as zeros);
//      the page-table entries a tile's copies need are read one tile
//      earlier still, so issuing copies never waits on memory;
//   2. scores S[h][key] = q_h . k * scale: one thread per key and head
//      group, K from shared memory (padded rows: no bank conflicts), q
//      broadcast; no shuffles;
//   3. per head (one warp per head) the tile's running max, rescale factor
//      and probabilities P[h][key];
//   4. O[h][d] = O * rescale + sum_key P[h][key] V[key][d]: each thread keeps
//      4 consecutive dims of one head in registers for the whole split.
//
// Every sum runs in a fixed order (keys in increasing order within a tile,
// tiles in order), so results do not depend on timing.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "common.cuh"
#include "kv_pool.cuh"
#include "mbarrier.cuh"

namespace megac {
namespace attn_tiles {

using bf16 = __nv_bfloat16;

// Tiles in flight + the one computed.
#ifndef MEGAC_ATTN_STAGES
#define MEGAC_ATTN_STAGES 3
#endif
constexpr int kStages = MEGAC_ATTN_STAGES;
static_assert(kStages >= 2, "a tile computed and one in flight");

struct Split {
  const bf16* q;              // [G][HD] query heads of this (row, kv head)
  const bf16* k_pool;         // kv_pool.cuh's layout (head_major below)
  const bf16* v_pool;
  const int32_t* pt;          // the row's page-table row
  int kv_heads, kvh, block_size;
  int begin, end;             // keys; empty when begin >= end
  float scale;
  float* o;                   // [G][HD] of this (split, row, kv head)
  float* lse;                 // [G]
  const void* tmaps = nullptr;  // the pools' tensor maps (LaunchDesc::kv_tmaps; attn_mma's tensor copies)
  bool head_major = false;      // the pools' layout (kv_pool.cuh; the model's KV_HEAD_MAJOR)
};

// The shape of a tile and of the shared memory it needs.
template <int HD, int G, int THREADS>
struct Shape {
  static_assert(HD % 8 == 0, "K/V rows move in 16-byte pieces");
  static constexpr int T = HD <= 128 ? 64 : 32;     // keys per tile
  static constexpr int P = HD + 8;                  // K/V row pitch (bf16): 16 B apart mod 128 B
  static constexpr int kRowBytes = T * P * 2;       // one K (or V) tile
  static constexpr int NG = THREADS / T;            // head groups in the score step
  static constexpr int HPT = (G + NG - 1) / NG;     // heads per thread in the score step
  static constexpr int QUADS = G * HD / 4;          // output quads (4 dims of one head)
  static constexpr int QPT = (QUADS + THREADS - 1) / THREADS;
  static_assert(THREADS % T == 0 && THREADS / 32 >= 1, "whole head groups");
  // byte offsets in the scratch
  static constexpr int kKV = 0;                                      // [kStages][K tile, V tile]
  static constexpr int kQ = kKV + kStages * 2 * kRowBytes;           // fp32 [G][HD]
  static constexpr int kS = kQ + G * HD * 4;                         // fp32 [G][T] scores, then P
  static constexpr int kStat = kS + G * T * 4;                       // fp32 [G] m, l, rescale
  static constexpr int kBytes = kStat + 3 * G * 4;
};

template <int HD, int G, int THREADS>
__host__ __device__ constexpr int smem_bytes() {
  return Shape<HD, G, THREADS>::kBytes;
}

// 16-byte pieces of a tile each thread copies (K and V alike).
template <int HD, int G, int THREADS>
constexpr int kPiecesPerThread = (Shape<HD, G, THREADS>::T * (HD / 8) + THREADS - 1) / THREADS;

// The page-table entries of this thread's keys in tile `t` (0 past the
// split): loaded one tile before its copies are issued, so the copies never
// wait on a page-table read.
template <int HD, int G, int THREADS>
__device__ __forceinline__ void load_blocks(const Split& a, int t, int32_t (&blk)[kPiecesPerThread<HD, G, THREADS>]) {
  using S = Shape<HD, G, THREADS>;
  constexpr int kPieces = HD / 8;
  const int key0 = a.begin + t * S::T;
#pragma unroll
  for (int r = 0; r < kPiecesPerThread<HD, G, THREADS>; ++r) {
    const int i = threadIdx.x + r * THREADS, key = key0 + i / kPieces;
    blk[r] = (i < S::T * kPieces && key < a.end) ? __ldg(a.pt + key / a.block_size) : 0;
  }
}

// Copies of tile `t` (keys begin + t*T ...) into stage t % kStages, then one
// commit group (empty past the last tile), so group t holds tile t. `blk`:
// load_blocks of tile t.
template <int HD, int G, int THREADS>
__device__ __forceinline__ void issue_tile(const Split& a, int t, int ntiles, uint8_t* sm,
                                           const int32_t (&blk)[kPiecesPerThread<HD, G, THREADS>]) {
  using S = Shape<HD, G, THREADS>;
  if (t < ntiles) {
    bf16* ks = reinterpret_cast<bf16*>(sm + S::kKV + (t % kStages) * 2 * S::kRowBytes);
    bf16* vs = ks + S::T * S::P;
    constexpr int kPieces = HD / 8;  // 16-byte pieces of a row
    const int key0 = a.begin + t * S::T;
#pragma unroll
    for (int r = 0; r < kPiecesPerThread<HD, G, THREADS>; ++r) {
      const int i = threadIdx.x + r * THREADS;
      if (i < S::T * kPieces) {
        const int j = i / kPieces, c = i % kPieces, key = key0 + j;
        const bool live = key < a.end;
        const int64_t tok = kvpool::row(blk[r], live ? key % a.block_size : 0, a.block_size, a.kv_heads, a.kvh,
                                        a.head_major);
        const int n = live ? 16 : 0;  // zeros past the split: never a stale page's NaN
        cp_async16(smem_addr(ks + j * S::P + c * 8), a.k_pool + tok * HD + c * 8, n);
        cp_async16(smem_addr(vs + j * S::P + c * 8), a.v_pool + tok * HD + c * 8, n);
      }
    }
  }
  cp_async_commit();
}

template <int HD, int G, int THREADS>
__device__ __forceinline__ void split(const Split& a, uint8_t* sm) {
  using S = Shape<HD, G, THREADS>;
  constexpr int T = S::T;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float* qs = reinterpret_cast<float*>(sm + S::kQ);
  float* ss = reinterpret_cast<float*>(sm + S::kS);
  float* mx = reinterpret_cast<float*>(sm + S::kStat);
  float* sum = mx + G;
  float* resc = sum + G;
  const int nkeys = a.end > a.begin ? a.end - a.begin : 0;
  const int ntiles = (nkeys + T - 1) / T;

  int32_t blk[kPiecesPerThread<HD, G, THREADS>];
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    load_blocks<HD, G, THREADS>(a, i, blk);
    issue_tile<HD, G, THREADS>(a, i, ntiles, sm, blk);
  }
  load_blocks<HD, G, THREADS>(a, kStages - 1, blk);
  // q was written by another CTA of this launch: through L2
  for (int i = tid; i < G * HD; i += THREADS) qs[i] = __bfloat162float(__ldcg(a.q + i));
  for (int h = tid; h < G; h += THREADS) {
    mx[h] = -INFINITY;
    sum[h] = 0.f;
  }
  float acc[S::QPT][4];
#pragma unroll
  for (int j = 0; j < S::QPT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;

  for (int t = 0; t < ntiles; ++t) {
    cp_async_wait<kStages - 2>();  // this thread's copies of tile t are in
    __syncthreads();               // everyone's are; tile t - 1 is done with
    issue_tile<HD, G, THREADS>(a, t + kStages - 1, ntiles, sm, blk);
    load_blocks<HD, G, THREADS>(a, t + kStages, blk);  // in flight while tile t computes
    const bf16* ks = reinterpret_cast<const bf16*>(sm + S::kKV + (t % kStages) * 2 * S::kRowBytes);
    const bf16* vs = ks + T * S::P;
    const int key0 = a.begin + t * T;

    // 2. scores: thread -> key tid % T, heads tid / T + NG * j
    {
      const int j = tid % T, hg = tid / T;
      float s[S::HPT];
#pragma unroll
      for (int hh = 0; hh < S::HPT; ++hh) s[hh] = 0.f;
#pragma unroll 4
      for (int d = 0; d < HD; d += 8) {
        float kf[8];
        unpack8(*reinterpret_cast<const uint4*>(ks + j * S::P + d), kf);
#pragma unroll
        for (int hh = 0; hh < S::HPT; ++hh) {
          const int h = hg + S::NG * hh;
          if (h < G) {
            const float4 q0 = *reinterpret_cast<const float4*>(qs + h * HD + d);
            const float4 q1 = *reinterpret_cast<const float4*>(qs + h * HD + d + 4);
            float v = s[hh];
            v = fmaf(q0.x, kf[0], v);
            v = fmaf(q0.y, kf[1], v);
            v = fmaf(q0.z, kf[2], v);
            v = fmaf(q0.w, kf[3], v);
            v = fmaf(q1.x, kf[4], v);
            v = fmaf(q1.y, kf[5], v);
            v = fmaf(q1.z, kf[6], v);
            v = fmaf(q1.w, kf[7], v);
            s[hh] = v;
          }
        }
      }
      const bool live = key0 + j < a.end;
#pragma unroll
      for (int hh = 0; hh < S::HPT; ++hh) {
        const int h = hg + S::NG * hh;
        if (h < G) ss[h * T + j] = live ? s[hh] * a.scale : -INFINITY;
      }
    }
    __syncthreads();

    // 3. online softmax, one warp per head: running max, rescale, P in place
    for (int h = warp; h < G; h += THREADS / 32) {
      float tm = -INFINITY;
      for (int j = lane; j < T; j += 32) tm = fmaxf(tm, ss[h * T + j]);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, o));
      const float m_old = mx[h];
      const float m_new = fmaxf(m_old, tm);  // finite: the first tile holds key `begin`
      float ps = 0.f;
      for (int j = lane; j < T; j += 32) {
        const float p = expf(ss[h * T + j] - m_new);  // a masked key: exp(-inf) = 0
        ss[h * T + j] = p;
        ps += p;
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
      __syncwarp();
      if (lane == 0) {
        const float r = expf(m_old - m_new);  // exp(-inf) = 0 on the first tile
        resc[h] = r;
        sum[h] = sum[h] * r + ps;
        mx[h] = m_new;
      }
    }
    __syncthreads();

    // 4. O = O * rescale + P V, 4 dims of one head per thread
#pragma unroll
    for (int jq = 0; jq < S::QPT; ++jq) {
      const int quad = tid + jq * THREADS;
      if (quad < S::QUADS) {
        const int h = quad / (HD / 4), d = (quad % (HD / 4)) * 4;
        const float r = resc[h];
        float o0 = acc[jq][0] * r, o1 = acc[jq][1] * r, o2 = acc[jq][2] * r, o3 = acc[jq][3] * r;
        const float* p = ss + h * T;
#pragma unroll 8
        for (int j = 0; j < T; ++j) {
          const float pj = p[j];
          const uint2 vv = *reinterpret_cast<const uint2*>(vs + j * S::P + d);
          const float2 v01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&vv.x));
          const float2 v23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&vv.y));
          o0 = fmaf(pj, v01.x, o0);
          o1 = fmaf(pj, v01.y, o1);
          o2 = fmaf(pj, v23.x, o2);
          o3 = fmaf(pj, v23.y, o3);
        }
        acc[jq][0] = o0;
        acc[jq][1] = o1;
        acc[jq][2] = o2;
        acc[jq][3] = o3;
      }
    }
  }
  cp_async_wait<0>();  // only empty groups can remain
  __syncthreads();     // the last tile's sums (mx, sum) are visible

  // normalised output and log-sum-exp; an empty split: o = 0, lse = -inf
#pragma unroll
  for (int jq = 0; jq < S::QPT; ++jq) {
    const int quad = tid + jq * THREADS;
    if (quad < S::QUADS) {
      const int h = quad / (HD / 4), d = (quad % (HD / 4)) * 4;
      const float l = ntiles > 0 ? sum[h] : 0.f;
      float4 out;
      out.x = l > 0.f ? acc[jq][0] / l : 0.f;
      out.y = l > 0.f ? acc[jq][1] / l : 0.f;
      out.z = l > 0.f ? acc[jq][2] / l : 0.f;
      out.w = l > 0.f ? acc[jq][3] / l : 0.f;
      *reinterpret_cast<float4*>(a.o + h * HD + d) = out;
      if (d == 0) a.lse[h] = l > 0.f ? mx[h] + logf(l) : -INFINITY;
    }
  }
  __syncthreads();  // the scratch is free for the next task
}

}  // namespace attn_tiles
}  // namespace megac

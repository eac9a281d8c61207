// Epilogues of the tiny-M GEMM tile (gemm_tile.cuh).
//
// Every epilogue reads the tile's fp32 result from the shared staging tile
// Ys[NT][8] (row = output feature inside the tile, column = token) after the
// consumer warps have synced, and is run by the NTHREADS consumer threads
// (tid = 0..NTHREADS-1). Staging through shared memory costs a few hundred
// cycles per tile but lets an epilogue combine rows that different warps
// computed (gate with up, a RoPE pair half a head apart).
//
// All arithmetic after the MMA is fp32 with a single rounding at the store.
// Nothing here reduces across rows of the batch.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "generated/megac_abi.h"
#include "kv_pool.cuh"

namespace megac {
namespace gemm {

template <class T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

// --- plain store (bf16 output, or fp32 split-K partial) -----------------------------

// y points at [row 0][column n0 of the tile]; row pitch ldy elements.
template <int NT, int M, int NTHREADS, class OutT>
__device__ __forceinline__ void epi_store(const float* ys, OutT* __restrict__ y, int64_t ldy,
                                          int tid) {
  for (int i = tid; i < M * NT; i += NTHREADS) {
    const int m = i / NT, c = i % NT;
    y[m * ldy + c] = from_f32<OutT>(ys[c * 8 + m]);
  }
}

// Split-K: task `split` of a K-split GEMM writes its fp32 partial to
// partial[split][M][N]; a later fixed-order reduce sums the splits. No
// atomics, so the sum is the same bits every run and for every batch.
template <int NT, int M, int NTHREADS>
__device__ __forceinline__ void epi_splitk_partial(const float* ys, float* __restrict__ partial,
                                                   int64_t split_stride, int split, int64_t ldp,
                                                   int n0, int tid) {
  epi_store<NT, M, NTHREADS, float>(ys, partial + split * split_stride + n0, ldp, tid);
}

// out[i] = sum over s = 0..nsplit-1, in that order, of partial[s][i] (fp32),
// for i in [begin, end), strided over `nthreads` threads.
template <class OutT>
__device__ __forceinline__ void splitk_reduce(const float* __restrict__ partial,
                                              int64_t split_stride, int nsplit,
                                              OutT* __restrict__ out, int64_t begin, int64_t end,
                                              int64_t tid, int64_t nthreads) {
  for (int64_t i = begin + tid; i < end; i += nthreads) {
    float acc = partial[i];
    for (int s = 1; s < nsplit; ++s) acc += partial[s * split_stride + i];
    out[i] = from_f32<OutT>(acc);
  }
}

// --- fused SiLU . up ------------------------------------------------------------------

// The gate and up weights are interleaved in chunks of NT/2 rows
// ([gate c | up c] per tile), so one tile holds gate and up for the same NT/2
// hidden columns. h points at [row 0][hidden column tile * NT/2].
template <int NT, int M, int NTHREADS>
__device__ __forceinline__ void epi_silu_mul(const float* ys, __nv_bfloat16* __restrict__ h,
                                             int64_t ldh, int tid) {
  constexpr int H = NT / 2;
  for (int i = tid; i < M * H; i += NTHREADS) {
    const int m = i / H, c = i % H;
    const float g = ys[c * 8 + m];
    const float u = ys[(c + H) * 8 + m];
    h[m * ldh + c] = __float2bfloat16_rn(g / (1.0f + expf(-g)) * u);
  }
}

// --- QKV: RoPE, Q out, K/V into the paged pool --------------------------------------

enum RopeStyle : int {
  kRopeNone = 0,
  kRopeInterleaved = 1,  // GPT-J / Cohere: pairs (2i, 2i+1)
  kRopeHalf = 2,         // Llama rotate_half: pairs (i, i + hd/2)
};

struct QkvArgs {
  const int32_t* positions;   // [M] position of each row's new token
  const float* inv_freq;      // [hd/2] theta^(-2i/hd), fp32 (same table as the reference)
  const int32_t* page_table;  // [M][max_pages] physical block of each logical block
  int32_t max_pages;
  int32_t block_size;         // tokens per KV block
  int32_t q_heads;
  int32_t kv_heads;
  int32_t rope_style;         // RopeStyle; kRopeNone on layers without positions
  __nv_bfloat16* q_out;       // [M][q_heads][hd]
  __nv_bfloat16* k_pool;      // [num_blocks][block_size][kv_heads][hd]
  __nv_bfloat16* v_pool;      // same
};

// sin and cos of an fp32 angle. Decode positions reach 1e5 and more, where
// sincosf would take its slow (Payne-Hanek, local-memory) path for the
// lowest frequencies; reducing mod 2*pi in fp64 first keeps every call on the
// fast path (reduction error ~|a| * 2^-52, far below fp32 rounding).
__device__ __forceinline__ void sincos_reduced(float a, float* s, float* c) {
  const double ad = a;
  const double k = rint(ad * 0.15915494309189535);  // 1 / (2 pi)
  sincosf(float(fma(-k, 6.283185307179586, ad)), s, c);
}

// RoPE of one pair (x0, x1) at position pos, angle pos * inv_freq.
__device__ __forceinline__ void rope_pair(float& x0, float& x1, int pos, float inv_freq) {
  float sn, cs;
  sincos_reduced(float(pos) * inv_freq, &sn, &cs);
  const float r0 = x0 * cs - x1 * sn;
  const float r1 = x1 * cs + x0 * sn;
  x0 = r0;
  x1 = r1;
}

// Head kvh's hd values of the token at `pos` in a paged K or V pool
// (kv_pool.cuh's layout), through the row's page-table row.
__device__ __forceinline__ __nv_bfloat16* kv_slot(__nv_bfloat16* pool, const int32_t* pt_row, int pos,
                                                  int block_size, int kv_heads, int kvh, int hd,
                                                  bool head_major = false) {
  const int64_t block = pt_row[pos / block_size];
  return pool + kvpool::row(block, pos % block_size, block_size, kv_heads, kvh, head_major) * hd;
}

// The fused projection's columns are [Q heads | K heads | V heads], hd each;
// n0 (the tile's first column) and NT are multiples of HD, so every head of
// the tile is whole and its RoPE partners are inside the tile. One thread
// handles one rotation pair (one sincos), and the loop is unrolled so the
// position / page-table loads of all its rows are in flight together.
template <int NT, int M, int NTHREADS, int HD>
__device__ __forceinline__ void epi_qkv(const float* ys, int n0, const QkvArgs& a, int tid) {
  static_assert(NT % HD == 0 && HD % 2 == 0, "a QKV tile holds whole heads");
  constexpr int PAIRS = NT / 2;
  constexpr int ITERS = (M * PAIRS + NTHREADS - 1) / NTHREADS;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int i = tid + it * NTHREADS;
    if (i >= M * PAIRS) break;
    const int m = i / PAIRS, j = i % PAIRS;
    const int hl = j / (HD / 2), fi = j % (HD / 2);
    const int d0 = a.rope_style == kRopeHalf ? fi : 2 * fi;
    const int d1 = a.rope_style == kRopeHalf ? fi + HD / 2 : 2 * fi + 1;
    const int head = n0 / HD + hl;
    const bool is_q = head < a.q_heads;
    const bool is_v = head >= a.q_heads + a.kv_heads;
    const int pos = a.positions[m];
    float x0 = ys[(hl * HD + d0) * 8 + m];
    float x1 = ys[(hl * HD + d1) * 8 + m];
    if (a.rope_style != kRopeNone && !is_v) rope_pair(x0, x1, pos, a.inv_freq[fi]);
    __nv_bfloat16* dst;
    if (is_q) {
      dst = a.q_out + (int64_t(m) * a.q_heads + head) * HD;
    } else {
      const int kvh = is_v ? head - a.q_heads - a.kv_heads : head - a.q_heads;
      dst = kv_slot(is_v ? a.v_pool : a.k_pool, a.page_table + int64_t(m) * a.max_pages, pos, a.block_size,
                    a.kv_heads, kvh, HD);
    }
    dst[d0] = __float2bfloat16_rn(x0);
    dst[d1] = __float2bfloat16_rn(x1);
  }
}

// --- LM head: logits slice + greedy argmax record -------------------------------------

// The ABI's greedy rule (megac/abi.py, ArgmaxRecord): the larger value wins,
// equal values go to the lower index, NaN ranks above every number and the
// lowest-index NaN wins, so a NaN logit is never dropped by one lane and kept
// by another. Takes (ov, oi) into (v, i) when it ranks higher.
__device__ __forceinline__ void argmax_merge(float& v, int& i, float ov, int oi) {
  const bool o_nan = isnan(ov), v_nan = isnan(v);
  const bool take = o_nan ? (!v_nan || oi < i) : (!v_nan && (ov > v || (ov == v && oi < i)));
  if (take) {
    v = ov;
    i = oi;
  }
}

__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, off);
    const int oi = __shfl_xor_sync(0xffffffffu, i, off);
    argmax_merge(v, i, ov, oi);
  }
}

// logits points at [row 0][column 0] (pitch ldl); the tile covers columns
// [n0, n0 + NT). Writes its slice and, per row, the tile's ArgmaxRecord to
// amax[m * amax_ld + tile] (one 8-byte store). The argmax is taken over the
// stored (rounded) values and moves them only through copies and shuffles,
// so the record's value is the bits of the logit at its index and the token
// agrees with a sampler reading the logits.
template <int NT, int M, int NTHREADS, class OutT>
__device__ __forceinline__ void epi_lm_head(const float* ys, OutT* __restrict__ logits,
                                            int64_t ldl, int n0, int tile,
                                            ArgmaxRecord* __restrict__ amax, int64_t amax_ld,
                                            int tid) {
  constexpr int NW = NTHREADS / 32;
  const int warp = tid >> 5, lane = tid & 31;
  for (int m = warp; m < M; m += NW) {
    // (-inf, INT_MAX) loses to every real column, -inf ones included
    float best = -__int_as_float(0x7f800000);
    int bi = 0x7fffffff;
    for (int c = lane; c < NT; c += 32) {
      const OutT o = from_f32<OutT>(ys[c * 8 + m]);
      logits[m * ldl + n0 + c] = o;
      argmax_merge(best, bi, to_f32(o), n0 + c);
    }
    warp_argmax(best, bi);
    if (lane == 0) amax[m * amax_ld + tile] = ArgmaxRecord{best, bi};
  }
}

// One warp: the greedy record of a row over its n tile records.
__device__ __forceinline__ ArgmaxRecord argmax_reduce_warp(const ArgmaxRecord* __restrict__ rec,
                                                           int n) {
  const int lane = threadIdx.x & 31;
  float best = -__int_as_float(0x7f800000);
  int bi = 0x7fffffff;
  for (int j = lane; j < n; j += 32) {
    const ArgmaxRecord r = rec[j];
    argmax_merge(best, bi, r.value, r.index);
  }
  warp_argmax(best, bi);
  return ArgmaxRecord{best, bi};
}

}  // namespace gemm
}  // namespace megac

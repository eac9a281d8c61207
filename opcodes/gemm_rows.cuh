// A GEMM tile of any shape on the CUDA cores: Y[rows, n0:n0+nlen] =
// X[rows, k0:k0+klen] . W[n0:n0+nlen, k0:k0+klen]^T, rows <= 8, weights
// row-major bf16, X bf16, fp32 accumulation.
//
// The first megakernel's GEMM: it takes every tile the compiler emits
// (partial last tiles, K slices of any multiple of 8, the run-time row count
// of an expert tile), so the task semantics can be proven on the device
// before the tensor-core tile (gemm_tile.cuh, tiled weights, fixed shapes)
// replaces it where the shapes allow.
//
// The activations are staged in shared memory once per tile (read through
// L2 only: other CTAs of the launch wrote them); one warp computes kFeat
// output features at a time, each lane a strided slice of K with kFeat *
// kUnroll weight loads in flight, reduced over a fixed xor tree, so results
// do not depend on timing. Results land in a
// shared staging tile ys[nlen][8] (row = output feature, column = token)
// that the epilogues below read, as those of gemm_epilogues.cuh do.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "common.cuh"
#include "gemm_epilogues.cuh"

namespace megac {
namespace rows {

using bf16 = __nv_bfloat16;
constexpr int kMaxRows = 8;

// xs[m * klen + k] = x[m * ldx + k] for m < rows, k < klen (klen % 8 == 0,
// x 16-byte aligned). All threads of the CTA, then a barrier.
__device__ __forceinline__ void stage_x(const bf16* x, int64_t ldx, int rows, int klen, bf16* xs) {
  const int per_row = klen / 8;
  for (int i = threadIdx.x; i < rows * per_row; i += blockDim.x) {
    const int m = i / per_row, c = i % per_row;
    const uint4 v = __ldcg(reinterpret_cast<const uint4*>(x + m * ldx) + c);
    reinterpret_cast<uint4*>(xs + m * klen)[c] = v;
  }
  __syncthreads();
}

__device__ __forceinline__ void unpack8(uint4 v, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

// A tile's weights: `rows` output features of `cols` bf16 each, pitch `ld`
// elements (cols == ld: one contiguous block). The one description of where
// a task's weights lie, used by the opcode and by the prefetch ahead of it.
struct WeightSpan {
  const bf16* p;
  int rows, cols;
  int64_t ld;
};

// L2 prefetch window: the TMA unit keeps about this many bytes of weight
// rows requested ahead of the warps' own loads (a sliding window inside a
// tile, and the head of a task's tile before its waits resolve). Little's
// law: an SM's share of HBM (~34 GB/s) at ~1.5 us loaded latency needs
// ~50 KB in flight; 132 windows must also fit L2 (50 MB) with room for the
// activations. 0 turns the prefetch off.
#ifndef MEGAC_L2_WINDOW
#define MEGAC_L2_WINDOW 0
#endif
constexpr int kWindowBytes = MEGAC_L2_WINDOW;

// Weight chunks (16 bytes per lane) each lane has in flight per feature, and
// features a warp computes at once: F * U loads in flight per lane keep
// enough bytes moving per SM (Little's law: ~25 KB at ~700 ns latency for
// an SM's share of HBM bandwidth); one load at a time reached 16-18 %.
#ifndef MEGAC_GEMM_FEAT
#define MEGAC_GEMM_FEAT 2
#endif
#ifndef MEGAC_GEMM_UNROLL
#define MEGAC_GEMM_UNROLL 4
#endif
// 1: weight loads ask L2 for whole 256-byte sector groups (fewer, larger
// DRAM requests for the rows every lane walks in 16-byte steps)
#ifndef MEGAC_GEMM_L2_256
#define MEGAC_GEMM_L2_256 0
#endif
constexpr int kFeat = MEGAC_GEMM_FEAT;
constexpr int kUnroll = MEGAC_GEMM_UNROLL;

// Features the window runs ahead of the feature loop: whole loop iterations
// (nwarps * kFeat features each), at least one.
__device__ __forceinline__ int ahead_features(int cols, int nwarps) {
  const int per_iter = nwarps * kFeat * cols * 2;
  return max(1, (kWindowBytes + per_iter - 1) / per_iter) * nwarps * kFeat;
}

// Prefetch features [r0, r1) of s into L2, spread over `nlanes` lanes
// (`lane` is this thread's): a contiguous span in 16 KB pieces, else row by row.
__device__ __forceinline__ void prefetch_rows(const WeightSpan& s, int r0, int r1, int lane, int nlanes) {
  r1 = min(r1, s.rows);
  if (kWindowBytes == 0 || r0 >= r1) return;
  const uint32_t rb = uint32_t(s.cols) * 2u;
  if (s.cols == s.ld) {
    constexpr uint32_t kPiece = 16384;
    const char* base = reinterpret_cast<const char*>(s.p + int64_t(r0) * s.ld);
    const int64_t total = int64_t(r1 - r0) * rb;
    for (int64_t off = int64_t(lane) * kPiece; off < total; off += int64_t(nlanes) * kPiece)
      prefetch_l2(base + off, total - off < kPiece ? uint32_t(total - off) : kPiece);
  } else {
    for (int r = r0 + lane; r < r1; r += nlanes) prefetch_l2(s.p + int64_t(r) * s.ld, rb);
  }
}

// The head of a tile's window (what the feature loop reads first): issued
// before the task's waits, so HBM works while the inputs are not ready.
__device__ __forceinline__ void prefetch_head(const WeightSpan& s, int lane, int nlanes) {
  prefetch_rows(s, 0, ahead_features(s.cols, blockDim.x >> 5), lane, nlanes);
}

// ys[c * 8 + m] for c < nlen, m < 8 (rows >= `rows` are 0). Whole CTA; ends
// with a barrier so the epilogue may read ys. Each lane sums its K chunks in
// increasing k (the order does not depend on the unrolling).
__device__ __forceinline__ void tile(const bf16* __restrict__ w, int64_t ldw, const bf16* xs, int rows,
                                     int nlen, int klen, float* ys) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int ahead = ahead_features(klen, nwarps);
  for (int c0 = warp * kFeat; c0 < nlen; c0 += nwarps * kFeat) {
    // slide the window: this warp's features one window ahead (the head,
    // features [0, ahead), was prefetched before the task's waits)
    if (kWindowBytes > 0 && lane < kFeat && c0 + ahead + lane < nlen)
      prefetch_l2(w + int64_t(c0 + ahead + lane) * ldw, uint32_t(klen) * 2u);
    float acc[kFeat][kMaxRows];
#pragma unroll
    for (int f = 0; f < kFeat; ++f)
#pragma unroll
      for (int m = 0; m < kMaxRows; ++m) acc[f][m] = 0.f;
    for (int kb = lane * 8; kb < klen; kb += 32 * 8 * kUnroll) {
      uint4 wv[kFeat][kUnroll];
#pragma unroll
      for (int f = 0; f < kFeat; ++f)
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int k = kb + u * 32 * 8;
          const bf16* src = w + (c0 + f) * ldw + k;
          wv[f][u] = (c0 + f < nlen && k < klen) ? (MEGAC_GEMM_L2_256 ? ld_stream_u4_l2_256(src) : ld_stream_u4(src))
                                                 : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int k = kb + u * 32 * 8;
        if (k >= klen) break;
#pragma unroll
        for (int f = 0; f < kFeat; ++f) {
          float wf[8];
          unpack8(wv[f][u], wf);
#pragma unroll
          for (int m = 0; m < kMaxRows; ++m) {
            if (m < rows) {
              float xf[8];
              unpack8(*reinterpret_cast<const uint4*>(xs + m * klen + k), xf);
              float s = acc[f][m];
#pragma unroll
              for (int e = 0; e < 8; ++e) s = fmaf(wf[e], xf[e], s);
              acc[f][m] = s;
            }
          }
        }
      }
    }
#pragma unroll
    for (int f = 0; f < kFeat; ++f) {
#pragma unroll
      for (int m = 0; m < kMaxRows; ++m) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[f][m] += __shfl_xor_sync(0xffffffffu, acc[f][m], o);
      }
      if (lane == 0 && c0 + f < nlen) {
#pragma unroll
        for (int m = 0; m < kMaxRows; ++m) ys[(c0 + f) * 8 + m] = m < rows ? acc[f][m] : 0.f;
      }
    }
  }
  __syncthreads();
}

// ---------------------------------------------------------------------------
// Epilogues (whole CTA; read ys, write only rows < `rows`)
// ---------------------------------------------------------------------------

// y[m * ldy + c] = ys[c][m] (bf16 or fp32).
template <class OutT>
__device__ __forceinline__ void store(const float* ys, OutT* __restrict__ y, int64_t ldy, int rows, int nlen) {
  for (int i = threadIdx.x; i < rows * nlen; i += blockDim.x) {
    const int m = i / nlen, c = i % nlen;
    y[m * ldy + c] = gemm::from_f32<OutT>(ys[c * 8 + m]);
  }
}

// Gate/up interleaved in chunks of nlen/2 rows: h[m * ldh + c] = silu(gate) * up.
__device__ __forceinline__ void silu_mul(const float* ys, bf16* __restrict__ h, int64_t ldh, int rows, int nlen) {
  const int half = nlen / 2;
  for (int i = threadIdx.x; i < rows * half; i += blockDim.x) {
    const int m = i / half, c = i % half;
    const float g = ys[c * 8 + m];
    const float u = ys[(c + half) * 8 + m];
    h[m * ldh + c] = __float2bfloat16_rn(g / (1.0f + expf(-g)) * u);
  }
}

struct QkvOut {
  const int32_t* seq_pos;     // [rows] position of each row's current token
  const int32_t* row_active;  // [rows] 0: write no K/V
  const float* inv_freq;      // [hd/2]
  const int32_t* page_table;  // this layer's [rows][max_pages]
  int32_t max_pages, block_size, q_heads, kv_heads, hd;
  bool rope, rope_half;
  bf16* q;                    // this layer's [rows][q_heads * hd]
  int64_t q_ld;
  bf16* k_pool;               // [blocks][block_size][kv_heads][hd]
  bf16* v_pool;
};

// The tile holds whole heads [n0, n0 + nlen) of the fused [Q | K | V]
// columns: RoPE on Q and K heads when flagged, Q to q, K and V of active
// rows into the paged pool at the row's position.
__device__ __forceinline__ void qkv(const float* ys, int n0, int nlen, int rows, const QkvOut& a) {
  const int hd = a.hd, pairs = nlen / 2;
  for (int i = threadIdx.x; i < rows * pairs; i += blockDim.x) {
    const int m = i / pairs, j = i % pairs;
    const int hl = j / (hd / 2), fi = j % (hd / 2);
    const int d0 = a.rope_half ? fi : 2 * fi;
    const int d1 = a.rope_half ? fi + hd / 2 : 2 * fi + 1;
    const int head = n0 / hd + hl;
    const bool is_q = head < a.q_heads;
    const bool is_v = head >= a.q_heads + a.kv_heads;
    float x0 = ys[(hl * hd + d0) * 8 + m];
    float x1 = ys[(hl * hd + d1) * 8 + m];
    const int pos = a.seq_pos[m];
    if (a.rope && !is_v) gemm::rope_pair(x0, x1, pos, a.inv_freq[fi]);
    bf16* dst;
    if (is_q) {
      dst = a.q + m * a.q_ld + head * hd;
    } else {
      if (!a.row_active[m]) continue;  // an inactive row's page table holds no block
      const int kvh = is_v ? head - a.q_heads - a.kv_heads : head - a.q_heads;
      dst = gemm::kv_slot(is_v ? a.v_pool : a.k_pool, a.page_table + int64_t(m) * a.max_pages, pos, a.block_size,
                          a.kv_heads, kvh, hd);
    }
    dst[d0] = __float2bfloat16_rn(x0);
    dst[d1] = __float2bfloat16_rn(x1);
  }
}

// LM head: logits [m * ldl + n0 + c] (fp32) and, per row and lm_bn-wide
// vocab tile the slice covers, its greedy record (the ABI's rule:
// gemm::argmax_merge). One warp per (row, vocab tile).
__device__ __forceinline__ void lm_head(const float* ys, float* __restrict__ logits, int64_t ldl, int n0, int nlen,
                                        int rows, int lm_bn, ArgmaxRecord* __restrict__ amax, int64_t amax_ld) {
  store<float>(ys, logits + n0, ldl, rows, nlen);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int t0 = n0 / lm_bn, t1 = (n0 + nlen + lm_bn - 1) / lm_bn;
  for (int it = warp; it < rows * (t1 - t0); it += nwarps) {
    const int m = it / (t1 - t0), t = t0 + it % (t1 - t0);
    const int c_lo = max(t * lm_bn, n0) - n0, c_hi = min((t + 1) * lm_bn, n0 + nlen) - n0;
    float best = -__int_as_float(0x7f800000);
    int bi = 0x7fffffff;
    for (int c = c_lo + lane; c < c_hi; c += 32) gemm::argmax_merge(best, bi, ys[c * 8 + m], n0 + c);
    gemm::warp_argmax(best, bi);
    if (lane == 0) amax[m * amax_ld + t] = ArgmaxRecord{best, bi};
  }
}

}  // namespace rows
}  // namespace megac

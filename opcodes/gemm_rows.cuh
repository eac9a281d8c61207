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
#include "mbarrier.cuh"

namespace megac {
namespace rows {

using bf16 = __nv_bfloat16;
constexpr int kMaxRows = 8;

// xs[m * klen + k] = x[m * ldx + k] for m < rows, k < klen (klen % 8 == 0,
// x 16-byte aligned). All threads of the CTA, then a barrier.
__device__ __forceinline__ void stage_x(const bf16* x, int64_t ldx, int rows, int klen, bf16* xs,
                                        const int32_t* rowof = nullptr) {
  const int per_row = klen / 8;
  for (int i = threadIdx.x; i < rows * per_row; i += blockDim.x) {
    const int m = i / per_row, c = i % per_row;
    const int64_t r = rowof != nullptr ? rowof[m] : m;  // rowof: the tile's rows gathered (routed claims)
    const uint4 v = __ldcg(reinterpret_cast<const uint4*>(x + r * ldx) + c);
    reinterpret_cast<uint4*>(xs + m * klen)[c] = v;
  }
  __syncthreads();
}

// A tile's weights: `rows` output features of `cols` bf16 each, pitch `ld`
// elements (cols == ld: one contiguous block). The one description of where
// a task's weights lie, used by the opcode and by the prefetch ahead of it.
// `tiled`: the matrix is in the tiled device layout (gemm_tc.cuh); `p` is the
// tile's first 16 x 32 block and `ld` the matrix's K.
struct WeightSpan {
  const bf16* p;
  int rows, cols;
  int64_t ld;
  bool tiled = false;
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
  if (s.tiled) {  // a 16-row group's K slice is one contiguous run
    for (int rg = r0 / 16 + lane; rg < (r1 + 15) / 16; rg += nlanes)
      prefetch_l2(s.p + int64_t(rg) * 16 * s.ld, rb * 16u);
  } else if (s.cols == s.ld) {
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

// One feature's 8 weights `w` (16 bytes) at K offset k folded into its
// live rows' sums, each in increasing k. Every CUDA-core weight path (the
// register-fed loop, its pipelines, the bulk-copy ring) calls it, so they
// are bit-identical.
__device__ __forceinline__ void fold8(const uint4& w, const bf16* xs, int rows, int klen, int k,
                                      float (&acc)[kMaxRows]) {
  float wf[8];
  unpack8(w, wf);
#pragma unroll
  for (int m = 0; m < kMaxRows; ++m) {
    if (m < rows) {
      float xf[8];
      unpack8(*reinterpret_cast<const uint4*>(xs + m * klen + k), xf);
      float s = acc[m];
#pragma unroll
      for (int e = 0; e < 8; ++e) s = fmaf(wf[e], xf[e], s);
      acc[m] = s;
    }
  }
}

// One step of a warp's feature loop: its kFeat features x kUnroll chunks of
// 8 weights (16 bytes per lane) at K offset kb + u * 256, folded into acc in
// increasing k. Both weight paths below call it, so they are bit-identical.
__device__ __forceinline__ void fma_chunk(const uint4 (&wv)[kFeat][kUnroll], const bf16* xs, int rows, int klen,
                                          int kb, float (&acc)[kFeat][kMaxRows]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int k = kb + u * 32 * 8;
    if (k >= klen) break;
#pragma unroll
    for (int f = 0; f < kFeat; ++f) fold8(wv[f][u], xs, rows, klen, k, acc[f]);
  }
}

// The end of a warp's features c0 .. c0 + F - 1 (those below nlen): each
// lane's partial sums reduced over a fixed xor tree (live rows only: at batch
// 1 the other seven rows' reductions were most of a feature's instructions),
// lane 0 writes ys. Every weight path of a tile ends here.
template <int F>
__device__ __forceinline__ void reduce_features(float (&acc)[F][kMaxRows], int c0, int nlen, int rows, float* ys) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int f = 0; f < F; ++f) {
#pragma unroll
    for (int m = 0; m < kMaxRows; ++m) {
      if (m < rows) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[f][m] += __shfl_xor_sync(0xffffffffu, acc[f][m], o);
      }
    }
    if (lane == 0 && c0 + f < nlen) {
#pragma unroll
      for (int m = 0; m < kMaxRows; ++m) ys[(c0 + f) * 8 + m] = m < rows ? acc[f][m] : 0.f;
    }
  }
}

template <int F>
__device__ __forceinline__ void zero(float (&acc)[F][kMaxRows]) {
#pragma unroll
  for (int f = 0; f < F; ++f)
#pragma unroll
    for (int m = 0; m < kMaxRows; ++m) acc[f][m] = 0.f;
}

// ys[c * 8 + m] for c < nlen, m < 8 (rows >= `rows` are 0). Whole CTA; ends
// with a barrier so the epilogue may read ys. Each lane sums its K chunks in
// increasing k (the order does not depend on the unrolling). Weights straight
// into registers: kFeat * kUnroll loads in flight per lane, no more.
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
    zero(acc);
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
      fma_chunk(wv, xs, rows, klen, kb, acc);
    }
    reduce_features(acc, c0, nlen, rows, ys);
  }
  __syncthreads();
}

// ---------------------------------------------------------------------------
// The weights through a per-warp cp.async pipeline
// ---------------------------------------------------------------------------
//
// The register-fed loop above keeps kFeat * kUnroll loads in flight per lane
// and waits for them before the next features' loads go out: ~25 KB per SM,
// so an SM streamed 10-14 GB/s of its 34 GB/s share (docs/perf-notes.md).
// Here each warp copies its own sequence of chunks (a chunk: what one step
// of the feature loop reads, kFeat * kUnroll * 512 bytes) into its own ring
// of kStages slots in shared memory, kAhead = kStages - 1 chunks ahead of the one it
// computes. Each lane reads back only the 16-byte pieces it copied itself, so
// the lane's own cp.async.wait_group is all the synchronisation there is: no
// barrier, no mbarrier, no producer lane that waits for the slowest warp
// (what sank the bulk-copy ring, gemm_ring.cuh). The first kAhead chunks may
// be issued before the task's waits (prime(): weights never depend on
// them), so HBM works while the activations are not ready.
// Off by default: on the H200 (same run) North Mini Code batch 1 took 7.85
// ms with 4 slots against 7.16 register-fed, batch 8 26.2 against 26.4
// (docs/perf-notes.md).
#ifndef MEGAC_GEMM_STAGES
#define MEGAC_GEMM_STAGES 0
#endif
constexpr int kStages = MEGAC_GEMM_STAGES;
static_assert(kStages == 0 || kStages >= 2, "a pipeline needs a slot to compute and one to fill");
constexpr int kAhead = kStages > 1 ? kStages - 1 : 1;  // chunks in flight ahead of the computed one
// 1: the static GEMM opcodes (their tile follows from the task words alone)
// prime their warps' pipelines before the task's waits (megakernel.cuh)
#ifndef MEGAC_GEMM_EARLY
#define MEGAC_GEMM_EARLY 1
#endif
constexpr bool kEarly = MEGAC_GEMM_EARLY && kStages > 0;
constexpr int kChunkU4 = kFeat * kUnroll * 32;  // 16-byte pieces of one chunk of one warp

// Shared memory of the rings of `nwarps` warps (0: the register-fed loop).
__host__ __device__ constexpr int pipe_bytes(int nwarps) { return kStages * kChunkU4 * 16 * nwarps; }

// A warp's chunk sequence over a tile: chunk i is features
// (warp + (i / nkb) * nwarps) * kFeat + f, K offsets lane * 8 + (i % nkb) *
// kStepK + u * 256.
struct PipeWalk {
  static constexpr int kStepK = 32 * 8 * kUnroll;
  int nkb, total;
  __device__ PipeWalk(int nlen, int klen, int warp, int nwarps) {
    nkb = (klen + kStepK - 1) / kStepK;
    const int first = warp * kFeat, stride = nwarps * kFeat;
    total = first < nlen ? ((nlen - first + stride - 1) / stride) * nkb : 0;
  }
  __device__ int c0(int i, int warp, int nwarps) const { return (warp + (i / nkb) * nwarps) * kFeat; }
  __device__ int kb(int i, int lane) const { return lane * 8 + (i % nkb) * kStepK; }
};

// This warp's ring (kStages slots of kChunkU4 pieces, [slot][f][u][lane]).
__device__ __forceinline__ uint4* warp_ring(uint8_t* rings) {
  return reinterpret_cast<uint4*>(rings) + (threadIdx.x >> 5) * kStages * kChunkU4;
}

// Chunk i of this lane into its slot (nothing past the tile's edges), then
// one commit group, empty or not, so group i holds chunk i. (Lane 0 copying
// the warp's chunk with bulk copies onto per-slot mbarriers measured 1.0 ms
// slower at North Mini Code batch 1: docs/perf-notes.md.)
__device__ __forceinline__ void issue_chunk(const WeightSpan& s, const PipeWalk& pw, int i, uint4* ring) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  if (i < pw.total) {
    const int c0 = pw.c0(i, warp, nwarps), kb = pw.kb(i, lane);
    uint4* slot = ring + (i % kStages) * kChunkU4 + lane;
#pragma unroll
    for (int f = 0; f < kFeat; ++f)
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int k = kb + u * 32 * 8;
        if (c0 + f < s.rows && k < s.cols)
          cp_async16(smem_addr(slot + (f * kUnroll + u) * 32), s.p + int64_t(c0 + f) * s.ld + k, 16);
      }
  }
  cp_async_commit();
}

// The first kAhead chunks of this thread's warp (every thread of the
// CTA calls it, before or after the task's waits, never twice per tile).
__device__ __forceinline__ void prime(const WeightSpan& s, uint8_t* rings) {
  const PipeWalk pw(s.rows, s.cols, threadIdx.x >> 5, blockDim.x >> 5);
  uint4* ring = warp_ring(rings);
#pragma unroll
  for (int i = 0; i < kAhead; ++i) issue_chunk(s, pw, i, ring);
}

// tile() over the rings: same sums in the same order, bit-identical. `primed`:
// prime() already ran for this span.
__device__ __forceinline__ void tile_piped(const WeightSpan& s, const bf16* xs, int rows, float* ys, uint8_t* rings,
                                           bool primed) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  if (!primed) prime(s, rings);
  const PipeWalk pw(s.rows, s.cols, warp, nwarps);
  uint4* ring = warp_ring(rings);
  float acc[kFeat][kMaxRows];
  for (int i = 0; i < pw.total; ++i) {
    // the slot refilled now was last read in step i - 1: this lane's own
    // reads, complete since its FMAs consumed them (in-order issue)
    issue_chunk(s, pw, i + kAhead, ring);
    cp_async_wait<kAhead>();  // groups complete in order: chunk i is in
    const int c0 = pw.c0(i, warp, nwarps), kb = pw.kb(i, lane);
    if (i % pw.nkb == 0) zero(acc);
    const uint4* slot = ring + (i % kStages) * kChunkU4 + lane;
    uint4 wv[kFeat][kUnroll];
#pragma unroll
    for (int f = 0; f < kFeat; ++f)
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        wv[f][u] = (c0 + f < s.rows && kb + u * 32 * 8 < s.cols) ? slot[(f * kUnroll + u) * 32] : make_uint4(0, 0, 0, 0);
    fma_chunk(wv, xs, rows, s.cols, kb, acc);
    if (i % pw.nkb == pw.nkb - 1) reduce_features(acc, c0, s.rows, rows, ys);
  }
  cp_async_wait<0>();  // only empty groups can remain; none outlives the tile
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

// store<float> by relaxed gpu-scope stores: outputs another SM polls
// (a down tile's, read by a polled combine: MEGAC_COMBINE_POLL).
__device__ __forceinline__ void store_relaxed(const float* ys, float* __restrict__ y, int64_t ldy, int rows, int nlen) {
  for (int i = threadIdx.x; i < rows * nlen; i += blockDim.x) {
    const int m = i / nlen, c = i % nlen;
    st_relaxed_gpu(y + m * ldy + c, ys[c * 8 + m]);
  }
}

// Gate/up interleaved in chunks of `chunk` rows (0: one chunk, nlen/2), the
// tile's rows whole chunks from a chunk boundary, the last one possibly
// shorter (the end of the matrix): [gate | up] per chunk. Feature c of the
// tile is gate row base + j and up row base + len + j of its chunk, so
// h[m * ldh + c] = silu(gate) * up over the tile's nlen/2 features in order.
__device__ __forceinline__ void silu_mul(const float* ys, bf16* __restrict__ h, int64_t ldh, int rows, int nlen,
                                         int chunk = 0) {
  const int half = nlen / 2;
  if (chunk <= 0 || chunk >= half) chunk = half;
  for (int i = threadIdx.x; i < rows * half; i += blockDim.x) {
    const int m = i / half, c = i % half;
    const int k = c / chunk, j = c - k * chunk;
    const int len = min(chunk, half - k * chunk), base = 2 * k * chunk;
    const float g = ys[(base + j) * 8 + m];
    const float u = ys[(base + len + j) * 8 + m];
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
  bf16* k_pool;               // kv_pool.cuh's layout (head_major below)
  bf16* v_pool;
  bool head_major;
};

// The tile holds columns [n0, n0 + nlen) of the fused [Q | K | V] columns:
// whole heads, or (interleaved RoPE or none: target tile qkv_bn) part of
// one head, whose rotation pairs (2k, 2k+1) are then inside the tile. RoPE
// on Q and K heads when flagged, Q to q, K and V of active rows into the
// paged pool at the row's position.
__device__ __forceinline__ void qkv(const float* ys, int n0, int nlen, int rows, const QkvOut& a) {
  const int hd = a.hd, pairs = nlen / 2;
  for (int i = threadIdx.x; i < rows * pairs; i += blockDim.x) {
    const int m = i / pairs, j = i % pairs;
    int t0, head, d0, d1, fi;  // the pair's first tile column, its head, its columns in the head
    if (a.rope_half) {  // whole heads: pair (k, k + hd/2)
      const int hl = j / (hd / 2);
      fi = j % (hd / 2);
      t0 = hl * hd + fi;
      head = n0 / hd + hl;
      d0 = fi;
      d1 = fi + hd / 2;
    } else {  // pair (2k, 2k + 1): the same columns as whole heads give
      t0 = 2 * j;
      head = (n0 + t0) / hd;
      d0 = (n0 + t0) % hd;
      d1 = d0 + 1;
      fi = d0 / 2;
    }
    const bool is_q = head < a.q_heads;
    const bool is_v = head >= a.q_heads + a.kv_heads;
    float x0 = ys[t0 * 8 + m];
    float x1 = ys[(t0 + d1 - d0) * 8 + m];
    const int pos = a.seq_pos[m];
    if (a.rope && !is_v) gemm::rope_pair(x0, x1, pos, a.inv_freq[fi]);
    bf16* dst;
    if (is_q) {
      dst = a.q + m * a.q_ld + head * hd;
    } else {
      if (!a.row_active[m]) continue;  // an inactive row's page table holds no block
      const int kvh = is_v ? head - a.q_heads - a.kv_heads : head - a.q_heads;
      dst = gemm::kv_slot(is_v ? a.v_pool : a.k_pool, a.page_table + int64_t(m) * a.max_pages, pos, a.block_size,
                          a.kv_heads, kvh, hd, a.head_major);
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

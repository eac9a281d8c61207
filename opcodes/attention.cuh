// Paged GQA flash-decode (ATTN_DECODE) and its log-sum-exp merge
// (ATTN_COMBINE).
//
// One decode task = (row, kv head, split). A CTA runs a *stream* of decode
// tasks (DecodeStream): a producer copies the K/V tiles of all its tasks,
// one sequence, into a shared-memory ring completing on mbarriers (TMA:
// one tensor-memory box copy per page, tensor and 64-dim half, the
// production path; or 16-byte cp.async from three producer warps, ~39 GB/s
// an SM at most); compute warps consume them. The next task's tiles are in
// flight while this one finishes (its epilogue, its counter, maybe a
// merge), so a task boundary costs no ring refill and no pause in the SM's
// loads; this is what makes short splits (a few tiles) stream at the DRAM
// rate. The producers load each tile's page-table entry one tile ahead and
// each task's geometry one task ahead, and copy the task's query rows into
// a shared-memory slot with its first tile.
//
// Compute: mma.sync m16n8k16, the GQA query heads of the kv head are the
// 16-row M side (padded), keys / head dims the N side. The online softmax
// runs in fp32 in the log2 domain. Each warp owns a fixed KPW-key slice of
// every tile (16, or 32: one softmax step per 32 keys and four independent
// QK^T accumulation chains, 17 % less compute time per key), so the result
// does not depend on timing; the warps' states are merged in warp order at
// the end of each task.
//
// Combine: the partials of one (row, kv head) are merged in split order, in
// fp32, by `combine_core`. It is reached two ways with identical bits: the
// standalone ATTN_COMBINE task (`combine_task`, after a counter wait; a
// schedule can give these SMs of their own), or fused: each split counts
// its arrival on a (row, kv head) counter and the LAST arriver merges right
// away (`warp_arrive_last`), which removes one dependency hop and one task.
// Counting and fused merging are meant for a control warp beside the
// stream's warps, so no counter wait or fence ever stalls the ring;
// opcodes/tests/attention_test.cu shows the hand-off. The fused merge runs
// on that one warp: cheap beside a long step, too slow (~12 us at 32
// splits) when the whole step takes a few microseconds.
// Spread merges: `combine_head_warp` cuts a merge into one piece per query
// head, and the pieces are dealt over warps that have nothing else to do
// (the test kernel gives each CTA one merge warp). On the control warp they
// delayed its next store permission and cost ~9 points at BS 1 / 8K; on a
// warp of their own, ~1-4.
// The merge copies all partials into shared memory with cp.async (all of
// them in flight at once, two buffers), so it costs about one L2 round trip
// plus the bytes, not one round trip per few splits.
//
// Split rule (shared with the host planner, megac/gpu/blocks/attention.py,
// `split_range`): the visible keys of a row are [lo, hi) with
// hi = seq_len and lo = max(0, hi - window) (window 0 = full). Splits are cut
// on page boundaries so every split reads whole pages:
//   base  = lo rounded down to block_size
//   chunk = ceil((hi - base) / num_splits) rounded up to block_size
//   split s covers [max(lo, base + s*chunk), min(hi, base + (s+1)*chunk))
// so trailing splits may be empty. A split index >= num_splits is also
// empty; a combine that merges more (empty) splits gives the same bits,
// because an empty split contributes weight exp(-inf) = 0 and o = 0.
//
// Layouts (all row-major):
//   q        bf16 [rows, kv_heads*GQA, HD]
//   k/v pool bf16 [num_blocks, BLOCK, kv_heads, HD]
//   page_table int32 [rows, pt_stride]   (physical block of each logical page)
//   seq_len  int32 [rows]                (cached tokens, current one included)
//   o_part   fp32 [split_stride, rows, q_heads, HD]   (normalised by its own sum)
//   lse_part fp32 [split_stride, rows, q_heads]       (natural-log LSE of the
//            scaled scores; -inf for an empty split)
//   out      bf16 [rows, q_heads*HD]
//
// Read paths: seq_len and the page table are written by the host before the
// launch (read through __ldg); q, the partials and the counters are written
// during the launch, so they are read through L2 only (cp.async.cg, ld.cg).
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "common.cuh"
#include "counters.cuh"
#include "mbarrier.cuh"

namespace megac {
namespace attn {

struct DecodeArgs {
  const __nv_bfloat16* q;
  const __nv_bfloat16* k_pool;
  const __nv_bfloat16* v_pool;
  const int32_t* page_table;
  const int32_t* seq_len;
  float* o_part;
  float* lse_part;
  int32_t rows;
  int32_t kv_heads;
  int32_t pt_stride;     // max blocks per sequence (page table row length)
  int32_t split_stride;  // leading dimension of o_part / lse_part (>= splits)
  float scale;           // softmax scale, usually 1/sqrt(HD)
};

struct CombineArgs {
  const float* o_part;
  const float* lse_part;
  __nv_bfloat16* out;
  int32_t rows;
  int32_t kv_heads;
  int32_t split_stride;
};

// Key range [begin, end) of split `split` (empty when begin >= end).
__device__ __forceinline__ void split_range(int seq_len, int window, int num_splits,
                                            int split, int block, int& begin, int& end) {
  const int hi = seq_len;
  const int lo = (window > 0 && hi > window) ? hi - window : 0;
  const int base = lo - lo % block;
  const int span = hi - base;
  int chunk = (span + num_splits - 1) / num_splits;
  chunk = (chunk + block - 1) / block * block;
  const long long b = (long long)base + (long long)split * chunk;
  const long long e = b + chunk;
  begin = b > lo ? (int)(b < hi ? b : hi) : lo;
  end = e < hi ? (int)e : hi;
  if (split >= num_splits || begin >= end) { begin = hi; end = hi; }
}

__device__ __forceinline__ uint32_t dynamic_smem_bytes() {
  uint32_t v;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(v));
  return v;
}

// Named barriers. 0 is __syncthreads; the decode stream's compute warps
// sync among themselves on kBarCompute, so a control warp of the same CTA
// (attention_test.cu) can run its own loop and meet them only through
// producer / consumer pairs (bar.arrive on one side, bar.sync on the other).
constexpr int kBarCompute = 1;
template <int ID, int N>
__device__ __forceinline__ void bar_sync() {
  asm volatile("bar.sync %0, %1;" ::"n"(ID), "n"(N) : "memory");
}
template <int ID, int N>
__device__ __forceinline__ void bar_arrive() {
  asm volatile("bar.arrive %0, %1;" ::"n"(ID), "n"(N) : "memory");
}

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1,
                                        uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t& r0, uint32_t& r1,
                                          uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// D = A(16x16 bf16, row) * B(16x8 bf16, col) + D, fp32 accumulate.
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1,
                                         uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---------------------------------------------------------------------------
// The combine
// ---------------------------------------------------------------------------

// ONE warp turns the lse values of one head's n splits (w[s * stride]) into
// merge weights in place, exp(lse - max), and returns 1 / their sum (0 when
// every split is empty). Lanes take splits lane, lane+32, ..., and max and
// sum run over a fixed xor tree, so the bits do not depend on timing, and
// the whole merge (combine_core) and its per-head pieces
// (combine_head_warp) share them. A lane reads only the entries it wrote
// until the fold is done; the caller syncs before others read the weights.
__device__ __forceinline__ float fold_weights_warp(float* w, int stride, int n) {
  const int lane = threadIdx.x & 31;
  float M = -INFINITY;
  for (int s = lane; s < n; s += 32) M = fmaxf(M, w[s * stride]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
  float L = 0.f;
  for (int s = lane; s < n; s += 32) {
    const float l = w[s * stride];
    const float f = (l == -INFINITY || M == -INFINITY) ? 0.f : expf(l - M);
    w[s * stride] = f;
    L += f;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
  return L > 0.f ? 1.f / L : 0.f;
}

// Bytes of `work` the combine needs at least: the weights of up to
// `max_splits` splits plus two one-split staging buffers.
template <int HD, int GQA>
constexpr int combine_min_bytes(int max_splits) {
  return ((max_splits * GQA + GQA) * 4 + 127) / 128 * 128 + 2 * GQA * HD * 4;
}

// Merge splits 0..n-1 of (row, kvh) in index order, fp32, and write bf16.
// NT threads call it (`tid` = 0..NT-1 among them): one warp (NT = 32, synced
// by __syncwarp) or NT threads that own named barrier BAR. The partials were
// written by other CTAs and acquired by the caller (counter wait or arrival).
// `work` (16-byte aligned shared memory, `work_bytes` of it) holds the split
// weights and two staging buffers that take as many splits as fit: all
// partials are copied with cp.async at once (two chunks in flight), so the
// merge pays about one L2 round trip plus the bytes. Waits for every
// outstanding cp.async group of the thread (also older ones) and ends with a
// CTA barrier.
// `orow`: where the merged GQA * HD values go (bf16, contiguous: the (row,
// kvh) slice of attn_out, or a merging O-projection's staged input row in
// shared memory).
template <int HD, int GQA, int NT, int BAR>
__device__ __forceinline__ void merge_into(const float* o_part, const float* lse_part,
                                           __nv_bfloat16* orow, int rows, int q_heads, int row,
                                           int kvh, int n, char* work, int work_bytes, int tid) {
  constexpr int kSlice = GQA * HD * 4;  // one split's partial of one kv head
  constexpr int kPieces = kSlice / 16;
  constexpr int kVec = GQA * HD / 4;    // float4 outputs
  constexpr int kItems = (kVec + NT - 1) / NT;
  auto sync = [] {
    if constexpr (NT == 32) {
      __syncwarp();
    } else {
      bar_sync<BAR, NT>();
    }
  };
  float* w = reinterpret_cast<float*>(work);  // [n][GQA] lse, then weights
  float* Ls = w + n * GQA;                     // [GQA] 1 / sum of weights
  const int wbytes = ((n * GQA + GQA) * 4 + 127) / 128 * 128;
  char* stage = work + wbytes;
  const int cap = (work_bytes - wbytes) / kSlice;
  const int half = cap >= 2 ? cap / 2 : 1;  // callers guarantee combine_min_bytes
  const int nchunks = (n + half - 1) / half;
  const size_t split_elems = (size_t)rows * q_heads;
  const float* ob = o_part + ((size_t)row * q_heads + (size_t)kvh * GQA) * HD;

  auto issue = [&](int c) {
    if (c < nchunks) {
      const int s0 = c * half;
      const int ns = n - s0 < half ? n - s0 : half;
      const uint32_t buf = smem_addr(stage + (c & 1) * half * kSlice);
      for (int i = tid; i < ns * kPieces; i += NT) {
        const int s = s0 + i / kPieces;
        cp_async16(buf + i * 16, ob + (size_t)s * split_elems * HD + (i % kPieces) * 4, 16);
      }
    }
    cp_async_commit();  // always one group, so wait_group<1> below is exact
  };
  issue(0);
  issue(1);

  // All lse values in one round trip, then one warp per head turns them into
  // weights while the partials are still in flight (a serial loop per head
  // cost ~0.7 us at 32 splits, on the critical path of every merge).
  const float* lp = lse_part + (size_t)row * q_heads + kvh * GQA;
  for (int i = tid; i < n * GQA; i += NT)
    w[i] = __ldcg(lp + (size_t)(i / GQA) * split_elems + i % GQA);
  sync();
  for (int h = tid >> 5; h < GQA; h += NT / 32) {
    const float inv = fold_weights_warp(w + h, GQA, n);
    if ((tid & 31) == 0) Ls[h] = inv;
  }

  float4 acc[kItems];
#pragma unroll
  for (int k = 0; k < kItems; ++k) acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int c = 0; c < nchunks; ++c) {
    cp_async_wait<1>();
    sync();  // chunk c landed for every thread; weights are ready
    const float* buf = reinterpret_cast<const float*>(stage + (c & 1) * half * kSlice);
    const int s0 = c * half;
    const int ns = n - s0 < half ? n - s0 : half;
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int i = tid + k * NT;
      if (kVec % NT == 0 || i < kVec) {
        const int h = (i * 4) / HD;
        for (int u = 0; u < ns; ++u) {
          const float f = w[(s0 + u) * GQA + h];
          const float4 v = reinterpret_cast<const float4*>(buf + u * GQA * HD)[i];
          acc[k].x += f * v.x;
          acc[k].y += f * v.y;
          acc[k].z += f * v.z;
          acc[k].w += f * v.w;
        }
      }
    }
    sync();  // buffer c & 1 is free again
    issue(c + 2);
  }
  cp_async_wait<0>();
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int i = tid + k * NT;
    if (kVec % NT == 0 || i < kVec) {
      const float inv = Ls[(i * 4) / HD];
      __nv_bfloat162 lo = __floats2bfloat162_rn(acc[k].x * inv, acc[k].y * inv);
      __nv_bfloat162 hi = __floats2bfloat162_rn(acc[k].z * inv, acc[k].w * inv);
      uint2 pk;
      pk.x = *reinterpret_cast<uint32_t*>(&lo);
      pk.y = *reinterpret_cast<uint32_t*>(&hi);
      *reinterpret_cast<uint2*>(orow + i * 4) = pk;
    }
  }
  sync();
}

// merge_into attn_out's (row, kvh) slice (`out`: attn_out [rows, q_heads * HD]).
template <int HD, int GQA, int NT, int BAR>
__device__ __forceinline__ void combine_core(const float* o_part, const float* lse_part,
                                             __nv_bfloat16* out, int rows, int q_heads, int row,
                                             int kvh, int n, char* work, int work_bytes, int tid) {
  merge_into<HD, GQA, NT, BAR>(o_part, lse_part, out + (size_t)row * q_heads * HD + (size_t)kvh * GQA * HD, rows,
                               q_heads, row, kvh, n, work, work_bytes, tid);
}

// ONE warp merges query head h of (row, kvh): splits 0..n-1 in index order,
// fp32, the same arithmetic as combine_core (weights folded over the same
// xor tree, products accumulated in split order), so it gives the same bits.
// A merge cut into GQA such pieces reads GQA times fewer partial bytes per
// warp, so the merges of a step can be spread over many SMs' spare warps
// instead of loading whole (row, kv head) partials onto a few SMs: at BS 1
// / 8K a 32-split merge is 128 KB, which one SM pulls from L2 in ~3.5 us,
// longer than the whole decode step. `work` (16-byte aligned shared memory
// of this warp, `work_bytes` of it) holds 4*(n rounded up to 4) bytes of
// weights, then as many partial rows (HD*4 bytes each) as fit, copied with
// cp.async a chunk at a time (all n at once when they fit; the warp must
// have no other cp.async group pending). The caller has acquired the
// arrivals.
template <int HD, int GQA>
__device__ __forceinline__ void combine_head_warp(const float* o_part, const float* lse_part,
                                                  __nv_bfloat16* out, int rows, int q_heads,
                                                  int row, int kvh, int h, int n, char* work,
                                                  int work_bytes) {
  static_assert(HD % 64 == 0, "each lane owns HD/32 consecutive dims (2 or 4)");
  constexpr int DPL = HD / 32;    // dims per lane
  constexpr int CPS = HD / 4;     // 16-byte chunks per split row
  const int lane = threadIdx.x & 31;
  const size_t split_elems = (size_t)rows * q_heads;
  const int qh = kvh * GQA + h;
  float* w = reinterpret_cast<float*>(work);
  float* rows_s = w + (n + 3) / 4 * 4;
  const int fit = (work_bytes - (n + 3) / 4 * 16) / (HD * 4);
  const int cap = fit < 1 ? 1 : fit;  // callers give room for one row at least
  const float* ob = o_part + ((size_t)row * q_heads + qh) * HD;
  float acc[DPL];
#pragma unroll
  for (int d = 0; d < DPL; ++d) acc[d] = 0.f;
  float inv = 0.f;
  for (int s0 = 0; s0 < n; s0 += cap) {
    const int m = n - s0 < cap ? n - s0 : cap;
    for (int i = lane; i < m * CPS; i += 32)
      cp_async16(smem_addr(rows_s) + i * 16, ob + (size_t)(s0 + i / CPS) * split_elems * HD + (i % CPS) * 4, 16);
    cp_async_commit();
    if (s0 == 0) {
      // The weights while the first rows are in flight.
      const float* lp = lse_part + (size_t)row * q_heads + qh;
      for (int s = lane; s < n; s += 32) w[s] = __ldcg(lp + (size_t)s * split_elems);
      inv = fold_weights_warp(w, 1, n);  // each lane folds the splits it loaded
    }
    cp_async_wait<0>();
    __syncwarp();
    for (int s = 0; s < m; ++s) {
      const float f = w[s0 + s];
      const float* v = rows_s + s * HD + lane * DPL;
#pragma unroll
      for (int d = 0; d < DPL; ++d) acc[d] += f * v[d];
    }
    __syncwarp();  // the rows are read before the next chunk lands on them
  }
  __nv_bfloat16* orow = out + (size_t)row * q_heads * HD + (size_t)qh * HD + lane * DPL;
#pragma unroll
  for (int d = 0; d < DPL; d += 2)
    *reinterpret_cast<__nv_bfloat162*>(orow + d) = __floats2bfloat162_rn(acc[d] * inv, acc[d + 1] * inv);
  __syncwarp();
}

// One ATTN_COMBINE task: merge splits 0..n_splits-1 of (row, kvh). The
// caller has acquired the (row, kvh) arrival counter. Threads 0..NT-1 call
// it (BAR 0 when they are the whole CTA). `smem` is free shared memory of
// `smem_bytes` (>= combine_min_bytes<HD, GQA>(n_splits)).
template <int HD, int GQA, int NT, int BAR = 0>
__device__ __forceinline__ void combine_task(const CombineArgs& a, int row, int kvh,
                                             int n_splits, char* smem, int smem_bytes) {
  combine_core<HD, GQA, NT, BAR>(a.o_part, a.lse_part, a.out, a.rows, a.kv_heads * GQA, row,
                                 kvh, n_splits, smem, smem_bytes, threadIdx.x);
}

// One warp counts a split of (row, kvh) on `counter` and learns whether it
// was the last of the `n` splits of this step (counters run on across steps:
// step boundaries fall at multiples of n). The caller has synchronised with
// the partial's writers (a barrier): the acq_rel add releases their stores,
// cumulatively, and for the last arriver acquires everyone else's.
// Done by a warp that has no cp.async in flight, so the release does not
// wait for a ring's loads.
__device__ __forceinline__ bool warp_arrive_last(uint32_t* counter, uint32_t n) {
  uint32_t old = 0;
  if ((threadIdx.x & 31) == 0)
    asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
  old = __shfl_sync(0xffffffffu, old, 0);
  __syncwarp();
  return (old + 1u) % n == 0u;
}

// ---------------------------------------------------------------------------
// The decode stream
// ---------------------------------------------------------------------------

// Shared-memory geometry of one decode CTA:
//   [0, kRingBytes)            STAGES x (K tile, V tile)
//   [kQOffset, +STAGES*kQBytes) query rows of task o (in stream order) in
//                              slot o % STAGES, swizzled like the K rows
//   [kBarOffset, +128)         full[STAGES], empty[STAGES] mbarriers
//   [kFlagOffset, +128)        CTA-wide flags (16 zero bytes at +64)
//   [kMergeOffset, +kMergeBytes) the warp merge
//   [kCtlOffset, ...)          a control warp's combine (everything up to the
//                              end of the dynamic shared memory)
// A tile is KPW keys per compute warp (16 or 32).
template <int HD, int GQA, int NWARPS, int STAGES, int KPW = 16>
struct DecodeSmem {
  static_assert(STAGES <= 8, "the barrier block holds 8 full + 8 empty barriers");
  static_assert(KPW == 16 || KPW == 32, "a warp attends 16 or 32 keys of each tile");
  static constexpr int kTileKeys = NWARPS * KPW;
  static constexpr int kRowBytes = HD * 2;
  static constexpr int kTileBytes = kTileKeys * kRowBytes;  // one of K or V
  static constexpr int kStageBytes = 2 * kTileBytes;
  static constexpr int kRingBytes = STAGES * kStageBytes;
  static constexpr int kQBytes = (GQA * HD * 2 + 127) / 128 * 128;
  static constexpr int kQOffset = kRingBytes;
  static constexpr int kBarOffset = kQOffset + STAGES * kQBytes;
  static constexpr int kFlagOffset = kBarOffset + 128;
  static constexpr int kMergeOffset = kFlagOffset + 128;
  // per warp 16 m + 16 l + GQA*HD o (fp32)
  static constexpr int kMergeBytes = NWARPS * (32 + GQA * HD) * 4;
  static constexpr int kCtlOffset = kMergeOffset + kMergeBytes;
  static constexpr int kMinCombineSplits = 64;
  // minimum dynamic smem (more = bigger combine chunks)
  static constexpr int kBytes = kCtlOffset + combine_min_bytes<HD, GQA>(kMinCombineSplits);
};

// Byte offset of 16-byte chunk `c` of row `r` in a region of ROWS rows:
// the head dims are split in 64-wide halves (128 bytes a row), each half a
// block of ROWS x 128 bytes, and inside a half chunk c is stored at
// c ^ (r mod 8). That is the layout the tensor-memory copies write with the
// 128-byte swizzle (the XOR comes from address bits 7-9, so halves sit on
// 1024-byte boundaries), and it puts the 8 rows an ldmatrix reads in 8
// different bank groups.
template <int HD, int ROWS>
__device__ __forceinline__ uint32_t swz(int r, int c) {
  return static_cast<uint32_t>((c >> 3) * (ROWS * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// The cp.async copies this thread has issued so far complete an arrival on
// `bar` (counted among the arrivals the barrier was initialised with).
__device__ __forceinline__ void cp_async_mbar_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar))
               : "memory");
}

// Tensor-memory copy of one 4-D box (coordinates innermost first) into
// shared memory, completing its bytes on `bar`. `tmap` is the generic
// address of a tensor map in global memory, written before the launch.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const void* tmap, int c0, int c1, int c2,
                                            int c3, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];" ::"r"(dst),
      "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(bar))
      : "memory");
}

// The words a task source loads for one task ahead of time (its split
// counts, sequence length, ...). Fetching them one task early keeps the
// global-memory round trips of the task geometry off both sides' critical
// paths: inside a megakernel every counter acquire invalidates the SM's L1,
// so these loads go to L2 each time.
struct TaskPrefetch {
  int32_t w[4];
};

// What the stream needs of one decode task.
struct DecodeTask {
  const __nv_bfloat16* q;  // [GQA][HD]: the query heads of this kv head
  const __nv_bfloat16* k;  // pool + kvh*HD (token p of block b at (b*BLOCK+p)*tok_stride)
  const __nv_bfloat16* v;
  const int32_t* pt;       // page-table row
  int tok_stride;          // elements per pool token (kv_heads * HD)
  int kbeg, kend;          // visible keys of the split (empty: kbeg >= kend)
  int tbeg;                // first tile position, page aligned
  int ntiles;              // 0 for an empty split
  int kvh;                 // kv head (the tensor-map coordinate)
};

// The producers' walk over a task source: `next` is the next task with
// tiles (task `idx`; idx < 0 once there is none), its geometry made from
// words fetched a task earlier, so a task boundary costs the producer no
// memory round trip. See DecodeStream::produce for the source's interface.
template <class Src>
struct TasksAhead {
  Src& src;
  int n;
  int scan = 0;  // next task index to look at
  TaskPrefetch pre;
  int idx = -1;
  DecodeTask next;

  __device__ __forceinline__ TasksAhead(Src& s, int count) : src(s), n(count) {
    if (n > 0) pre = src.fetch(0);
    advance();
  }
  __device__ __forceinline__ void advance() {
    idx = -1;
    while (scan < n && idx < 0) {
      const TaskPrefetch p = pre;
      if (scan + 1 < n) pre = src.fetch(scan + 1);
      if (src.make(scan, p, next) && next.ntiles > 0) idx = scan;
      ++scan;
    }
  }
};

// A producer's task walk: TasksAhead plus the next task's first page
// entries, loaded while the current task issues (waiting for them at every
// task start cost an L2 round trip per task). `entry(const DecodeTask&)`
// loads them; `none` stands for "no task".
template <class Src, class Entry>
struct TasksWithEntry {
  TasksAhead<Src> ahead;
  Entry entry;
  int nblk;

  __device__ __forceinline__ TasksWithEntry(Src& s, int count, Entry e, int none)
      : ahead(s, count), entry(e), nblk(ahead.idx >= 0 ? entry(ahead.next) : none) {}
  // The next task with tiles (slot i) and its first entries; false when
  // none is left.
  __device__ __forceinline__ bool pop(DecodeTask& t, int& i, int& blk) {
    if (ahead.idx < 0) return false;
    t = ahead.next;
    i = ahead.idx;
    blk = nblk;
    ahead.advance();
    if (ahead.idx >= 0) nblk = entry(ahead.next);
    return true;
  }
};

// Optional timing probe (a test kernel defines MEGAC_ATTN_TRACE and points
// megac_attn_trace at [grid][kTraceTasks][16] u64): per task, the first
// compute thread records clock64 at the task's start, first tile ready, last
// tile done and finish done, and the cycles it waited for tiles; the
// producer's first lane adds the cycles it waited for free ring slots.
#ifdef MEGAC_ATTN_TRACE
constexpr int kTraceTasks = 256;
}  // namespace attn
}  // namespace megac
extern "C" __device__ unsigned long long* megac_attn_trace;  // C name: the host looks it up
namespace megac {
namespace attn {
#define MEGAC_ATTN_TRACE_AT(who, task, slot, value)                                         \
  do {                                                                                      \
    if ((who) && (task) < ::megac::attn::kTraceTasks)                                                      \
      megac_attn_trace[((size_t)blockIdx.x * ::megac::attn::kTraceTasks + (task)) * 16 + (slot)] = (value); \
  } while (0)
#define MEGAC_ATTN_TRACE_ADD(who, task, slot, value)                                         \
  do {                                                                                       \
    if ((who) && (task) < ::megac::attn::kTraceTasks)                                                       \
      megac_attn_trace[((size_t)blockIdx.x * ::megac::attn::kTraceTasks + (task)) * 16 + (slot)] += (value); \
  } while (0)
#else
#define MEGAC_ATTN_TRACE_AT(who, task, slot, value) \
  do {                                             \
  } while (0)
#define MEGAC_ATTN_TRACE_ADD(who, task, slot, value) \
  do {                                              \
  } while (0)
#endif

// A stream of decode tasks on one CTA, warp-specialised:
//   * PWARPS PRODUCER warps (threads NT.. of the CTA) walk the tasks and
//     issue every K/V tile (and each task's query rows) into a ring of
//     STAGES slots with 16-byte cp.async, each lane's copies completing an
//     arrival on the slot's `full` mbarrier; they wait only for free slots
//     (`empty`). One warp cannot issue fast enough (measured: a 32 KB tile
//     every ~3000 cycles, 56 % of the DRAM rate at 128K); four keep up.
//   * NWARPS COMPUTE warps walk the same tasks, wait for each tile's `full`
//     barrier, attend their KPW-key slice of it and hand the slot back
//     (`empty`, one arrival per warp), then merge and write each task's
//     partial.
// The ring is not tied to a task, so the producer streams on into the next
// tasks while the compute warps run a task's epilogue (merge, partial
// store, counter hand-offs): the SM's loads never pause at task boundaries.
// That is what makes short splits (a few tiles each) stream at the DRAM
// rate: with the copies issued by the compute warps themselves, every
// task's epilogue (~1.5 us) stopped issuing while it ran.
//
// Both sides derive the same task sequence from the same source and keep
// their ring position (RingCursor) across calls, so a CTA may run its
// tasks in several streams (one per step, say) without re-initialising.
template <int HD, int GQA, int BLOCK, int NWARPS, int STAGES, int PWARPS, bool TMA = false,
          int KPW = 16>
struct DecodeStream {
  static_assert(HD % 64 == 0 && HD <= 256, "head_dim must be 64, 128, 192 or 256");
  static_assert(GQA >= 1 && GQA <= 16, "at most 16 query heads per kv head");
  static_assert(STAGES >= 2, "need a ring");
  using G = DecodeSmem<HD, GQA, NWARPS, STAGES, KPW>;
  static constexpr int NT = NWARPS * 32;  // compute threads
  static constexpr int KB = KPW / 16;     // 16-key blocks a warp attends per tile
  static constexpr int NP = PWARPS * 32;  // producer threads
  static constexpr int KT = G::kTileKeys;
  static constexpr int CPR = HD / 8;        // 16-byte chunks per key row
  static_assert(KT % BLOCK == 0 || BLOCK % KT == 0,
                "pages must hold whole tiles or tiles whole pages");
  // A page holds the whole tile: one page-table entry serves every row.
  static constexpr bool kTileInPage = BLOCK >= KT;
  static constexpr int QCHUNKS = GQA * HD / 8;
  static_assert(!TMA || PWARPS == 1, "tensor copies need one producer warp");
  // Rows of one tensor copy: a page, or the tile when pages hold whole tiles.
  static constexpr int TMA_ROWS = kTileInPage ? KT : BLOCK;
  static constexpr int PAGES_PER_TILE = kTileInPage ? 1 : KT / BLOCK;
  // `full` completes on: each producer thread's cp.asyncs (noinc arrivals),
  // plus, with tensor copies, the expect-tx arrival of the issuing thread.
  static constexpr int kFullArrivals = NP + (TMA ? 1 : 0);

  RingCursor<STAGES> cur;  // this side's ring position
  uint32_t ord = 0;        // tasks with tiles seen so far (their q slot: ord % STAGES)

  __device__ __forceinline__ static uint64_t* full_bar(char* smem) {
    return reinterpret_cast<uint64_t*>(smem + G::kBarOffset);
  }
  __device__ __forceinline__ static uint64_t* empty_bar(char* smem) {
    return full_bar(smem) + STAGES;
  }

  // ONE thread, once per kernel; then every thread that will use the ring
  // must pass a CTA barrier.
  __device__ __forceinline__ static void init(char* smem) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full_bar(smem) + s, kFullArrivals);
      mbar_init(empty_bar(smem) + s, NWARPS);     // one per compute warp
    }
    *reinterpret_cast<uint4*>(smem + G::kFlagOffset + 64) = make_uint4(0, 0, 0, 0);
    mbar_init_fence();
  }

  // Geometry of split `split` of (row, kvh) whose row holds `seq_len` tokens.
  __device__ __forceinline__ static void task(const DecodeArgs& a, int row, int kvh, int split,
                                              int num_splits, int window, int seq_len,
                                              DecodeTask& t) {
    const int q_heads = a.kv_heads * GQA;
    int kbeg, kend;
    split_range(seq_len, window, num_splits, split, BLOCK, kbeg, kend);
    t.q = a.q + ((size_t)row * q_heads + (size_t)kvh * GQA) * HD;
    t.k = a.k_pool + (size_t)kvh * HD;
    t.v = a.v_pool + (size_t)kvh * HD;
    t.pt = a.page_table + (size_t)row * a.pt_stride;
    t.tok_stride = a.kv_heads * HD;
    t.kbeg = kbeg;
    t.kend = kend;
    t.tbeg = kbeg - kbeg % BLOCK;
    t.ntiles = kbeg < kend ? (kend - t.tbeg + KT - 1) / KT : 0;
    t.kvh = kvh;
  }

  // Page-table entry of the page holding tile `tt` when pages hold whole
  // tiles (a tile that starts a task or lies inside it is on a live page).
  __device__ __forceinline__ static int tile_page(const DecodeTask& t, int tt) {
    return kTileInPage ? __ldg(t.pt + (t.tbeg + tt * KT) / BLOCK) : 0;
  }

  // --- the producer warp ----------------------------------------------------
  //   src.fetch(i) -> TaskPrefetch: issue the global loads task i's geometry
  //       needs and return them unused (called one task ahead).
  //   src.make(i, const TaskPrefetch&, DecodeTask&) -> bool: task i's
  //       geometry; false = no task in slot i. Both sides call it for every
  //       i and must get the same answer.
  // Returns false after a watchdog / abort (the consumers then fail too).
  // Threads NT..NT+NP-1 of the CTA call it.
  template <class Src>
  __device__ __forceinline__ bool produce(Src& src, int n, char* smem, const WaitSite& site) {
    const int lane = threadIdx.x & 31;
    const int ptid = (int)threadIdx.x - NT;
    const uint32_t ring = smem_addr(smem);
    bool ok = true;
    auto first = [](const DecodeTask& t) { return tile_page(t, 0); };
    TasksWithEntry<Src, decltype(first)> walk(src, n, first, 0);
    DecodeTask t;
    int i, blk;
    while (ok && walk.pop(t, i, blk)) {
      const uint32_t qd = ring + G::kQOffset + (ord % STAGES) * G::kQBytes;
      ++ord;
      for (int tt = 0; tt < t.ntiles; ++tt) {
#ifdef MEGAC_ATTN_TRACE
        const long long w0 = clock64();
#endif
        // A fresh barrier counts as having completed the phase before phase
        // 0, so the first pass over the ring does not wait.
        ok = mbar_wait(empty_bar(smem) + cur.stage, cur.phase ^ 1u, (int32_t)cur.stage, site,
                       lane == 0);
        ok = __all_sync(0xffffffffu, ok);
        if (!ok) break;
        MEGAC_ATTN_TRACE_ADD(ptid == 0, i, 5, (unsigned long long)(clock64() - w0));
        // Next tile's page entry now, used one tile later.
        const int blk_next = tt + 1 < t.ntiles ? tile_page(t, tt + 1) : 0;
        const int tile_pos = t.tbeg + tt * KT;
        const uint32_t st = ring + cur.stage * G::kStageBytes;
#pragma unroll 4
        for (int idx = ptid; idx < KT * CPR; idx += NP) {
          const int r = idx / CPR;
          const int c = idx % CPR;
          const int pos = tile_pos + r;
          const bool in = pos >= t.kbeg && pos < t.kend;
          // Smaller pages: each row's own entry (only live rows look).
          const int b = kTileInPage ? blk : (in ? __ldg(t.pt + pos / BLOCK) : 0);
          const size_t off = in ? ((size_t)b * BLOCK + pos % BLOCK) * (size_t)t.tok_stride + c * 8 : 0;
          const uint32_t d = st + swz<HD, KT>(r, c);
          // Masked rows read as zeros, never as a stale page (0 * NaN = NaN).
          cp_async16(d, t.k + off, in ? 16 : 0);
          cp_async16(d + G::kTileBytes, t.v + off, in ? 16 : 0);
        }
        if (tt == 0) {
          // Task o+STAGES is first issued after task o's last tile was
          // handed back, so slot o % STAGES is free again.
          for (int q = ptid; q < QCHUNKS; q += NP) cp_async16(qd + swz<HD, GQA>(q / CPR, q % CPR), t.q + q * 8, 16);
        }
        cp_async_mbar_arrive(full_bar(smem) + cur.stage);
        cur.advance();
        blk = blk_next;
      }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");  // leave no copy behind
    return ok;
  }

  // The producer with tensor-memory copies (TMA mode): ONE warp. Lane 0
  // issues, per tile, one 4-D box copy per live page, tensor (K, V) and
  // 64-dim half, from tensor maps over the pools ([num_blocks, BLOCK,
  // kv_heads, HD], box [TMA_ROWS tokens, 1 head, 64 dims], 128-byte swizzle),
  // counted in bytes on `full`: four instructions instead of 2048 16-byte
  // cp.asyncs a 64-key tile, which capped an SM near 39 GB/s. Whole pages
  // are copied, so rows outside the split's keys hold whatever the page
  // holds: the compute warps mask scores and zero those V rows. The lanes
  // copy each task's query rows with cp.async as before.
  template <class Src>
  __device__ __forceinline__ bool produce_tma(Src& src, int n, char* smem, const WaitSite& site,
                                              const void* tmap_k, const void* tmap_v) {
    const int lane = threadIdx.x & 31;
    const uint32_t ring = smem_addr(smem);
    bool ok = true;
    // Page entries of tile tt of task t (lane p: the tile's page p, or -1).
    auto entry = [&](const DecodeTask& t, int tt) {
      const int page = (t.tbeg + tt * KT) / BLOCK + lane;
      const bool live = lane < PAGES_PER_TILE && page * BLOCK < t.kend && (page + 1) * BLOCK > t.kbeg;
      return live ? __ldg(t.pt + page) : -1;
    };
    // Entries are loaded a tile ahead, across task boundaries too.
    auto first = [&](const DecodeTask& t) { return entry(t, 0); };
    TasksWithEntry<Src, decltype(first)> walk(src, n, first, -1);
    DecodeTask t;
    int i, blk;
    while (ok && walk.pop(t, i, blk)) {
      const uint32_t qd = ring + G::kQOffset + (ord % STAGES) * G::kQBytes;
      ++ord;
      for (int tt = 0; tt < t.ntiles; ++tt) {
        ok = mbar_wait(empty_bar(smem) + cur.stage, cur.phase ^ 1u, (int32_t)cur.stage, site,
                       lane == 0);
        ok = __all_sync(0xffffffffu, ok);
        if (!ok) break;
        const int blk_next = tt + 1 < t.ntiles ? entry(t, tt + 1) : -1;
        const uint32_t live = __ballot_sync(0xffffffffu, blk >= 0);
        uint64_t* bar = full_bar(smem) + cur.stage;
        const uint32_t st = ring + cur.stage * G::kStageBytes;
        if (lane == 0) {
          constexpr uint32_t kBoxBytes = TMA_ROWS * 128;
          mbar_arrive_expect_tx(bar, __popc(live) * 2 * (HD / 64) * kBoxBytes);
        }
        const int tok0 = kTileInPage ? (t.tbeg + tt * KT) % BLOCK : 0;
#pragma unroll
        for (int p = 0; p < PAGES_PER_TILE; ++p) {
          const int b = __shfl_sync(0xffffffffu, blk, p);
          if (lane == 0 && b >= 0) {
#pragma unroll
            for (int h = 0; h < HD / 64; ++h) {
              const uint32_t off = h * (KT * 128) + p * TMA_ROWS * 128;
              tma_load_4d(st + off, tmap_k, h * 64, t.kvh, tok0, b, bar);
              tma_load_4d(st + G::kTileBytes + off, tmap_v, h * 64, t.kvh, tok0, b, bar);
            }
          }
        }
        if (tt == 0) {
          // Task o+STAGES is first issued after task o's last tile was
          // handed back, so slot o % STAGES is free again.
          for (int q = lane; q < QCHUNKS; q += 32) cp_async16(qd + swz<HD, GQA>(q / CPR, q % CPR), t.q + q * 8, 16);
        }
        cp_async_mbar_arrive(bar);
        cur.advance();
        blk = blk_next;
      }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    return ok;
  }

  // --- the compute warps ------------------------------------------------------
  // Threads 0..NT-1 call it; they sync on named barrier kBarCompute only and
  // never fence or wait on a counter (that is a control warp's job), so a
  // slow hand-off never stalls the ring.
  //   begin(i): called by every compute thread when task i starts.
  //   finish(i, const DecodeTask&, char* smem) -> bool: the task's merged
  //       state is in the merge area (write it with write_partial); must end
  //       with a kBarCompute barrier. false = abort: consume returns false.
  template <class Src, class Begin, class Finish>
  __device__ __forceinline__ bool consume(Src& src, Begin& begin, Finish& finish, int n,
                                          float scale, char* smem, const WaitSite& site) {
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int g = lane >> 2;
    const int tq = lane & 3;
    const uint32_t ring = smem_addr(smem);
    // 16 zero bytes: the ldmatrix rows of the padded query heads (>= GQA).
    const uint32_t zero_row = ring + G::kFlagOffset + 64;
    float* mw = reinterpret_cast<float*>(smem + G::kMergeOffset);  // [NWARPS][16]
    float* lw = mw + NWARPS * 16;                                   // [NWARPS][16]
    float* ow = lw + NWARPS * 16;                                   // [NWARPS][GQA][HD]
    constexpr bool kTwoRows = GQA > 8;  // rows g+8 carry real heads
    const float sl2 = scale * kLog2e;
    // This lane's ldmatrix row of the Q operand: rows (heads) 0-15, chunk
    // +0 / +1 of each 16-dim k step.
    const int q_row = (lane & 7) + ((lane >> 3) & 1) * 8;
    const int q_half = lane >> 4;
    bool ok = true;

    TaskPrefetch pre;
    if (n > 0) pre = src.fetch(0);
    for (int i = 0; i < n; ++i) {
      MEGAC_ATTN_TRACE_AT(tid == 0, i, 0, clock64());
      DecodeTask t;
      const TaskPrefetch p = pre;
      if (i + 1 < n) pre = src.fetch(i + 1);
      if (!src.make(i, p, t)) continue;
      begin(i);
      float m_run[2] = {-INFINITY, -INFINITY};
      float l_run[2] = {0.f, 0.f};  // per-thread partial over its own columns
      float o_acc[HD / 8][4];
#pragma unroll
      for (int n8 = 0; n8 < HD / 8; ++n8)
        o_acc[n8][0] = o_acc[n8][1] = o_acc[n8][2] = o_acc[n8][3] = 0.f;
      // Q (the A operand: rows = query heads, k = head dims) stays in its
      // slot for the whole task and is re-read by ldmatrix every tile, which
      // keeps 32 registers free.
      const uint32_t qs = ring + G::kQOffset + (ord % STAGES) * G::kQBytes;
      if (t.ntiles > 0) ++ord;

      for (int tt = 0; tt < t.ntiles; ++tt) {
#ifdef MEGAC_ATTN_TRACE
        const long long w0 = clock64();
#endif
        if (ok) {
          ok = mbar_wait(full_bar(smem) + cur.stage, cur.phase, (int32_t)cur.stage, site, lane == 0);
          ok = __all_sync(0xffffffffu, ok);
        }
#ifdef MEGAC_ATTN_TRACE
        const long long w1 = clock64();
        MEGAC_ATTN_TRACE_ADD(tid == 0, i, 4, (unsigned long long)(w1 - w0));
        if (tt == 0) MEGAC_ATTN_TRACE_AT(tid == 0, i, 1, w1);
#endif
        const uint32_t kst = ring + cur.stage * G::kStageBytes;
        const uint32_t vst = kst + G::kTileBytes;
        const int key0 = warp * KPW;  // this warp's slice of the tile
        const int pos0 = t.tbeg + tt * KT + key0;
        bool zeroed = false;
        if constexpr (TMA) {
          // Whole pages were copied: this warp's rows outside the split's
          // keys hold stale (even NaN) values. Scores are masked below; V
          // rows must be 0, since 0 * NaN would poison the output.
          if (ok && pos0 < t.kend && pos0 + KPW > t.kbeg && (pos0 < t.kbeg || pos0 + KPW > t.kend)) {
            for (int idx = lane; idx < KPW * CPR; idx += 32) {
              const int pos = pos0 + idx / CPR;
              if (pos < t.kbeg || pos >= t.kend)
                asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(vst + swz<HD, KT>(key0 + idx / CPR, idx % CPR)),
                             "r"(0u)
                             : "memory");
            }
            __syncwarp();
            zeroed = true;
          }
        }
        // After an abort the slot may never fill: skip the math, keep walking.
        if (ok && pos0 < t.kend && pos0 + KPW > t.kbeg) {
          // S = Q K^T for the warp's KPW keys: KB blocks of two 8-key
          // n-tiles, 2*KB independent accumulation chains (the Q fragment of
          // a k step is loaded once for all of them).
          float s[KB][2][4];
#pragma unroll
          for (int b = 0; b < KB; ++b)
#pragma unroll
            for (int n2 = 0; n2 < 2; ++n2) s[b][n2][0] = s[b][n2][1] = s[b][n2][2] = s[b][n2][3] = 0.f;
          {
            const int mat = lane >> 3;
            const int kr = key0 + ((mat >> 1) << 3) + (lane & 7);
#pragma unroll
            for (int ks = 0; ks < HD / 16; ++ks) {
              uint32_t a0, a1, a2, a3;
              ldsm_x4(q_row < GQA ? qs + swz<HD, GQA>(q_row, ks * 2 + q_half) : zero_row, a0, a1, a2, a3);
#pragma unroll
              for (int b = 0; b < KB; ++b) {
                uint32_t b0, b1, b2, b3;
                ldsm_x4(kst + swz<HD, KT>(kr + b * 16, ks * 2 + (mat & 1)), b0, b1, b2, b3);
                mma_bf16(s[b][0], a0, a1, a2, a3, b0, b1);
                mma_bf16(s[b][1], a0, a1, a2, a3, b2, b3);
              }
            }
          }

          // Online softmax, log2 domain, once per tile over the warp's KPW
          // keys. Thread holds rows g (s[b][.][0..1]) and g+8 (s[b][.][2..3])
          // at keys pos0 + b*16 + n2*8 + tq*2 + {0,1}.
          float pr[KB][2][4];
#pragma unroll
          for (int hr = 0; hr < (kTwoRows ? 2 : 1); ++hr) {
            float x[KB][4];
            float mx = -INFINITY;
#pragma unroll
            for (int b = 0; b < KB; ++b)
#pragma unroll
              for (int n2 = 0; n2 < 2; ++n2)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                  const int pos = pos0 + b * 16 + n2 * 8 + tq * 2 + j;
                  const bool vis = pos >= t.kbeg && pos < t.kend;
                  x[b][n2 * 2 + j] = vis ? s[b][n2][hr * 2 + j] * sl2 : -INFINITY;
                  mx = fmaxf(mx, x[b][n2 * 2 + j]);
                }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(m_run[hr], mx);
            // m_new = -inf only if no key so far was visible: keep everything 0.
            const float m_use = m_new == -INFINITY ? 0.f : m_new;
            const float alpha = exp2f(m_run[hr] - m_use);
            m_run[hr] = m_new;
            float psum = 0.f;
#pragma unroll
            for (int b = 0; b < KB; ++b)
#pragma unroll
              for (int q4 = 0; q4 < 4; ++q4) {
                const float e = exp2f(x[b][q4] - m_use);
                pr[b][q4 >> 1][hr * 2 + (q4 & 1)] = e;
                psum += e;
              }
            l_run[hr] = l_run[hr] * alpha + psum;
#pragma unroll
            for (int n8 = 0; n8 < HD / 8; ++n8) {
              o_acc[n8][hr * 2 + 0] *= alpha;
              o_acc[n8][hr * 2 + 1] *= alpha;
            }
          }
          if constexpr (!kTwoRows) {
#pragma unroll
            for (int b = 0; b < KB; ++b) pr[b][0][2] = pr[b][0][3] = pr[b][1][2] = pr[b][1][3] = 0.f;
          }

          // O += P V: V^T chunks through ldmatrix.trans, two 8-dim n-tiles a
          // call, one k step per 16-key block.
#pragma unroll
          for (int b = 0; b < KB; ++b) {
            const uint32_t pa0 = pack_bf16(pr[b][0][0], pr[b][0][1]);
            const uint32_t pa1 = pack_bf16(pr[b][0][2], pr[b][0][3]);
            const uint32_t pa2 = pack_bf16(pr[b][1][0], pr[b][1][1]);
            const uint32_t pa3 = pack_bf16(pr[b][1][2], pr[b][1][3]);
            const int mat = lane >> 3;
            const int vr = key0 + b * 16 + ((mat & 1) << 3) + (lane & 7);
#pragma unroll
            for (int np = 0; np < HD / 16; ++np) {
              uint32_t b0, b1, b2, b3;
              ldsm_x4_t(vst + swz<HD, KT>(vr, np * 2 + (mat >> 1)), b0, b1, b2, b3);
              mma_bf16(o_acc[2 * np], pa0, pa1, pa2, pa3, b0, b1);
              mma_bf16(o_acc[2 * np + 1], pa0, pa1, pa2, pa3, b2, b3);
            }
          }
        }
        // The warp's reads of the slot (and of q, on a task's last tile) are
        // done: hand the slot back. Its zero stores must be ordered before
        // the tensor copies that will refill the slot (another proxy).
        if (zeroed) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncwarp();
        if (lane == 0) mbar_arrive(empty_bar(smem) + cur.stage);
        cur.advance();
      }

      // Quad-reduce the running sums (fixed shuffle tree: deterministic),
      // then hand each warp's state to the merge area. The previous task's
      // finish ended with a compute barrier, so the area is free.
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        l_run[hr] += __shfl_xor_sync(0xffffffffu, l_run[hr], 1);
        l_run[hr] += __shfl_xor_sync(0xffffffffu, l_run[hr], 2);
      }
      if (tq == 0) {
        mw[warp * 16 + g] = m_run[0];
        lw[warp * 16 + g] = l_run[0];
        mw[warp * 16 + g + 8] = m_run[1];
        lw[warp * 16 + g + 8] = l_run[1];
      }
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int h = g + hr * 8;
        if (h < GQA) {
#pragma unroll
          for (int n8 = 0; n8 < HD / 8; ++n8) {
            float2 v = make_float2(o_acc[n8][hr * 2], o_acc[n8][hr * 2 + 1]);
            *reinterpret_cast<float2*>(ow + ((size_t)warp * GQA + h) * HD + n8 * 8 + tq * 2) = v;
          }
        }
      }
      bar_sync<kBarCompute, NT>();
      MEGAC_ATTN_TRACE_AT(tid == 0, i, 2, clock64());
      MEGAC_ATTN_TRACE_AT(tid == 0, i, 6, t.ntiles);
      if (!finish(i, t, smem)) ok = false;
      MEGAC_ATTN_TRACE_AT(tid == 0, i, 3, clock64());
    }
    return ok;
  }

  // Merge the warps' states (merge area) in warp order and store the
  // normalised partial and its lse. Ends with a compute barrier.
  __device__ __forceinline__ static void write_partial(const char* smem, float* o_dst,
                                                       float* lse_dst) {
    const float* mw = reinterpret_cast<const float*>(smem + G::kMergeOffset);
    const float* lw = mw + NWARPS * 16;
    const float* ow = lw + NWARPS * 16;
    for (int i = threadIdx.x; i < GQA * HD / 4; i += NT) {
      const int h = (i * 4) / HD;
      const int d = (i * 4) % HD;
      float M = -INFINITY;
#pragma unroll
      for (int w = 0; w < NWARPS; ++w) M = fmaxf(M, mw[w * 16 + h]);
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      float L = 0.f;
      if (M != -INFINITY) {
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) {
          const float mwv = mw[w * 16 + h];
          const float f = mwv == -INFINITY ? 0.f : exp2f(mwv - M);
          L += f * lw[w * 16 + h];
          const float4 o = *reinterpret_cast<const float4*>(ow + ((size_t)w * GQA + h) * HD + d);
          acc.x += f * o.x;
          acc.y += f * o.y;
          acc.z += f * o.z;
          acc.w += f * o.w;
        }
      }
      const float inv = L > 0.f ? 1.f / L : 0.f;
      reinterpret_cast<float4*>(o_dst)[i] =
          make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
      if (d == 0) lse_dst[h] = L > 0.f ? (M + log2f(L)) * kLn2 : -INFINITY;
    }
    bar_sync<kBarCompute, NT>();
  }

  // Shared memory a control warp may use for a combine while the stream runs.
  __device__ __forceinline__ static char* ctl_work(char* smem) { return smem + G::kCtlOffset; }
  __device__ __forceinline__ static int ctl_work_bytes() {
    return (int)dynamic_smem_bytes() - G::kCtlOffset;
  }
};

}  // namespace attn
}  // namespace megac

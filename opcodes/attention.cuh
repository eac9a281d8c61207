// Paged GQA flash-decode (ATTN_DECODE) and its log-sum-exp merge
// (ATTN_COMBINE).
//
// One decode task = (row, kv head, split). A CTA runs a *stream* of decode
// tasks (DecodeStream::run): the K/V tiles of all its tasks form one sequence
// that a shared-memory ring of 16-byte cp.async copies runs through, so the
// next task's first tiles are already in flight while this one finishes
// (its epilogue, its counter, maybe a combine). A task boundary therefore
// costs no ring refill; this is what makes short splits (a few tiles) cheap.
// The issue side also loads each tile's page-table entries one tile ahead,
// so no cp.async ever waits on a page-table read, and it copies the task's
// query rows into a shared-memory slot with its first tile.
//
// Compute: mma.sync m16n8k16, the GQA query heads of the kv head are the
// 16-row M side (padded), keys / head dims the N side. The online softmax
// runs in fp32 in the log2 domain. Each warp owns a fixed 16-key slice of
// every tile, so the result does not depend on timing; the warps' states are
// merged in warp order at the end of each task.
//
// Combine: the partials of one (row, kv head) are merged in split order, in
// fp32, by `combine_core`. It is reached two ways with identical bits: the
// standalone ATTN_COMBINE task (`combine_task`, after a counter wait), or
// fused: each split counts its arrival on a (row, kv head) counter and the
// LAST arriver merges right away (`warp_arrive_last`), which removes one
// dependency hop and one task. Counting and merging are meant for a warp
// beside the stream's compute warps (see DecodeStream::run on why the
// compute warps must not fence); opcodes/tests/attention_test.cu shows the
// hand-off.
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

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ uint32_t dynamic_smem_bytes() {
  uint32_t v;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(v));
  return v;
}

// 16-byte async copy through L2 only (L2 fetches whole 256-byte sectors: a
// kv head's key row is 256 contiguous bytes at head_dim 128); src_bytes 0
// writes zeros (masked keys must read as 0, never as whatever a stale page
// holds: 0 * NaN would poison the output).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
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
template <int HD, int GQA, int NT, int BAR>
__device__ __forceinline__ void combine_core(const float* o_part, const float* lse_part,
                                             __nv_bfloat16* out, int rows, int q_heads, int row,
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
      const uint32_t buf = smem_u32(stage + (c & 1) * half * kSlice);
      for (int i = tid; i < ns * kPieces; i += NT) {
        const int s = s0 + i / kPieces;
        cp_async16(buf + i * 16, ob + (size_t)s * split_elems * HD + (i % kPieces) * 4, 16);
      }
    }
    cp_async_commit();  // always one group, so wait_group<1> below is exact
  };
  issue(0);
  issue(1);

  // All lse values in one round trip, then one thread per head folds them in
  // split order while the partials are still in flight.
  const float* lp = lse_part + (size_t)row * q_heads + kvh * GQA;
  for (int i = tid; i < n * GQA; i += NT)
    w[i] = __ldcg(lp + (size_t)(i / GQA) * split_elems + i % GQA);
  sync();
  if (tid < GQA) {
    float M = -INFINITY;
    for (int s = 0; s < n; ++s) M = fmaxf(M, w[s * GQA + tid]);
    float L = 0.f;
    for (int s = 0; s < n; ++s) {
      const float l = w[s * GQA + tid];
      const float f = (l == -INFINITY || M == -INFINITY) ? 0.f : expf(l - M);
      w[s * GQA + tid] = f;
      L += f;
    }
    Ls[tid] = L > 0.f ? 1.f / L : 0.f;
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
  __nv_bfloat16* orow = out + (size_t)row * q_heads * HD + (size_t)kvh * GQA * HD;
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
//   [kFlagOffset, +128)        CTA-wide flags
//   [kMergeOffset, +kMergeBytes) the warp merge
//   [kCtlOffset, ...)          a control warp's combine (everything up to the
//                              end of the dynamic shared memory)
template <int HD, int GQA, int NWARPS, int STAGES>
struct DecodeSmem {
  static constexpr int kTileKeys = NWARPS * 16;
  static constexpr int kRowBytes = HD * 2;
  static constexpr int kTileBytes = kTileKeys * kRowBytes;  // one of K or V
  static constexpr int kStageBytes = 2 * kTileBytes;
  static constexpr int kRingBytes = STAGES * kStageBytes;
  static constexpr int kQBytes = (GQA * HD * 2 + 127) / 128 * 128;
  static constexpr int kQOffset = kRingBytes;
  static constexpr int kFlagOffset = kQOffset + STAGES * kQBytes;
  static constexpr int kMergeOffset = kFlagOffset + 128;
  // per warp 16 m + 16 l + GQA*HD o (fp32)
  static constexpr int kMergeBytes = NWARPS * (32 + GQA * HD) * 4;
  static constexpr int kCtlOffset = kMergeOffset + kMergeBytes;
  static constexpr int kMinCombineSplits = 64;
  // minimum dynamic smem (more = bigger combine chunks)
  static constexpr int kBytes = kCtlOffset + combine_min_bytes<HD, GQA>(kMinCombineSplits);
};

// Swizzled byte offset of 16-byte chunk `c` of key row `r`: XOR with the row
// index mod 8 puts the 8 rows an ldmatrix reads in 8 different bank groups.
template <int HD>
__device__ __forceinline__ uint32_t swz(int r, int c) {
  return static_cast<uint32_t>(r * (HD * 2) + ((c ^ (r & 7)) << 4));
}

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
};

template <int HD, int GQA, int BLOCK, int NWARPS, int STAGES>
struct DecodeStream {
  static_assert(HD % 64 == 0 && HD <= 256, "head_dim must be 64, 128, 192 or 256");
  static_assert(GQA >= 1 && GQA <= 16, "at most 16 query heads per kv head");
  static_assert(STAGES >= 2, "need a ring");
  using G = DecodeSmem<HD, GQA, NWARPS, STAGES>;
  static constexpr int NT = NWARPS * 32;
  static constexpr int KT = G::kTileKeys;
  static constexpr int CPR = HD / 8;          // 16-byte chunks per key row
  static constexpr int LOADS = KT * CPR / NT;  // chunks per thread per tensor
  static_assert((KT * CPR) % NT == 0, "tile must split evenly over threads");
  static constexpr int ROWS_PER_PASS = NT / CPR;
  // A page holds whole tiles: one page-table entry serves the whole tile.
  static constexpr bool kTileInPage = BLOCK % KT == 0;
  // A tile holds whole pages and each thread's rows j map to page
  // (j*ROWS_PER_PASS)/BLOCK of the tile: one entry per page, not per row.
  static constexpr bool kPagesAligned = KT % BLOCK == 0 && BLOCK % ROWS_PER_PASS == 0;
  static constexpr int NBLK = kTileInPage ? 1 : (kPagesAligned ? KT / BLOCK : LOADS);
  static constexpr int QCHUNKS = GQA * HD / 8;

  // Geometry of split `split` of (row, kvh).
  __device__ __forceinline__ static void task(const DecodeArgs& a, int row, int kvh, int split,
                                              int num_splits, int window, DecodeTask& t) {
    const int q_heads = a.kv_heads * GQA;
    int kbeg, kend;
    split_range(__ldg(a.seq_len + row), window, num_splits, split, BLOCK, kbeg, kend);
    t.q = a.q + ((size_t)row * q_heads + (size_t)kvh * GQA) * HD;
    t.k = a.k_pool + (size_t)kvh * HD;
    t.v = a.v_pool + (size_t)kvh * HD;
    t.pt = a.page_table + (size_t)row * a.pt_stride;
    t.tok_stride = a.kv_heads * HD;
    t.kbeg = kbeg;
    t.kend = kend;
    t.tbeg = kbeg - kbeg % BLOCK;
    t.ntiles = kbeg < kend ? (kend - t.tbeg + KT - 1) / KT : 0;
  }

  // --- issue side: the task and tile the next cp.async batch is for -------
  uint32_t ring;
  DecodeTask it;
  int it_idx;
  int it_tile;
  int n_tasks;
  uint32_t issued;  // tiles issued so far; tile i goes to stage i % STAGES
  uint32_t it_ord;  // tasks with tiles found so far; task o's q goes to slot o % STAGES
  int blk[NBLK];    // physical blocks of the next tile's rows (loaded ahead)
  bool more;

  // Page-table entries of tile it_tile of `it`. Rows outside [kbeg, kend)
  // never look at the page table (their pages may be released).
  __device__ __forceinline__ void load_blk() {
    const int tile_pos = it.tbeg + it_tile * KT;
    if constexpr (kTileInPage) {
      // tile_pos lies in [page of kbeg, page of kend-1]: a live page.
      blk[0] = __ldg(it.pt + tile_pos / BLOCK);
    } else if constexpr (kPagesAligned) {
#pragma unroll
      for (int p = 0; p < NBLK; ++p) {
        const int page = tile_pos / BLOCK + p;
        const bool live = page * BLOCK < it.kend && (page + 1) * BLOCK > it.kbeg;
        blk[p] = live ? __ldg(it.pt + page) : 0;
      }
    } else {
#pragma unroll
      for (int j = 0; j < LOADS; ++j) {
        const int pos = tile_pos + (int)threadIdx.x / CPR + j * ROWS_PER_PASS;
        blk[j] = (pos >= it.kbeg && pos < it.kend) ? __ldg(it.pt + pos / BLOCK) : 0;
      }
    }
  }

  template <class Src>
  __device__ __forceinline__ void next_issue_task(Src& src) {
    for (;;) {
      ++it_idx;
      it_tile = 0;
      if (it_idx >= n_tasks) {
        more = false;
        return;
      }
      if (src(it_idx, it) && it.ntiles > 0) {
        more = true;
        ++it_ord;
        load_blk();
        return;
      }
    }
  }

  // Issue the next tile of the sequence (caller commits the group).
  template <class Src>
  __device__ __forceinline__ void issue(Src& src) {
    const int tid = threadIdx.x;
    const uint32_t slot = issued % STAGES;
    const uint32_t st = ring + slot * G::kStageBytes;
    const int tile_pos = it.tbeg + it_tile * KT;
    const int c = tid % CPR;
#pragma unroll
    for (int j = 0; j < LOADS; ++j) {
      const int r = tid / CPR + j * ROWS_PER_PASS;
      const int pos = tile_pos + r;
      const bool ok = pos >= it.kbeg && pos < it.kend;
      const int b = kTileInPage ? blk[0] : (kPagesAligned ? blk[(j * ROWS_PER_PASS) / BLOCK] : blk[j]);
      const size_t off =
          ok ? ((size_t)b * BLOCK + pos % BLOCK) * (size_t)it.tok_stride + c * 8 : 0;
      const uint32_t d = st + swz<HD>(r, c);
      cp_async16(d, it.k + off, ok ? 16 : 0);
      cp_async16(d + G::kTileBytes, it.v + off, ok ? 16 : 0);
    }
    if (it_tile == 0) {
      // The issue side runs at most STAGES-1 tiles (so tasks) ahead, so task
      // o+STAGES is first issued after task o's last tile was consumed.
      const uint32_t qd = ring + G::kQOffset + ((it_ord - 1) % STAGES) * G::kQBytes;
      for (int i = tid; i < QCHUNKS; i += NT) cp_async16(qd + swz<HD>(i / CPR, i % CPR), it.q + i * 8, 16);
    }
    ++issued;
    if (++it_tile == it.ntiles) {
      next_issue_task(src);
    } else {
      load_blk();
    }
  }

  // Run tasks 0..n-1 of this CTA. Threads 0..NT-1 (the compute warps) call
  // it; they sync on named barrier kBarCompute only, and no thread of theirs
  // ever fences or waits on a counter: a release fence by a thread with
  // cp.async in flight waits for those loads, which would drain the ring at
  // every task boundary. Signalling belongs to another warp.
  //   src(i, DecodeTask&) -> bool: task i's geometry; false = no task in
  //       slot i (skipped by both sides). Called by both the issue side
  //       (ahead) and the consume side: must be cheap and give the same
  //       answer every time.
  //   begin(i): called by every thread when task i starts computing.
  //   finish(i, const DecodeTask&, char* smem) -> bool: the task's merged
  //       state is in the merge area (write it with write_partial); must end
  //       with a CTA barrier. false = abort (watchdog): run returns false.
  template <class Src, class Begin, class Finish>
  __device__ __forceinline__ bool run(Src& src, Begin& begin, Finish& finish, int n,
                                      float scale, char* smem) {
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int g = lane >> 2;
    const int tq = lane & 3;
    ring = smem_u32(smem);
    n_tasks = n;
    it_idx = -1;
    issued = 0;
    it_ord = 0;
    // 16 zero bytes: the ldmatrix rows of the padded query heads (>= GQA).
    const uint32_t zero_row = ring + G::kFlagOffset + 64;
    if (tid < 4) asm volatile("st.shared.u32 [%0], %1;" ::"r"(zero_row + tid * 4), "r"(0u));
    next_issue_task(src);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (more) issue(src);
      cp_async_commit();
    }

    float* mw = reinterpret_cast<float*>(smem + G::kMergeOffset);  // [NWARPS][16]
    float* lw = mw + NWARPS * 16;                                   // [NWARPS][16]
    float* ow = lw + NWARPS * 16;                                   // [NWARPS][GQA][HD]
    constexpr bool kTwoRows = GQA > 8;  // rows g+8 carry real heads
    const float sl2 = scale * kLog2e;
    uint32_t consumed = 0;
    uint32_t c_ord = 0;  // tasks with tiles consumed so far
    // This lane's ldmatrix row of the Q operand: rows (heads) 0-15, chunk
    // +0 / +1 of each 16-dim k step.
    const int q_row = (lane & 7) + ((lane >> 3) & 1) * 8;
    const int q_half = lane >> 4;

    for (int i = 0; i < n; ++i) {
      DecodeTask t;
      if (!src(i, t)) continue;
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
      const uint32_t qs = ring + G::kQOffset + (c_ord % STAGES) * G::kQBytes;
      if (t.ntiles > 0) ++c_ord;

      for (int tt = 0; tt < t.ntiles; ++tt) {
        cp_async_wait<STAGES - 2>();
        bar_sync<kBarCompute, NT>();
        const uint32_t slot = consumed % STAGES;
        if (more) issue(src);
        cp_async_commit();
        ++consumed;

        const uint32_t kst = ring + slot * G::kStageBytes;
        const uint32_t vst = kst + G::kTileBytes;
        const int key0 = warp * 16;  // this warp's slice of the tile
        const int pos0 = t.tbeg + tt * KT + key0;
        if (pos0 >= t.kend || pos0 + 16 <= t.kbeg) continue;  // slice fully masked

        // S = Q K^T for 16 keys: two n-tiles of 8 keys.
        float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        {
          const int mat = lane >> 3;
          const int kr = key0 + ((mat >> 1) << 3) + (lane & 7);
#pragma unroll
          for (int ks = 0; ks < HD / 16; ++ks) {
            uint32_t a0, a1, a2, a3, b0, b1, b2, b3;
            ldsm_x4(q_row < GQA ? qs + swz<HD>(q_row, ks * 2 + q_half) : zero_row, a0, a1, a2, a3);
            ldsm_x4(kst + swz<HD>(kr, ks * 2 + (mat & 1)), b0, b1, b2, b3);
            mma_bf16(s[0], a0, a1, a2, a3, b0, b1);
            mma_bf16(s[1], a0, a1, a2, a3, b2, b3);
          }
        }

        // Online softmax, log2 domain. Thread holds rows g (s[.][0..1]) and
        // g+8 (s[.][2..3]) at keys pos0 + n*8 + tq*2 + {0,1}.
        float p[2][4];
#pragma unroll
        for (int hr = 0; hr < (kTwoRows ? 2 : 1); ++hr) {
          float x[4];
#pragma unroll
          for (int n2 = 0; n2 < 2; ++n2)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              const int pos = pos0 + n2 * 8 + tq * 2 + j;
              const bool ok = pos >= t.kbeg && pos < t.kend;
              x[n2 * 2 + j] = ok ? s[n2][hr * 2 + j] * sl2 : -INFINITY;
            }
          float mx = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float m_new = fmaxf(m_run[hr], mx);
          // m_new = -inf only if no key so far was visible: keep everything 0.
          const float m_use = m_new == -INFINITY ? 0.f : m_new;
          const float alpha = exp2f(m_run[hr] - m_use);
          m_run[hr] = m_new;
          float psum = 0.f;
#pragma unroll
          for (int q4 = 0; q4 < 4; ++q4) {
            const float e = exp2f(x[q4] - m_use);
            p[q4 >> 1][hr * 2 + (q4 & 1)] = e;
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
          p[0][2] = p[0][3] = p[1][2] = p[1][3] = 0.f;
        }
        const uint32_t pa0 = pack_bf16(p[0][0], p[0][1]);
        const uint32_t pa1 = pack_bf16(p[0][2], p[0][3]);
        const uint32_t pa2 = pack_bf16(p[1][0], p[1][1]);
        const uint32_t pa3 = pack_bf16(p[1][2], p[1][3]);

        // O += P V: V^T chunks through ldmatrix.trans, two 8-dim n-tiles a call.
        {
          const int mat = lane >> 3;
          const int vr = key0 + ((mat & 1) << 3) + (lane & 7);
#pragma unroll
          for (int np = 0; np < HD / 16; ++np) {
            uint32_t b0, b1, b2, b3;
            ldsm_x4_t(vst + swz<HD>(vr, np * 2 + (mat >> 1)), b0, b1, b2, b3);
            mma_bf16(o_acc[2 * np], pa0, pa1, pa2, pa3, b0, b1);
            mma_bf16(o_acc[2 * np + 1], pa0, pa1, pa2, pa3, b2, b3);
          }
        }
      }

      // Quad-reduce the running sums (fixed shuffle tree: deterministic),
      // then hand each warp's state to the merge area. The previous task's
      // finish ended with a CTA barrier, so the area is free.
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
      if (!finish(i, t, smem)) {
        cp_async_wait<0>();
        bar_sync<kBarCompute, NT>();
        return false;
      }
    }
    cp_async_wait<0>();
    bar_sync<kBarCompute, NT>();
    return true;
  }

  // Merge the warps' states (merge area) in warp order and store the
  // normalised partial and its lse. Ends with a CTA barrier.
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

// One ATTN_DECODE task on its own (no stream around it: the ring fills and
// drains inside the task). Threads 0..NWARPS*32-1 of the CTA call it;
// `smem` holds at least DecodeSmem<HD,GQA,NWARPS,STAGES>::kBytes, 128-byte
// aligned. Ends with a barrier of the calling threads (kBarCompute) after
// the last global store, so the caller may signal right after.
template <int HD, int GQA, int BLOCK, int NWARPS, int STAGES>
__device__ __forceinline__ void decode_task(const DecodeArgs& a, int row, int kvh, int split,
                                            int num_splits, int window, char* smem) {
  using S = DecodeStream<HD, GQA, BLOCK, NWARPS, STAGES>;
  const int q_heads = a.kv_heads * GQA;
  float* o_dst = a.o_part + ((size_t)split * a.rows + row) * q_heads * HD + (size_t)kvh * GQA * HD;
  float* lse_dst = a.lse_part + ((size_t)split * a.rows + row) * q_heads + kvh * GQA;
  auto src = [&](int, DecodeTask& t) {
    S::task(a, row, kvh, split, num_splits, window, t);
    return true;
  };
  auto begin = [](int) {};
  auto finish = [&](int, const DecodeTask&, char* sm) {
    S::write_partial(sm, o_dst, lse_dst);
    return true;
  };
  S s;
  s.run(src, begin, finish, 1, a.scale, smem);
}

}  // namespace attn
}  // namespace megac

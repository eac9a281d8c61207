// Paged GQA flash-decode (ATTN_DECODE) and its log-sum-exp merge
// (ATTN_COMBINE).
//
// One decode task = (row, kv head, split). It streams the split's K/V pages
// for one kv head through a shared-memory ring filled by 16-byte cp.async
// (several tiles in flight, so the SM keeps ~100 KB of DRAM reads
// outstanding), and computes with mma.sync m16n8k16: the GQA query heads of
// the kv head are the 16-row M side (padded), keys / head dims the N side.
// The online softmax runs in fp32 in the log2 domain. Each warp owns a fixed
// 16-key slice of every tile, so the result does not depend on timing; the
// warps' states are merged in warp order at the end.
//
// Split rule (shared with the host planner, megac/gpu/blocks/attention.py,
// `attn_split_range`): the visible keys of a row are [lo, hi) with
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
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "common.cuh"

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

// 16-byte async copy (L2 fetches whole 256-byte sectors: a kv head's key
// row is 256 contiguous bytes at head_dim 128); src_bytes 0 writes zeros (masked keys must read as 0,
// never as whatever a stale page holds: 0 * NaN would poison the output).
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

// Shared-memory geometry of one decode CTA.
template <int HD, int NWARPS, int STAGES>
struct DecodeSmem {
  static constexpr int kTileKeys = NWARPS * 16;
  static constexpr int kRowBytes = HD * 2;
  static constexpr int kTileBytes = kTileKeys * kRowBytes;  // one of K or V
  static constexpr int kStageBytes = 2 * kTileBytes;
  static constexpr int kRingBytes = STAGES * kStageBytes;
  // The warp merge reuses the ring: per warp 16 m + 16 l + GQA*HD o (fp32).
  static constexpr int kMergeBytes(int gqa) { return NWARPS * (32 + gqa * HD) * 4; }
  static constexpr int bytes(int gqa) {
    return kRingBytes > kMergeBytes(gqa) ? kRingBytes : kMergeBytes(gqa);
  }
};

// Swizzled byte offset of 16-byte chunk `c` of key row `r`: XOR with the row
// index mod 8 puts the 8 rows an ldmatrix reads in 8 different bank groups.
template <int HD>
__device__ __forceinline__ uint32_t swz(int r, int c) {
  return static_cast<uint32_t>(r * (HD * 2) + ((c ^ (r & 7)) << 4));
}

// One ATTN_DECODE task. Every thread of the CTA (NWARPS warps) calls it;
// `smem` is at least DecodeSmem<HD,NWARPS,STAGES>::bytes(GQA), 16-byte
// aligned. Ends with a CTA barrier after the last global store, so the
// caller may signal right after.
template <int HD, int GQA, int BLOCK, int NWARPS, int STAGES>
__device__ __forceinline__ void decode_task(const DecodeArgs& a, int row, int kvh, int split,
                                            int num_splits, int window, char* smem) {
  static_assert(HD % 64 == 0 && HD <= 256, "head_dim must be 64, 128, 192 or 256");
  static_assert(GQA >= 1 && GQA <= 16, "at most 16 query heads per kv head");
  static_assert(STAGES >= 2, "need a ring");
  using G = DecodeSmem<HD, NWARPS, STAGES>;
  constexpr int NT = NWARPS * 32;
  constexpr int KT = G::kTileKeys;
  constexpr int CPR = HD / 8;                    // 16-byte chunks per key row
  constexpr int LOADS = KT * CPR / NT;           // chunks per thread per tensor
  static_assert((KT * CPR) % NT == 0, "tile must split evenly over threads");
  constexpr int ROWS_PER_PASS = NT / CPR;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int q_heads = a.kv_heads * GQA;
  const int sl = a.seq_len[row];
  int kbeg, kend;
  split_range(sl, window, num_splits, split, BLOCK, kbeg, kend);

  float* o_dst = a.o_part + ((size_t)split * a.rows + row) * q_heads * HD + (size_t)kvh * GQA * HD;
  float* lse_dst = a.lse_part + ((size_t)split * a.rows + row) * q_heads + kvh * GQA;

  if (kbeg >= kend) {
    for (int i = tid; i < GQA * HD / 4; i += NT)
      reinterpret_cast<float4*>(o_dst)[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (tid < GQA) lse_dst[tid] = -INFINITY;
    __syncthreads();
    return;
  }

  const int tbeg = kbeg - kbeg % BLOCK;  // tiles start on a page boundary
  const int ntiles = (kend - tbeg + KT - 1) / KT;
  const int32_t* pt = a.page_table + (size_t)row * a.pt_stride;
  const size_t tok_stride = (size_t)a.kv_heads * HD;  // elements per pool token
  const uint32_t ring = smem_u32(smem);

  // Issue tile `t` into stage `t % STAGES`. Each thread copies LOADS chunks
  // of K and the same chunks of V; rows outside [kbeg, kend) are zero-filled
  // and never look at the page table (their pages may be unallocated).
  auto issue = [&](int t) {
    const uint32_t st = ring + (t % STAGES) * G::kStageBytes;
    const int tile_pos = tbeg + t * KT;
    const int c = tid % CPR;
#pragma unroll
    for (int j = 0; j < LOADS; ++j) {
      const int r = tid / CPR + j * ROWS_PER_PASS;
      const int pos = tile_pos + r;
      const bool ok = pos >= kbeg && pos < kend;
      size_t off = 0;
      if (ok) {
        const int blk = __ldg(pt + pos / BLOCK);
        off = ((size_t)blk * BLOCK + pos % BLOCK) * tok_stride + (size_t)kvh * HD + c * 8;
      }
      const uint32_t d = st + swz<HD>(r, c);
      cp_async16(d, a.k_pool + off, ok ? 16 : 0);
      cp_async16(d + G::kTileBytes, a.v_pool + off, ok ? 16 : 0);
    }
  };

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < ntiles) issue(s);
    cp_async_commit();
  }

  // Q as the A operand, loaded straight from global (tiny, read once):
  // rows = query heads (g = lane/4 and g+8), k = head dims.
  const int g = lane >> 2;
  const int tq = lane & 3;
  const __nv_bfloat16* qrow = a.q + ((size_t)row * q_heads + (size_t)kvh * GQA) * HD;
  uint32_t qa[HD / 16][4];
#pragma unroll
  for (int ks = 0; ks < HD / 16; ++ks) {
    const int d0 = ks * 16 + tq * 2;
    auto ld = [&](int h, int d) -> uint32_t {
      return h < GQA ? __ldg(reinterpret_cast<const uint32_t*>(qrow + (size_t)h * HD + d)) : 0u;
    };
    qa[ks][0] = ld(g, d0);
    qa[ks][1] = ld(g + 8, d0);
    qa[ks][2] = ld(g, d0 + 8);
    qa[ks][3] = ld(g + 8, d0 + 8);
  }

  constexpr bool kTwoRows = GQA > 8;  // rows g+8 carry real heads
  const float sl2 = a.scale * kLog2e;
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.f, 0.f};  // per-thread partial over its own columns
  float o_acc[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) o_acc[n][0] = o_acc[n][1] = o_acc[n][2] = o_acc[n][3] = 0.f;

  for (int t = 0; t < ntiles; ++t) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    if (t + STAGES - 1 < ntiles) issue(t + STAGES - 1);
    cp_async_commit();

    const uint32_t kst = ring + (t % STAGES) * G::kStageBytes;
    const uint32_t vst = kst + G::kTileBytes;
    const int key0 = warp * 16;  // this warp's slice of the tile
    const int pos0 = tbeg + t * KT + key0;
    if (pos0 >= kend || pos0 + 16 <= kbeg) continue;  // slice fully masked

    // S = Q K^T for 16 keys: two n-tiles of 8 keys.
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    {
      const int mat = lane >> 3;
      const int kr = key0 + ((mat >> 1) << 3) + (lane & 7);
#pragma unroll
      for (int ks = 0; ks < HD / 16; ++ks) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4(kst + swz<HD>(kr, ks * 2 + (mat & 1)), b0, b1, b2, b3);
        mma_bf16(s[0], qa[ks][0], qa[ks][1], qa[ks][2], qa[ks][3], b0, b1);
        mma_bf16(s[1], qa[ks][0], qa[ks][1], qa[ks][2], qa[ks][3], b2, b3);
      }
    }

    // Online softmax, log2 domain. Thread holds rows g (s[.][0..1]) and g+8
    // (s[.][2..3]) at keys pos0 + n*8 + tq*2 + {0,1}.
    float p[2][4];
#pragma unroll
    for (int hr = 0; hr < (kTwoRows ? 2 : 1); ++hr) {
      float x[4];
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int pos = pos0 + n * 8 + tq * 2 + j;
          const bool ok = pos >= kbeg && pos < kend;
          x[n * 2 + j] = ok ? s[n][hr * 2 + j] * sl2 : -INFINITY;
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
      for (int i = 0; i < 4; ++i) {
        const float e = exp2f(x[i] - m_use);
        p[i >> 1][hr * 2 + (i & 1)] = e;
        psum += e;
      }
      l_run[hr] = l_run[hr] * alpha + psum;
#pragma unroll
      for (int n = 0; n < HD / 8; ++n) {
        o_acc[n][hr * 2 + 0] *= alpha;
        o_acc[n][hr * 2 + 1] *= alpha;
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
  cp_async_wait<0>();
  __syncthreads();  // ring is now free: reuse it for the warp merge

  // Quad-reduce the running sums (fixed shuffle tree: deterministic).
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    l_run[hr] += __shfl_xor_sync(0xffffffffu, l_run[hr], 1);
    l_run[hr] += __shfl_xor_sync(0xffffffffu, l_run[hr], 2);
  }
  float* mw = reinterpret_cast<float*>(smem);      // [NWARPS][16]
  float* lw = mw + NWARPS * 16;                    // [NWARPS][16]
  float* ow = lw + NWARPS * 16;                    // [NWARPS][GQA][HD]
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
      for (int n = 0; n < HD / 8; ++n) {
        float2 v = make_float2(o_acc[n][hr * 2], o_acc[n][hr * 2 + 1]);
        *reinterpret_cast<float2*>(ow + ((size_t)warp * GQA + h) * HD + n * 8 + tq * 2) = v;
      }
    }
  }
  __syncthreads();

  // Merge warps in index order; one thread per 4 consecutive dims.
  for (int i = tid; i < GQA * HD / 4; i += NT) {
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
  __syncthreads();
}

// One ATTN_COMBINE task: merge splits 0..n_splits-1 of (row, kvh) in index
// order, fp32, and write bf16. Reads partials written by other CTAs, so it
// uses L2-coherent loads (ld.global.cg); the caller has acquired the
// counter. `smem` needs n_splits*GQA*4 + GQA*4 bytes.
template <int HD, int GQA, int NT>
__device__ __forceinline__ void combine_task(const CombineArgs& a, int row, int kvh,
                                             int n_splits, char* smem) {
  const int tid = threadIdx.x;
  const int q_heads = a.kv_heads * GQA;
  float* w = reinterpret_cast<float*>(smem);  // [n_splits][GQA] lse, then weights
  float* Ls = w + n_splits * GQA;             // [GQA] 1 / sum of weights
  const size_t split_elems = (size_t)a.rows * q_heads;
  // All lse values in one round trip (a serial loop would pay one L2
  // latency per split), then one thread per head folds them in split order.
  const float* lp = a.lse_part + (size_t)row * q_heads + kvh * GQA;
  for (int i = tid; i < n_splits * GQA; i += NT)
    w[i] = __ldcg(lp + (size_t)(i / GQA) * split_elems + i % GQA);
  __syncthreads();
  if (tid < GQA) {
    float M = -INFINITY;
    for (int s = 0; s < n_splits; ++s) M = fmaxf(M, w[s * GQA + tid]);
    float L = 0.f;
    for (int s = 0; s < n_splits; ++s) {
      const float l = w[s * GQA + tid];
      const float f = (l == -INFINITY || M == -INFINITY) ? 0.f : expf(l - M);
      w[s * GQA + tid] = f;
      L += f;
    }
    Ls[tid] = L > 0.f ? 1.f / L : 0.f;
  }
  __syncthreads();
  const float* ob = a.o_part + ((size_t)row * q_heads + (size_t)kvh * GQA) * HD;
  for (int i = tid; i < GQA * HD / 4; i += NT) {
    const int h = (i * 4) / HD;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    const float4* op = reinterpret_cast<const float4*>(ob) + i;
    const size_t sstride = split_elems * HD / 4;
    int s = 0;
    // Loads eight splits ahead; the adds stay in split order.
    for (; s + 8 <= n_splits; s += 8) {
      float4 v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) v[u] = __ldcg(op + (size_t)(s + u) * sstride);
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const float f = w[(s + u) * GQA + h];
        acc.x += f * v[u].x;
        acc.y += f * v[u].y;
        acc.z += f * v[u].z;
        acc.w += f * v[u].w;
      }
    }
    for (; s < n_splits; ++s) {
      const float4 v = __ldcg(op + (size_t)s * sstride);
      const float f = w[s * GQA + h];
      acc.x += f * v.x;
      acc.y += f * v.y;
      acc.z += f * v.z;
      acc.w += f * v.w;
    }
    const float inv = Ls[h];
    __nv_bfloat162 lo = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
    __nv_bfloat162 hi = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
    uint2 pk;
    pk.x = *reinterpret_cast<uint32_t*>(&lo);
    pk.y = *reinterpret_cast<uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(a.out + (size_t)row * q_heads * HD + (size_t)kvh * GQA * HD + i * 4) = pk;
  }
  __syncthreads();
}

}  // namespace attn
}  // namespace megac

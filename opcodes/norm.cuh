// ADD_RMSNORM for one row: the residual plus its partial sums, each set in
// index order (fp32, one rounding per add, as the VM adds), then (ADD_MOE)
// the row's expert outputs score-weighted in k order (MOE_COMBINE's sum,
// rounded as combine_row rounds it, then added), then RMSNorm:
// y = bf16(x * rsqrt(mean(x^2) + eps)), out = bf16(gamma * y).
//
// Whole CTA. The mean's sum runs over a fixed tree (per thread in index
// order, then warps, then the warp sums in warp order), so the bits do not
// depend on timing (they may differ from the VM's by the order of the
// sum: a few ulp of the scale).
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "moe_out.cuh"
#include "profile_marks.cuh"

// 1: a TIMING PROBE, not a candidate (its reads are not ordered: it can
// read the previous step's routing): at one row, a folding QKV tile's and a
// COMBINE_IN router tile's slots and scores (route_slot, topk_w of
// NORM_LAYER) are loaded into their staging words as the task starts,
// before its waits (ops_gemm.cuh slots_early), and the fold skips that
// round trip. Measures what taking the first of the fold's two dependent L2
// round trips off both of a MoE layer's chain heads is worth before the
// ordered form (a wait on the finalize's counter) is built. Measured (H100,
// fiftieth session, NMC bs1 8K, engines alternating): +0.7 %, and +0.8 %
// with the QKV fold's expert rows loaded beside its other planes (one
// round trip): the fold's "loads and adds done" moved ~0.1 us, the
// router's staged input ~0.2. A QKV fold's time is its ~106 KB of L2 loads
// on one SM, not their order; the ordered form is not built. 0: off.
#ifndef MEGAC_SLOTS_EARLY
#define MEGAC_SLOTS_EARLY 0
#endif

namespace megac {
namespace norm {

using bf16 = __nv_bfloat16;

struct AddNorm {
  const float* x;       // the row of the residual read (fp32 [D]: x_resid[RESID_IN])
  float* x_out;         // the row of the residual written (x_resid[GAMMA])
  const float* parts0;  // first partial set: parts0 + s * stride0, s < n0 (may be null)
  int64_t stride0;
  int n0;
  const float* parts1;  // second partial set (FFN) after the first
  int64_t stride1;
  int n1;
  const bf16* gamma;    // [D]
  bf16* out;            // the row of x_norm[GAMMA] (bf16), element i at out[i - lo]
  // the output elements written: [lo, hi) (a NORM_IN tile stages its K range
  // in shared memory; the norm task writes all D); with x_out null the
  // residual is not written (a NORM_IN tile; rows of one pass only)
  int lo = 0, hi = 0;
  int D;
  float eps;
  // ADD_MOE: where the row's experts are (in shared memory, written by
  // thread 0 before the call: one register here, not four live across the
  // partials' loads: the kernel is at its 255); null: none
  const struct MoeRow* moe = nullptr;
};

// The layer's expert outputs (moe_out_t [slots, D]: moe_out.cuh) and the
// row's k routed slots and scores.
struct MoeRow {
  const moe_out_t* y;
  const int32_t* slot;
  const float* w;
  int k;
#if MEGAC_SLOTS_EARLY
  int pre;  // the slots and scores are in rs / rw already (ops_norm.cuh slots_early: a timing probe)
#endif
};

// ADD_MOE: the row's slots and scores, loaded by threads q < k into
// registers first (`load`, before the planes' loads: their round trip
// overlaps the planes'), then shared with the CTA (`share`, after the
// planes' loads are issued) at rs / rw. Both norm forms take this order.
struct MoeSlots {
  int32_t slot = 0;
  float w = 0.f;
  __device__ __forceinline__ void load(const MoeRow* m) {
    if (m != nullptr) {
      __syncthreads();  // thread 0's MoeRow (written before the call) in view
#if MEGAC_SLOTS_EARLY
      if (m->pre) return;
#endif
      if (int(threadIdx.x) < m->k) {
        slot = __ldcg(m->slot + threadIdx.x);
        w = __ldcg(m->w + threadIdx.x);
      }
    }
  }
  __device__ __forceinline__ void share(const MoeRow& m, int32_t* rs, float* rw) const {
    if (int(threadIdx.x) < m.k) {
      rs[threadIdx.x] = slot;
      rw[threadIdx.x] = w;
    }
    __syncthreads();
  }
};

// Elements a thread sums at once, and partial sets whose loads are issued
// together before the first add: the partials come from other SMs through
// L2, and each round of loads costs a loaded L2 round trip on every layer's
// critical path (one element at a time: ~10 us per task; one set at a
// time: ~7 us).
constexpr int kNormBatch = 8;
constexpr int kSetsAtOnce = 8;

// Experts a norm sums at most (MOE_COMBINE inside it: the row's top k), and
// expert outputs a thread loads at once per element: all of them, so the
// combine costs one L2 round trip after the partials' (two rounds of four
// cost a round trip more on every layer's critical path; the partials'
// registers are dead by then, so the 64 loads in flight do not spill).
constexpr int kMoeMaxK = 8;
constexpr int kMoeAtOnce = 8;

// MOE_COMBINE's sum of elements i0 + j * blockDim.x (j < kNormBatch) of the
// row, into acc: w0 * y0, then + wq * yq in k order, product and sum rounded
// apart (moe::weighted_add's arithmetic, so the same bits as the task). The
// row's slots and scores are in shared memory (rs, rw).
__device__ __forceinline__ void moe_sum(const AddNorm& a, const MoeRow& m, const int32_t* rs, const float* rw,
                                        int i0, float (&acc)[kNormBatch]) {
#pragma unroll
  for (int q0 = 0; q0 < kMoeMaxK; q0 += kMoeAtOnce) {
    if (q0 >= m.k) break;
    float u[kMoeAtOnce][kNormBatch];
#pragma unroll
    for (int q = 0; q < kMoeAtOnce; ++q)
#pragma unroll
      for (int j = 0; j < kNormBatch; ++j) {
        const int i = i0 + j * blockDim.x;
        u[q][j] = (q0 + q < m.k && i < a.D) ? ld_moe_out(m.y + int64_t(rs[q0 + q]) * a.D + i) : 0.f;
      }
#pragma unroll
    for (int q = 0; q < kMoeAtOnce; ++q)
      if (q0 + q < m.k) {
        const float w = rw[q0 + q];
#pragma unroll
        for (int j = 0; j < kNormBatch; ++j) {
          const float p = __fmul_rn(w, u[q][j]);
          acc[j] = q0 + q == 0 ? p : __fadd_rn(acc[j], p);
        }
      }
  }
}

// Partial set s (< n0 + n1) of the row: parts0 sets, then parts1 sets.
__device__ __forceinline__ const float* norm_set(const AddNorm& a, int s) {
  return s < a.n0 ? a.parts0 + s * a.stride0 : a.parts1 + (s - a.n0) * a.stride1;
}

// The row's partial sets added to this thread's elements `v`, each set in
// index order (one rounding per add, as the VM adds): element j is unit
// first + j * blockDim.x of a plane seen as T (float: add_rmsnorm; float4:
// add_rmsnorm_vec), present where below n; kSetsAtOnce sets' loads are
// issued together before their adds.
__device__ __forceinline__ float add_rn(float x, float y) { return __fadd_rn(x, y); }
__device__ __forceinline__ float4 add_rn(float4 x, float4 y) {
  return make_float4(__fadd_rn(x.x, y.x), __fadd_rn(x.y, y.y), __fadd_rn(x.z, y.z), __fadd_rn(x.w, y.w));
}

template <class T, int N>
__device__ __forceinline__ void add_sets(const AddNorm& a, int nsets, int first, int n, T (&v)[N]) {
  for (int s0 = 0; s0 < nsets; s0 += kSetsAtOnce) {
    T p[kSetsAtOnce][N];
#pragma unroll
    for (int s = 0; s < kSetsAtOnce; ++s) {
      const T* src = s0 + s < nsets ? reinterpret_cast<const T*>(norm_set(a, s0 + s)) : nullptr;
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const int u = first + j * blockDim.x;
        p[s][j] = (src != nullptr && u < n) ? __ldcg(src + u) : T{};
      }
    }
#pragma unroll
    for (int s = 0; s < kSetsAtOnce; ++s)
      if (s0 + s < nsets) {
#pragma unroll
        for (int j = 0; j < N; ++j) v[j] = add_rn(v[j], p[s][j]);
      }
  }
}

// 1 / rms of the row from each thread's sum of squares `ss`: warps, then
// the warp sums in warp order (a fixed tree). `red`: 33 floats of shared
// memory. Whole CTA.
__device__ __forceinline__ float inv_rms(const AddNorm& a, float ss, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if (lane == 0) red[warp] = ss;
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = 0.f;
    for (int w = 0; w < nwarps; ++w) t += red[w];
    red[32] = rsqrtf(t / float(a.D) + a.eps);
  }
  __syncthreads();
  MEGAC_MARK(1);  // the row's 1 / rms known to the CTA
  return red[32];
}

// `red` is 33 floats of shared memory (one per warp, up to 32 warps, and the
// scale), and with ADD_MOE 2 * kMoeMaxK words more from red + 64 (a.moe
// points past them).
__device__ __forceinline__ void add_rmsnorm(const AddNorm& a, float* red) {
  const int nsets = a.n0 + a.n1;
  // a row of at most kNormBatch elements per thread stays in registers, and
  // its gamma loads go out with the first loads
  const bool one_pass = a.D <= kNormBatch * int(blockDim.x);
  float v[kNormBatch], g[kNormBatch];
  if (one_pass) {
#pragma unroll
    for (int j = 0; j < kNormBatch; ++j) {
      const int i = threadIdx.x + j * blockDim.x;
      g[j] = i < a.D ? __bfloat162float(a.gamma[i]) : 0.f;
    }
  }
  // ADD_MOE: the row's slots and scores (MoeSlots: loaded now, shared on the first pass)
  int32_t* rs = reinterpret_cast<int32_t*>(red + 64);
  float* rw = red + 64 + kMoeMaxK;
  MoeSlots ms;
  ms.load(a.moe);
  float ss = 0.f;
  // per element the same adds in the same order as one at a time:
  // x, then parts0[0..n0), then parts1[0..n1); ss over elements in index order
  for (int i0 = threadIdx.x; i0 < a.D; i0 += kNormBatch * blockDim.x) {
#pragma unroll
    for (int j = 0; j < kNormBatch; ++j) {
      const int i = i0 + j * blockDim.x;
      v[j] = i < a.D ? __ldcg(a.x + i) : 0.f;
    }
    add_sets(a, nsets, i0, a.D, v);
    if (a.moe != nullptr) {  // MOE_COMBINE's plane, the last one added
      const MoeRow& m = *a.moe;
      if (i0 == int(threadIdx.x)) ms.share(m, rs, rw);  // first pass: the slots and scores to the CTA
      float acc[kNormBatch];
      moe_sum(a, m, rs, rw, i0, acc);
#pragma unroll
      for (int j = 0; j < kNormBatch; ++j) v[j] = __fadd_rn(v[j], acc[j]);
    }
#pragma unroll
    for (int j = 0; j < kNormBatch; ++j) {
      const int i = i0 + j * blockDim.x;
      if (i < a.D) {
        if (a.x_out != nullptr) a.x_out[i] = v[j];
        ss = fmaf(v[j], v[j], ss);
      }
    }
  }
  MEGAC_MARK(0);  // thread 0's loads and adds done
  const float r = inv_rms(a, ss, red);
  if (one_pass) {
#pragma unroll
    for (int j = 0; j < kNormBatch; ++j) {
      const int i = threadIdx.x + j * blockDim.x;
      if (i >= a.lo && i < a.hi) {
        const float y = __bfloat162float(__float2bfloat16_rn(v[j] * r));
        a.out[i - a.lo] = __float2bfloat16_rn(g[j] * y);
      }
    }
  } else {
    for (int i = threadIdx.x; i < a.D; i += blockDim.x) {
      const float y = __bfloat162float(__float2bfloat16_rn(a.x_out[i] * r));
      if (i >= a.lo && i < a.hi) a.out[i - a.lo] = __float2bfloat16_rn(__bfloat162float(a.gamma[i]) * y);
    }
  }
  __syncthreads();
}


// The QKV tile that folds the MoE combine with its norm (MEGAC_QKV_COMBINE,
// ops_gemm.cuh) adds the row's expert outputs in the vector form below, so
// that it and the norm task (whose FFN partial is MOE_COMBINE's sum) take
// one path: the same sum of squares, the same bits. 0 (a build without the
// tile): the vector form refuses ADD_MOE, the code from before it.
#ifndef MEGAC_QKV_COMBINE
#define MEGAC_QKV_COMBINE 0
#endif
// The up claims that fold their norm with the combine (MEGAC_UP_COMBINE,
// ops_gemm.cuh) stage it through the same path.
#ifndef MEGAC_UP_COMBINE
#define MEGAC_UP_COMBINE 0
#endif
// a fold that adds the experts is built (the vector form's ADD_MOE, NormIn::moe)
#define MEGAC_FOLD_MOE (MEGAC_QKV_COMBINE || MEGAC_UP_COMBINE)

// ADD_RMSNORM's vector form (MEGAC_NORM_VEC, ops_norm.cuh; rows whose D is
// a multiple of 4 and at most kNormBatch per thread, without ADD_MOE unless
// MEGAC_FOLD_MOE):
// each thread owns kNormBatch / 4 runs of 4 consecutive elements and moves
// them as float4 (the planes) and 4 x bf16 (gamma, the output). Why: the
// norm's 48 KB of planes take 3.2 us through 32-bit loads, ~15 GB/s (one
// request per 128 bytes a warp), where MOE_COMBINE's float4 loads read its
// 64 KB in ~1.5 us. The same adds per element in the same order; the sum of
// squares runs over each thread's elements in its own order, so its bits
// may differ from add_rmsnorm's by the order of that sum (a few ulp of the
// scale, as against the VM).
constexpr int kNormVecRuns = kNormBatch / 4;

// MEGAC_FOLD_MARKS (profile builds only; VARIANTS fold_marks): stamps inside
// a fold, where the fifty-second session's traces left ~1.2 us of a QKV
// tile's fold unexplained (~2.7 us profiled against ~1.5 us for the same
// bytes in one round, fold_l2 block): 8 stage_norm_in's entry, 6 the
// slots' loads out, 9 the residual and partials summed, 11 the slots
// shared, then 0 as before. Marks 6, 8, 9, 11 are unused by these tasks.
#ifndef MEGAC_FOLD_MARKS
#define MEGAC_FOLD_MARKS 0
#endif
#if MEGAC_FOLD_MARKS
#define MEGAC_FOLD_MARK(i) MEGAC_MARK(i)
#define MEGAC_FOLD_MARK_AFTER(i, v) MEGAC_MARK_AFTER(i, v)
#else
#define MEGAC_FOLD_MARK(i) ((void)0)
#define MEGAC_FOLD_MARK_AFTER(i, v) ((void)0)
#endif

__device__ __forceinline__ bool vec_fits(const AddNorm& a) {
  return (MEGAC_FOLD_MOE || a.moe == nullptr) && a.D % 4 == 0 && a.D <= kNormBatch * int(blockDim.x);
}

// A TIMING PROBE, not a candidate (its sums are wrong): the vector form's
// folds (a QKV tile's, the norm task's) load half of the partial sets and
// half of the row's expert rows, the rest read as zero: the bytes a fold
// would load if the O-projection's partials and the experts' outputs were
// bf16 planes instead of fp32 (~60 of ~104 KB a fold). Measures what
// halving the fold's planes is worth on the two chain heads before the
// bf16 planes (a change of moe_out's and o_part's dtype in the ABI, the VM
// and every reader) are built. 0: off.
#ifndef MEGAC_PROBE_FOLD_HALF
#define MEGAC_PROBE_FOLD_HALF 0
#endif
// the partial sets / expert rows of n a probed fold loads
__device__ __forceinline__ int fold_loaded(int n) { return MEGAC_PROBE_FOLD_HALF ? (n + 1) / 2 : n; }

#if MEGAC_FOLD_MOE
// The row's expert outputs of this thread's runs into u: every expert's
// loads out at once (one L2 round trip). The row's slots in shared memory (rs).
__device__ __forceinline__ void moe_load_vec(const AddNorm& a, const MoeRow& m, const int32_t* rs,
                                             float4 (&u)[kMoeMaxK][kNormVecRuns]) {
  const int n4 = a.D / 4;
#pragma unroll
  for (int q = 0; q < kMoeMaxK; ++q)
#pragma unroll
    for (int j = 0; j < kNormVecRuns; ++j) {
      const int c = threadIdx.x + j * blockDim.x;
      u[q][j] = (q < fold_loaded(m.k) && c < n4) ? ld4_moe_out(m.y + int64_t(rs[q]) * a.D, c)
                                    : make_float4(0.f, 0.f, 0.f, 0.f);
    }
}

// MOE_COMBINE's sum of the loaded outputs u (moe_sum's arithmetic per
// element: w0 * y0, then + wq * yq in k order, product and sum rounded
// apart) added to v, the last plane. The row's scores in shared memory (rw).
__device__ __forceinline__ void moe_sum_vec(const MoeRow& m, const float* rw, const float4 (&u)[kMoeMaxK][kNormVecRuns],
                                            float4 (&v)[kNormVecRuns]) {
  float4 acc[kNormVecRuns];
#pragma unroll
  for (int q = 0; q < kMoeMaxK; ++q)
    if (q < m.k) {
      const float w = rw[q];
#pragma unroll
      for (int j = 0; j < kNormVecRuns; ++j) {
        const float4 p = make_float4(__fmul_rn(w, u[q][j].x), __fmul_rn(w, u[q][j].y), __fmul_rn(w, u[q][j].z),
                                     __fmul_rn(w, u[q][j].w));
        acc[j] = q == 0 ? p : add_rn(acc[j], p);
      }
    }
#pragma unroll
  for (int j = 0; j < kNormVecRuns; ++j) v[j] = add_rn(v[j], acc[j]);
}

// Both, after the other planes' adds (slots and scores in rs, rw).
__device__ __forceinline__ void moe_add_vec(const AddNorm& a, const MoeRow& m, const int32_t* rs, const float* rw,
                                            float4 (&v)[kNormVecRuns]) {
  float4 u[kMoeMaxK][kNormVecRuns];
  moe_load_vec(a, m, rs, u);
  moe_sum_vec(m, rw, u, v);
}
#endif

// This thread's runs of gamma and of the row's residual plus its partial
// sets (add_sets' order), the vector form's planes before the experts.
__device__ __forceinline__ void load_planes(const AddNorm& a, int nsets, uint2 (&g)[kNormVecRuns],
                                            float4 (&v)[kNormVecRuns]) {
  const int n4 = a.D / 4;
#pragma unroll
  for (int j = 0; j < kNormVecRuns; ++j) {
    const int c = threadIdx.x + j * blockDim.x;
    g[j] = c < n4 ? __ldg(reinterpret_cast<const uint2*>(a.gamma) + c) : make_uint2(0u, 0u);
    v[j] = c < n4 ? __ldcg(reinterpret_cast<const float4*>(a.x) + c) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  add_sets(a, fold_loaded(nsets), int(threadIdx.x), n4, v);
}

__device__ __forceinline__ void add_rmsnorm_vec(const AddNorm& a, float* red) {
  const int nsets = a.n0 + a.n1;
  const int n4 = a.D / 4;
  float4 v[kNormVecRuns];
  uint2 g[kNormVecRuns];  // 4 bf16 of gamma per run
#if MEGAC_FOLD_MOE
  // ADD_MOE: the row's slots and scores (MoeSlots, add_rmsnorm's order of events)
  int32_t* rs = reinterpret_cast<int32_t*>(red + 64);
  float* rw = red + 64 + kMoeMaxK;
  MoeSlots ms;
  ms.load(a.moe);
#endif
#if MEGAC_SLOTS_EARLY && MEGAC_FOLD_MOE
  if (a.moe != nullptr && a.moe->pre) {
    // the slots are in rs / rw (slots_early, a timing probe): the experts'
    // rows go out first, with the residual's and the partials' loads, one
    // round trip; their weighted sum is added last, as moe_add_vec adds it
    float4 u[kMoeMaxK][kNormVecRuns];
    moe_load_vec(a, *a.moe, rs, u);
    load_planes(a, nsets, g, v);
    moe_sum_vec(*a.moe, rw, u, v);
  } else
#endif
  {
    MEGAC_FOLD_MARK(6);  // ms.load's barrier passed, the slots' loads out
    load_planes(a, nsets, g, v);
    MEGAC_FOLD_MARK_AFTER(9, v[0].x);  // thread 0's residual and partials summed
#if MEGAC_FOLD_MOE
    if (a.moe != nullptr) {  // MOE_COMBINE's plane, the last one added
      ms.share(*a.moe, rs, rw);
      MEGAC_FOLD_MARK(11);  // the slots shared (their barrier passed)
      moe_add_vec(a, *a.moe, rs, rw, v);
    }
#endif
  }
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < kNormVecRuns; ++j) {
    const int c = threadIdx.x + j * blockDim.x;
    if (c < n4) {
      if (a.x_out != nullptr) reinterpret_cast<float4*>(a.x_out)[c] = v[j];
      ss = fmaf(v[j].x, v[j].x, ss);
      ss = fmaf(v[j].y, v[j].y, ss);
      ss = fmaf(v[j].z, v[j].z, ss);
      ss = fmaf(v[j].w, v[j].w, ss);
    }
  }
  MEGAC_MARK(0);  // thread 0's loads and adds done
  const float r = inv_rms(a, ss, red);
#pragma unroll
  for (int j = 0; j < kNormVecRuns; ++j) {
    const int c = threadIdx.x + j * blockDim.x;
    if (4 * c >= a.lo && 4 * c < a.hi) {  // lo, hi: multiples of 4
      const float x4[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
      const bf16* g4 = reinterpret_cast<const bf16*>(&g[j]);
      bf16 o4[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float y = __bfloat162float(__float2bfloat16_rn(x4[e] * r));
        o4[e] = __float2bfloat16_rn(__bfloat162float(g4[e]) * y);
      }
      reinterpret_cast<uint2*>(a.out)[c - a.lo / 4] = *reinterpret_cast<const uint2*>(o4);
    }
  }
  __syncthreads();
}

}  // namespace norm
}  // namespace megac

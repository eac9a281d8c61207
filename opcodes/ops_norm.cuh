// Device side of ADD_RMSNORM (megac/ops/norm.py) through norm.cuh: the row's
// residual plus the O-proj partials (ADD_ATTN) and the FFN partials
// (ADD_FFN), each set in index order, or the row's expert outputs
// score-weighted in k order (ADD_MOE: MOE_COMBINE's sum), then RMSNorm with
// gamma GAMMA into x_norm[GAMMA].
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "mk_core.cuh"
#include "mk_layout.cuh"
#include "norm.cuh"

// ADD_RMSNORM's gamma row toward L2 before the task's waits (norm_warm).
// The profile has the norm's loads and adds done 3.4 us after its waits
// (twelfth session, NMC bs1): its inputs come from L2, but gamma, a weight
// read once a step, comes from HBM, behind the weight streams' queues.
#ifndef MEGAC_NORM_WARM
#define MEGAC_NORM_WARM 0
#endif

// 1: rows without ADD_MOE through norm::add_rmsnorm_vec (float4 loads of
// the planes); 0: add_rmsnorm's 32-bit loads. H200, North Mini Code, kernel
// ms against 32-bit loads (nineteenth session, check variants): bs1 8K
// -1.6 %, bs8 8K -0.5 %, bs4 32K -2.4 %, bs8 32K -0.6 %.
#ifndef MEGAC_NORM_VEC
#define MEGAC_NORM_VEC 1
#endif

// 1: the residual form of COMBINE_IN (a router tile where no fold applies:
// every router of a router_combine model past one row) loads an element's
// rows together before it stores them (stage_combine_in). 0: row by row.
// Why: the forty-sixth session's H200 run had the router_combine default
// +1.6 % against the one before at batch 8 (8.541 / 8.407 ms, medians of
// 8 / 7 engines alternating), where the only tile that changes is this
// one's staging (8 rows, fp32 residual instead of bf16 x_norm) and the
// finalize's 1 / rms; row by row a thread's next load waited behind its
// store to xs (~8 L2 round trips for 8 rows). The same bits either way.
// Measured (H100, forty-sixth session, engines alternating, NMC 8K): bs8
// -0.24 % against the default (11.1238 / 11.1502 ms, 6 / 7 engines; the same
// bits, so the same experts), bs1 even (+0.04 % median, -0.25 % mean). norc's
// 11.0536 is no gap to close: its other bits route to other experts, 0.9 %
// fewer expert bytes at bs8 (forty-seventh session's profiles).
#ifndef MEGAC_RESID_BATCH
#define MEGAC_RESID_BATCH 0
#endif

namespace megac {
namespace mk {

// Warp 0 (`lane` of 32), from an ADD_RMSNORM task's words `w` before its
// waits: every 128-byte line of its gamma row toward L2, kept there
// (evict_last) until the loads after the waits. A plain prefetch per lane,
// not a bulk one: the SM's copy engine stays free for the GEMMs it primes.
template <class M>
__device__ __forceinline__ void norm_warm(const Ctx& c, const int32_t* w, int lane) {
#if MEGAC_NORM_WARM
  using Lay = Layout<M>;
  const char* g = reinterpret_cast<const char*>(ptr<const __nv_bfloat16>(c.d->w_norm) +
                                                Lay::w_norm(w[f_add_rmsnorm::GAMMA]));
  const char* end = g + M::HIDDEN * 2;
  const char* line = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(g) & ~uintptr_t(127));
  for (const char* p = line + lane * 128; p < end; p += 32 * 128)
    asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(p));
#endif
}

// A norm's planes for row `row`: the residual slot `resid`, `n_attn`
// O-proj and `n_ffn` FFN partial sets of layer `layer`, gamma of norm slot
// `gamma`. The caller says where the output goes (out, lo, hi) and whether
// the residual is written (x_out).
template <class M>
__device__ __forceinline__ norm::AddNorm norm_planes(const LaunchDesc* d, int layer, int row, int resid, int n_attn,
                                                     int n_ffn, int gamma) {
  using Lay = Layout<M>;
  norm::AddNorm a;
  a.x = ptr<const float>(d->x_resid) + Lay::x_resid(resid, row);
  a.x_out = nullptr;
  a.parts0 = ptr<const float>(d->o_part) + Lay::o_part(layer, 0, row);
  a.stride0 = Lay::o_part(0, 1, 0);
  a.n0 = n_attn;
  a.parts1 = ptr<const float>(d->ffn_part) + Lay::ffn_part(layer, 0, row);
  a.stride1 = Lay::ffn_part(0, 1, 0);
  a.n1 = n_ffn;
  a.gamma = ptr<const __nv_bfloat16>(d->w_norm) + Lay::w_norm(gamma);
  a.D = M::HIDDEN;
  a.eps = d->norm_eps;
  return a;
}

// One norm through the form this build uses: the float4 form where the row
// fits it (MEGAC_NORM_VEC), else the 32-bit one. The norm task and a NORM_IN
// tile both come here, so they take the same path and write the same bits.
__device__ __forceinline__ void run_norm(const norm::AddNorm& a, float* red) {
#if MEGAC_NORM_VEC
  if (norm::vec_fits(a)) {
    norm::add_rmsnorm_vec(a, red);
    return;
  }
#endif
  norm::add_rmsnorm(a, red);
}

template <class M>
__device__ __forceinline__ void add_rmsnorm(const Ctx& c) {
  using Lay = Layout<M>;
  const LaunchDesc* d = c.d;
  const int layer = c.ts->w[H_LAYER], flags = c.ts->w[H_FLAGS];
  const int row = c.ts->w[f_add_rmsnorm::ROW], gamma = c.ts->w[f_add_rmsnorm::GAMMA];
  norm::AddNorm a = norm_planes<M>(d, layer, row, c.ts->w[f_add_rmsnorm::RESID_IN],
                                   (flags & FLAG_ADD_ATTN) ? c.ts->w[f_add_rmsnorm::ATTN_SPLITS] : 0,
                                   (flags & FLAG_ADD_FFN) ? c.ts->w[f_add_rmsnorm::FFN_SPLITS] : 0, gamma);
  a.x_out = ptr<float>(d->x_resid) + Lay::x_resid(gamma, row);
  a.out = ptr<__nv_bfloat16>(d->x_norm) + Lay::x_norm(gamma, row);
#if MEGAC_UP_COMBINE
  a.hi = (flags & FLAG_RESID_ONLY) ? 0 : M::HIDDEN;  // RESID_ONLY: no output element (its readers fold it)
#else
  a.hi = M::HIDDEN;
#endif
  float* red = reinterpret_cast<float*>(c.scratch);
  if constexpr (M::NUM_EXPERTS > 0) {
    if (flags & FLAG_ADD_MOE) {  // MOE_COMBINE's sum here (fused_combine)
      static_assert(M::TOP_K <= norm::kMoeMaxK, "the norm sums at most kMoeMaxK experts");
      norm::MoeRow* m = reinterpret_cast<norm::MoeRow*>(red + 64 + 2 * norm::kMoeMaxK);
      if (threadIdx.x == 0) {
        m->y = ptr<const moe_out_t>(d->moe_out) + Lay::moe_out(layer, 0);  // tile 0 (fused_combine: no split_down)
        m->slot = ptr<const int32_t>(d->route_slot) + Lay::topk(layer, row);
        m->w = ptr<const float>(d->topk_w) + Lay::topk(layer, row);
        m->k = M::TOP_K;
#if MEGAC_SLOTS_EARLY
        m->pre = 0;
#endif
      }
      a.moe = m;
    }
  }
  run_norm(a, red);
}

// NORM_IN (abi.py's _NORM_IN fields): a GEMM tile that folds the norm
// writing x_norm slot `slot` stages that norm's output itself: per row m <
// rows, the norm's planes (residual slot `resid`, `n_attn` O-proj and
// `n_ffn` FFN partial sets of layer `layer`) added and normalised by the
// norm task's own code path (so the same bits), elements [k0, k0 + klen)
// to xs + m * pitch; the residual is not written (the norm task does).
struct NormIn {
  int layer, n_attn, n_ffn, resid, slot, k0;
#if MEGAC_ROUTER_COMBINE
  // COMBINE_IN (a ROUTER_GEMM tile): stage_combine_in stages the tile's
  // input from the same fields instead of the norm
  bool combine = false;
#endif
#if MEGAC_FOLD_MOE
  // NORM_IN with ADD_MOE (a QKV_PROJ tile or a routed up claim, abi.py's
  // _NORM_IN): the folded norm adds layer `layer`'s expert outputs itself
  // (MOE_COMBINE's sum, as the norm task's ADD_MOE adds it) instead of an
  // FFN partial (n_ffn 0)
  bool moe = false;
#endif
};

#if MEGAC_ROUTER_COMBINE
// COMBINE_IN (abi.py's _COMBINE_IN): a ROUTER_GEMM tile that folds the MoE
// combine of layer f.layer stages, per row m < rows and element i of
// [k0, k0 + klen), bf16(gamma[i] * x) to xs + m * pitch + i - k0, x the new
// residual: residual slot f.resid, plus the f.n_attn O-proj partial sets in
// index order, plus MOE_COMBINE's sum of the row (w_0 * y_0, then + w_j *
// y_j in k order, product and sum rounded apart: norm::moe_sum's
// arithmetic), each add rounded once: ADD_RMSNORM's adds with ADD_MOE, in
// its order, so x has the bits of the residual the norm task writes. gamma:
// norm slot f.slot. Not normalised: a range needs no other range, so the
// tile waits on no norm (the finalize scales the weights by 1 / rms). Only
// the K range's elements are loaded. NORM_LAYER -1 (f.layer < 0: the
// residual form, where no fold applies): x is residual slot f.resid as the
// norm task wrote it, the same bits. f.n_ffn is not read (0 under
// COMBINE_IN: the combine is the FFN's output); at most KV_HEADS partial
// sets (o_part holds no more).
//
// Two dependent L2 round trips for an element: the rows' slots and scores
// (entry e = m * TOP_K + j on thread e, both loads out at once), then,
// after the barrier that shares them, the element's residual, partials,
// gamma and K expert rows together (the SASS issues them as one batch). A
// thread takes the elements m * klen + tid, + THREADS, ...: one at North
// Mini Code's folded batch 1 (K ranges of 256); each further one is a round
// trip more. The simpler shapes tried first (the slots kept in registers
// across the residual's loads, the elements kNormBatch a thread in arrays,
// the expert rows in an array) tipped the megakernel, at its 255
// registers, into spills elsewhere (the attention's MMA loop); this one
// builds North Mini Code's batch-1 kernel without (its batch 1 and 8
// kernel keeps one pointer of the dispatch loop in local memory, 8 bytes
// read once a task). Whole CTA, ends with a barrier (stage_norm_in's
// contract). `red`: 2 * MAX_ROWS * TOP_K shared words free while staging
// (the tile's ys: ops_gemm.cuh router_gemm checks). f by value: a pointer
// would put it in local memory. Checked on an H100 (forty-fourth session):
// the tiny models' one-row steps against the VM, the one-row NMC slice
// against fp32 (min cosine 0.99997, top-1 1.0).
template <class M>
__device__ __forceinline__ void stage_combine_in(const Ctx& c, const NormIn f, int rows, int klen, __nv_bfloat16* xs,
                                                 int pitch, float* red) {
  if constexpr (M::NUM_EXPERTS > 0) {
    using Lay = Layout<M>;
    constexpr int K = M::TOP_K, D = M::HIDDEN;
    constexpr int ld = M::MOE_OUT_TILES * D;  // a slot's row of moe_out; tile 0 (no split_down)
    static_assert(K >= 1 && K <= norm::kMoeMaxK, "the combine sums 1..kMoeMaxK experts");
    const LaunchDesc* d = c.d;
    if (f.layer < 0) {  // the residual form (NORM_LAYER -1): x is the residual slot as the norm wrote it
      const float* xr = ptr<const float>(d->x_resid) + Lay::x_resid(f.resid, 0) + f.k0;
      const __nv_bfloat16* gamma = ptr<const __nv_bfloat16>(d->w_norm) + Lay::w_norm(f.slot) + f.k0;
#if MEGAC_RESID_BATCH
      // four elements a thread (16-byte loads), two rows at once (both
      // loads out before either store): where the K range splits the CTA
      // into whole rows of threads (North Mini Code: 64 a row, 4 rows a
      // pass), else the scalar loop below
      const int q = klen >> 2;
      if ((klen & 3) == 0 && (pitch & 3) == 0 && (f.k0 & 3) == 0 && q > 0 && blockDim.x % q == 0) {
        const int t = (threadIdx.x % q) * 4, step = blockDim.x / q;
        const uint2 gw = *reinterpret_cast<const uint2*>(gamma + t);  // its 4 gammas
        const __nv_bfloat162 g01 = *reinterpret_cast<const __nv_bfloat162*>(&gw.x);
        const __nv_bfloat162 g23 = *reinterpret_cast<const __nv_bfloat162*>(&gw.y);
        const float g0 = __low2float(g01), g1 = __high2float(g01), g2 = __low2float(g23), g3 = __high2float(g23);
        auto put = [&](int m, const float4 v) {
          uint2 o;
          __nv_bfloat162 a = __floats2bfloat162_rn(__fmul_rn(g0, v.x), __fmul_rn(g1, v.y));
          __nv_bfloat162 b = __floats2bfloat162_rn(__fmul_rn(g2, v.z), __fmul_rn(g3, v.w));
          o.x = *reinterpret_cast<uint32_t*>(&a);
          o.y = *reinterpret_cast<uint32_t*>(&b);
          *reinterpret_cast<uint2*>(xs + m * pitch + t) = o;
        };
        for (int m = threadIdx.x / q; m < rows; m += 2 * step) {
          const float4 a = __ldcg(reinterpret_cast<const float4*>(xr + m * D + t));
          const bool two = m + step < rows;
          float4 b;
          if (two) b = __ldcg(reinterpret_cast<const float4*>(xr + (m + step) * D + t));
          put(m, a);
          if (two) put(m + step, b);
        }
        __syncthreads();
        return;
      }
#endif
      for (int m = 0; m < rows; ++m)
        for (int t = threadIdx.x; t < klen; t += blockDim.x)
          xs[m * pitch + t] = __float2bfloat16_rn(__fmul_rn(__bfloat162float(gamma[t]), __ldcg(xr + m * D + t)));
      __syncthreads();
      return;
    }
    const int n = rows * K;
    int32_t* rs = reinterpret_cast<int32_t*>(red);  // [rows * K]: entry m * K + j
    float* rw = red + M::MAX_ROWS * K;              // [rows * K]
    // MEGAC_SLOTS_EARLY (a timing probe): at one row slots_early loaded them before the task's waits
    if (!(MEGAC_SLOTS_EARLY && rows == 1)) {
      // threadIdx.x and blockDim.x read where used: a local copy of them (or
      // a loop over the entries where one pass does) spilled the megakernel
      if constexpr (M::MAX_ROWS * K <= M::THREADS) {
        if (threadIdx.x < n) {  // both loads out before either store
          const int32_t slot = __ldcg(ptr<const int32_t>(d->route_slot) + Lay::topk(f.layer, 0) + threadIdx.x);
          const float w = __ldcg(ptr<const float>(d->topk_w) + Lay::topk(f.layer, 0) + threadIdx.x);
          rs[threadIdx.x] = slot;
          rw[threadIdx.x] = w;
        }
      } else {
        for (int e = threadIdx.x; e < n; e += blockDim.x) {
          const int32_t slot = __ldcg(ptr<const int32_t>(d->route_slot) + Lay::topk(f.layer, 0) + e);
          const float w = __ldcg(ptr<const float>(d->topk_w) + Lay::topk(f.layer, 0) + e);
          rs[e] = slot;
          rw[e] = w;
        }
      }
      __syncthreads();
    }
    const float* xr = ptr<const float>(d->x_resid) + Lay::x_resid(f.resid, 0) + f.k0;
    const float* pa = ptr<const float>(d->o_part) + Lay::o_part(f.layer, 0, 0) + f.k0;
    const moe_out_t* y = ptr<const moe_out_t>(d->moe_out) + Lay::moe_out(f.layer, 0) + f.k0;
    const __nv_bfloat16* gamma = ptr<const __nv_bfloat16>(d->w_norm) + Lay::w_norm(f.slot) + f.k0;
    for (int m = 0; m < rows; ++m)
      for (int t = threadIdx.x; t < klen; t += blockDim.x) {  // element k0 + t of row m
        float x = __ldcg(xr + m * D + t);
#pragma unroll
        for (int s = 0; s < M::KV_HEADS; ++s)
          if (s < f.n_attn) x = __fadd_rn(x, __ldcg(pa + s * int(Lay::o_part(0, 1, 0)) + m * D + t));
        float acc = __fmul_rn(rw[m * K], ld_moe_out(y + rs[m * K] * ld + t));
        for (int k = 1; k < K; ++k)
          acc = __fadd_rn(acc, __fmul_rn(rw[m * K + k], ld_moe_out(y + rs[m * K + k] * ld + t)));
        xs[m * pitch + t] = __float2bfloat16_rn(__fmul_rn(__bfloat162float(gamma[t]), __fadd_rn(x, acc)));
      }
    __syncthreads();
  } else {
    __trap();  // a dense model has no router
  }
}
#endif

// Whole CTA, ends with a barrier. `red`: shared floats free while staging
// (the tile's ys). Rows of one pass only (D <= kNormBatch per thread, which
// codegen's check_envelope demands of a schedule that folds).
template <class M>
__device__ __forceinline__ void stage_norm_in(const Ctx& c, const NormIn& f, int rows, int klen, __nv_bfloat16* xs,
                                              int pitch, float* red) {
#if MEGAC_ROUTER_COMBINE
  if (f.combine) {  // COMBINE_IN: the MoE combine folded instead of the norm
    stage_combine_in<M>(c, f, rows, klen, xs, pitch, red);
    return;
  }
#endif
  if constexpr (M::HIDDEN <= norm::kNormBatch * M::THREADS) {
    MEGAC_FOLD_MARK(8);  // the fold entered (norm.cuh MEGAC_FOLD_MARKS)
    for (int m = 0; m < rows; ++m) {
      norm::AddNorm a = norm_planes<M>(c.d, f.layer, m, f.resid, f.n_attn, f.n_ffn, f.slot);
#if MEGAC_FOLD_MOE
      if constexpr (M::NUM_EXPERTS > 0) {
        if (f.moe) {  // the row's experts (add_rmsnorm's ADD_MOE setup; run_norm's barrier ended the last row)
          static_assert(M::TOP_K <= norm::kMoeMaxK, "the norm sums at most kMoeMaxK experts");
          using Lay = Layout<M>;
          norm::MoeRow* e = reinterpret_cast<norm::MoeRow*>(red + 64 + 2 * norm::kMoeMaxK);
          if (threadIdx.x == 0) {
            e->y = ptr<const moe_out_t>(c.d->moe_out) + Lay::moe_out(f.layer, 0);  // tile 0 (no split_down)
            e->slot = ptr<const int32_t>(c.d->route_slot) + Lay::topk(f.layer, m);
            e->w = ptr<const float>(c.d->topk_w) + Lay::topk(f.layer, m);
            e->k = M::TOP_K;
#if MEGAC_SLOTS_EARLY
            e->pre = rows == 1 && f.layer >= 0;  // slots_early loaded row 0's before the waits
#endif
          }
          a.moe = e;
        }
      }
#endif
      a.out = xs + m * pitch;  // the residual is not written (x_out null)
      a.lo = f.k0;
      a.hi = f.k0 + klen;
      run_norm(a, red);
    }
  } else {
    __trap();  // refused at compile time (check_envelope)
  }
}

}  // namespace mk
}  // namespace megac

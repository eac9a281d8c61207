// ADD_RMSNORM for one row: the residual plus its partial sums, each set in
// index order (fp32, one rounding per add, as the VM adds), then RMSNorm:
// y = bf16(x * rsqrt(mean(x^2) + eps)), out = bf16(gamma * y).
//
// Whole CTA. The mean's sum runs over a fixed tree (per thread in index
// order, then warps, then the warp sums in warp order), so the bits do not
// depend on timing (they may differ from the VM's by the order of the
// sum: a few ulp of the scale).
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "profile_marks.cuh"

namespace megac {
namespace norm {

using bf16 = __nv_bfloat16;

struct AddNorm {
  float* x;             // the row of x_resid (fp32 [D]), read and rewritten
  const float* parts0;  // first partial set: parts0 + s * stride0, s < n0 (may be null)
  int64_t stride0;
  int n0;
  const float* parts1;  // second partial set (FFN) after the first
  int64_t stride1;
  int n1;
  const bf16* gamma;    // [D]
  bf16* out;            // the row of x_norm[GAMMA] (bf16 [D])
  int D;
  float eps;
};

// Elements a thread sums at once, and partial sets whose loads are issued
// together before the first add: the partials come from other SMs through
// L2, and each round of loads costs a loaded L2 round trip on every layer's
// critical path (one element at a time: ~10 us per task; one set at a
// time: ~7 us).
constexpr int kNormBatch = 8;
constexpr int kSetsAtOnce = 8;

// Partial set s (< n0 + n1) of the row: parts0 sets, then parts1 sets.
__device__ __forceinline__ const float* norm_set(const AddNorm& a, int s) {
  return s < a.n0 ? a.parts0 + s * a.stride0 : a.parts1 + (s - a.n0) * a.stride1;
}

// `red` is 33 floats of shared memory (one per warp, up to 32 warps, and the scale).
__device__ __forceinline__ void add_rmsnorm(const AddNorm& a, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
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
  float ss = 0.f;
  // per element the same adds in the same order as one at a time:
  // x, then parts0[0..n0), then parts1[0..n1); ss over elements in index order
  for (int i0 = threadIdx.x; i0 < a.D; i0 += kNormBatch * blockDim.x) {
#pragma unroll
    for (int j = 0; j < kNormBatch; ++j) {
      const int i = i0 + j * blockDim.x;
      v[j] = i < a.D ? __ldcg(a.x + i) : 0.f;
    }
    for (int s0 = 0; s0 < nsets; s0 += kSetsAtOnce) {
      float p[kSetsAtOnce][kNormBatch];
#pragma unroll
      for (int s = 0; s < kSetsAtOnce; ++s) {
        const float* src = s0 + s < nsets ? norm_set(a, s0 + s) : nullptr;
#pragma unroll
        for (int j = 0; j < kNormBatch; ++j) {
          const int i = i0 + j * blockDim.x;
          p[s][j] = (src != nullptr && i < a.D) ? __ldcg(src + i) : 0.f;
        }
      }
#pragma unroll
      for (int s = 0; s < kSetsAtOnce; ++s)
        if (s0 + s < nsets) {
#pragma unroll
          for (int j = 0; j < kNormBatch; ++j) v[j] = __fadd_rn(v[j], p[s][j]);
        }
    }
#pragma unroll
    for (int j = 0; j < kNormBatch; ++j) {
      const int i = i0 + j * blockDim.x;
      if (i < a.D) {
        a.x[i] = v[j];
        ss = fmaf(v[j], v[j], ss);
      }
    }
  }
  MEGAC_MARK(0);  // thread 0's loads and adds done
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
  const float r = red[32];
  if (one_pass) {
#pragma unroll
    for (int j = 0; j < kNormBatch; ++j) {
      const int i = threadIdx.x + j * blockDim.x;
      if (i < a.D) {
        const float y = __bfloat162float(__float2bfloat16_rn(v[j] * r));
        a.out[i] = __float2bfloat16_rn(g[j] * y);
      }
    }
  } else {
    for (int i = threadIdx.x; i < a.D; i += blockDim.x) {
      const float y = __bfloat162float(__float2bfloat16_rn(a.x[i] * r));
      a.out[i] = __float2bfloat16_rn(__bfloat162float(a.gamma[i]) * y);
    }
  }
  __syncthreads();
}

}  // namespace norm
}  // namespace megac

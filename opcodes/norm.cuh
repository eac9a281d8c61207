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

// Elements a thread sums at once: their loads of one partial are all in
// flight together (one element at a time left the norm, on every layer's
// critical path, at ~10 us of load latency per task).
constexpr int kNormBatch = 8;

// `red` is 33 floats of shared memory (one per warp, up to 32 warps, and the scale).
__device__ __forceinline__ void add_rmsnorm(const AddNorm& a, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  float ss = 0.f;
  // per element the same adds in the same order as one at a time:
  // x, then parts0[0..n0), then parts1[0..n1); ss over elements in index order
  for (int i0 = threadIdx.x; i0 < a.D; i0 += kNormBatch * blockDim.x) {
    float v[kNormBatch];
#pragma unroll
    for (int j = 0; j < kNormBatch; ++j) {
      const int i = i0 + j * blockDim.x;
      v[j] = i < a.D ? __ldcg(a.x + i) : 0.f;
    }
    for (int s = 0; s < a.n0; ++s) {
      float p[kNormBatch];
#pragma unroll
      for (int j = 0; j < kNormBatch; ++j) {
        const int i = i0 + j * blockDim.x;
        p[j] = i < a.D ? __ldcg(a.parts0 + s * a.stride0 + i) : 0.f;
      }
#pragma unroll
      for (int j = 0; j < kNormBatch; ++j) v[j] = __fadd_rn(v[j], p[j]);
    }
    for (int s = 0; s < a.n1; ++s) {
      float p[kNormBatch];
#pragma unroll
      for (int j = 0; j < kNormBatch; ++j) {
        const int i = i0 + j * blockDim.x;
        p[j] = i < a.D ? __ldcg(a.parts1 + s * a.stride1 + i) : 0.f;
      }
#pragma unroll
      for (int j = 0; j < kNormBatch; ++j) v[j] = __fadd_rn(v[j], p[j]);
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
  const float r = red[32];
  for (int i = threadIdx.x; i < a.D; i += blockDim.x) {
    const float y = __bfloat162float(__float2bfloat16_rn(a.x[i] * r));
    a.out[i] = __float2bfloat16_rn(__bfloat162float(a.gamma[i]) * y);
  }
  __syncthreads();
}

}  // namespace norm
}  // namespace megac

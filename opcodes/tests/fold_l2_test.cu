// How long a QKV tile's norm fold takes when many SMs fold at once: at the
// head of every batch-1 MoE layer ~88 tiles (80 QKV, 8 router) each pull the
// same ~104 KB from L2 (the residual, four O-projection partials, eight
// expert rows, fp32) and the profiled fold takes ~3 us (forty-seventh
// session's H100 stamps), where one L2 round trip is ~1 us. Is that the
// number of SMs reading the same lines at once (same), the L2's total
// traffic (private: each CTA its own copy, the same bytes in all), or
// neither (one CTA alone as slow)?
//
// One CTA per SM (256 threads). Active CTAs meet at a grid barrier on a
// global counter (bounded spin; the launch is cooperative, so all are
// resident), then each thread loads its kRuns float4 of every plane (into
// registers, as the megakernel's vector fold does in norm.cuh moe_load_vec /
// load_planes, or all out at once by cp.async), adds them in plane order and
// writes the sum to out[cta]; a CTA barrier, then its end time. `reps`
// rounds, a grid barrier before each;
// times[(rep * gridDim.x + cta) * 2 + {0, 1}] = {start, end} ns by the
// global timer (0 for an inactive CTA).
#include <cstdint>

#include "common.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kPlanes = 13;  // the residual, 4 O-projection partials, 8 expert rows
constexpr int kRuns = 2;     // float4 per thread per plane: D = 2048
constexpr int kAsyncSmem = kPlanes * kRuns * kThreads * 16;  // fold_l2_async's dynamic shared bytes

// All active CTAs arrive; true once `target` arrived (false: gave up, the
// host sees a zero time and fails the check).
__device__ bool grid_meet(int* gate, int target) {
  __shared__ int ok;
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(gate, 1);
    int spins = 0;
    while (atomicAdd(gate, 0) < target && ++spins < (1 << 22)) {
    }
    ok = spins < (1 << 22);  // ~4 s of L2 atomics at most
  }
  __syncthreads();
  return ok != 0;
}

}  // namespace

// One round of one CTA's fold: each thread's kRuns float4 of every plane,
// summed in plane order into out. kAsync: every load a cp.async into shared
// memory, all in flight before the first wait (the most the SM can have
// out); else __ldcg into registers, as the megakernel's fold loads (ptxas
// sums as they land: 36 registers, so not all 26 of a thread's loads are
// in flight at once).
// kRotate (with kAsync): CTA b issues its copies from plane b mod kPlanes on,
// so the SMs do not all ask for the same lines at the same moment; each
// lands in its plane's slot and the sum's order is unchanged (same bits).
template <bool kAsync, bool kRotate = false>
__device__ __forceinline__ void fold_round(const float4* src, float* out) {
  extern __shared__ __align__(16) float4 st[];  // kAsync: kAsyncSmem bytes (launched with them)
  float4 u[kPlanes][kRuns];
  if constexpr (kAsync) {
    int p = kRotate ? int(blockIdx.x % kPlanes) : 0;
#pragma unroll 1
    for (int i = 0; i < kPlanes; ++i, p = p + 1 == kPlanes ? 0 : p + 1)
#pragma unroll
      for (int j = 0; j < kRuns; ++j)
        megac::cp_async16(static_cast<uint32_t>(__cvta_generic_to_shared(&st[(p * kRuns + j) * kThreads + threadIdx.x])),
                          src + p * 512 + threadIdx.x + j * kThreads, 16);
    megac::cp_async_commit();
    megac::cp_async_wait<0>();
#pragma unroll
    for (int p = 0; p < kPlanes; ++p)
#pragma unroll
      for (int j = 0; j < kRuns; ++j) u[p][j] = st[(p * kRuns + j) * kThreads + threadIdx.x];
  } else {
#pragma unroll
    for (int p = 0; p < kPlanes; ++p)
#pragma unroll
      for (int j = 0; j < kRuns; ++j) u[p][j] = __ldcg(src + p * 512 + threadIdx.x + j * kThreads);
  }
#pragma unroll
  for (int j = 0; j < kRuns; ++j) {
    float4 acc = u[0][j];
#pragma unroll
    for (int p = 1; p < kPlanes; ++p) {
      acc.x += u[p][j].x;
      acc.y += u[p][j].y;
      acc.z += u[p][j].z;
      acc.w += u[p][j].w;
    }
    reinterpret_cast<float4*>(out)[threadIdx.x + j * kThreads] = acc;
  }
  __syncthreads();
}

// planes: [copies][kPlanes][2048] fp32; CTA b reads copy (private ? b : 0).
template <bool kAsync, bool kRotate>
__device__ __forceinline__ void fold_l2(const float* __restrict__ planes, int private_copies,
                                        const int32_t* __restrict__ active, int nactive, int reps,
                                        float* __restrict__ out, unsigned long long* __restrict__ times, int* gate) {
  const int b = blockIdx.x;
  if (!active[b]) return;
  const float4* src = reinterpret_cast<const float4*>(planes + int64_t(private_copies ? b : 0) * kPlanes * 2048);
  for (int rep = 0; rep < reps; ++rep) {
    if (!grid_meet(gate, nactive * (rep + 1))) return;
    const unsigned long long t0 = megac::globaltimer_ns();
    fold_round<kAsync, kRotate>(src, out + int64_t(b) * 2048);
    if (threadIdx.x == 0) {
      times[(int64_t(rep) * gridDim.x + b) * 2 + 0] = t0;
      times[(int64_t(rep) * gridDim.x + b) * 2 + 1] = megac::globaltimer_ns();
    }
  }
}

#define FOLD_L2(name, async, rotate)                                                                                      \
  extern "C" __global__ void __launch_bounds__(kThreads)                                                          \
      name(const float* planes, int private_copies, const int32_t* active, int nactive, int reps, float* out,     \
           unsigned long long* times, int* gate) {                                                                \
    fold_l2<async, rotate>(planes, private_copies, active, nactive, reps, out, times, gate);                              \
  }

FOLD_L2(fold_l2_regs, false, false)
FOLD_L2(fold_l2_async, true, false)
FOLD_L2(fold_l2_async_rot, true, true)

extern "C" __global__ void fold_l2_async_smem_bytes(int* out) { *out = kAsyncSmem; }

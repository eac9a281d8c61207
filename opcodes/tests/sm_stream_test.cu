// How fast one SM streams weights through the megakernel's per-warp rings
// (gemm_tc.cuh: each warp's lane 0 bulk-copies its own stages onto its own
// mbarriers, the warp reads a stage, hands the slot back and refills it) when
// only some SMs stream: the question behind a batch-1 MoE layer, where ~48 SMs
// stream the expert up tiles at ~55 GB/s each while the rest wait.
//
// One CTA per SM (8 warps). A CTA streams only where active[its %smid] is
// nonzero: `bytes` from its own region of `src` (region = blockIdx.x), one
// contiguous run per warp, and sums every 32-bit word it received so the host
// can check that every byte landed. times[blockIdx] = {smid, start ns, end ns,
// 0} by the global timer.
#include <cstdint>

#include "common.cuh"
#include "mbarrier.cuh"
#include "weight_stream.cuh"

namespace {

constexpr int kWarps = 8;

template <int kStages, int kStageBytes>
__device__ __forceinline__ void stream(const uint8_t* __restrict__ src, unsigned long long bytes,
                                       const int32_t* __restrict__ active,
                                       unsigned long long* __restrict__ sums,
                                       unsigned long long* __restrict__ times) {
  extern __shared__ __align__(1024) uint8_t smem[];
  __shared__ uint64_t bar[kWarps][kStages];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint32_t sm = megac::smid();
  if (!active[sm]) {
    if (threadIdx.x == 0) {
      times[4 * blockIdx.x + 0] = sm;
      times[4 * blockIdx.x + 1] = 0;
      times[4 * blockIdx.x + 2] = 0;
    }
    return;
  }
  if (threadIdx.x == 0) {
    for (int w = 0; w < kWarps; ++w)
      for (int s = 0; s < kStages; ++s) megac::mbar_init(&bar[w][s], 1);
    megac::mbar_init_fence();
  }
  __syncthreads();
  const unsigned long long t0 = megac::globaltimer_ns();
  const unsigned long long per_warp = bytes / kWarps;
  const uint8_t* mine = src + blockIdx.x * bytes + warp * per_warp;
  const int n = static_cast<int>(per_warp / kStageBytes);
  uint8_t* ring = smem + warp * kStages * kStageBytes;
  const uint64_t policy = megac::l2_evict_first_policy();
  if (lane == 0)
    for (int i = 0; i < kStages && i < n; ++i) {
      megac::mbar_arrive_expect_tx(&bar[warp][i], kStageBytes);
      megac::bulk_load_hint(ring + i * kStageBytes, mine + size_t(i) * kStageBytes, kStageBytes, &bar[warp][i], policy);
    }
  unsigned long long acc = 0;
  for (int i = 0; i < n; ++i) {
    const int slot = i % kStages;
    while (!megac::mbar_try_wait(&bar[warp][slot], (i / kStages) & 1u)) {
    }
    const uint4* st = reinterpret_cast<const uint4*>(ring + slot * kStageBytes);
#pragma unroll 4
    for (int v = lane; v < kStageBytes / 16; v += 32) {
      const uint4 x = st[v];
      acc += static_cast<unsigned long long>(x.x) + x.y + static_cast<unsigned long long>(x.z) + x.w;
    }
    __syncwarp();
    if (lane == 0 && i + kStages < n) {
      megac::mbar_arrive_expect_tx(&bar[warp][slot], kStageBytes);
      megac::bulk_load_hint(ring + slot * kStageBytes, mine + size_t(i + kStages) * kStageBytes, kStageBytes,
                            &bar[warp][slot], policy);
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  __syncthreads();
  if (lane == 0) atomicAdd(sums + blockIdx.x, acc);
  if (threadIdx.x == 0) {
    times[4 * blockIdx.x + 0] = sm;
    times[4 * blockIdx.x + 1] = t0;
    times[4 * blockIdx.x + 2] = megac::globaltimer_ns();
  }
}

}  // namespace

#define SM_STREAM(name, stages, stage_bytes)                                                                 \
  extern "C" __global__ void __launch_bounds__(256) name(const uint8_t* src, unsigned long long bytes,       \
                                                         const int32_t* active, unsigned long long* sums,    \
                                                         unsigned long long* times) {                        \
    stream<stages, stage_bytes>(src, bytes, active, sums, times);                                            \
  }                                                                                                          \
  extern "C" __global__ void name##_smem_bytes(int* out) { *out = kWarps * (stages) * (stage_bytes); }

// the megakernel's ring (2 x 8 KB per warp, 128 KB per SM), then more in flight per SM
SM_STREAM(sm_stream_2x8k, 2, 8192)
SM_STREAM(sm_stream_3x8k, 3, 8192)
SM_STREAM(sm_stream_2x12k, 2, 12288)
SM_STREAM(sm_stream_4x4k, 4, 4096)

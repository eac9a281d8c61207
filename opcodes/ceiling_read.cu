// Streaming-read ceiling: read every 16-byte vector of a large random buffer
// once with non-caching loads and fold it into a 64-bit sum, so the compiler
// cannot drop a load and the host can check that every byte was read.
// megac bench's streaming-read ceiling (megac/gpu/ceiling.py) and the battery's
// ceiling block both read with it.
//
// Entry points differ only in the L2 fetch granularity they ask for;
// the launch configuration (many CTAs, or one 1024-thread CTA per SM) is the
// host's choice.
#include <cstdint>

#include "common.cuh"

namespace {

template <int kUnroll, bool kL2Fetch256>
__device__ __forceinline__ void stream_sum(const uint4* __restrict__ src, uint64_t n_vec,
                                           unsigned long long* __restrict__ out) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  uint64_t acc = 0;
  // All kUnroll loads issue before any is used: that is what keeps enough
  // bytes in flight per SM to cover DRAM latency.
  for (; i + (kUnroll - 1) * stride < n_vec; i += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      v[u] = kL2Fetch256 ? megac::ld_stream_u4_l2_256(src + i + u * stride)
                         : megac::ld_stream_u4(src + i + u * stride);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      acc += static_cast<uint64_t>(v[u].x) + v[u].y + static_cast<uint64_t>(v[u].z) + v[u].w;
    }
  }
  for (; i < n_vec; i += stride) {
    const uint4 v = megac::ld_stream_u4(src + i);
    acc += static_cast<uint64_t>(v.x) + v.y + static_cast<uint64_t>(v.z) + v.w;
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if ((threadIdx.x & 31) == 0) atomicAdd(out, static_cast<unsigned long long>(acc));
}

}  // namespace

// ptxas keeps four 16-byte loads per thread in flight here (it interleaves the
// sums of a deeper unroll with its loads, so more buys nothing): 64 KB per SM
// at 1024 threads, which is what the persistent megakernel has.
extern "C" __global__ void __launch_bounds__(1024) ceiling_read_u4(
    const uint4* __restrict__ src, unsigned long long n_vec, unsigned long long* out) {
  stream_sum<4, false>(src, n_vec, out);
}

extern "C" __global__ void __launch_bounds__(1024) ceiling_read_u4_l2_256(
    const uint4* __restrict__ src, unsigned long long n_vec, unsigned long long* out) {
  stream_sum<4, true>(src, n_vec, out);
}

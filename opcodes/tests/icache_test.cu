// What running cold code costs on one SM: the instruction fetch of code the
// SM has not run lately. Why: the megakernel is ~414 KB of SASS (North Mini
// Code) and an SM runs a dozen opcodes per layer; the profile shows ~1 us
// of every task before any of its loads (claimers with no header wait,
// the first LM_HEAD tile on an SM against the later ones), which no data
// dependency explains.
//
// kBlocks distinct code blocks of kFma dependent FMAs each (kFma * 16 B of
// code, immediates unique per block, so nothing is shared or folded), each
// its own non-inlined function. Lane 0 of each CTA (one CTA per SM) runs
// every block once (the sweep: more code than any instruction cache holds),
// then times block 0 twice (cold after the sweep, then warm) and blocks
// 1..kSeq once and again (a task's worth of different code), on the SM
// clock. With `load`, warps 1.. of the CTA stream `buf` meanwhile (the
// memory system as busy as in a step).
#include <cstdint>
#include <utility>

namespace {

constexpr int kFma = 256;  // 4 KB of code per block
constexpr int kBlocks = 96;  // 384 KB in all
constexpr int kSeq = 8;      // blocks 1..kSeq: 32 KB

template <int I>
__device__ __noinline__ float code_block(float x) {
#pragma unroll
  for (int k = 0; k < kFma; ++k) x = fmaf(x, 1.0f - 1e-8f * float(I * kFma + k + 1), 1e-7f * float(k + 1));
  return x;
}

template <int... I>
__device__ __forceinline__ float sweep(float x, std::integer_sequence<int, I...>) {
  ((x = code_block<I>(x)), ...);
  return x;
}

template <int... I>
__device__ __forceinline__ float seq(float x, std::integer_sequence<int, I...>) {
  ((x = code_block<I + 1>(x)), ...);
  return x;
}

}  // namespace

// cyc[(cta * reps + r) * 4 + {0, 1, 2, 3}]: block 0 cold, warm; blocks
// 1..kSeq cold, warm (SM clock cycles). out[cta]: the chain's value (every
// CTA starts from in[0], so all must agree); sink: the streamers' sums.
// clk[cta * 4 + {0, 1, 2, 3}]: clock64 and the global timer (ns) at the
// start and the end of lane 0's work (cycles into ns).
extern "C" __global__ void icache_probe(const float* in, float* out, long long* cyc, long long* clk, int reps,
                                        const uint4* buf, long long n16, int load, unsigned long long* sink) {
  __shared__ volatile int done;
  if (threadIdx.x == 0) done = 0;
  __syncthreads();
  if (threadIdx.x >= 32) {
    if (!load) return;
    // streamers: read buf through L2 until lane 0 of warp 0 is done
    const long long stride = int64_t(gridDim.x) * (blockDim.x - 32);
    unsigned long long s = 0;
    long long i = int64_t(blockIdx.x) * (blockDim.x - 32) + (threadIdx.x - 32);
    while (!done) {
      const uint4 v = __ldcg(buf + i);
      s += v.x ^ v.w;
      i += stride;
      if (i >= n16) i -= n16;
    }
    if (s == 0x123456789ull) atomicAdd(sink, s);
    return;
  }
  if (threadIdx.x != 0) return;
  float x = in[0];
  unsigned long long g0, g1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g0));
  const long long c0 = clock64();
  for (int r = 0; r < reps; ++r) {
    x = sweep(x, std::make_integer_sequence<int, kBlocks>{});
    long long t0 = clock64();
    x = code_block<0>(x);
    long long t1 = clock64();
    x = code_block<0>(x);
    long long t2 = clock64();
    x = seq(x, std::make_integer_sequence<int, kSeq>{});
    long long t3 = clock64();
    x = seq(x, std::make_integer_sequence<int, kSeq>{});
    long long t4 = clock64();
    long long* c = cyc + (int64_t(blockIdx.x) * reps + r) * 4;
    c[0] = t1 - t0;
    c[1] = t2 - t1;
    c[2] = t3 - t2;
    c[3] = t4 - t3;
  }
  const long long c1 = clock64();
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g1));
  clk[blockIdx.x * 4 + 0] = c0;
  clk[blockIdx.x * 4 + 1] = (long long)g0;
  clk[blockIdx.x * 4 + 2] = c1;
  clk[blockIdx.x * 4 + 3] = (long long)g1;
  out[blockIdx.x] = x;
  done = 1;
}

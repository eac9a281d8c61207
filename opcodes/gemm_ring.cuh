// The row GEMM fed by a bulk-copy ring: the TMA unit streams a tile's
// weight rows into shared memory many stages ahead, so the bytes in flight
// per SM no longer depend on how many loads each lane can keep in
// registers (the register-fed loop of gemm_rows.cuh reached 10-14 GB/s per
// SM inside the megakernel, a third of an SM's share of HBM).
//
// Measured slower than the register-fed loop (off by default,
// MEGAC_GEMM_RING in ops_gemm.cuh): larger stages did better, so the cost
// is per stage (the producer thread inside a compute warp, the waits), not
// bytes in flight -- see docs/perf-notes.md.
//
// A tile of `rows` features x `cols` K is cut into stages of R whole
// features (R * cols * 2 <= kRingStageBytes); stage j goes to warp j mod
// nwarps, which computes its R features exactly as gemm_rows.cuh's loop
// does (each lane its K chunks in increasing k, the same xor tree), so the
// results are bit-identical to the register-fed tile.
//
// Thread 0 is the producer: it issues stages 0..S-1 before any wait, then,
// at each of its own loop iterations i, the stages up to nwarps * i + S - 1
// -- each needs only stages consumed in iterations before i, so it never
// waits on its own warp. Stages are numbered globally across tasks
// (`base`), so the barriers are initialised once per launch and their
// phases carry over: slot g mod S, phase (g / S) mod 2. Every wait is
// bounded by the watchdog; a timeout clears *ok and the tile bails out.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "common.cuh"
#include "gemm_rows.cuh"
#include "mbarrier.cuh"
#include "weight_stream.cuh"

namespace megac {
namespace rows {

#ifndef MEGAC_RING_STAGES
#define MEGAC_RING_STAGES 16
#endif
#ifndef MEGAC_RING_STAGE_BYTES
#define MEGAC_RING_STAGE_BYTES 8192
#endif
constexpr int kRingStages = MEGAC_RING_STAGES;
constexpr int kRingStageBytes = MEGAC_RING_STAGE_BYTES;
constexpr int kRingBytes = kRingStages * kRingStageBytes;
// Most features a stage may hold (register arrays are sized by it).
constexpr int kRingMaxR = 8;

// The ring's state that outlives a task (in the task loop's TaskShared):
// barriers initialised once per launch and the global stage count.
struct RingState {
  uint64_t full[kRingStages];
  uint64_t empty[kRingStages];
  uint32_t base;
  uint32_t pad[3];
};

// Thread 0, once per launch, before the CTA's first barrier.
__device__ __forceinline__ void ring_init(RingState* r) {
  for (int s = 0; s < kRingStages; ++s) {
    mbar_init(&r->full[s], 1);
    mbar_init(&r->empty[s], 1);
  }
  r->base = 0;
  mbar_init_fence();
}

// Features per stage for K = cols (at least 1; a row longer than a stage is
// refused by the caller's static checks).
__device__ __forceinline__ int ring_rows_per_stage(int cols) {
  const int r = kRingStageBytes / (cols * 2);
  return r < 1 ? 1 : (r > kRingMaxR ? kRingMaxR : r);
}

// Producer: stage j (global g) of tile s into its slot.
__device__ __forceinline__ bool ring_issue(RingState* r, uint8_t* data, const WeightSpan& s, int R, int j,
                                           uint64_t policy, const WaitSite& site) {
  const uint32_t g = r->base + uint32_t(j);
  const uint32_t slot = g % kRingStages, phase = (g / kRingStages) & 1u;
  // a fresh barrier counts as having completed the phase before phase 0
  if (!mbar_wait(&r->empty[slot], phase ^ 1u, int32_t(slot), site)) return false;
  const int f0 = j * R;
  const int nf = min(R, s.rows - f0);
  const uint32_t rb = uint32_t(s.cols) * 2u;
  uint64_t* bar = &r->full[slot];
  mbar_arrive_expect_tx(bar, uint32_t(nf) * rb);
  uint8_t* dst = data + slot * kRingStageBytes;
  if (s.cols == s.ld) {
    bulk_load_hint(dst, s.p + int64_t(f0) * s.ld, uint32_t(nf) * rb, bar, policy);
  } else {
    for (int f = 0; f < nf; ++f) bulk_load_hint(dst + f * rb, s.p + int64_t(f0 + f) * s.ld, rb, bar, policy);
  }
  return true;
}

// ys[c * 8 + m] = sum_k W[c, k] X[m, k] for the tile `s` (rows >= `rows`
// are 0), X staged in xs [rows][s.cols]. Whole CTA; ends with a barrier.
// Every thread has fenced its earlier generic writes to `data` to the async
// proxy (fence.proxy.async) before the CTA barrier that precedes this call.
__device__ __forceinline__ void tile_ring(const WeightSpan& s, const bf16* xs, int rows, float* ys, uint8_t* data,
                                          RingState* r, int32_t* ok, const WaitSite& site) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int klen = s.cols;
  const int R = ring_rows_per_stage(klen);
  const int nstages = (s.rows + R - 1) / R;
  const uint32_t rb = uint32_t(klen) * 2u;
  uint64_t policy = 0;
  int issued = 0;
  bool good = true;
  if (threadIdx.x == 0) {
    policy = l2_evict_first_policy();
    for (; issued < nstages && issued < kRingStages && good; ++issued)
      good = ring_issue(r, data, s, R, issued, policy, site);
  }
  for (int i = 0;; ++i) {
    if (threadIdx.x == 0 && good) {
      const int upto = min(nstages, nwarps * i + kRingStages);
      for (; issued < upto && good; ++issued) good = ring_issue(r, data, s, R, issued, policy, site);
    }
    const int j = warp + i * nwarps;
    if (j >= nstages) break;
    const uint32_t g = r->base + uint32_t(j);
    const uint32_t slot = g % kRingStages, phase = (g / kRingStages) & 1u;
    bool landed = mbar_wait(&r->full[slot], phase, int32_t(slot), site, lane == 0);
    landed = __all_sync(0xffffffffu, landed);
    if (!landed || (threadIdx.x == 0 && !good)) {
      if (lane == 0) *ok = 0;
      break;
    }
    const uint8_t* st = data + slot * kRingStageBytes;
    const int f0 = j * R;
    const int nf = min(R, s.rows - f0);
    float acc[kRingMaxR][kMaxRows];
    zero(acc);
    for (int k = lane * 8; k < klen; k += 32 * 8) {
#pragma unroll
      for (int f = 0; f < kRingMaxR; ++f) {
        if (f < nf) fold8(*reinterpret_cast<const uint4*>(st + f * rb + k * 2), xs, rows, klen, k, acc[f]);
      }
    }
    // every lane has read the stage: hand it back to the producer
    __syncwarp();
    if (lane == 0) mbar_arrive(&r->empty[slot]);
    reduce_features(acc, f0, f0 + nf, rows, ys);
  }
  __syncthreads();
  if (threadIdx.x == 0) r->base += uint32_t(nstages);
}

}  // namespace rows
}  // namespace megac

// Weight streaming into a shared-memory ring, for one CTA per SM.
//
// One producer thread issues bulk async copies (global -> shared, completion
// counted in bytes on an mbarrier) as far ahead as the ring allows; consumer
// warps wait for a stage, read it, and hand it back. The ring is not tied to
// a task: the producer runs on into the next task's tiles while the
// consumers are still on this one, so a task boundary costs no refill.
//
// Every mbarrier wait is bounded by the watchdog of common.cuh.
#pragma once

#include <cstdint>

#include "common.cuh"
#include "mbarrier.cuh"

namespace megac {

// --- bulk copies ------------------------------------------------------------

// L2 policy for data read once per step: let it go first, so activations and
// counters stay resident.
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// L2 policy for data fetched ahead of its one reader: keep it until then.
__device__ __forceinline__ uint64_t l2_evict_last_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// global -> shared bulk copy completing `bytes` transactions on `bar`.
// dst, src 16-byte aligned, bytes a multiple of 16.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

__device__ __forceinline__ void bulk_load_hint(void* dst, const void* src, uint32_t bytes,
                                               uint64_t* bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1], %2, [%3], %4;" ::"r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy)
      : "memory");
}

// --- the ring ---------------------------------------------------------------

// kStages stages of kStageBytes each, released by kConsumerWarps arrivals.
// kChunks: bulk copies per stage (several smaller copies start the stage's
// first bytes sooner; one is usually enough).
template <int kStages, int kStageBytes, int kConsumerWarps, int kChunks = 1>
struct WeightRing {
  static_assert(kStageBytes % (16 * kChunks) == 0, "bulk copies move multiples of 16 bytes");
  static_assert(kStages >= 2, "a ring needs at least two stages to overlap");
  static constexpr uint32_t kChunkBytes = kStageBytes / kChunks;

  // Dynamic shared memory this ring needs: data first (128-byte aligned),
  // then the barriers.
  static constexpr uint32_t kDataBytes = kStages * kStageBytes;
  static constexpr uint32_t kSmemBytes = kDataBytes + 2 * kStages * sizeof(uint64_t);

  uint8_t* data;
  uint64_t* full;   // completes when a stage's bytes have landed
  uint64_t* empty;  // completes when every consumer warp has released it

  // `smem` is 128-byte aligned. Thread 0 initialises; all threads must then
  // pass a CTA barrier before touching the ring.
  __device__ __forceinline__ void bind(uint8_t* smem) {
    data = smem;
    full = reinterpret_cast<uint64_t*>(smem + kDataBytes);
    empty = full + kStages;
  }

  __device__ __forceinline__ void init_barriers() {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kConsumerWarps);
    }
    mbar_init_fence();
  }

  __device__ __forceinline__ uint8_t* stage_ptr(uint32_t stage) const {
    return data + stage * kStageBytes;
  }

  // Producer (one thread): claim the stage under the cursor, then fill it
  // from `src` (kStageBytes). False: watchdog or abort.
  template <bool kEvictFirst = true>
  __device__ __forceinline__ bool produce(RingCursor<kStages>& cur, const uint8_t* src,
                                          uint64_t policy, const WaitSite& site) {
    // A fresh barrier counts as having completed the phase before phase 0,
    // so the first pass over the ring does not wait.
    if (!mbar_wait(&empty[cur.stage], cur.phase ^ 1u, static_cast<int32_t>(cur.stage), site))
      return false;
    uint64_t* bar = &full[cur.stage];
    mbar_arrive_expect_tx(bar, kStageBytes);
    uint8_t* dst = stage_ptr(cur.stage);
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      if constexpr (kEvictFirst) {
        bulk_load_hint(dst + c * kChunkBytes, src + c * kChunkBytes, kChunkBytes, bar, policy);
      } else {
        bulk_load(dst + c * kChunkBytes, src + c * kChunkBytes, kChunkBytes, bar);
      }
    }
    cur.advance();
    return true;
  }

  // Consumer warp (all 32 lanes): wait until the stage under the cursor has
  // landed. Returns the stage's bytes, or null on watchdog / abort. The lanes
  // agree on the verdict so the warp never splits.
  __device__ __forceinline__ const uint8_t* consume(const RingCursor<kStages>& cur,
                                                    const WaitSite& site) {
    bool ok = mbar_wait(&full[cur.stage], cur.phase, static_cast<int32_t>(cur.stage), site,
                        (threadIdx.x & 31) == 0);
    ok = __all_sync(0xffffffffu, ok);
    return ok ? stage_ptr(cur.stage) : nullptr;
  }

  // Consumer warp: every lane has finished reading the stage; give it back.
  __device__ __forceinline__ void release(RingCursor<kStages>& cur) {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) mbar_arrive(&empty[cur.stage]);
    cur.advance();
  }
};

}  // namespace megac

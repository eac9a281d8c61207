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

namespace megac {

// --- mbarrier primitives (shared::cta) --------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(arrivals)
               : "memory");
}

// Makes initialised barriers visible to the async proxy (the copy engine
// completes transactions on them). Follow with a CTA barrier.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// One bounded-by-hardware probe: true once the phase with this parity has
// completed. The thread may be suspended inside for a short while, so a
// spinning waiter does not steal issue slots from the consumers.
__device__ __forceinline__ bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n\t.reg .pred p;\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
      "selp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// Watchdog-bounded wait. `stage` goes into the record's counter field (and
// the awaited parity into "seen") so the host can tell which ring slot
// stalled. When a whole warp waits, let one lane (`reporter`) report, so the
// timeout count says how many waits failed rather than how many lanes.
__device__ __forceinline__ bool mbar_wait(uint64_t* bar, uint32_t parity, int32_t stage,
                                          const WaitSite& site, bool reporter = true) {
  if (mbar_try_wait(bar, parity)) return true;
  SpinBound bound;
  for (;;) {
    if (!bound.keep_going(site)) {
      if (bound.expired && reporter) {
        report_error(site.status, site.task, site.opcode, stage, static_cast<int32_t>(parity), -1,
                     site.layer, kErrMbarrierTimeout);
      }
      return false;
    }
    if (mbar_try_wait(bar, parity)) return true;
  }
}

// --- bulk copies ------------------------------------------------------------

// L2 policy for data read once per step: let it go first, so activations and
// counters stay resident.
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
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

// Position in the ring; producer and consumers each keep one and advance it
// in the same order, so they agree on stage and phase without talking.
template <int kStages>
struct RingCursor {
  uint32_t stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

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

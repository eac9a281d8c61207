// mbarrier primitives (shared::cta) and the ring cursor shared by every
// producer / consumer ring in the device code (the weight stream's bulk-copy
// ring, the flash-decode K/V ring). Every wait is bounded by the watchdog of
// common.cuh.
#pragma once

#include <cstdint>

#include "common.cuh"

namespace megac {

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

}  // namespace megac

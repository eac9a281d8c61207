// Cross-CTA dependency counters: the only synchronisation between tasks of a
// megakernel step. A producer task bumps a uint32 counter in global memory
// once its outputs are visible; a consumer task waits until the counter
// reaches the number of producer tasks it depends on.
//
// Counters are never reused within a step (the host zeroes them before each
// launch), so a plain `>=` needs no epochs or phase bits.
//
// Every wait is bounded (megac::SpinBound): on timeout it writes the error
// record, raises the launch's abort flag and returns false; every other CTA's
// waits see the flag and return false too, so the kernel always ends.
#pragma once

#include <cstdint>

#include "common.cuh"

namespace megac {

// Publish this CTA's writes, then count one arrival.
//
// Call from ONE thread, after a CTA barrier that follows every write the
// consumers will read (cta_signal_counter below does both). The barrier makes
// the other threads' writes happen-before this thread's fence, and the
// gpu-scope fence is cumulative, so all of them are visible before the add.
//
// kAsyncWrites: the outputs were written by the async proxy (TMA / bulk
// stores, after their cp.async.bulk.wait_group): order them with the generic
// proxy first, or the consumer could see the count before the data.
template <bool kAsyncWrites = false>
__device__ __forceinline__ void signal_counter(uint32_t* counter, uint32_t n = 1) {
  if constexpr (kAsyncWrites) {
    asm volatile("fence.proxy.async.global;" ::: "memory");
  }
  __threadfence();
  atomicAdd(counter, n);
}

// Spin until *counter >= target. ONE thread calls it; false means the
// watchdog fired (or another CTA aborted) and the caller must leave its task
// loop without touching the task's outputs.
//
// kAsyncReads: the data this wait guards will be read by the async proxy (TMA
// loads of activations another SM wrote): fence the proxies after acquiring.
template <bool kAsyncReads = false>
__device__ __forceinline__ bool wait_counter(const uint32_t* counter, uint32_t target,
                                             int32_t counter_index, const WaitSite& site) {
  uint32_t seen = ld_acquire_gpu(counter);
  if (seen < target) {
    SpinBound bound;
    for (;;) {
      if (!bound.keep_going(site)) {
        if (bound.expired) {
          report_error(site.status, site.task, site.opcode, counter_index,
                       static_cast<int32_t>(seen), static_cast<int32_t>(target),
                       site.layer, kErrCounterTimeout);
        }
        return false;
      }
      // A short sleep keeps 132 pollers from flooding the L2 slice that
      // holds the counter; longer ones add directly to the dependency latency.
      __nanosleep(20);
      // Relaxed polls: an acquire load also invalidates the SM's whole L1
      // (CCTL.IVALL), and a warp that polled that way through a 64 us
      // attention step cost its SM's decode stream 3-8 %.
      seen = ld_relaxed_gpu(counter);
      if (seen >= target) break;
    }
    // One acquire (of a value at least as new) orders the reads after it.
    ld_acquire_gpu(counter);
  }
  if constexpr (kAsyncReads) {
    asm volatile("fence.proxy.async.global;" ::: "memory");
  }
  return true;
}

// CTA-wide forms: every thread of the CTA calls them.

// Barrier over the CTA's writes, then thread 0 signals.
template <bool kAsyncWrites = false>
__device__ __forceinline__ void cta_signal_counter(uint32_t* counter, uint32_t n = 1) {
  __syncthreads();
  if (threadIdx.x == 0) signal_counter<kAsyncWrites>(counter, n);
}

// Thread 0 waits; the barrier hands both its acquire and its verdict to the
// whole CTA (bar.red is a CTA barrier, so it orders the later reads of every
// thread after the acquire).
template <bool kAsyncReads = false>
__device__ __forceinline__ bool cta_wait_counter(const uint32_t* counter, uint32_t target,
                                                 int32_t counter_index, const WaitSite& site) {
  int ok = 1;
  if (threadIdx.x == 0) ok = wait_counter<kAsyncReads>(counter, target, counter_index, site);
  return __syncthreads_and(ok) != 0;
}

}  // namespace megac

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
//
// MEGAC_SIGNAL_ACQREL 1: the release as CUTLASS's semaphores write it,
// fence.acq_rel.gpu (MEMBAR.ALL.GPU: the thread's earlier writes acked)
// then a relaxed reduction, instead of __threadfence() (fence.sc.gpu,
// MEMBAR.SC.GPU, which also orders against every other SC fence of the
// GPU) and the add. Both are release patterns of the PTX memory model; a
// counter's signal sits on every hop of a step's critical path. The
// twenty-first session's single red.release.gpu measured mixed (NMC bs1
// +2.8 %, bs1 32K -1.8 %); this form (twenty-seventh session, H200, one
// engine, interleaved rounds) NMC bs1 2.751 against 2.715, bs8 8.528
// against 8.545: no gain. 0: the SC fence.
#ifndef MEGAC_SIGNAL_ACQREL
#define MEGAC_SIGNAL_ACQREL 0
#endif

template <bool kAsyncWrites = false>
__device__ __forceinline__ void signal_counter(uint32_t* counter, uint32_t n = 1) {
  if constexpr (kAsyncWrites) {
    asm volatile("fence.proxy.async.global;" ::: "memory");
  }
#if MEGAC_SIGNAL_ACQREL
  asm volatile("fence.acq_rel.gpu;\n\tred.relaxed.gpu.global.add.u32 [%0], %1;" ::"l"(counter), "r"(n) : "memory");
#else
  __threadfence();
  atomicAdd(counter, n);
#endif
}

// How a wait polls a counter that is not yet met. Each poll is one loaded
// L2 round trip (~0.5-1 us under the step's streaming), and with one poll
// in flight a count that lands just after a poll left is seen a whole round
// trip later: ~half a round trip of every hop on a step's critical path
// (4-5 hops a MoE layer; docs/perf-notes.md, fifty-second session's
// `--heads`). MEGAC_POLL_DEPTH D > 1 keeps D polls in flight, issued
// MEGAC_POLL_GAP_CYCLES apart (SM clocks, ~a loaded round trip / D) and
// each reissued as soon as the value it returned was looked at, so a count
// is seen ~a round trip / D after it lands, at D loads a round trip against
// the counter's L2 slice. When one is met, the others are still in flight:
// their registers are not reused before they land. 1: one poll in flight,
// MEGAC_POLL_SLEEP_NS between a poll's return and the next (0: none; the
// sleep keeps 132 pollers from flooding one L2 slice).
// Measured (H200, fifty-third session, NMC bs1 8K, engines alternating, 12-14
// a side): D 2 +1.1 %, D 4 +1.6 %; one poll with no sleep -0.1 %, 200 ns
// -0.1 % (even), 800 ns +1.1 %. The polls' rate does not contend (200 ns
// apart is even), and a count seen ~0.4 us later on every hop costs 1.1 %,
// so D polls in flight, which see it sooner, pay for something else: most
// likely thread 0 stalling after its wait until the other polls land (their
// registers are reused). Off (1, 20 ns).
#ifndef MEGAC_POLL_DEPTH
#define MEGAC_POLL_DEPTH 1
#endif
#ifndef MEGAC_POLL_GAP_CYCLES
#define MEGAC_POLL_GAP_CYCLES 400
#endif
#ifndef MEGAC_POLL_SLEEP_NS
#define MEGAC_POLL_SLEEP_NS 20
#endif
static_assert(MEGAC_POLL_DEPTH >= 1 && MEGAC_POLL_DEPTH <= 8, "MEGAC_POLL_DEPTH: 1 .. 8 polls in flight");

__device__ __forceinline__ void spin_cycles(uint32_t n) {
  const uint32_t t0 = static_cast<uint32_t>(clock());
  while (static_cast<uint32_t>(clock()) - t0 < n) {
  }
}

// MEGAC_POLL_DEPTH > 1: poll until *counter >= target (true) or the watchdog
// says stop (false); `seen` is the last value looked at.
template <int D>
__device__ __forceinline__ bool poll_deep(const uint32_t* counter, uint32_t target, uint32_t& seen, SpinBound& bound,
                                          const WaitSite& site) {
  uint32_t v[D];
#pragma unroll
  for (int i = 0; i < D; ++i) {
    v[i] = ld_relaxed_gpu(counter);
    if (i + 1 < D) spin_cycles(MEGAC_POLL_GAP_CYCLES);
  }
  for (;;) {
#pragma unroll
    for (int i = 0; i < D; ++i) {
      seen = v[i];  // waits for poll i alone; the later ones stay in flight
      if (seen >= target) return true;
      v[i] = ld_relaxed_gpu(counter);
    }
    if (!bound.keep_going(site)) return false;
  }
}

// Spin until *counter >= target. ONE thread calls it; false means the
// watchdog fired (or another CTA aborted) and the caller must leave its task
// loop without touching the task's outputs.
//
// kAsyncReads: the data this wait guards will be read by the async proxy (TMA
// loads of activations another SM wrote): fence the proxies after acquiring.
//
// What a wait costs after its target lands (nvdisasm of the North Mini Code
// build): each poll is an LDG.E.STRONG.GPU, and the trailing acquire of a
// value the poll already saw compiles to CCTL.IVALL alone (ptxas drops the
// dead load), so the acquire adds no round trip; the abort flag's read in
// SpinBound did, every poll (common.cuh MEGAC_ABORT_EVERY).
template <bool kAsyncReads = false>
__device__ __forceinline__ bool wait_counter(const uint32_t* counter, uint32_t target,
                                             int32_t counter_index, const WaitSite& site) {
  uint32_t seen = ld_acquire_gpu(counter);
  if (seen < target) {
    SpinBound bound;
    // Relaxed polls: an acquire load also invalidates the SM's whole L1
    // (CCTL.IVALL), and a warp that polled that way through a 64 us
    // attention step cost its SM's decode stream 3-8 %.
    bool met;
    if constexpr (MEGAC_POLL_DEPTH > 1) {
      met = poll_deep<MEGAC_POLL_DEPTH>(counter, target, seen, bound, site);
    } else {
      for (;;) {
        if (!bound.keep_going(site)) {
          met = false;
          break;
        }
        if (MEGAC_POLL_SLEEP_NS > 0) __nanosleep(MEGAC_POLL_SLEEP_NS);
        seen = ld_relaxed_gpu(counter);
        if (seen >= target) {
          met = true;
          break;
        }
      }
    }
    if (!met) {
      if (bound.expired) {
        report_error(site.status, site.task, site.opcode, counter_index, static_cast<int32_t>(seen),
                     static_cast<int32_t>(target), site.layer, kErrCounterTimeout);
      }
      return false;
    }
    // One acquire (of a value at least as new) orders the reads after it.
    ld_acquire_gpu(counter);
  }
  if constexpr (kAsyncReads) {
    asm volatile("fence.proxy.async.global;" ::: "memory");
  }
  return true;
}

// Both c0 >= t0 and c1 >= t1, the two counters read in the same round trip
// each poll (wait_counter one after the other pays a round trip for the
// second even when its producer finished long before the first's); the
// same contract and watchdog as wait_counter, whose record names the
// counter still short.
__device__ __forceinline__ bool wait_counters2(const uint32_t* c0, uint32_t t0, int32_t i0, const uint32_t* c1,
                                               uint32_t t1, int32_t i1, const WaitSite& site) {
  // both loads in flight before either value is used
  uint32_t s0 = ld_relaxed_gpu(c0);
  uint32_t s1 = ld_relaxed_gpu(c1);
  if (s0 < t0 || s1 < t1) {
    SpinBound bound;
    for (;;) {
      if (!bound.keep_going(site)) {
        if (bound.expired) {
          const bool first = s0 < t0;
          report_error(site.status, site.task, site.opcode, first ? i0 : i1, static_cast<int32_t>(first ? s0 : s1),
                       static_cast<int32_t>(first ? t0 : t1), site.layer, kErrCounterTimeout);
        }
        return false;
      }
      __nanosleep(20);
      if (s0 < t0) s0 = ld_relaxed_gpu(c0);
      if (s1 < t1) s1 = ld_relaxed_gpu(c1);
      if (s0 >= t0 && s1 >= t1) break;
    }
  }
  // an acquire of each (of values at least as new) orders the reads after them
  ld_acquire_gpu(c0);
  ld_acquire_gpu(c1);
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

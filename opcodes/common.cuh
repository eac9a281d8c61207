// Shared device helpers for every opcode header: wide non-caching loads, the
// global timer, and the watchdog / error-record protocol that every bounded
// wait in the megakernel reports through.
//
// Header-only, no host code, no model constants.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "generated/megac_abi.h"

namespace megac {

// ---------------------------------------------------------------------------
// Loads
// ---------------------------------------------------------------------------

// Weights and KV are read exactly once per step: keep them out of L1 so they
// do not evict activations, and read through the non-coherent path, which is
// legal because nothing writes them during a launch.
__device__ __forceinline__ uint4 ld_stream_u4(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// The TMA unit pulls [p, p + bytes) into L2 on its own: no registers, no
// shared memory, no warp waits for it. p 16-byte aligned, bytes a multiple
// of 16. Used to keep HBM busy ahead of the loads (and ahead of a task's
// waits): weights are read-only during a launch, so any time is safe.
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// Same, with an L2 eviction policy (createpolicy) for the lines it brings.
__device__ __forceinline__ void prefetch_l2_hint(const void* p, uint32_t bytes, uint64_t policy) {
  asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(p), "r"(bytes), "l"(policy)
               : "memory");
}

// Same, asking L2 to fetch the whole 256-byte sector group: fewer DRAM
// requests when a warp streams a contiguous range.
__device__ __forceinline__ uint4 ld_stream_u4_l2_256(const void* p) {
  uint4 v;
  asm volatile(
      "ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// Eight bf16 (one 16-byte load) to fp32, in order.
__device__ __forceinline__ void unpack8(uint4 v, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

// 16-byte async copy (cp.async) into shared memory, through L2 only (L2
// fetches whole 256-byte sectors: a kv head's key row and a warp's step
// along a weight row are contiguous 256+ bytes); src_bytes 0 writes zeros
// (masked keys must read as 0, never as whatever a stale page holds: 0 * NaN
// would poison the output). The issuing thread sees the data after its
// cp_async_wait; other threads after a barrier as well.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Data that another CTA of this launch wrote (activations): must not come
// from the non-coherent path, and a plain 16-byte load is enough once the
// counter wait has acquired.
__device__ __forceinline__ uint4 ld_u4(const void* p) {
  return *reinterpret_cast<const uint4*>(p);
}

__device__ __forceinline__ void st_u4(void* p, uint4 v) {
  *reinterpret_cast<uint4*>(p) = v;
}

// Relaxed gpu-scope load: sees other SMs' writes without ordering anything
// else. Used for polling flags whose value alone is the message.
__device__ __forceinline__ uint32_t ld_relaxed_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// 1: a combine (not split-K) polls its experts' outputs instead of waiting
// for the down claims' counter (mk_core.cuh header_waits skips that wait;
// moe_routing.cuh combine_row_polled). Each word of moe_out holds
// UNLANDED_F32 until a down tile stores it; the combine reads its range
// until no word does, adds, and writes the bits back for the next step
// (the host fills moe_out once, and again after an abort). Why: the hop that ends a MoE layer's chain pays, after the last
// down tile's stores, the claim's fence (its stores acknowledged), the
// counter's atomic, the combine's poll of it and its acquire, then the
// slots' and the outputs' loads, each a dependent L2 round trip; here the
// slots are read while the down tiles run and the outputs' poll is the
// load. The counter stays (the VM's, the watchdog report's). 0: the wait.
// Measured (H100, thirty-eighth session, engines alternating, NMC bs1 8K):
// even (-0.1 %), exact (likely: the attention chain ends the layer as late).
#ifndef MEGAC_COMBINE_POLL
#define MEGAC_COMBINE_POLL 0
#endif

// A one-row routed up claimer that polls its router partials instead of the
// router's counter (ops_moe.cuh moe_upgate_routed, moe_routing.cuh
// poll_one_row_warp; mk_core.cuh header_waits skips its WAIT0). Each word of
// router_part holds UNLANDED_F32 until a router tile stores it; the claimer
// reads row 0's partials until no word does, then sums and ranks them. Why:
// from a router tile's stores to a claimer's summed logits the counter form
// pays the tile's fence (its stores acknowledged), the counter's add, the
// claimer's poll of it (~a round trip after it lands), then two rounds of
// partial loads (MEGAC_TOPK_WARP_SPLITS): ~4 loaded L2 round trips on the
// expert chain of every MoE layer (fifty-second session's `--heads`: router
// end -> ranked ~4 us); here the poll is the load, ~1-1.5 round trips. Who
// writes the sentinel back: ROUTE_FINALIZE of layer L, for layer L - 1's
// partials (the first MoE layer's: the last MoE layer's, of the step
// before). It runs after the router of layer L, which runs after every
// claim of layer L - 1 (their down tiles, then the combine it folds) and
// after layer L - 1's finalize; a claimer that claims nothing (drained)
// leaves its poll through its stop() instead. The host fills router_part
// once, and again after a poisoned step or an abort (megac/gpu/backend.py
// _unland). The router's counter stays (the finalize's, the VM's, the
// watchdog report's). Only for claimers whose claims wait on the norm
// themselves (TASK_WAIT_BASE >= 0, the router folding the combine): there
// the router's counter orders nothing else they read. A model of one MoE
// layer cannot take it (its finalize would unland its own layer's partials:
// the build refuses). 0: the counter. Measured (fifty-fourth session, H100,
// NMC bs1 8K): +0.40 %. The ranking then follows the router by 1.8 us
// instead of 4.1, but a polling claimer starts as soon as its SM is free
// and polls ~10 us a layer with no sleep; the sliding layers' QKV stream
// (the attention chain) ran longer: +1.7 us a sliding layer, -1.1 us a
// full one (docs/perf-notes.md). 2: the claimer waits on its claims' norm
// first (its header, one thread with the usual sleep), then reads the
// partials: no load while the router runs (the norm ends ~2 us after it),
// and the claims' own wait is then met (ranked -> handed ~0.9 us in the
// default's stamps). Measured (fifty-fifth session, H100, NMC bs1 8K):
// +0.88 %.
#ifndef MEGAC_ROUTER_POLL
#define MEGAC_ROUTER_POLL 0
#endif

// With MEGAC_ROUTER_POLL: 1 polls in the full-attention layers alone (the
// generated MEGAC_FULL_LAYERS_LO/HI masks); a sliding layer's claimers wait
// on the router's counter as without the poll. Why: the fifty-fourth
// session's profiles (H100) gave the poll -1.1 us a full layer (there the
// up claims go first and the expert chain gates) and +1.7 us a sliding one
// (its polls slow the QKV stream, the attention chain that gates there).
// 0: every MoE layer polls. Measured (fifty-fifth session, H100, NMC bs1
// 8K, with MEGAC_ROUTER_POLL 1): +1.09 %, worse than every layer polling:
// the per-layer stamps do not predict the poll builds; the probe with no
// layer polling (VARIANTS router_poll_none) tells the builds' fixed costs.
#ifndef MEGAC_ROUTER_POLL_FULL
#define MEGAC_ROUTER_POLL_FULL 0
#endif
#if MEGAC_ROUTER_POLL_FULL && !MEGAC_ROUTER_POLL
#error "MEGAC_ROUTER_POLL_FULL picks the layers that poll: with MEGAC_ROUTER_POLL"
#endif
#ifndef MEGAC_FULL_LAYERS_LO  // a build outside the generated megakernel.cu: no layer is full
#define MEGAC_FULL_LAYERS_LO 0u
#endif
#ifndef MEGAC_FULL_LAYERS_HI
#define MEGAC_FULL_LAYERS_HI 0u
#endif

// A timing probe, not a candidate: with MEGAC_ROUTER_POLL, a polling
// claimer's claims skip their wait on the norm (TASK_WAIT_BASE) and read
// x_norm as they find it (the layer before's values, or part-written: the
// logits are wrong). What it measures: how much of the expert chain's head
// the norm still gates once the router's hop is polled (the fifty-third
// session's `--heads`: the norm ends ~2 us after the router, before the
// counter form's ranking in 39 of 47 layers). 0: the claims wait. Measured
// (fifty-fourth session, H100): as slow as MEGAC_ROUTER_POLL alone, so the
// norm was not the gate.
#ifndef MEGAC_PROBE_UP_NO_NORM
#define MEGAC_PROBE_UP_NO_NORM 0
#endif
#if MEGAC_PROBE_UP_NO_NORM && !MEGAC_ROUTER_POLL
#error "MEGAC_PROBE_UP_NO_NORM probes the polling claimers: with MEGAC_ROUTER_POLL"
#endif

// The router tile that folds the MoE combine (COMBINE_IN): ops_gemm.cuh
// says what the switch does. Its default here, once, for the three headers
// that read it (ops_gemm.cuh, ops_norm.cuh, moe_routing.cuh); a generated
// megakernel sets it before the headers (codegen switch_defaults).
#ifndef MEGAC_ROUTER_COMBINE
#define MEGAC_ROUTER_COMBINE 0
#endif

// 16 bytes by one relaxed gpu-scope load (a poll of data another SM
// stores: each 32-bit element is read whole, with no order between them).
__device__ __forceinline__ uint4 ld_relaxed_gpu_v4(const void* p) {
  uint4 v;
  asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

// A relaxed gpu-scope store: the write a poll of the data (above) reads.
__device__ __forceinline__ void st_relaxed_gpu(float* p, float v) {
  asm volatile("st.relaxed.gpu.global.f32 [%0], %1;" ::"l"(p), "f"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_gpu_v4(void* p, uint4 v) {
  asm volatile("st.relaxed.gpu.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

// Acquire gpu-scope load: every read after it in this thread (and, through a
// CTA barrier, in the threads it synchronises with) sees what the releasing
// writer made visible before its release.
__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// ---------------------------------------------------------------------------
// Time
// ---------------------------------------------------------------------------

// Nanoseconds, common to all SMs, but it ticks coarsely (its update period is
// chip dependent, up to 1 us): good for watchdogs and long intervals, not for
// sub-microsecond latencies (use clock64 on one SM for those).
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint32_t smid() {
  uint32_t s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}

// ---------------------------------------------------------------------------
// Watchdog and error record
// ---------------------------------------------------------------------------
//
// Every launch gets one int32[kStatusWords] status buffer, zeroed by the host.
// Layout (defined once in megac/abi.py, rendered into generated/megac_abi.h):
//   [0]      abort flag: 0 = running, else the kind of the first error.
//            Every CTA polls it inside every wait and leaves when it is set.
//   [1]      record claim (atomicCAS 0 -> 1): the first CTA to fail writes the
//            record, later failures only count themselves.
//   [2]      number of waits that timed out on their own (not via abort).
//   [3]      record complete (1 once words 8..15 are written and fenced).
//   [8..15]  the record: sm (blockIdx.x, i.e. which task list), task index,
//            opcode, counter index, value seen, target, layer, kind.
constexpr int kStatusWords = STATUS_WORDS;
constexpr int kStatusAbort = STATUS_ABORT;
constexpr int kStatusClaim = STATUS_CLAIM;
constexpr int kStatusTimeouts = STATUS_TIMEOUTS;
constexpr int kStatusDone = STATUS_DONE;
constexpr int kStatusRecord = STATUS_RECORD;

enum ErrorKind : int32_t {
  kErrNone = ERRKIND_NONE,
  kErrCounterTimeout = ERRKIND_COUNTER_TIMEOUT,
  kErrMbarrierTimeout = ERRKIND_MBARRIER_TIMEOUT,
  kErrQueueOverflow = ERRKIND_QUEUE_OVERFLOW,
  kErrBadTask = ERRKIND_BAD_TASK,
};

// Default watchdog: long enough that no legitimate wait in a decode step
// (1-2 ms) comes near it, short enough that a hang costs seconds.
constexpr uint64_t kDefaultWatchdogNs = DEFAULT_WATCHDOG_NS;

// Who is waiting: copied into the error record when a wait gives up.
struct WaitSite {
  int32_t* status;      // the launch's status buffer (may be null: no watchdog record)
  uint64_t timeout_ns;  // 0 means kDefaultWatchdogNs
  int32_t task;         // index of the task in this CTA's list
  int32_t opcode;
  int32_t layer;
};

__device__ __forceinline__ bool abort_raised(const int32_t* status) {
  return status != nullptr &&
         ld_relaxed_gpu(reinterpret_cast<const uint32_t*>(status + kStatusAbort)) != 0;
}

// Records the first failure of the launch and raises the abort flag. The
// record is written and fenced before the flag goes up, so a host that sees
// the flag after the kernel ends always finds a complete record.
__device__ __noinline__ void report_error(int32_t* status, int32_t task,
                                          int32_t opcode, int32_t counter,
                                          int32_t seen, int32_t target,
                                          int32_t layer, int32_t kind) {
  if (status == nullptr) return;
  atomicAdd(status + kStatusTimeouts, 1);
  if (atomicCAS(status + kStatusClaim, 0, 1) == 0) {
    int32_t* r = status + kStatusRecord;
    r[0] = static_cast<int32_t>(blockIdx.x);
    r[1] = task;
    r[2] = opcode;
    r[3] = counter;
    r[4] = seen;
    r[5] = target;
    r[6] = layer;
    r[7] = kind;
    __threadfence();
    atomicExch(status + kStatusDone, 1);
  }
  __threadfence();
  atomicCAS(status + kStatusAbort, 0, kind);
}

// Polls between two reads of the abort flag (a power of two). The flag's
// read is an L2 round trip whose value the poll loop branches on before it
// issues the counter's load, so read at every poll it doubles the poll's
// period, and a hop's latency after its signal lands with it (the hops of
// the profiles: 1.1-1.2 us from a producer's end to its waiter's start).
// 16: read with the clock, once per 16 polls (an abort still reaches every
// waiter within ~10 us); 1: every poll.
#ifndef MEGAC_ABORT_EVERY
#define MEGAC_ABORT_EVERY 1
#endif
static_assert(MEGAC_ABORT_EVERY >= 1 && (MEGAC_ABORT_EVERY & (MEGAC_ABORT_EVERY - 1)) == 0,
              "MEGAC_ABORT_EVERY is a power of two");

// Bookkeeping for one bounded spin: the timer is read only after a few
// failed polls, so a wait that succeeds at once costs no timer read.
struct SpinBound {
  uint64_t deadline = 0;
  uint32_t polls = 0;
  bool expired = false;  // our own deadline passed (vs. someone else's abort)

  // True while the caller may keep spinning. Checks the abort flag every
  // MEGAC_ABORT_EVERY calls and the clock every 16 calls.
  __device__ __forceinline__ bool keep_going(const WaitSite& site) {
    ++polls;
    if ((polls & (MEGAC_ABORT_EVERY - 1u)) == 0u && abort_raised(site.status)) return false;
    if ((polls & 15u) == 0u) {
      const uint64_t now = globaltimer_ns();
      if (deadline == 0) {
        deadline = now + (site.timeout_ns ? site.timeout_ns : kDefaultWatchdogNs);
      } else if (now > deadline) {
        expired = true;
        return false;
      }
    }
    return true;
  }
};

}  // namespace megac

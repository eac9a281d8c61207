// The megakernel's body: one CTA per SM walks its task list
// (mk_core.cuh). `M` is the model (the generated constants of
// megakernel.cu), `Dispatch` the generated opcode switch: 
//
//   struct Dispatch {
//     static __device__ void resolve_fields(const Ctx&);  // dynamic fields -> values
//     static __device__ bool run(const Ctx&, int opcode);  // false: abort
//   };
#pragma once

#include <cstdint>
#include <type_traits>

#include "common.cuh"
#include "mk_core.cuh"

namespace megac {
namespace mk {

constexpr int cmax(int a) { return a; }
template <class... T>
constexpr int cmax(int a, T... rest) {
  const int b = cmax(rest...);
  return a > b ? a : b;
}

// Opcode device functions return void, or bool (false: a wait gave up).
template <class F>
__device__ __forceinline__ bool call(F f, const Ctx& c) {
  if constexpr (std::is_void_v<decltype(f(c))>) {
    f(c);
    return true;
  } else {
    return f(c);
  }
}

// Weight prefetch into L2 ahead of the task loop (rows::prefetch_head;
// weights are read-only during a launch, so any moment is safe):
//   0: none (the warps' own loads only);
//   1: the head of each task's tile, just before its waits;
//   2: the head of the NEXT task's tile as each task starts, so HBM streams
//      across the task boundary and through the next task's waits.
#ifndef MEGAC_OPROJ_L2  // ops_gemm.cuh says what it does
#define MEGAC_OPROJ_L2 0
#endif
#ifndef MEGAC_PREFETCH
#define MEGAC_PREFETCH 0
#endif
// The SM's next O-projection tile (within its next kOprojAhead tasks) toward
// L2 by warp 2, at normal priority (every weight stream is evict_first, so
// these lines outlast them): 1 as a QKV tile starts (beside MEGAC_QKV_L2's
// pull: the previous layer's tail, ~10 us under 1 TB/s in the fortieth
// session's H200 trace), 2 as the task after a QKV tile starts (this layer's
// routing hole, 4-10 us under 1.5 TB/s). Why: at batch 1 the O-projection
// tiles that end a layer start behind an up claim at ~34 us and stream their
// 256 KB after a 3 us merge; from L2 that stream is shorter. The QKV tile
// itself never reads them, so nothing waits on the pull. Measured beside
// MEGAC_QKV_L2 (H200, NMC 8K bs1, 8 engines a side against 9 of the
// default, forty-first session): 1 +3.5 %, 2 +2.4 % (MEGAC_QKV_L2 alone
// +1.2 %). The bytes pulled into the "idle" spans still slow the latency-
// bound chains running there. 0: off.
#ifndef MEGAC_OPROJ_AHEAD
#define MEGAC_OPROJ_AHEAD 0
#endif
constexpr int kOprojAhead = 4;

// ADD_RMSNORM's gamma toward L2 before its waits (ops_norm.cuh's norm_warm,
// through the warm hook below); defined here too: this header comes first.
#ifndef MEGAC_NORM_WARM
#define MEGAC_NORM_WARM 0
#endif

// Per-task timeline (compiled in with -DMEGAC_PROFILE=1; megac/gpu/profile.py
// points `megakernel_profile` at a [num_sms][max_tasks][kProfileWords]
// uint64 buffer): thread 0 records, per task, the global timer (ns) when its
// words landed, when its header waits were done, when the CTA finished it, a
// word opcode | claims << 8 | claim_wait_ns << 32 (claimers: records run and
// the time their record waits took), then the task's MEGAC_MARK stamps (0:
// not reached; profile_marks.cuh).
#ifndef MEGAC_PROFILE
#define MEGAC_PROFILE 0
#endif
#if MEGAC_PROFILE
// defined here: the header belongs to the one translation unit of the kernel
extern "C" __device__ unsigned long long* megakernel_profile = nullptr;
#endif
// 1: a static attention split (ATTN_DECODE) issues its first tensor-copy
// chunks before its waits, through the warm hook (ops_attention.cuh
// attn_prime, attn_mma.cuh prime_warp), in schedules of at most
// MEGAC_ATTN_PRIME_ROWS rows; 0: when it runs. Defined here: the hook's
// guard below needs it. Why batch 1: there the splits wait ~7 us for Q on
// otherwise idle SMs and their first chunk then landed 4-10 us after the
// wait (the split schedules' attention chain ends the layer); H200, North
// Mini Code 8K batch 1, kernel ms (twenty-fourth session, same engine):
// split schedules -0.9 / -1.3 / -2.5 %, the plain schedule -0.5 %; the
// fifteenth session's +1.6 % at batch 1 and even at batch 8 were of the
// plain schedule, whose attention chain ends early.
#ifndef MEGAC_ATTN_PRIME
#define MEGAC_ATTN_PRIME 1
#endif
#ifndef MEGAC_ATTN_PRIME_ROWS
#define MEGAC_ATTN_PRIME_ROWS 1
#endif
// uint64 words per task record: start, waits done, end, the opcode word, the marks
constexpr int kProfileWords = 4 + kProfileMarks;

// 1: the launch descriptor is copied into shared memory as the CTA starts and
// every opcode reads its pointers there; 0: from global memory. Why: a wait's
// acquire invalidates the SM's L1 (CCTL.IVALL), so the first descriptor field
// a task reads after its waits (the pointer to its inputs) was an L2 round
// trip on the critical path of every hop.
#ifndef MEGAC_DESC_SMEM
#define MEGAC_DESC_SMEM 1
#endif
// 1 (with MEGAC_DESC_SMEM): the layer-slot and RoPE tables copied as well
#ifndef MEGAC_DESC_TABLES
#define MEGAC_DESC_TABLES 1
#endif
// 1 (with MEGAC_DESC_SMEM): the step's per-row words (seq_pos, row_active:
// [max_rows] each, written by the host before the launch, read-only in it)
// copied as well, and the copy's fields pointing at them. Why (forty-third
// session, H100 profile): a full layer's claimed attention split reaches its
// first chunk 10.5 us after its hand-off, behind dependent L2 round trips
// (~1.4 us each while the up claims stream) of which split_keys' read of
// these words is the first; the QKV epilogue's KV write reads them too.
// 0: read from global memory. Not yet measured.
#ifndef MEGAC_DESC_ROWS
#define MEGAC_DESC_ROWS 0
#endif

#if MEGAC_OPROJ_AHEAD
// MEGAC_OPROJ_AHEAD's pull: the first O-projection among tasks k + 1 ..
// k + kOprojAhead of this CTA's `list` toward L2, one warp. Not inlined:
// inline in the task loop its scan spilled 88 bytes.
template <class Dispatch>
__device__ __noinline__ void oproj_ahead_l2(const LaunchDesc* d, const int32_t* list, int k, int n, int lane) {
  const Ctx c{d, nullptr, nullptr, 0, WaitSite{nullptr, 0, 0, 0, 0}, false};
  for (int j = k + 1; j < n && j <= k + kOprojAhead; ++j) {
    const int32_t* wj = list + int64_t(j) * TASK_WORDS;
    if (__ldg(wj + H_OPCODE) == OP_O_PROJ) {
      Dispatch::oproj_l2(c, wj, lane);
      return;
    }
  }
}
#endif

#if MEGAC_SLOTS_EARLY
// ops_gemm.cuh (included after this header): a timing probe's preload
template <class M>
__device__ __forceinline__ void slots_early(const Ctx& c, const int32_t* w, int lane);
#endif

template <class M, class Dispatch>
__device__ __forceinline__ void megakernel_body(const LaunchDesc* __restrict__ gdesc) {
  extern __shared__ __align__(1024) uint8_t smem[];  // the scratch's alignment (kScratchOffset) from here
#if MEGAC_DESC_SMEM
  // with the two small read-only tables a task reads after its waits: the
  // layer's slot in its weight stack (an expert claim's weight pointer) and
  // the RoPE frequencies (the QKV epilogue); the copy's fields point at them
  __shared__ __align__(16) LaunchDesc sdesc;
  __shared__ int32_t layer_slot[M::NUM_LAYERS];
  __shared__ float inv_freq[M::HEAD_DIM / 2];
  static_assert(sizeof(LaunchDesc) % 4 == 0, "copied as words");
  for (int i = threadIdx.x; i < int(sizeof(LaunchDesc) / 4); i += blockDim.x)
    reinterpret_cast<int32_t*>(&sdesc)[i] = reinterpret_cast<const int32_t*>(gdesc)[i];
  const int32_t* g_slot = ptr<const int32_t>(gdesc->layer_slot);
  const float* g_freq = ptr<const float>(gdesc->rope_inv_freq);
  for (int i = threadIdx.x; g_slot != nullptr && i < M::NUM_LAYERS; i += blockDim.x) layer_slot[i] = g_slot[i];
  for (int i = threadIdx.x; g_freq != nullptr && i < M::HEAD_DIM / 2; i += blockDim.x) inv_freq[i] = g_freq[i];
#if MEGAC_DESC_ROWS
  __shared__ int32_t seq_pos_s[M::MAX_ROWS], row_active_s[M::MAX_ROWS];
  const int32_t* g_pos = ptr<const int32_t>(gdesc->seq_pos);
  const int32_t* g_act = ptr<const int32_t>(gdesc->row_active);
  for (int i = threadIdx.x; g_pos != nullptr && i < M::MAX_ROWS; i += blockDim.x) seq_pos_s[i] = g_pos[i];
  for (int i = threadIdx.x; g_act != nullptr && i < M::MAX_ROWS; i += blockDim.x) row_active_s[i] = g_act[i];
#endif
  __syncthreads();
  if (MEGAC_DESC_TABLES && threadIdx.x == 0) {
    if (g_slot != nullptr) sdesc.layer_slot = reinterpret_cast<uint64_t>(layer_slot);
    if (g_freq != nullptr) sdesc.rope_inv_freq = reinterpret_cast<uint64_t>(inv_freq);
  }
#if MEGAC_DESC_ROWS
  if (threadIdx.x == 0) {  // generic pointers into shared memory: every reader's plain loads take them
    if (g_pos != nullptr) sdesc.seq_pos = reinterpret_cast<uint64_t>(seq_pos_s);
    if (g_act != nullptr) sdesc.row_active = reinterpret_cast<uint64_t>(row_active_s);
  }
#endif
  __syncthreads();
  const LaunchDesc* desc = &sdesc;
#else
  const LaunchDesc* desc = gdesc;
#endif
  TaskShared* ts = reinterpret_cast<TaskShared*>(smem);
  Ctx c{desc, ts, smem + kScratchOffset, M::SCRATCH_BYTES,
        WaitSite{ptr<int32_t>(desc->status), desc->watchdog_ns, 0, 0, 0}, false};
  uint32_t dyn;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
  if (dyn < uint32_t(kScratchOffset + M::SCRATCH_BYTES)) {  // the host launched with too little
    if (threadIdx.x == 0) report_error(c.site.status, -1, -1, -1, int32_t(dyn), M::SCRATCH_BYTES, -1, kErrBadTask);
    return;
  }
  const int sm = blockIdx.x;
  const int n = ptr<const int32_t>(desc->task_counts)[sm];
  if (threadIdx.x == 0) {  // visible after the loop's first barrier
    rows::ring_init(&ts->ring);
    attn_mma::tma_init(&ts->tma);
    tc::bulk_init(&ts->tc);
  }
  const int32_t* list = ptr<const int32_t>(desc->tasks) + int64_t(sm) * desc->max_tasks * TASK_WORDS;
  // The next task's words are loaded while this one runs (a load per task
  // on the critical path cost ~0.6 us of dispatch); with MEGAC_PREFETCH 2
  // the words two tasks ahead, for the prefetch of the next task's weights.
  int32_t next = (threadIdx.x < TASK_WORDS && n > 0) ? __ldg(list + threadIdx.x) : 0;
#if MEGAC_PREFETCH == 2
  int32_t next2 = (threadIdx.x < TASK_WORDS && n > 1) ? __ldg(list + TASK_WORDS + threadIdx.x) : 0;
#endif
  int k = 0;
  for (; k < n; ++k) {
    if (threadIdx.x < TASK_WORDS) {
      ts->w[threadIdx.x] = next;
#if MEGAC_PREFETCH == 2
      ts->nw[threadIdx.x] = next2;
      next = next2;
      if (k + 2 < n) next2 = __ldg(list + int64_t(k + 2) * TASK_WORDS + threadIdx.x);
#else
      if (k + 1 < n) next = __ldg(list + int64_t(k + 1) * TASK_WORDS + threadIdx.x);
#endif
    }
    __syncthreads();
#if MEGAC_PREFETCH > 0
    if (threadIdx.x < 32) {
      if (MEGAC_PREFETCH == 1 || k == 0) Dispatch::prefetch(c, ts->w, threadIdx.x);
      if (MEGAC_PREFETCH == 2 && k + 1 < n) Dispatch::prefetch(c, ts->nw, threadIdx.x);
    }
#endif
#if MEGAC_OPROJ_L2 && MEGAC_PREFETCH == 2
    if (threadIdx.x >= 32 && threadIdx.x < 64 && k + 1 < n && ts->nw[H_OPCODE] == OP_O_PROJ)
      Dispatch::oproj_l2(c, ts->nw, threadIdx.x & 31);
#endif
    const int op = ts->w[H_OPCODE];
    const int32_t sig = ts->w[H_SIGNAL];  // read now: the next task's words overwrite ts->w
    c.site.task = k;
    c.site.opcode = op;
    c.site.layer = ts->w[H_LAYER];
#if MEGAC_PROFILE
    uint64_t t_start = 0, t_waited = 0;
    if (threadIdx.x == 0) {
      t_start = globaltimer_ns();
      ts->claims = 0;
      ts->claim_wait_ns = 0;
      for (int i = 0; i < kProfileMarks; ++i) profile_marks[i] = 0;
    }
#endif
#if MEGAC_ATTN_WARM || MEGAC_NORM_WARM || MEGAC_ATTN_PRIME
    if (threadIdx.x < 32) Dispatch::warm(c, ts->w, threadIdx.x);
#endif
    // weights never depend on the waits: a static GEMM's first chunks stream
    // while thread 0 waits for its inputs
    c.primed = (rows::kEarly || tc::kBulk) && Dispatch::prime(c, ts->w);
#if MEGAC_SLOTS_EARLY
    // a folding task's slots and scores before its waits (ops_gemm.cuh; a timing probe)
    if (threadIdx.x >= 32 && threadIdx.x < 64) slots_early<M>(c, ts->w, threadIdx.x & 31);
#endif
#if MEGAC_QKV_L2
    // a QKV tile's whole weight span toward L2 behind its prime's copies, while
    // its waits (the layer's tail) run (ops_gemm.cuh); warp 1: thread 0 waits
    if (op == OP_QKV_PROJ && threadIdx.x >= 32 && threadIdx.x < 64) Dispatch::qkv_l2(c, ts->w, threadIdx.x & 31);
#endif
#if MEGAC_OPROJ_AHEAD
    // the task words come from the list in global memory (read-only in a
    // launch): nothing more held in registers across the task
    if (threadIdx.x >= 64 && threadIdx.x < 96 &&
        (MEGAC_OPROJ_AHEAD == 1 ? op == OP_QKV_PROJ
                                : k > 0 && __ldg(list + int64_t(k - 1) * TASK_WORDS + H_OPCODE) == OP_QKV_PROJ))
      oproj_ahead_l2<Dispatch>(desc, list, k, n, threadIdx.x & 31);
#endif
    if (threadIdx.x == 0) {
      ts->task = k;
      ptr<int32_t>(desc->progress)[sm] = k;  // where this CTA is, for the watchdog report
      ts->ok = header_waits(c, [](const Ctx& cc) { Dispatch::resolve_fields(cc); }) ? 1 : 0;
    }
#if MEGAC_PROFILE
    if (threadIdx.x == 0) t_waited = globaltimer_ns();
#endif
    __syncthreads();
    if (!ts->ok) {
      cp_async_wait<0>();  // no copy of a primed tile outlives the CTA
      tc::drain(&ts->tc);
      if (threadIdx.x == 0) attn_mma::tma_drain(&ts->tma);
      break;
    }
    const bool ok = Dispatch::run(c, op);
    // this task's generic writes to the scratch before the copy engine
    // writes the next GEMM's rings there (gemm_tc.cuh)
    if constexpr (tc::kBulk) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
#if MEGAC_PROFILE
    if (threadIdx.x == 0 && megakernel_profile != nullptr) {
      unsigned long long* p = megakernel_profile + (int64_t(sm) * desc->max_tasks + k) * kProfileWords;
      p[0] = t_start;
      p[1] = t_waited;
      p[2] = globaltimer_ns();
      p[3] = uint64_t(uint32_t(op) & 0xffu) | (uint64_t(ts->claims & 0xffffffu) << 8) |
             (uint64_t(ts->claim_wait_ns) << 32);
      for (int i = 0; i < kProfileMarks; ++i) p[4 + i] = profile_marks[i];
    }
#endif
    if (!ok || !ts->ok) break;
    if (threadIdx.x == 0) signal(c, sig);
  }
  // n: every task of this CTA signalled (the report then never blames it)
  if (k == n && threadIdx.x == 0) ptr<int32_t>(desc->progress)[sm] = n;
}

}  // namespace mk
}  // namespace megac

// The megakernel's task loop: one CTA per SM walks its list of 32-word tasks
// (tasks[sm, :task_counts[sm]]), waits on the header's counters, runs the
// opcode, and signals.
//
// This first assembly runs every task with the whole CTA in lock step
// (wait -> run -> signal, separated by CTA barriers): the semantics of the
// ABI (megac/abi.py) in their plainest device form, against which faster
// forms are checked. Per task:
//
//   1. the 32 words land in shared memory;
//   2. thread 0 reads TARGET0 (a dynamic target word is read before any
//      wait: only host-written words may be), waits WAIT0, then reads
//      TARGET1 and every dynamic field (device-written words are ordered by
//      WAIT0), waits WAIT1; every wait is bounded by the watchdog;
//   3. the opcode runs (generated dispatch, megakernel.cu). A claimer instead
//      claims records one by one with an atomic cursor (thread 0 claims and
//      publishes the record in shared memory, so every warp runs the same
//      claimed task), waits the claimed task's counter, runs it, signals
//      its counter, until the queue is drained;
//   4. a CTA barrier orders every thread's stores before thread 0's
//      gpu-scope fence and atomic add on SIGNAL.
//
// A wait that expires writes the error record and raises the abort word
// (common.cuh); every CTA leaves its loop at its next wait.
#pragma once

#include <cstdint>

#include "attn_mma.cuh"
#include "common.cuh"
#include "profile_marks.cuh"
#include "counters.cuh"
#include "gemm_ring.cuh"
#include "gemm_tc.cuh"
#include "generated/megac_abi.h"

// Per-task timeline build (megakernel.cuh, megac/gpu/profile.py); here for
// the claim loop's own counts, which only that build keeps.
#ifndef MEGAC_PROFILE
#define MEGAC_PROFILE 0
#endif

namespace megac {
namespace mk {

// What thread 0 shares with the CTA about the current task.
struct TaskShared {
  int32_t w[TASK_WORDS];       // the task, dynamic fields resolved to values
  int32_t nw[TASK_WORDS];      // the next task's words as compiled (prefetch of its weights)
  int32_t rec[QUEUE_RECORD_WORDS];  // the claimed record (claimers)
  int32_t ok;                  // 0 once a wait gave up (abort)
  int32_t claimed;             // 1 while a claimed record is published
  int32_t task;                // index in this CTA's list
  int32_t claim_signal;        // counter the claimed record signals (-1: none)
  rows::RingState ring;        // the GEMM weight ring's barriers (gemm_ring.cuh), per launch
  tc::BulkState tc;            // the tensor-core tile's per-warp rings (gemm_tc.cuh), per launch
  attn_mma::TmaState tma;      // the attention splits' per-warp tensor-copy rings (attn_mma.cuh), per launch
  uint32_t claims;             // records this claimer task ran (profile)
  uint32_t claim_wait_ns;      // time its record waits took (profile)
  int32_t early;               // 1: the claimed tile's ring primed before its wait (claim_loop's Early)
  int32_t pad[1];
};
static_assert(sizeof(TaskShared) % 16 == 0, "keeps the scratch that follows aligned");

// Where the opcodes' scratch starts in the dynamic shared memory: after
// TaskShared, aligned up to MEGAC_SCRATCH_ALIGN bytes. The GEMM rings' 1 KB
// bulk copies land at fixed offsets from it, and where the scratch starts
// moves the whole step (eighteenth session, NMC): 64 bytes past a 128-byte
// line (TaskShared's 960 bytes, every build before) against 1024-aligned,
// 2-3 % slower at batch 1 and 5-6 % at batch 4 and 8; 16 bytes past one,
// ~9 % slower than 64.
#ifndef MEGAC_SCRATCH_ALIGN
#define MEGAC_SCRATCH_ALIGN 1024
#endif
constexpr int kScratchOffset =
    (int(sizeof(TaskShared)) + MEGAC_SCRATCH_ALIGN - 1) / MEGAC_SCRATCH_ALIGN * MEGAC_SCRATCH_ALIGN;

// Per-launch view the opcodes read: the descriptor and this CTA's shared
// scratch (from kScratchOffset, M::SCRATCH_BYTES of it).
struct Ctx {
  const LaunchDesc* d;
  TaskShared* ts;
  uint8_t* scratch;
  int scratch_bytes;
  WaitSite site;
  bool primed;  // the dispatcher primed this task's GEMM pipelines (ops_gemm.cuh)
  // a routed up claim's X copies (cp.async) went out with its primed ring's
  // first stages before the claim loop (ops_moe.cuh MEGAC_UP_FIRST_EARLY):
  // the GEMM waits for them instead of staging X
  bool x_issued = false;
};

template <class T>
__device__ __forceinline__ T* ptr(uint64_t p) {
  return reinterpret_cast<T*>(p);
}

// A count or target: itself, or the target word it names. Device-written
// words are read through L2 only (the acquire that orders them invalidated
// this SM's L1, but a plain load could still hit a line fetched earlier).
__device__ __forceinline__ int32_t resolve(const LaunchDesc* d, int32_t v) {
  if (!is_dyn(v)) return v;
  return __ldcg(ptr<const int32_t>(d->targets) + dyn_index(v));
}

__device__ __forceinline__ bool wait_on(const Ctx& c, int32_t counter, int32_t target) {
  if (counter < 0) return true;
  const uint32_t* ctr = ptr<const uint32_t>(c.d->counters) + counter;
  return wait_counter(ctr, static_cast<uint32_t>(target), counter, c.site);
}

// 1: a task with two waits of static targets polls both counters together
// (counters.cuh wait_counters2), then resolves its fields: the first wait
// of a QKV or router tile (the O-projection's counter) ends last in the
// split schedules, and the combine's counter behind it then cost another
// loaded round trip at the start of every MoE layer's two chains. 0: one
// wait after the other.
#ifndef MEGAC_WAIT_PAIR
#define MEGAC_WAIT_PAIR 0
#endif

// A MOE_COMBINE task of a build whose combine polls the down tiles'
// outputs instead of their counter (not split-K: those sum the up claims'
// partials, which wait as before). Its WAIT1 is that counter (WAIT0 the
// route's, whose slots and weights it reads).
__device__ __forceinline__ bool combine_polls(const int32_t* w) {
  return MEGAC_COMBINE_POLL && w[H_OPCODE] == OP_MOE_COMBINE && !(w[H_FLAGS] & FLAG_SPLIT_DOWN);
}

// A one-row routed up claimer of a build whose claimers poll the router's
// partials instead of its counter (MEGAC_ROUTER_POLL, common.cuh): its WAIT0
// is the router's counter (its only header wait: tests/test_router_poll.py),
// left unread; its claims wait on the norm themselves (TASK_WAIT_BASE).
// MEGAC_ROUTER_POLL_FULL: only a full-attention layer's claimers poll.
__device__ __forceinline__ bool full_layer(int layer) {
  const uint32_t mask = layer < 32 ? uint32_t(MEGAC_FULL_LAYERS_LO) : uint32_t(MEGAC_FULL_LAYERS_HI);
  return layer < 64 && ((mask >> (layer & 31)) & 1u);
}

__device__ __forceinline__ bool router_polls(const int32_t* w) {
  return MEGAC_ROUTER_POLL && w[H_OPCODE] == OP_MOE_UPGATE_DRAIN && w[f_moe_upgate_drain::ROUTE_SPLITS] > 0 &&
         w[f_moe_upgate_drain::NUM_ROWS] == 1 && w[f_moe_upgate_drain::TASK_WAIT_BASE] >= 0 &&
         !(w[H_FLAGS] & FLAG_NORM_IN) && w[H_WAIT1] < 0 && (!MEGAC_ROUTER_POLL_FULL || full_layer(w[H_LAYER]));
}

// A TIMING PROBE, not a candidate (its reads are not ordered: the logits
// are wrong): a QKV tile that folds its norm (FLAG_NORM_IN: every MoE layer
// past the first at batch 1) skips its header waits (the O-projection's and
// the down claims' counters) and folds whatever the planes hold when its SM
// reaches it. What it measures: the whole worth of the attention chain
// starting before the layer before has ended, the bound of any pipelined
// layer boundary on that chain (the fifty-sixth session's cost model: -1.8 %,
// which overstates that chain ~3x). Near the default: the expert chain
// gates and levers on the attention chain's head are spent. 0: off.
#ifndef MEGAC_PROBE_QKV_NO_WAIT
#define MEGAC_PROBE_QKV_NO_WAIT 0
#endif

// Thread 0: the header waits of the task in c.ts->w; after WAIT0,
// `resolve_fields(c)` turns the opcode's dynamic fields into values, then
// TARGET1 is read and WAIT1 waited. False: the watchdog fired or another
// CTA aborted.
template <class ResolveFields>
__device__ __forceinline__ bool header_waits(const Ctx& c, ResolveFields resolve_fields) {
  int32_t* w = c.ts->w;
  if (MEGAC_PROBE_QKV_NO_WAIT && w[H_OPCODE] == OP_QKV_PROJ && (w[H_FLAGS] & FLAG_NORM_IN)) {
    resolve_fields(c);
    return true;
  }
  if (MEGAC_WAIT_PAIR && w[H_WAIT0] >= 0 && w[H_WAIT1] >= 0 && !is_dyn(w[H_TARGET0]) && !is_dyn(w[H_TARGET1]) &&
      !combine_polls(w)) {
    // a field resolved after both waits reads what it would after the first
    const uint32_t* ctr = ptr<const uint32_t>(c.d->counters);
    if (!wait_counters2(ctr + w[H_WAIT0], uint32_t(w[H_TARGET0]), w[H_WAIT0], ctr + w[H_WAIT1],
                        uint32_t(w[H_TARGET1]), w[H_WAIT1], c.site))
      return false;
    resolve_fields(c);
    return true;
  }
  if (router_polls(w)) {  // its one wait, the router's, is its poll of the partials (ops_moe.cuh)
    if constexpr (MEGAC_ROUTER_POLL == 2) {
      // the claims' own wait (the norm that writes x_norm) first, so the poll
      // loads nothing while the router runs; the claimer then clears it from
      // its words (ops_moe.cuh): met here, no claim waits again
      const int32_t t = resolve(c.d, w[f_moe_upgate_drain::TASK_WAIT_TARGET]);
      if (!wait_on(c, w[f_moe_upgate_drain::TASK_WAIT_BASE], t)) return false;
    }
    resolve_fields(c);
    return true;
  }
  const int32_t t0 = resolve(c.d, w[H_TARGET0]);
  if (!wait_on(c, w[H_WAIT0], t0)) return false;
  resolve_fields(c);
  // a combine that polls its inputs (MEGAC_COMBINE_POLL) skips WAIT1, the
  // down claims' counter
  if (w[H_WAIT1] >= 0 && !combine_polls(w)) {
    const int32_t t1 = resolve(c.d, w[H_TARGET1]);
    if (!wait_on(c, w[H_WAIT1], t1)) return false;
  }
  return true;
}

__device__ __forceinline__ void signal(const Ctx& c, int32_t counter) {
  if (counter >= 0) signal_counter(ptr<uint32_t>(c.d->counters) + counter);
}

// Claim loop of one claimer task (every thread calls it). `source(rec)`
// (thread 0) claims the next record into rec and returns false once the
// queue is drained (QueueSource below: the queue head's atomic and the
// record in memory; routed expert claims derive theirs, ops_moe.cuh).
// `offsets(rec, &wo, &so)` gives the claimed record's wait and signal
// offsets (the ABI's, per queue); `prefetch(rec)` (thread 0) starts the
// claimed record's inputs toward L2 before its wait; `run()` runs the record
// published in c.ts->rec with the whole CTA. (Issuing a claimed expert
// tile's first bulk-copy stages before the claim's wait was measured slower
// on the H200, tenth session: the claim's wait ended 2.2 us later and the
// stage landed no sooner; docs/perf-notes.md.)
//
// `early` (Early::kOn, every thread): where the claim's counter is not yet
// met when thread 0 first reads it, early(rec) primes the claimed tile's
// ring, then thread 0 waits, and run() finds c.ts->early set (the tile goes
// on from the primed stages). Thread 0 reads the counter once (an acquire,
// as the wait's first read) and a met claim runs as without it; so only a
// claim that would idle primes, with the whole CTA, not thread 0 before its
// poll (the tenth session's form). Early::kAlways: every claim with a wait
// primes first, its counter read only by the wait after (a claim whose
// counter is met then saves the read's round trip before its first copies).
// early.drain() (thread 0): a primed claim given up after its failed wait
// waits there for copies of a ring other than the GEMM's (drained here).
// 1: a claim with an Early hook (the down claims' MEGAC_DOWN_PRIME 1, the
// claimed attention splits') whose counter thread 0's first read finds met
// goes on from that read: the read is an acquire, which is all
// wait_counter would do with a met counter. 0: wait_on reads the counter
// again, a second dependent L2 round trip before the claim's first copies.
// At batch 1 the late down claims (claimed after their expert's up tiles
// ended, unprimed: the ones that end a sliding layer, thirty-fifth
// session's per-SM view) pay it on the critical path. The default since the
// thirty-sixth session, with MEGAC_TOPK_WARP and MEGAC_UP_ONE_CLAIM (TILES s35,
// geometry.py's router_splits / routed_combine_splits / lm_bn, tuned.yaml's
// moe_routed_full): docs/perf-notes.md
#ifndef MEGAC_CLAIM_ONE_READ
#define MEGAC_CLAIM_ONE_READ 1
#endif

// Whether one claim a claimer covers a queue of `claims` claims: every SM
// runs exactly one claimer of each claimer node a layer (passes/assign.py
// checks it), so with no more claims than SMs the first arrivals take them
// all, one each, and a claimer that ran one may stop before the head's
// atomic: no index is taken that no claim runs, and none is left.
__device__ __forceinline__ bool one_claim_each_covers(int32_t claims) { return claims <= int32_t(gridDim.x); }

// 0: a down claimer takes one record a claim. T > 0: the down queue's first
// records go two at a time (adjacent tiles of one expert, one GEMM over both),
// its last T one at a time (ops_moe.cuh DownPairSource), with down tiles
// half as long (TILES dn128p). Why: at batch 1 the claims taken after the
// up tiles end are the ones that end a sliding layer (~13 of them, ~10 us
// each, 3.9 to the first byte; thirty-fourth session's layer 22), while ~19
// more SMs ask then and find the queue drained; halves spread that tail over
// twice the SMs, and the early claimers keep whole tiles (128-row tiles for
// every claim lost ~3 %: each claim pays its start for half the bytes).
#ifndef MEGAC_DOWN_PAIRS
#define MEGAC_DOWN_PAIRS 0
#endif

// 0: a routed up claimer (batch 1) takes one up tile a claim. T > 0: the
// layer's first claims take two adjacent up tiles of one expert (one GEMM
// over both), its last T one each (ops_moe.cuh moe_up_claims), with up
// tiles half as long (TILES up128p: 1 MB pairs, 512 KB singles). Why: at
// batch 1 ~19 SMs claim as routing ends (the router's and the free ones)
// and ~29 QKV SMs ~7 us later, after their QKV tile; every claim streams
// 1 MB, so the late claims end ~8 us after the early ones and each
// expert's down claims wait for its slowest up tile (forty-seventh
// session's layer 22: up claims end 28-30 early, 36-38 late, the down
// phase 38-51). Guided self-scheduling: the early claimers keep whole
// tiles, the late ones take halves and end with them. Measured (H100,
// fiftieth session, NMC bs1 8K, engines alternating): T 56 +1.8 %, T 48
// +1.4 %, T 56 with MEGAC_DOWN_PAIRS 26 +1.2 %: the layer's middle is
// bandwidth-bound, so the late halves end no sooner, each pays a claim's
// preamble for half the bytes, and twice the QKV SMs hold an up claim when
// their O-projection tiles would start. Off; correct on the GPU (the
// one-row NMC slice against fp32, min cosine 0.99997).
#ifndef MEGAC_UP_PAIRS
#define MEGAC_UP_PAIRS 0
#endif

// How many queue records a claimed record covers (its Offsets' count where
// it has one: the down claims' under MEGAC_DOWN_PAIRS, the up claims' under
// MEGAC_UP_PAIRS; else 1).
template <class Offsets>
__device__ __forceinline__ auto claim_records_impl(const Offsets& o, const int32_t* rec, int)
    -> decltype(o.count(rec)) {
  return o.count(rec);
}
template <class Offsets>
__device__ __forceinline__ int32_t claim_records_impl(const Offsets&, const int32_t*, long) {
  return 1;
}
template <class Offsets>
__device__ __forceinline__ int32_t claim_records(const Offsets& o, const int32_t* rec) {
  return claim_records_impl(o, rec, 0);
}

struct NoEarly {
  static constexpr bool kOn = false;
  static constexpr bool kAlways = false;  // prime every claim, its counter unread (kOn only)
  __device__ void operator()(const int32_t*) const {}
  // thread 0, a primed claim given up (its wait failed), after the GEMM
  // ring's drain: an Early priming another ring waits for its copies here
  __device__ void drain() const {}
};

template <class Source, class Offsets, class Prefetch, class Run, class Early = NoEarly>
__device__ __forceinline__ bool claim_loop(const Ctx& c, Source source, int wait_base_field, int wait_target_field,
                                           int signal_base_field, Offsets offsets, Prefetch prefetch, Run run,
                                           Early early = {}) {
  TaskShared* ts = c.ts;
  for (;;) {
    [[maybe_unused]] int32_t wait_ctr = -1, wait_target = 0;
#if MEGAC_PROFILE
    [[maybe_unused]] uint64_t t0 = 0;
#endif
    if (threadIdx.x == 0) {
      const int32_t* w = ts->w;
      int claimed = source(ts->rec);
      int defer = 0;
      if (claimed) {
        MEGAC_MARK(0);  // the queue head's atomic and the record's loads
        prefetch(ts->rec);
        int32_t wo = 0, so = 0;
        offsets(ts->rec, wo, so);
        const int32_t wb = w[wait_base_field];
#if MEGAC_PROFILE
        t0 = globaltimer_ns();
#endif
        if constexpr (Early::kOn) {
          if (wb >= 0) {
            wait_ctr = wb + wo;
            wait_target = resolve(c.d, w[wait_target_field]);
            if (Early::kAlways) {
              defer = 1;
            } else {
              defer = ld_acquire_gpu(ptr<const uint32_t>(c.d->counters) + wait_ctr) < uint32_t(wait_target);
              // the acquire that saw the count met is the whole wait (wait_counter's own first read)
              if (MEGAC_CLAIM_ONE_READ && !defer) wait_ctr = -1;
            }
          }
          if (!defer && !wait_on(c, wait_ctr, wait_target)) {
            ts->ok = 0;
            claimed = 0;
          }
        } else if (wb >= 0 && !wait_on(c, wb + wo, resolve(c.d, w[wait_target_field]))) {
          ts->ok = 0;
          claimed = 0;
        }
#if MEGAC_PROFILE
        if (!defer) {
          ts->claims += 1;
          ts->claim_wait_ns += uint32_t(globaltimer_ns() - t0);
        }
#endif
        if (!defer) MEGAC_MARK(1);  // the claim's own wait
        const int32_t sb = w[signal_base_field];
        ts->claim_signal = sb >= 0 ? sb + so : -1;
#if MEGAC_DOWN_PAIRS || MEGAC_UP_PAIRS
        // a claim of two records (paired down or up claims) signals twice in
        // one add (counter indices stay below 2^24: the count rides above them)
        if (sb >= 0) ts->claim_signal |= (claim_records(offsets, ts->rec) - 1) << 24;
#endif
      }
      ts->claimed = claimed;
      if constexpr (Early::kOn) ts->early = defer;
    }
    __syncthreads();
    if (!ts->claimed || !ts->ok) return ts->ok != 0;
    if constexpr (Early::kOn) {
      if (ts->early) {
        // this thread's generic writes to the scratch (the last claim's)
        // before the copy engine writes the ring there, as between tasks
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        early(ts->rec);
        if (threadIdx.x == 0) {
          if (!wait_on(c, wait_ctr, wait_target)) ts->ok = 0;
#if MEGAC_PROFILE
          ts->claims += 1;
          ts->claim_wait_ns += uint32_t(globaltimer_ns() - t0);
#endif
          MEGAC_MARK(1);  // the claim's own wait (its ring primed)
        }
        __syncthreads();
        if (!ts->ok) {
          tc::drain(&ts->tc);  // no primed copy lands in a CTA that has left
          if (threadIdx.x == 0) early.drain();
          return false;
        }
      }
    }
    MEGAC_MARK(8);  // the claim handed to the CTA (past the claim loop's barrier)
    run();
    __syncthreads();
    MEGAC_MARK(6);  // the claimed tile's work (its GEMM stamps 2-5 on the way)
#if MEGAC_DOWN_PAIRS || MEGAC_UP_PAIRS
    if (threadIdx.x == 0 && ts->claim_signal >= 0)
      signal_counter(ptr<uint32_t>(c.d->counters) + (ts->claim_signal & 0xffffff), 1u + (ts->claim_signal >> 24));
#else
    if (threadIdx.x == 0) signal(c, ts->claim_signal);
#endif
  }
}

// The records of a claimer queue in memory: the queue head's atomic, then
// the record, while the index is below the word's QUEUE_LEN.
struct QueueSource {
  const Ctx& c;
  int queue_field, len_field, num_layers;
  // the layer's queue head: one atomic a claim takes the next index
  __device__ uint32_t* head(int32_t layer, int32_t queue) const {
    return ptr<uint32_t>(c.d->queue_heads) + queue * num_layers + layer;
  }
  // record idx of the layer's queue into rec
  __device__ void load(int32_t layer, int32_t queue, uint32_t idx, int32_t* rec) const {
    const int32_t* q;
    if (queue == QUEUE_ATTN)
      q = ptr<const int32_t>(c.d->attn_queue);
    else if (queue == QUEUE_MOE_UP)
      q = ptr<const int32_t>(c.d->moe_up_queue) + int64_t(layer) * c.d->moe_queue_cap * QUEUE_RECORD_WORDS;
    else
      q = ptr<const int32_t>(c.d->moe_down_queue) + int64_t(layer) * c.d->moe_queue_cap * QUEUE_RECORD_WORDS;
    for (int i = 0; i < QUEUE_RECORD_WORDS; ++i) rec[i] = __ldcg(q + int64_t(idx) * QUEUE_RECORD_WORDS + i);
  }
  __device__ bool operator()(int32_t* rec) const {
    const int32_t* w = c.ts->w;
    const int32_t layer = w[H_LAYER];
    const int32_t queue = w[queue_field];
    const uint32_t idx = atomicAdd(head(layer, queue), 1u);
    if (static_cast<int32_t>(idx) >= w[len_field]) return false;
    load(layer, queue, idx, rec);
    return true;
  }
};

template <class Offsets, class Prefetch, class Run, class Early = NoEarly>
__device__ __forceinline__ bool claim_loop(const Ctx& c, int queue_field, int len_field, int wait_base_field,
                                           int wait_target_field, int signal_base_field, Offsets offsets,
                                           Prefetch prefetch, Run run, int num_layers, Early early = {}) {
  return claim_loop(c, QueueSource{c, queue_field, len_field, num_layers}, wait_base_field, wait_target_field,
                    signal_base_field, offsets, prefetch, run, early);
}

}  // namespace mk
}  // namespace megac

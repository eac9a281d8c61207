// Standalone persistent test kernel for ATTN_DECODE + ATTN_COMBINE
// (opcodes/attention.cuh): grid = SM count (cooperative launch). Decode slots
// (row, kv head, split) are dealt round-robin over CTAs, the same way every
// step, and each CTA runs its slots of all steps as one decode stream: its
// producer warp issues the K/V tiles, its compute warps attend, one more
// warp (the control warp) does everything that touches counters: the
// buffer-free wait before a partial is stored, the arrival, and the fused
// combine; a last warp runs spread merges. Compute threads never fence, and
// the producer never waits for a task's epilogue, so the ring keeps
// streaming across task boundaries.
//
// `phases` bits:
//   1 decode          2 separate combine phase      4 fused combine
//  32 spread merges: every merge is cut into one piece per query head
//     (megac::attn::combine_head_warp) and the pieces of step e are dealt
//     over every CTA's merge warp (the block's last warp, idle otherwise),
//     which runs them as soon as their arrivals are in, beside the decodes
//     of the next step (a step stands for a layer here).
//   8 combine CTAs: the last `comb_ctas` CTAs of the grid only merge (every
//     thread of the CTA), step after step, each waiting on its (row, kv
//     head)'s arrival counter; the decode slots are dealt over the others,
//     whose control warps just count arrivals. The standalone ATTN_COMBINE
//     task of a schedule that gives the merges their own SMs.
// 1|4 (the default): the last split of each (row, kv head) to arrive is
// merged by that CTA's control warp while its compute warps stream on.
// 1|2: after each step's decodes, combine tasks (row, kv head) dealt
// round-robin wait on their arrival counter through a bounded wait
// (megac::cta_wait_counter, 2 s watchdog); the stream then restarts every
// step. 1: decode only. 2: combine only (watchdog test).
//
// Counters are never reset between launches of one configuration: steps are
// numbered across launches (`epoch` = number of the launch's first step).
#include <cstdint>
#include <cuda_bf16.h>

#include "../attention.cuh"
#include "../counters.cuh"

namespace {

constexpr int kPhaseDecode = 1;
constexpr int kPhaseCombine = 2;
constexpr int kPhaseFused = 4;
constexpr int kPhaseCombineCtas = 8;
constexpr int kPhaseSpread = 32;
constexpr int kOpDecode = 2;
constexpr int kOpCombine = 4;
constexpr int kBufs = 4;

// Global step e = epoch + r uses partial buffer (e-1) % kBufs, arrival
// counters arrive[(e-1) % kBufs] and page-table copy (e-1) % pt_copies.
// Before a decode of step e > kBufs stores its partial it waits until the
// combine of step e-kBufs on its (row, kv head) has read that buffer (done
// counter). Arrivals of steps e and e+kBufs on one counter therefore never
// interleave. A step stands for one layer's attention: in a megakernel each
// layer has its own partials, so the only reuse is across decode steps;
// four buffers keep this test's reuse from coupling steps more tightly than
// that (with two, a late merge stalled the decodes two steps on).
// counters: [0, kBufs*nrk) arrivals, [kBufs*nrk, (kBufs+1)*nrk) merges done.
struct Launch {
  const __nv_bfloat16* q;
  const __nv_bfloat16* k_pool;
  const __nv_bfloat16* v_pool;
  const int32_t* page_table;
  const int32_t* seq_len;
  const int32_t* chunk_splits;
  const int32_t* merge_splits;
  float* o_part;
  float* lse_part;
  __nv_bfloat16* out;
  uint32_t* counters;
  int32_t* status;
  int rows, kv_heads, pt_stride, split_stride, window;
  float scale;
  int epoch, phases, pt_copies;
  int q_heads, nrk, per;  // per: decode slots of this CTA per step
  int dec_ctas;           // CTAs 0..dec_ctas-1 decode
  const void* tmap_k;     // tensor maps over the pools (TMA variants only)
  const void* tmap_v;
};

// Step e's output: one per partial buffer as well, so a late merge of step e
// never lands on a later step's output.
template <int HD>
__device__ __forceinline__ __nv_bfloat16* out_of(const Launch& L, int e) {
  return L.out + (size_t)((e - 1) % kBufs) * L.rows * L.q_heads * HD;
}

// Hand-offs between the compute warps (the decode stream) and the control
// warp, once per task, in this order:
//   control: [wait until the task's partial buffer is free]  arrive(kMayWrite)
//   compute: sync(kMayWrite)  store the partial  arrive(kWritten)
//   control: sync(kWritten)   count the arrival / merge as the last arriver
// Each side passes one barrier only after the other side's previous arrival
// on the other one, so no barrier is ever arrived at twice in one phase.
constexpr int kBarWritten = 2;
constexpr int kBarMayWrite = 3;

template <int HD, int GQA, int BLOCK, int NWARPS, int STAGES, int PWARPS, bool TMA, int KPW>
struct TestTasks {
  using S = megac::attn::DecodeStream<HD, GQA, BLOCK, NWARPS, STAGES, PWARPS, TMA, KPW>;
  static constexpr int NT = NWARPS * 32;
  static constexpr int NALL = NT + 32;
  const Launch& L;
  int first_step;  // slot i belongs to step first_step + i / L.per

  __device__ __forceinline__ void slot(int i, int& e, int& row, int& kvh, int& split) const {
    e = first_step + i / L.per;
    const int t = blockIdx.x + (i % L.per) * L.dec_ctas;
    split = t % L.split_stride;
    const int rk = t / L.split_stride;
    row = rk / L.kv_heads;
    kvh = rk % L.kv_heads;
  }

  // The decode stream's task source: the row's length and split counts are
  // fetched a task ahead (megac::attn::TaskPrefetch).
  __device__ __forceinline__ megac::attn::TaskPrefetch fetch(int i) const {
    int e, row, kvh, split;
    slot(i, e, row, kvh, split);
    return {{__ldg(L.seq_len + row), __ldg(L.chunk_splits + row), __ldg(L.merge_splits + row), 0}};
  }
  __device__ __forceinline__ bool make(int i, const megac::attn::TaskPrefetch& p,
                                       megac::attn::DecodeTask& t) const {
    int e, row, kvh, split;
    slot(i, e, row, kvh, split);
    if (split >= p.w[2]) return false;
    megac::attn::DecodeArgs a{L.q, L.k_pool, L.v_pool,
                              L.page_table + (size_t)((e - 1) % L.pt_copies) * L.rows * L.pt_stride,
                              L.seq_len, nullptr, nullptr, L.rows, L.kv_heads, L.pt_stride,
                              L.split_stride, L.scale};
    S::task(a, row, kvh, split, p.w[1], L.window, p.w[0], t);
    return true;
  }

  __device__ __forceinline__ bool waits(int e) const {
    return e > kBufs && (L.phases & (kPhaseCombine | kPhaseFused | kPhaseCombineCtas | kPhaseSpread));
  }
  // What the done counter of a (row, kv head) counts per step: merges, or
  // with spread merges their per-head pieces.
  __device__ __forceinline__ uint32_t done_per_step() const {
    return (L.phases & kPhaseSpread) ? GQA : 1;
  }
  __device__ __forceinline__ float* opart(int e) const {
    return L.o_part + (size_t)((e - 1) % kBufs) * L.split_stride * L.rows * L.q_heads * HD;
  }
  __device__ __forceinline__ float* lpart(int e) const {
    return L.lse_part + (size_t)((e - 1) % kBufs) * L.split_stride * L.rows * L.q_heads;
  }
  __device__ __forceinline__ __nv_bfloat16* outp(int e) const { return out_of<HD>(L, e); }

  // Compute warps, at the end of task i.
  __device__ __forceinline__ bool finish(int i, char* smem) const {
    int e, row, kvh, split;
    slot(i, e, row, kvh, split);
    megac::attn::bar_sync<kBarMayWrite, NALL>();
    S::write_partial(smem, opart(e) + ((size_t)split * L.rows + row) * L.q_heads * HD + (size_t)kvh * GQA * HD,
                     lpart(e) + ((size_t)split * L.rows + row) * L.q_heads + kvh * GQA);
    megac::attn::bar_arrive<kBarWritten, NALL>();
    return true;
  }

  // The control warp: the counter side of tasks 0..n-1. Each task's split
  // count is loaded a task ahead (an L2 round trip per task otherwise sat
  // between the previous arrival and the next store permission).
  __device__ __forceinline__ void control(int n, char* smem) const {
    const int lane = threadIdx.x & 31;
    uint32_t* done = L.counters + kBufs * L.nrk;
    bool ok = true;  // false after a watchdog: keep the hand-offs, do nothing else
    auto splits_of = [&](int i) {
      int e, row, kvh, split;
      slot(i, e, row, kvh, split);
      return __ldg(L.merge_splits + row);
    };
    int ns_next = n > 0 ? splits_of(0) : 0;
    for (int i = 0; i < n; ++i) {
#ifdef MEGAC_ATTN_TRACE
      const long long c0 = clock64();
#endif
      int e, row, kvh, split;
      slot(i, e, row, kvh, split);
      const int ns = ns_next;
      if (i + 1 < n) ns_next = splits_of(i + 1);
      if (split >= ns) continue;
      const int rk = row * L.kv_heads + kvh;
      if (ok && waits(e)) {
        int w = 1;
        if (lane == 0) {
          megac::WaitSite site{L.status, 0, i, kOpDecode, 0};
          w = megac::wait_counter(done + rk, done_per_step() * (uint32_t)(e - kBufs), kBufs * L.nrk + rk, site);
        }
        ok = __shfl_sync(0xffffffffu, w, 0) != 0;
      }
#ifdef MEGAC_ATTN_TRACE
      const long long c1 = clock64();
      MEGAC_ATTN_TRACE_AT(lane == 0, i, 7, (unsigned long long)(c1 - c0));
      MEGAC_ATTN_TRACE_AT(lane == 0, i, 9, (unsigned long long)c1);
#endif
      megac::attn::bar_arrive<kBarMayWrite, NALL>();
      megac::attn::bar_sync<kBarWritten, NALL>();
      if (!ok) continue;
#ifdef MEGAC_ATTN_TRACE
      const long long c2 = clock64();
#endif
      uint32_t* arrive = L.counters + ((e - 1) % kBufs) * L.nrk + rk;
      if (L.phases & kPhaseFused) {
        if (megac::attn::warp_arrive_last(arrive, (uint32_t)ns)) {
          megac::attn::combine_core<HD, GQA, 32, 0>(opart(e), lpart(e), outp(e), L.rows, L.q_heads,
                                                    row, kvh, ns, S::ctl_work(smem),
                                                    S::ctl_work_bytes(), lane);
          if (lane == 0) megac::signal_counter(done + rk);
          __syncwarp();
        }
      } else {
        if (lane == 0) megac::signal_counter(arrive);
        __syncwarp();
      }
      MEGAC_ATTN_TRACE_AT(lane == 0, i, 8, (unsigned long long)(clock64() - c2));
    }
  }

  // The merge warp (spread merges): the pieces (row, kv head, query head)
  // of steps first_step.. first_step+steps-1 dealt to this CTA, step by
  // step: piece p of step e goes to CTA (p + e * pieces) % dec_ctas, so the
  // pieces rotate over every CTA, the idle ones included. Each waits for
  // its row's arrivals. A warp of its own, so a merge never holds up the
  // control warp's hand-offs with the compute warps. Uses the control
  // warp's shared-memory work area (spread merges exclude fused ones).
  __device__ __forceinline__ void merges(int steps, char* smem) const {
    const int lane = threadIdx.x & 31;
    const int pieces = L.nrk * GQA;
    const int ctas = L.dec_ctas;
    uint32_t* done = L.counters + kBufs * L.nrk;
    for (int r = 0; r < steps; ++r) {
      const int e = first_step + r;
      const int first = (int)(((long long)blockIdx.x - (long long)e * pieces) % ctas + ctas) % ctas;
      for (int p = first; p < pieces; p += ctas) {
        const int c = p / GQA;
        const int row = c / L.kv_heads;
        const int ns = __ldg(L.merge_splits + row);
        int got = 1;
        if (lane == 0) {
          megac::WaitSite site{L.status, 0, p, kOpCombine, 0};
          const int arr = ((e - 1) % kBufs) * L.nrk + c;
          got = megac::wait_counter(L.counters + arr, (uint32_t)((e - 1) / kBufs + 1) * ns, arr, site);
        }
        if (!__shfl_sync(0xffffffffu, got, 0)) return;
        megac::attn::combine_head_warp<HD, GQA>(opart(e), lpart(e), outp(e), L.rows, L.q_heads, row,
                                                c % L.kv_heads, p % GQA, ns, S::ctl_work(smem),
                                                S::ctl_work_bytes());
        if (lane == 0) megac::signal_counter(done + c);
        __syncwarp();
      }
    }
  }
};

// A combine CTA (phase kPhaseCombineCtas): merges (row, kv head) c =
// blockIdx.x - dec_ctas, + comb_ctas, ... of every step, with all threads.
template <int HD, int GQA, int NALL>
__device__ __forceinline__ void combine_ctas(const Launch& L, int reps) {
  extern __shared__ __align__(1024) char smem[];  // tensor-copy swizzle: 1024-byte rows of 8
  uint32_t* done = L.counters + kBufs * L.nrk;
  const int nc = (int)gridDim.x - L.dec_ctas;
  int task = 0;
  for (int r = 0; r < reps; ++r) {
    const int e = L.epoch + r;
    const int buf = (e - 1) % kBufs;
    megac::attn::CombineArgs ca{L.o_part + (size_t)buf * L.split_stride * L.rows * L.q_heads * HD,
                                L.lse_part + (size_t)buf * L.split_stride * L.rows * L.q_heads,
                                out_of<HD>(L, e), L.rows, L.kv_heads, L.split_stride};
    for (int c = (int)blockIdx.x - L.dec_ctas; c < L.nrk; c += nc, ++task) {
      const int row = c / L.kv_heads;
      const int kvh = c % L.kv_heads;
      const uint32_t n = (uint32_t)__ldg(L.merge_splits + row);
      const uint32_t target = (uint32_t)((e - 1) / kBufs + 1) * n;
      megac::WaitSite site{L.status, 0, task, kOpCombine, 0};
      MEGAC_ATTN_TRACE_AT(threadIdx.x == 0, task, 0, clock64());
      if (!megac::cta_wait_counter(L.counters + buf * L.nrk + c, target, buf * L.nrk + c, site))
        return;
      MEGAC_ATTN_TRACE_AT(threadIdx.x == 0, task, 1, clock64());
      megac::attn::combine_task<HD, GQA, NALL, 0>(ca, row, kvh, (int)n, smem,
                                               (int)megac::attn::dynamic_smem_bytes());
      MEGAC_ATTN_TRACE_AT(threadIdx.x == 0, task, 2, clock64());
      megac::cta_signal_counter(done + c);
      MEGAC_ATTN_TRACE_AT(threadIdx.x == 0, task, 3, clock64());
    }
  }
}

template <int HD, int GQA, int BLOCK, int NWARPS, int STAGES, int PWARPS, bool TMA, int KPW>
__device__ __forceinline__ void attn_test_body(const Launch& L, int reps) {
  extern __shared__ __align__(1024) char smem[];  // tensor-copy swizzle: 1024-byte rows of 8
  using S = megac::attn::DecodeStream<HD, GQA, BLOCK, NWARPS, STAGES, PWARPS, TMA, KPW>;
  using T = TestTasks<HD, GQA, BLOCK, NWARPS, STAGES, PWARPS, TMA, KPW>;
  constexpr int NT = NWARPS * 32;
  const bool compute = (int)threadIdx.x < NT;
  // Both sides of one decode stream over steps first_step.. (n slots).
  const bool producer = !compute && (int)threadIdx.x < NT + PWARPS * 32;
  const bool merger = (int)threadIdx.x >= NT + PWARPS * 32 + 32;  // the last warp
  if (L.phases & kPhaseCombineCtas && (int)blockIdx.x >= L.dec_ctas) {
    combine_ctas<HD, GQA, NT + PWARPS * 32 + 64>(L, reps);
    return;
  }
  if constexpr (TMA) {
    // The tensor copies' swizzle is a function of address bits 7-9.
    if (megac::smem_addr(smem) & 1023u) {
      if (threadIdx.x == 0)
        megac::report_error(L.status, 0, kOpDecode, -1, (int32_t)megac::smem_addr(smem), 1024, 0,
                            megac::kErrBadTask);
      return;
    }
  }
  if (threadIdx.x == 0) S::init(smem);
  __syncthreads();
  // Each role keeps its side of the ring (its cursor) across streams.
  S s;
  const megac::WaitSite site{L.status, 0, 0, kOpDecode, 0};
  // All roles of one decode stream over steps first_step.. (n slots).
  auto stream = [&](int first_step, int n) {
    T tasks{L, first_step};
    if (merger) {
      // spread merges of the launch's steps (the default path only)
    } else if (compute) {
      auto begin = [](int) {};
      auto finish = [&](int i, const megac::attn::DecodeTask&, char* sm) { return tasks.finish(i, sm); };
      s.consume(tasks, begin, finish, n, L.scale, smem, site);
    } else if (producer) {
      if constexpr (TMA) {
        s.produce_tma(tasks, n, smem, site, L.tmap_k, L.tmap_v);
      } else {
        s.produce(tasks, n, smem, site);
      }
    } else {
      tasks.control(n, smem);
    }
  };
  if (L.phases & kPhaseCombineCtas) {
    if (L.phases & kPhaseDecode) stream(L.epoch, reps * L.per);
    return;
  }
  const bool separate = (L.phases & kPhaseCombine) && !(L.phases & kPhaseFused);
  if (merger && !separate) {
    if (L.phases & kPhaseSpread) T{L, L.epoch}.merges(reps, smem);
    return;
  }
  if (!separate) {
    if (L.phases & kPhaseDecode) stream(L.epoch, reps * L.per);
    return;
  }
  uint32_t* done = L.counters + kBufs * L.nrk;
  int task = 0;
  for (int r = 0; r < reps; ++r) {
    const int e = L.epoch + r;
    const int buf = (e - 1) % kBufs;
    if (L.phases & kPhaseDecode) stream(e, L.per);
    __syncthreads();  // the ring is idle: the combine may use its K/V slots
    megac::attn::CombineArgs ca{L.o_part + (size_t)buf * L.split_stride * L.rows * L.q_heads * HD,
                                L.lse_part + (size_t)buf * L.split_stride * L.rows * L.q_heads,
                                out_of<HD>(L, e), L.rows, L.kv_heads, L.split_stride};
    for (int c = blockIdx.x; c < L.nrk; c += gridDim.x, ++task) {
      const int row = c / L.kv_heads;
      const int kvh = c % L.kv_heads;
      const uint32_t n = (uint32_t)__ldg(L.merge_splits + row);
      const uint32_t target = (uint32_t)((e - 1) / kBufs + 1) * n;
      megac::WaitSite csite{L.status, 0, task, kOpCombine, 0};
      if (!megac::cta_wait_counter(L.counters + buf * L.nrk + c, target, buf * L.nrk + c, csite))
        return;
      if (compute)
        megac::attn::combine_task<HD, GQA, NT, megac::attn::kBarCompute>(
            ca, row, kvh, (int)n, smem, megac::attn::DecodeSmem<HD, GQA, NWARPS, STAGES, KPW>::kRingBytes);
      megac::cta_signal_counter(done + c);
    }
  }
}

}  // namespace

// Block = NWARPS compute warps, the producer warps, the control warp, the
// merge warp. KPW: keys per compute warp of each tile.
#define ATTN_TEST_ENTRY(NAME, HD, GQA, BLOCK, NWARPS, STAGES, PWARPS, TMA, KPW)                \
  extern "C" __global__ void __launch_bounds__(NWARPS * 32 + PWARPS * 32 + 64, 1) NAME(         \
      const __nv_bfloat16* q, const __nv_bfloat16* k_pool, const __nv_bfloat16* v_pool,         \
      const int32_t* page_table, const int32_t* seq_len, const int32_t* chunk_splits,           \
      const int32_t* merge_splits, float* o_part, float* lse_part, __nv_bfloat16* out,          \
      uint32_t* counters, int32_t* status, int rows, int kv_heads, int pt_stride,               \
      int split_stride, int window, float scale, int epoch, int phases, int reps,               \
      int pt_copies, int comb_ctas, const void* tmap_k, const void* tmap_v) {                   \
    const int n = rows * kv_heads * split_stride;                                               \
    const int dec = (phases & kPhaseCombineCtas) ? (int)gridDim.x - comb_ctas : (int)gridDim.x; \
    const int per = (int)blockIdx.x < n ? (n - 1 - (int)blockIdx.x) / dec + 1 : 0;              \
    const Launch L{q, k_pool, v_pool, page_table, seq_len, chunk_splits, merge_splits, o_part,  \
                   lse_part, out, counters, status, rows, kv_heads, pt_stride, split_stride,    \
                   window, scale, epoch, phases, pt_copies, kv_heads * GQA, rows * kv_heads,    \
                   per, dec, tmap_k, tmap_v};                                                   \
    attn_test_body<HD, GQA, BLOCK, NWARPS, STAGES, PWARPS, TMA, KPW>(L, reps);                  \
  }                                                                                             \
  extern "C" __global__ void NAME##_smem_bytes(unsigned int* o) {                               \
    o[0] = megac::attn::DecodeSmem<HD, GQA, NWARPS, STAGES, KPW>::kBytes;                            \
  }

// North Mini Code: 8 query heads per kv head, head_dim 128.
ATTN_TEST_ENTRY(attn_h128_g8_b64_w4_p2_s4, 128, 8, 64, 4, 4, 2, false, 16)
ATTN_TEST_ENTRY(attn_h128_g8_b64_w4_p2_s5, 128, 8, 64, 4, 5, 2, false, 16)
// K/V through tensor-memory copies (one producer warp).
ATTN_TEST_ENTRY(attn_h128_g8_b64_w4_tma_s4, 128, 8, 64, 4, 4, 1, true, 16)
ATTN_TEST_ENTRY(attn_h128_g8_b16_w4_tma_s4, 128, 8, 16, 4, 4, 1, true, 16)
// 32 keys per compute warp: 128-key tiles, softmax once per 32 keys.
ATTN_TEST_ENTRY(attn_h128_g8_b64_w4k32_tma_s2, 128, 8, 64, 4, 2, 1, true, 32)
ATTN_TEST_ENTRY(attn_h64_g3_b64_w4_tma_s8, 64, 3, 64, 4, 8, 1, true, 16)
// Page size other than the tile: 16-token pages, 64-key tiles.
ATTN_TEST_ENTRY(attn_h128_g8_b16_w4_p2_s4, 128, 8, 16, 4, 4, 2, false, 16)
// SmolLM2: 3 query heads per kv head, head_dim 64.
ATTN_TEST_ENTRY(attn_h64_g3_b64_w4_p2_s8, 64, 3, 64, 4, 8, 2, false, 16)

// Streaming-read ceiling for this block when the battery gives none
// (MEGAC_CEILING_TBPS unset): 16-byte non-caching loads, four in flight per
// thread, folded into a sum so no load is dropped.
extern "C" __global__ void __launch_bounds__(1024) attn_ceiling_read(
    const uint4* __restrict__ src, unsigned long long n_vec, unsigned long long* out) {
  const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  uint64_t acc = 0;
  for (; i + 3 * stride < n_vec; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = megac::ld_stream_u4(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < 4; ++u) acc += (uint64_t)v[u].x + v[u].y + (uint64_t)v[u].z + v[u].w;
  }
  for (; i < n_vec; i += stride) {
    const uint4 v = megac::ld_stream_u4(src + i);
    acc += (uint64_t)v.x + v.y + (uint64_t)v.z + v.w;
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if ((threadIdx.x & 31) == 0) atomicAdd(out, (unsigned long long)acc);
}

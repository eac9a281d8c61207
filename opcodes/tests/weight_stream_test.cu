// Weight stream across task boundaries: one CTA per SM walks its task list;
// each task is a run of consecutive weight tiles (one tile = one ring stage).
// Warp 0 produces (bulk copies into the ring), the other warps consume: they
// sum every 32-bit word of the task's tiles into sums[task id] so the host
// can check each task against torch.
//
// Task list: int4 {first tile, tile count, global task id, unused} per task,
// tasks[cta * max_tasks + i] for i < task_count[cta].
#include <cstdint>

#include "common.cuh"
#include "weight_stream.cuh"

namespace {

template <int kStages, int kStageBytes, int kConsumerWarps, bool kEvictFirst>
__device__ __forceinline__ void stream_tasks(const uint8_t* __restrict__ weights,
                                             const int4* __restrict__ tasks,
                                             const int* __restrict__ task_count, int max_tasks,
                                             unsigned long long* __restrict__ sums,
                                             int32_t* status, unsigned long long timeout_ns,
                                             long long drop_tile) {
  using Ring = megac::WeightRing<kStages, kStageBytes, kConsumerWarps>;
  extern __shared__ __align__(128) uint8_t smem[];
  Ring ring;
  ring.bind(smem);
  if (threadIdx.x == 0) ring.init_barriers();
  __syncthreads();

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int n = task_count[blockIdx.x];
  const int4* my_tasks = tasks + static_cast<size_t>(blockIdx.x) * max_tasks;
  megac::WaitSite site{status, timeout_ns, 0, /*opcode=*/0, /*layer=*/0};
  megac::RingCursor<kStages> cur;

  if (warp == 0) {
    if (lane != 0) return;
    const uint64_t policy = megac::l2_evict_first_policy();
    long long ordinal = 0;  // tile position in this CTA's stream
    for (int i = 0; i < n; ++i) {
      const int4 t = my_tasks[i];
      site.task = i;
      const uint8_t* src = weights + static_cast<size_t>(t.x) * kStageBytes;
      for (int k = 0; k < t.y; ++k, ++ordinal) {
        if (blockIdx.x == 0 && ordinal == drop_tile) {
          // Test hook: claim the stage but never fill it, so the consumers'
          // bounded wait must fire and report.
          cur.advance();
          continue;
        }
        if (!ring.template produce<kEvictFirst>(cur, src + static_cast<size_t>(k) * kStageBytes,
                                                policy, site))
          return;
      }
    }
    return;
  }

  // Consumers: each thread reads kVecs 16-byte vectors of every stage,
  // consecutive threads on consecutive vectors (conflict-free).
  constexpr int kThreads = kConsumerWarps * 32;
  constexpr int kVecs = kStageBytes / 16 / kThreads;
  static_assert(kStageBytes % (16 * kThreads) == 0, "stage must split evenly over consumers");
  const int ct = threadIdx.x - 32;
  for (int i = 0; i < n; ++i) {
    const int4 t = my_tasks[i];
    site.task = i;
    uint64_t acc = 0;
    for (int k = 0; k < t.y; ++k) {
      const uint8_t* stage = ring.consume(cur, site);
      if (stage == nullptr) return;
      const uint4* v = reinterpret_cast<const uint4*>(stage);
      uint4 x[kVecs];
#pragma unroll
      for (int j = 0; j < kVecs; ++j) x[j] = v[ct + j * kThreads];
      ring.release(cur);
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        acc += static_cast<uint64_t>(x[j].x) + x[j].y + static_cast<uint64_t>(x[j].z) + x[j].w;
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) atomicAdd(sums + t.z, static_cast<unsigned long long>(acc));
  }
}

}  // namespace

#define MEGAC_WS_ENTRY(NAME, STAGES, STAGE_BYTES, CWARPS, EVICT_FIRST)                          \
  extern "C" __global__ void __launch_bounds__(32 * (1 + CWARPS), 1)                           \
      NAME(const uint8_t* weights, const int4* tasks, const int* task_count, int max_tasks,    \
           unsigned long long* sums, int32_t* status, unsigned long long timeout_ns,           \
           long long drop_tile) {                                                               \
    stream_tasks<STAGES, STAGE_BYTES, CWARPS, EVICT_FIRST>(weights, tasks, task_count,         \
                                                           max_tasks, sums, status, timeout_ns, \
                                                           drop_tile);                          \
  }                                                                                             \
  extern "C" __global__ void NAME##_smem_bytes(unsigned int* out) {                             \
    *out = megac::WeightRing<STAGES, STAGE_BYTES, CWARPS>::kSmemBytes;                          \
  }

// name                     stages  stage bytes  consumer warps  evict-first
MEGAC_WS_ENTRY(ws_16k_x12_c8, 12, 16384, 8, true)
MEGAC_WS_ENTRY(ws_16k_x12_c8_nohint, 12, 16384, 8, false)
MEGAC_WS_ENTRY(ws_8k_x24_c8, 24, 8192, 8, true)
MEGAC_WS_ENTRY(ws_32k_x6_c8, 6, 32768, 8, true)
MEGAC_WS_ENTRY(ws_16k_x12_c4, 12, 16384, 4, true)
MEGAC_WS_ENTRY(ws_16k_x4_c8, 4, 16384, 8, true)

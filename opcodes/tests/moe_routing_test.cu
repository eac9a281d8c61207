// Standalone persistent test kernel for the routing opcodes
// (opcodes/moe_routing.cuh): grid = SM count, cooperative launch.
//
// Each routing step g runs TOPK (one task per row, dealt round-robin over
// CTAs) -> FINALIZE (last CTA) -> GATHER and COMBINE (one task per row), the
// hops joined by counters through bounded waits. `iters` steps run back to
// back in one launch, so iters > 1 measures the per-step latency inside a
// persistent kernel; the next step's TOPK waits for the previous step's
// gather and combine, since they read what it overwrites.
//
// Buffers have the ABI's per-layer shapes (abi.LAUNCH_DESC, one layer):
// router_part fp32 [num_splits, rows, E], topk_ids / topk_w / route_slot
// [rows, K], up/down queues int4 [queue_cap], queue_len the two target
// words, x bf16 [rows, D], moe_x bf16 [rows*K, D], moe_out fp32 [rows*K, D],
// out (ffn_part slot 0) fp32 [rows, D].
//
// Counters (uint32[4]: topk, finalize, gather+combine, spare) are never reset
// between launches of one configuration: step numbers continue across
// launches through `step0`.
#include <cstdint>
#include <cuda_bf16.h>

#include "../counters.cuh"
#include "../moe_routing.cuh"

namespace {
constexpr int kPhaseGather = 1;
constexpr int kPhaseCombine = 2;
}  // namespace

__device__ __forceinline__ void moe_route_body(
    const float* router_part, int num_splits, int rows, int E, int K, int flags, int up_tiles,
    int down_tiles, int queue_cap, int32_t* topk_ids, float* topk_w, int32_t* route_slot,
    int4* up_queue, int4* down_queue, int32_t* queue_len, const __nv_bfloat16* x,
    __nv_bfloat16* moe_x, const float* moe_out, float* out, int D, uint32_t* counters,
    int32_t* status, int step0, int iters, int phases) {
  extern __shared__ __align__(16) int32_t smem_words[];
  const int fin_cta = gridDim.x - 1;
  const int per_step_rows = ((phases & kPhaseGather) ? rows : 0) + ((phases & kPhaseCombine) ? rows : 0);
  for (int it = 0; it < iters; ++it) {
    const uint32_t g = (uint32_t)(step0 + it);  // 0-based global step
    int task = 0;
    // TOPK: row r on CTA r % grid, the whole CTA.
    for (int r = blockIdx.x; r < rows; r += gridDim.x, ++task) {
      megac::WaitSite site{status, 0, task, megac::OP_ROUTER_TOPK, 0};
      if (!megac::cta_wait_counter(counters + 2, g * (uint32_t)per_step_rows, 2, site)) return;
      megac::moe::topk_rows_cta(router_part + (size_t)r * E, (size_t)rows * E, num_splits, 1, E, K, flags,
                                topk_ids + r * K, topk_w + r * K, smem_words);
      megac::cta_signal_counter(counters + 0);
    }
    if (blockIdx.x == fin_cta) {
      megac::WaitSite site{status, 0, task++, megac::OP_ROUTE_FINALIZE, 0};
      if (!megac::cta_wait_counter(counters + 0, (g + 1) * (uint32_t)rows, 0, site)) return;
      const megac::moe::FinalizeArgs fa{topk_ids, rows, K, E, up_tiles, down_tiles, queue_cap,
                                        route_slot, up_queue, down_queue, queue_len, queue_len + 1};
      if (!megac::moe::finalize_cta(fa, smem_words, site)) return;
      megac::cta_signal_counter(counters + 1);
    }
    // GATHER / COMBINE: row r on CTA (r + 1) % grid, away from the finaliser.
    for (int r = (blockIdx.x + gridDim.x - 1) % gridDim.x; r < rows; r += gridDim.x, ++task) {
      megac::WaitSite site{status, 0, task, megac::OP_MOE_GATHER, 0};
      if (!megac::cta_wait_counter(counters + 1, g + 1, 1, site)) return;
      if (phases & kPhaseGather) {
        megac::moe::gather_row(x, moe_x, route_slot, r, K, D, smem_words);
        megac::cta_signal_counter(counters + 2);
      }
      if (phases & kPhaseCombine) {
        megac::moe::combine_row(moe_out, route_slot, topk_w, out, r, K, D, smem_words);
        megac::cta_signal_counter(counters + 2);
      }
    }
  }
}

#define MOE_ROUTE_ENTRY(NAME)                                                                      \
  extern "C" __global__ void __launch_bounds__(256, 1) NAME(                                       \
      const float* router_part, int num_splits, int rows, int E, int K, int flags, int up_tiles,  \
      int down_tiles, int queue_cap, int32_t* topk_ids, float* topk_w, int32_t* route_slot,       \
      int4* up_queue, int4* down_queue, int32_t* queue_len, const __nv_bfloat16* x,               \
      __nv_bfloat16* moe_x, const float* moe_out, float* out, int D, uint32_t* counters,          \
      int32_t* status, int step0, int iters, int phases) {                                        \
    moe_route_body(router_part, num_splits, rows, E, K, flags, up_tiles, down_tiles,       \
                          queue_cap, topk_ids, topk_w, route_slot, up_queue, down_queue,          \
                          queue_len, x, moe_x, moe_out, out, D, counters, status, step0, iters,   \
                          phases);                                                                \
  }

MOE_ROUTE_ENTRY(moe_route)

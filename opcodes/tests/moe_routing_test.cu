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

template <int MAX_E>
__device__ __forceinline__ void moe_route_body(
    const float* logits, int rows, int E, int K, int mode, int renorm, int row_tile,
    int n_tiles_up, int n_tiles_down, int cap_up, int cap_down, int32_t* topk_ids,
    float* topk_w, int32_t* expert_counts, int32_t* expert_offsets, int32_t* slot,
    int32_t* slot_entry, int4* queue_up, int4* queue_down, int32_t* qcount,
    const __nv_bfloat16* x, __nv_bfloat16* moe_x, const __nv_bfloat16* y, float* out, int D,
    uint32_t* counters, int32_t* status, int step0, int iters, int phases) {
  extern __shared__ __align__(16) int32_t smem_words[];
  const int fin_cta = gridDim.x - 1;
  const int per_step_rows = ((phases & kPhaseGather) ? rows : 0) + ((phases & kPhaseCombine) ? rows : 0);
  for (int it = 0; it < iters; ++it) {
    const uint32_t g = (uint32_t)(step0 + it);  // 0-based global step
    int task = 0;
    // TOPK: row r on CTA r % grid; warp 0 does the row.
    for (int r = blockIdx.x; r < rows; r += gridDim.x, ++task) {
      megac::WaitSite site{status, 0, task, 9, 0};
      if (!megac::cta_wait_counter(counters + 2, g * (uint32_t)per_step_rows, 2, site)) return;
      if (threadIdx.x < 32)
        megac::moe::topk_row_warp<MAX_E>(logits + (size_t)r * E, E, K, mode, renorm != 0,
                                         topk_ids + r * K, topk_w + r * K);
      megac::cta_signal_counter(counters + 0);
    }
    if (blockIdx.x == fin_cta) {
      megac::WaitSite site{status, 0, task++, 10, 0};
      if (!megac::cta_wait_counter(counters + 0, (g + 1) * (uint32_t)rows, 0, site)) return;
      megac::moe::FinalizeArgs fa{topk_ids, rows, K, E, row_tile, n_tiles_up, n_tiles_down,
                                  cap_up, cap_down, expert_counts, expert_offsets, slot,
                                  slot_entry, queue_up, queue_down, qcount};
      if (!megac::moe::finalize_cta(fa, smem_words, status)) return;
      megac::cta_signal_counter(counters + 1);
    }
    // GATHER / COMBINE: row r on CTA (r + 1) % grid, away from the finaliser.
    for (int r = (blockIdx.x + gridDim.x - 1) % gridDim.x; r < rows; r += gridDim.x, ++task) {
      megac::WaitSite site{status, 0, task, 11, 0};
      if (!megac::cta_wait_counter(counters + 1, g + 1, 1, site)) return;
      if (phases & kPhaseGather) {
        megac::moe::gather_row(x, moe_x, slot, r, K, D, smem_words);
        megac::cta_signal_counter(counters + 2);
      }
      if (phases & kPhaseCombine) {
        megac::moe::combine_row(y, slot, topk_w, out, r, K, D, smem_words);
        megac::cta_signal_counter(counters + 2);
      }
    }
  }
}

#define MOE_ROUTE_ENTRY(NAME, MAX_E)                                                            \
  extern "C" __global__ void __launch_bounds__(256, 1) NAME(                                    \
      const float* logits, int rows, int E, int K, int mode, int renorm, int row_tile,          \
      int n_tiles_up, int n_tiles_down, int cap_up, int cap_down, int32_t* topk_ids,           \
      float* topk_w, int32_t* expert_counts, int32_t* expert_offsets, int32_t* slot,           \
      int32_t* slot_entry, int4* queue_up, int4* queue_down, int32_t* qcount,                  \
      const __nv_bfloat16* x, __nv_bfloat16* moe_x, const __nv_bfloat16* y, float* out, int D, \
      uint32_t* counters, int32_t* status, int step0, int iters, int phases) {                \
    moe_route_body<MAX_E>(logits, rows, E, K, mode, renorm, row_tile, n_tiles_up,              \
                          n_tiles_down, cap_up, cap_down, topk_ids, topk_w, expert_counts,     \
                          expert_offsets, slot, slot_entry, queue_up, queue_down, qcount, x,   \
                          moe_x, y, out, D, counters, status, step0, iters, phases);           \
  }

MOE_ROUTE_ENTRY(moe_route_e128, 128)
MOE_ROUTE_ENTRY(moe_route_e32, 32)

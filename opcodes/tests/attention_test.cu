// Standalone persistent test kernel for ATTN_DECODE + ATTN_COMBINE
// (opcodes/attention.cuh): grid = SM count (cooperative launch), decode
// tasks (row, kv head, split) dealt round-robin over CTAs, then combine tasks
// (row, kv head) dealt the same way, each waiting on its (row, kv head)
// counter through a bounded wait (megac::cta_wait_counter, 2 s watchdog).
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
constexpr int kOpDecode = 2;
constexpr int kOpCombine = 4;

// `reps` back-to-back attention steps in one launch (reps > 1 measures the
// steady state without host launch gaps). Global step e = epoch + r:
//   decode (e)  writes partial buffer (e-1) % 2, page-table copy (e-1) % pt_copies;
//               for e >= 3 it first waits until the combine of step e-2 on
//               its (row, kv head) has read that buffer (done counter);
//   combine (e) waits for e * merge_splits[row] decode arrivals.
// counters: [0, rows*kvh) decode arrivals, [rows*kvh, 2*rows*kvh) combines done.
template <int HD, int GQA, int BLOCK, int NWARPS, int STAGES>
__device__ __forceinline__ void attn_test_body(
    const __nv_bfloat16* q, const __nv_bfloat16* k_pool, const __nv_bfloat16* v_pool,
    const int32_t* page_table, const int32_t* seq_len, const int32_t* chunk_splits,
    const int32_t* merge_splits, float* o_part, float* lse_part, __nv_bfloat16* out,
    uint32_t* counters, int32_t* status, int rows, int kv_heads, int pt_stride,
    int split_stride, int window, float scale, int epoch, int phases, int reps, int pt_copies) {
  extern __shared__ __align__(128) char smem[];
  const int q_heads = kv_heads * GQA;
  const int nrk = rows * kv_heads;
  uint32_t* arrive = counters;
  uint32_t* done = counters + nrk;
  int task = 0;
  for (int r = 0; r < reps; ++r) {
    const int e = epoch + r;
    const int buf = (e - 1) & 1;
    float* op = o_part + (size_t)buf * split_stride * rows * q_heads * HD;
    float* lp = lse_part + (size_t)buf * split_stride * rows * q_heads;
    const int32_t* pt = page_table + (size_t)((e - 1) % pt_copies) * rows * pt_stride;
    megac::attn::DecodeArgs da{q, k_pool, v_pool, pt, seq_len, op, lp,
                               rows, kv_heads, pt_stride, split_stride, scale};
    if (phases & kPhaseDecode) {
      const int n = nrk * split_stride;
      for (int t = blockIdx.x; t < n; t += gridDim.x, ++task) {
        const int split = t % split_stride;
        const int rk = t / split_stride;
        const int row = rk / kv_heads;
        const int kvh = rk % kv_heads;
        if (split >= merge_splits[row]) continue;
        if (e >= 3 && (phases & kPhaseCombine)) {
          megac::WaitSite site{status, 0, task, kOpDecode, 0};
          if (!megac::cta_wait_counter(done + rk, (uint32_t)(e - 2), nrk + rk, site)) return;
        }
        megac::attn::decode_task<HD, GQA, BLOCK, NWARPS, STAGES>(da, row, kvh, split,
                                                                  chunk_splits[row], window, smem);
        megac::cta_signal_counter(arrive + rk);
      }
    }
    if (phases & kPhaseCombine) {
      megac::attn::CombineArgs ca{op, lp, out, rows, kv_heads, split_stride};
      for (int c = blockIdx.x; c < nrk; c += gridDim.x, ++task) {
        const int row = c / kv_heads;
        const int kvh = c % kv_heads;
        const uint32_t target = (uint32_t)e * (uint32_t)merge_splits[row];
        megac::WaitSite site{status, 0, task, kOpCombine, 0};
        if (!megac::cta_wait_counter(arrive + c, target, c, site)) return;
        megac::attn::combine_task<HD, GQA, NWARPS * 32>(ca, row, kvh, merge_splits[row], smem);
        megac::cta_signal_counter(done + c);
      }
    }
  }
}

}  // namespace

#define ATTN_TEST_ENTRY(NAME, HD, GQA, BLOCK, NWARPS, STAGES)                                  \
  extern "C" __global__ void __launch_bounds__(NWARPS * 32, 1) NAME(                            \
      const __nv_bfloat16* q, const __nv_bfloat16* k_pool, const __nv_bfloat16* v_pool,         \
      const int32_t* page_table, const int32_t* seq_len, const int32_t* chunk_splits,           \
      const int32_t* merge_splits, float* o_part, float* lse_part, __nv_bfloat16* out,          \
      uint32_t* counters, int32_t* status, int rows, int kv_heads, int pt_stride,               \
      int split_stride, int window, float scale, int epoch, int phases, int reps,               \
      int pt_copies) {                                                                          \
    attn_test_body<HD, GQA, BLOCK, NWARPS, STAGES>(q, k_pool, v_pool, page_table, seq_len,      \
                                                   chunk_splits, merge_splits, o_part, lse_part, \
                                                   out, counters, status, rows, kv_heads,       \
                                                   pt_stride, split_stride, window, scale,      \
                                                   epoch, phases, reps, pt_copies);             \
  }

// North Mini Code: 8 query heads per kv head, head_dim 128.
ATTN_TEST_ENTRY(attn_h128_g8_b64_w4_s4, 128, 8, 64, 4, 4)
ATTN_TEST_ENTRY(attn_h128_g8_b64_w4_s6, 128, 8, 64, 4, 6)
ATTN_TEST_ENTRY(attn_h128_g8_b64_w8_s3, 128, 8, 64, 8, 3)
// Page size other than the tile: 16-token pages, 64-key tiles.
ATTN_TEST_ENTRY(attn_h128_g8_b16_w4_s4, 128, 8, 16, 4, 4)
// SmolLM2: 3 query heads per kv head, head_dim 64.
ATTN_TEST_ENTRY(attn_h64_g3_b64_w4_s8, 64, 3, 64, 4, 8)

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

// Standalone persistent test kernels for the tiny-M GEMM tile and its
// epilogues (opcodes/gemm_tile.cuh, opcodes/gemm_epilogues.cuh).
//
// One CTA per SM walks a list of tasks of one shape (task k -> CTA k mod
// gridDim.x), the way the megakernel will: the producer warp streams the
// next task's weights while the consumers finish this one. A task is
// int4 {w_mat, x_mat, n_tile, split}: which weight matrix (experts, and
// rotated copies for benchmarks), which activation matrix, which NT-row
// tile, which K slice.
//
// Entry points are named gemm_<epilogue>_nt<NT>_k<K>_m<M> (see the
// GEMM_ENTRY list at the bottom); megac/gpu/blocks/gemm.py builds the same
// names. GEMM_TEST_ONLY=<n> compiles only the n-th group of entries (quick
// builds); by default all are built.
#include <cstdint>
#include <type_traits>
#include <cuda_bf16.h>

#include "common.cuh"
#include "gemm_epilogues.cuh"
#include "gemm_tile.cuh"

namespace {

using bf16 = __nv_bfloat16;
using namespace megac;
using namespace megac::gemm;

// Kernel parameters live in one device buffer of 8-byte words, so the host
// packs them by index (order mirrored in megac/gpu/blocks/gemm.py PARAM_FIELDS).
struct Params {
  const bf16* w;
  const bf16* x;
  void* y;
  const int4* tasks;
  int64_t num_tasks;
  int64_t w_mat_stride;  // elements between weight matrices
  int64_t x_mat_stride;  // elements between activation matrices
  int64_t ldw;           // weight row pitch (the full K of the GEMM)
  int64_t ldx;
  int64_t y_mat_stride;  // elements between per-x_mat outputs
  int64_t ldy;
  int64_t split_stride;  // elements between split-K partials
  const int32_t* positions;
  const float* inv_freq;
  const int32_t* page_table;
  int64_t max_pages;
  int64_t block_size;
  int64_t q_heads;
  int64_t kv_heads;
  int64_t rope_style;
  bf16* k_pool;
  bf16* v_pool;
  ArgmaxRecord* amax;  // [x_mat][M][num_ntiles]
  int64_t num_ntiles;
  int32_t* status;
};

enum Epi : int {
  kEpiBf16 = 0,
  kEpiF32 = 1,
  kEpiSplitK = 2,
  kEpiSilu = 3,
  kEpiQkv = 4,
  kEpiLmHead = 5,     // fp32 logits
  kEpiLmHeadBf16 = 6  // bf16 logits
};

template <int EPI, class Cfg, int HD>
__device__ __forceinline__ void run_epilogue(const float* ys, const Params& p, int4 task, int tid) {
  constexpr int NT = Cfg::NT, M = Cfg::M, NTH = Cfg::NC * 32;
  const int x_mat = task.y, n_tile = task.z, split = task.w;
  const int n0 = n_tile * NT;
  if constexpr (EPI == kEpiBf16) {
    bf16* y = static_cast<bf16*>(p.y) + x_mat * p.y_mat_stride + n0;
    epi_store<NT, M, NTH, bf16>(ys, y, p.ldy, tid);
  } else if constexpr (EPI == kEpiF32) {
    float* y = static_cast<float*>(p.y) + x_mat * p.y_mat_stride + n0;
    epi_store<NT, M, NTH, float>(ys, y, p.ldy, tid);
  } else if constexpr (EPI == kEpiSplitK) {
    float* y = static_cast<float*>(p.y) + x_mat * p.y_mat_stride;
    epi_splitk_partial<NT, M, NTH>(ys, y, p.split_stride, split, p.ldy, n0, tid);
  } else if constexpr (EPI == kEpiSilu) {
    bf16* h = static_cast<bf16*>(p.y) + x_mat * p.y_mat_stride + n_tile * (NT / 2);
    epi_silu_mul<NT, M, NTH>(ys, h, p.ldy, tid);
  } else if constexpr (EPI == kEpiQkv) {
    QkvArgs a;
    a.positions = p.positions;
    a.inv_freq = p.inv_freq;
    a.page_table = p.page_table;
    a.max_pages = int32_t(p.max_pages);
    a.block_size = int32_t(p.block_size);
    a.q_heads = int32_t(p.q_heads);
    a.kv_heads = int32_t(p.kv_heads);
    a.rope_style = int32_t(p.rope_style);
    a.q_out = static_cast<bf16*>(p.y);
    a.k_pool = p.k_pool;
    a.v_pool = p.v_pool;
    epi_qkv<NT, M, NTH, HD>(ys, n0, a, tid);
  } else if constexpr (EPI == kEpiLmHead || EPI == kEpiLmHeadBf16) {
    using OutT = std::conditional_t<EPI == kEpiLmHead, float, bf16>;
    OutT* logits = static_cast<OutT*>(p.y) + x_mat * p.y_mat_stride;
    const int64_t arow = int64_t(x_mat) * M * p.num_ntiles;
    epi_lm_head<NT, M, NTH, OutT>(ys, logits, p.ldy, n0, n_tile, p.amax + arow, p.num_ntiles,
                                  tid);
  }
}

template <int EPI, int NT, int K, int M, int HD, bool TILED, int BK_MAX = 576>
__device__ __forceinline__ void gemm_persistent(const Params* __restrict__ pp) {
  using Cfg = TileCfg<NT, K, M, TILED, BK_MAX>;
  extern __shared__ __align__(128) uint8_t smem[];
  const Params p = *pp;
  uint32_t dyn_smem;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
  if (dyn_smem < uint32_t(Cfg::SMEM_BYTES)) {  // host and TileCfg disagree on the layout
    if (threadIdx.x == 0)
      report_error(p.status, -1, 100 + EPI, -1, int32_t(dyn_smem), Cfg::SMEM_BYTES, 0, kErrBadTask);
    return;
  }
  TileSmem<Cfg> sm;
  sm.bind(smem);
  if (threadIdx.x == 0) sm.init_barriers();
  __syncthreads();

  const int warp = threadIdx.x >> 5;
  WaitSite site{p.status, 0, 0, 100 + EPI, 0};
  StreamPos pos;
  if (warp == Cfg::NC) {
    const uint64_t policy = l2_evict_first_policy();
    bool alive = true;
    for (int64_t k = blockIdx.x; k < p.num_tasks && alive; k += gridDim.x) {
      const int4 task = p.tasks[k];
      site.task = int32_t(k);
      const bf16* w = Cfg::tile_weights(p.w + task.x * p.w_mat_stride, task.z, task.w, p.ldw);
      const bf16* x = p.x + task.y * p.x_mat_stride + int64_t(task.w) * K;
      alive = produce_tile<Cfg>(sm, pos, w, p.ldw, x, p.ldx, policy, site);
    }
  } else {
    bool alive = true;
    for (int64_t k = blockIdx.x; k < p.num_tasks; k += gridDim.x) {
      const int4 task = p.tasks[k];
      site.task = int32_t(k);
      const float* ys = sm.ytile(pos.tile_seq);
      alive = consume_tile<Cfg>(sm, pos, warp, site, alive);
      consumer_sync<Cfg>();
      if (alive) run_epilogue<EPI, Cfg, HD>(ys, p, task, threadIdx.x);
    }
  }
}

}  // namespace

// Each shape in both weight layouts: row-major, and tiled (suffix _tiled).
#define GEMM_ENTRY(EPI, NAME, NT, K, M, HD)                                           \
  extern "C" __global__ void __launch_bounds__(TileCfg<NT, K, M>::THREADS, 1)          \
      gemm_##NAME##_nt##NT##_k##K##_m##M(const Params* __restrict__ p) {             \
    gemm_persistent<EPI, NT, K, M, HD, false>(p);                                     \
  }                                                                                   \
  extern "C" __global__ void __launch_bounds__(TileCfg<NT, K, M>::THREADS, 1)          \
      gemm_##NAME##_nt##NT##_k##K##_m##M##_tiled(const Params* __restrict__ p) {     \
    gemm_persistent<EPI, NT, K, M, HD, true>(p);                                      \
  }

#define GEMM_ENTRY_M(EPI, NAME, NT, K, HD) \
  GEMM_ENTRY(EPI, NAME, NT, K, 1, HD)      \
  GEMM_ENTRY(EPI, NAME, NT, K, 2, HD)      \
  GEMM_ENTRY(EPI, NAME, NT, K, 4, HD)      \
  GEMM_ENTRY(EPI, NAME, NT, K, 8, HD)

#ifndef GEMM_TEST_ONLY
#define GEMM_TEST_ONLY -1
#endif
#define GEMM_GROUP(n) (GEMM_TEST_ONLY < 0 || GEMM_TEST_ONLY == (n))

// North Mini Code (hidden 2048, head_dim 128).
#if GEMM_GROUP(0)
GEMM_ENTRY_M(kEpiQkv, qkv, 128, 2048, 128)     // QKV 5120 x 2048, interleaved RoPE
GEMM_ENTRY_M(kEpiSplitK, splitk, 64, 1024, 0)  // O-proj 2048 x 4096, 4 splits
GEMM_ENTRY_M(kEpiSplitK, splitk, 64, 512, 0)   // router 128 x 2048, 4 splits
#endif
#if GEMM_GROUP(1)
GEMM_ENTRY_M(kEpiSilu, silu, 128, 2048, 0)     // expert 1536 x 2048, dense 6144 x 2048
GEMM_ENTRY_M(kEpiBf16, bf16, 128, 768, 0)      // expert down 2048 x 768
GEMM_ENTRY_M(kEpiSplitK, splitk, 64, 1536, 0)  // dense down 2048 x 3072, 2 splits
#endif
#if GEMM_GROUP(2)
GEMM_ENTRY_M(kEpiLmHead, lmhead, 256, 2048, 0)  // LM head 262144 x 2048
GEMM_ENTRY_M(kEpiF32, f32, 128, 2048, 0)        // plain fp32 store
#endif
// SmolLM2-135M (hidden 576, head_dim 64).
#if GEMM_GROUP(3)
GEMM_ENTRY_M(kEpiQkv, qkv, 64, 576, 64)        // QKV 960 x 576, rotate_half RoPE
GEMM_ENTRY_M(kEpiBf16, bf16, 64, 576, 0)       // O 576 x 576
GEMM_ENTRY_M(kEpiSilu, silu, 128, 576, 0)      // up/gate 3072 x 576
GEMM_ENTRY_M(kEpiBf16, bf16, 64, 1536, 0)      // down 576 x 1536
GEMM_ENTRY_M(kEpiLmHead, lmhead, 128, 576, 0)  // LM head 49152 x 576
GEMM_ENTRY_M(kEpiLmHeadBf16, lmheadbf16, 128, 576, 0)  // same, bf16 logits
#endif

// Row-major with 2 KB row copies (BK = 1024), to measure what copy size the
// row-major layout needs.
#if GEMM_GROUP(4)
#define GEMM_ENTRY_BK1024(M)                                                                 \
  extern "C" __global__ void __launch_bounds__(TileCfg<128, 2048, M, false, 1024>::THREADS, 1) \
      gemm_silu_nt128_k2048_m##M##_bk1024(const Params* __restrict__ p) {                   \
    gemm_persistent<kEpiSilu, 128, 2048, M, 0, false, 1024>(p);                              \
  }
GEMM_ENTRY_BK1024(1)
GEMM_ENTRY_BK1024(8)
#endif

// Fixed-order split-K reduce: out = sum_s partial[s] (fp32), one element per
// thread-step; out_bf16 selects the output type.
extern "C" __global__ void gemm_splitk_reduce(const float* __restrict__ partial,
                                              long long split_stride, int nsplit, void* out,
                                              int out_bf16, long long count) {
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nth = int64_t(gridDim.x) * blockDim.x;
  if (out_bf16)
    splitk_reduce<bf16>(partial, split_stride, nsplit, static_cast<bf16*>(out), 0, count, tid, nth);
  else
    splitk_reduce<float>(partial, split_stride, nsplit, static_cast<float*>(out), 0, count, tid,
                         nth);
}

// Streaming-read ceiling for the same run: 16-byte non-caching loads, four
// in flight per thread (64 KB per SM at 1024 threads), folded into a sum the
// compiler cannot drop.
extern "C" __global__ void __launch_bounds__(1024, 1)
    gemm_stream_read(const uint4* __restrict__ src, long long n_vec, unsigned long long* out) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  uint32_t acc = 0;
  for (; i + 3 * stride < n_vec; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = ld_stream_u4(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n_vec; i += stride) {
    const uint4 v = ld_stream_u4(src + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) atomicAdd(out, 1ull);
}

// Greedy record of each row over its per-tile records: one warp per row.
extern "C" __global__ void gemm_argmax_reduce(const ArgmaxRecord* __restrict__ rec, int ntiles,
                                              ArgmaxRecord* __restrict__ out) {
  const int row = blockIdx.x;
  const ArgmaxRecord r = argmax_reduce_warp(rec + int64_t(row) * ntiles, ntiles);
  if (threadIdx.x == 0) out[row] = r;
}

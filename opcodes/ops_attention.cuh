// Device side of attention (megac/ops/attention.py): ATTN_DECODE (a static
// split of a sliding layer), the splits the ATTN_DRAIN claimer pulls from
// the host-written attention queue, and ATTN_COMBINE. Split rule:
// attention.cuh split_range (the VM's abi.split_range) over the row's
// visible keys; the row's key count is seq_pos + 1 (its current token
// included). Partials are split-major per layer: o [L, S, R, H, hd], lse
// [L, S, R, H] (ABI 4).
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "attention.cuh"
#include "attn_mma.cuh"
#include "attn_rows.cuh"
#include "attn_tiles.cuh"
#include "mk_core.cuh"
#include "mk_layout.cuh"
#include "weight_stream.cuh"

namespace megac {
namespace mk {

using bf16 = __nv_bfloat16;

// (When attn_mma does not apply) 1: a split runs in key tiles through shared memory (attn_tiles.cuh); 0:
// a key per warp at a time (attn_rows.cuh, ~60 us per 512-key split of North
// Mini Code on the H200).
#ifndef MEGAC_ATTN_TILES
#define MEGAC_ATTN_TILES 1
#endif
// 1: where the shape allows (attn_mma::supported), a split runs on the tensor
// cores, each warp on its own 16-key chunks (attn_mma.cuh); 0: attn_tiles.
#ifndef MEGAC_ATTN_MMA
#define MEGAC_ATTN_MMA 1
#endif

template <class M>
struct AttnScratch {
  static constexpr int kDpl = (M::HEAD_DIM + 31) / 32;
  static constexpr bool kMma = MEGAC_ATTN_MMA && attn_mma::supported<M::HEAD_DIM, M::GQA>();
  static constexpr int kSplitBytes = kMma ? attn_mma::smem_bytes<M::HEAD_DIM, M::GQA, M::THREADS>()
                                     : MEGAC_ATTN_TILES
                                         ? attn_tiles::smem_bytes<M::HEAD_DIM, M::GQA, M::THREADS>()
                                         : attn_rows::smem_floats(M::THREADS / 32, M::GQA, M::HEAD_DIM) * 4;
  static constexpr int kCombineBytes = attn::combine_min_bytes<M::HEAD_DIM, M::GQA>(M::MAX_SPLITS) + 4096;
  static constexpr int kBytes = kSplitBytes > kCombineBytes ? kSplitBytes : kCombineBytes;
};

// The keys [begin, end) of split `split` (of `nsplits`) of `row`; empty for
// an inactive row.
__device__ __forceinline__ void split_keys(const LaunchDesc* d, int row, int split, int nsplits, int window,
                                          int& begin, int& end) {
  begin = 0;
  end = 0;
#if MEGAC_ATTN_AHEAD
  // both loads in one round trip (the position of an inactive row is read, not used)
  const int32_t active = ptr<const int32_t>(d->row_active)[row], pos = ptr<const int32_t>(d->seq_pos)[row];
  if (active) attn::split_range(pos + 1, window, nsplits, split, d->kv_block_size, begin, end);
#else
  if (ptr<const int32_t>(d->row_active)[row]) {
    const int seq_len = ptr<const int32_t>(d->seq_pos)[row] + 1;
    attn::split_range(seq_len, window, nsplits, split, d->kv_block_size, begin, end);
  }
#endif
}

// The page-table row of `row` in `layer`.
template <class M>
__device__ __forceinline__ const int32_t* page_row(const LaunchDesc* d, int layer, int row) {
  return ptr<const int32_t>(d->page_table) + (int64_t(layer) * M::MAX_ROWS + row) * d->max_blocks_per_seq;
}

// The partial of split `split` (of `nsplits`) of (row, kvh) in `layer`.
template <class M>
__device__ __forceinline__ void attend_split(const Ctx& c, int layer, int row, int kvh, int split, int nsplits,
                                             int window) {
  using Lay = Layout<M>;
  const LaunchDesc* d = c.d;
  const bf16* q = ptr<const bf16>(d->q) + Lay::q(layer, row) + kvh * M::GQA * M::HEAD_DIM;
  const int32_t* pt = page_row<M>(d, layer, row);
  int begin, end;
  split_keys(d, row, split, nsplits, window, begin, end);
  float* o = ptr<float>(d->attn_o_part) + Lay::o_part_attn(layer, split, row, kvh * M::GQA);
  float* lse = ptr<float>(d->attn_lse_part) + Lay::lse_part(layer, split, row, kvh * M::GQA);
  if constexpr (AttnScratch<M>::kMma || MEGAC_ATTN_TILES) {
    attn_tiles::Split a{q, ptr<const bf16>(d->k_pool), ptr<const bf16>(d->v_pool), pt, M::KV_HEADS, kvh,
                        d->kv_block_size, begin, end, d->attn_scale, o, lse};
    a.tmaps = ptr<const void>(d->kv_tmaps);
    a.head_major = M::KV_HEAD_MAJOR;
    if constexpr (AttnScratch<M>::kMma)
      attn_mma::split<M::HEAD_DIM, M::GQA, M::THREADS>(a, c.scratch, &c.ts->tma);
    else
      attn_tiles::split<M::HEAD_DIM, M::GQA, M::THREADS>(a, c.scratch);
  } else {
    attn_rows::Split a;
    a.q = q;
    a.k_pool = ptr<const bf16>(d->k_pool);
    a.v_pool = ptr<const bf16>(d->v_pool);
    a.pt = pt;
    a.kv_heads = M::KV_HEADS;
    a.kvh = kvh;
    a.hd = M::HEAD_DIM;
    a.gqa = M::GQA;
    a.block_size = d->kv_block_size;
    a.head_major = M::KV_HEAD_MAJOR;
    a.scale = d->attn_scale;
    a.begin = begin;
    a.end = end;
    a.o = o;
    a.lse = lse;
    attn_rows::split<AttnScratch<M>::kDpl, M::GQA>(a, reinterpret_cast<float*>(c.scratch));
  }
}

// 1: a static split (ATTN_DECODE) pulls its keys' K and V toward L2 as its
// task starts, before its waits (2: with an evict_last policy); 0: its keys
// move when the split runs. Why: the profile (H200, North Mini Code bs1 8K)
// has a sliding layer's splits waiting ~26 us for their Q and then streaming
// their 256 KB in ~13 us at ~25 GB/s per SM beside the expert claims, on the
// path to the O projection and the norm; the keys of earlier steps do not
// depend on anything of this step. The (row, kv head) tasks of one split
// share its pages (kv heads interleaved in a block), so each pulls a quarter
// of the split's keys for every head. A full layer's claimer (ATTN_DRAIN)
// does the same for the record it claimed, before the claim's wait.
#ifndef MEGAC_ATTN_WARM
#define MEGAC_ATTN_WARM 0
#endif

// Lanes `lane` of `nlanes`: split `split` of (row, kvh)'s share of K and V
// toward L2 (`nsplits` resolved; a quarter of the split's keys, every kv head).
template <class M>
__device__ __forceinline__ void warm_split(const Ctx& c, int layer, int row, int kvh, int split, int nsplits,
                                           int window, int lane, int nlanes) {
  const LaunchDesc* d = c.d;
  int begin, end;
  split_keys(d, row, split, nsplits, window, begin, end);
  const int bs = d->kv_block_size;
  const int n = end - begin;
  // token-major: a quarter of the keys, every kv head's rows (contiguous);
  // head-major (kv_pool.cuh): this head's keys, each block's run contiguous
  const int lo = M::KV_HEAD_MAJOR ? begin : begin + n * kvh / M::KV_HEADS;
  const int hi = M::KV_HEAD_MAJOR ? end : begin + n * (kvh + 1) / M::KV_HEADS;
  if (lo >= hi) return;  // an empty split, or an inactive row
  const int32_t* pt = page_row<M>(d, layer, row);
  // pieces of g keys never cross a block: a piece's rows are contiguous (token-major: from
  // head 0's row of its first key, every head; head-major: this head's rows)
  const int g = bs % 16 == 0 ? 16 : 1;
  constexpr int64_t kKeyBytes = int64_t(M::KV_HEAD_MAJOR ? 1 : M::KV_HEADS) * M::HEAD_DIM * 2;
#if MEGAC_ATTN_WARM == 2
  const uint64_t policy = l2_evict_last_policy();
#endif
  for (int p = lo / g + lane; p * g < hi; p += nlanes) {
    const int k0 = max(lo, p * g), k1 = min(hi, (p + 1) * g);
    const int64_t row = kvpool::row(__ldg(pt + k0 / bs), k0 % bs, bs, M::KV_HEADS, M::KV_HEAD_MAJOR ? kvh : 0,
                                    M::KV_HEAD_MAJOR);
    const char* kp = reinterpret_cast<const char*>(ptr<const bf16>(d->k_pool) + row * M::HEAD_DIM);
    const char* vp = reinterpret_cast<const char*>(ptr<const bf16>(d->v_pool) + row * M::HEAD_DIM);
    const uint32_t bytes = uint32_t((k1 - k0) * kKeyBytes);
#if MEGAC_ATTN_WARM == 2
    prefetch_l2_hint(kp, bytes, policy);
    prefetch_l2_hint(vp, bytes, policy);
#else
    prefetch_l2(kp, bytes);
    prefetch_l2(vp, bytes);
#endif
  }
}

// Splits of M prime before their waits in the tensor-copy form alone.
template <class M>
constexpr bool kPrimesSplits = AttnScratch<M>::kMma && attn_mma::tma_shape<M::HEAD_DIM>();

// Lane `lane` of warp 0 (below M::THREADS / 32), before a split's waits:
// warp `lane`'s first chunks of split `split` (of `nsplits`) of (row, kvh) onto
// its tensor-copy ring (attn_mma::prime_warp; only keys older than this
// step's token: those do not depend on the waits). A static split's
// (attn_prime) and a claimed one's (AttnEarly).
template <class M>
__device__ __forceinline__ void prime_split(const Ctx& c, int layer, int row, int kvh, int split, int nsplits,
                                            int window, int lane) {
  if constexpr (kPrimesSplits<M>) {
    const LaunchDesc* d = c.d;
    int begin, end;
    split_keys(d, row, split, nsplits, window, begin, end);
    attn_tiles::Split a{nullptr, ptr<const bf16>(d->k_pool), ptr<const bf16>(d->v_pool), page_row<M>(d, layer, row),
                        M::KV_HEADS, kvh, d->kv_block_size, begin, end, 0.f, nullptr, nullptr};
    a.tmaps = ptr<const void>(d->kv_tmaps);
    a.head_major = M::KV_HEAD_MAJOR;
    attn_mma::prime_warp<M::HEAD_DIM, M::GQA, M::THREADS>(a, c.scratch, &c.ts->tma, lane,
                                                          ptr<const int32_t>(d->seq_pos)[row]);
  }
}

// The static split of an ATTN_DECODE task's words `w`.
template <class M>
__device__ __forceinline__ void attn_prime(const Ctx& c, const int32_t* w, int lane) {
  if constexpr (kPrimesSplits<M>) {
    const LaunchDesc* d = c.d;
    if (lane >= M::THREADS / 32 || d->rows > MEGAC_ATTN_PRIME_ROWS) return;
    prime_split<M>(c, w[H_LAYER], w[f_attn_decode::ROW], w[f_attn_decode::KV_HEAD], w[f_attn_decode::SPLIT],
                   resolve(d, w[f_attn_decode::NUM_SPLITS]), w[f_attn_decode::WINDOW], lane);
  }
}

// Warp 0 (`lane` of 32), from an ATTN_DECODE task's words `w` before its
// waits (its dynamic NUM_SPLITS not yet resolved).
template <class M>
__device__ __forceinline__ void attn_warm(const Ctx& c, const int32_t* w, int lane) {
#if MEGAC_ATTN_WARM  // the warm hook also runs for MEGAC_NORM_WARM (ops_norm.cuh)
  warm_split<M>(c, w[H_LAYER], w[f_attn_decode::ROW], w[f_attn_decode::KV_HEAD], w[f_attn_decode::SPLIT],
                resolve(c.d, w[f_attn_decode::NUM_SPLITS]), w[f_attn_decode::WINDOW], lane, 32);
#endif
#if MEGAC_ATTN_PRIME
  attn_prime<M>(c, w, lane);
#endif
}

template <class M>
__device__ __forceinline__ void attn_decode(const Ctx& c) {
  attend_split<M>(c, c.ts->w[H_LAYER], c.ts->w[f_attn_decode::ROW], c.ts->w[f_attn_decode::KV_HEAD],
                  c.ts->w[f_attn_decode::SPLIT], c.ts->w[f_attn_decode::NUM_SPLITS], c.ts->w[f_attn_decode::WINDOW]);
}

// A claimed record {row, kv_head, split, num_splits}: waits TASK_WAIT_BASE +
// kv_head, signals TASK_SIGNAL_BASE + row * kv_heads + kv_head.
struct AttnOffsets {
  __device__ void operator()(const int32_t* rec, int32_t& wo, int32_t& so) const {
    wo = rec[rec_attn::KV_HEAD];
    so = rec[rec_attn::ROW] * kv_heads + rec[rec_attn::KV_HEAD];
  }
  int kv_heads;
};

// 1: a claimed attention split (ATTN_DRAIN) whose counter is not yet met
// when its claimer first reads it issues its first tensor-copy chunks before
// its wait, as a static split does through attn_prime (mk_core.cuh
// claim_loop's Early hook, as the down claims' MEGAC_DOWN_PRIME); 0: when it
// runs. Why: at batch 1 a full layer's 64 splits are claimed 10-20 us before
// their KV head's Q is written (SMs free at the layer's start claim them) and
// then their first chunk landed ~7 us after the wait, against ~3 us for a
// primed static split of a sliding layer (thirtieth session's reading of the
// twenty-ninth session's profile, layer 24); the late splits hold their SMs,
// whose O-projection tiles and down claims come after them.
#ifndef MEGAC_ATTN_CLAIM_PRIME
#define MEGAC_ATTN_CLAIM_PRIME 0
#endif

template <class M>
struct AttnEarly {
  static constexpr bool kOn = MEGAC_ATTN_CLAIM_PRIME && kPrimesSplits<M>;
  static constexpr bool kAlways = false;
  const Ctx& c;
  // every thread, the record in c.ts->rec: warp 0's lane w primes warp w's ring
  __device__ void operator()(const int32_t* r) const {
    if constexpr (kOn) {
      if (threadIdx.x >= M::THREADS / 32 || c.d->rows > MEGAC_ATTN_PRIME_ROWS) return;
      prime_split<M>(c, c.ts->w[H_LAYER], r[rec_attn::ROW], r[rec_attn::KV_HEAD], r[rec_attn::SPLIT],
                     r[rec_attn::NUM_SPLITS], c.ts->w[f_attn_drain::WINDOW], threadIdx.x);
    }
  }
  // thread 0, the claim given up after its wait failed: until the primed
  // chunks have landed (no copy outlives the CTA)
  __device__ void drain() const {
    if constexpr (kOn) attn_mma::tma_drain(&c.ts->tma);
  }
};

template <class M>
__device__ __forceinline__ bool attn_drain(const Ctx& c) {
  auto run = [&]() {
    const int32_t* r = c.ts->rec;
    attend_split<M>(c, c.ts->w[H_LAYER], r[rec_attn::ROW], r[rec_attn::KV_HEAD], r[rec_attn::SPLIT],
                    r[rec_attn::NUM_SPLITS], c.ts->w[f_attn_drain::WINDOW]);
  };
#if MEGAC_ATTN_WARM
  // thread 0, the claimed record known, before its wait: its keys toward L2
  auto warm = [&](const int32_t* r) {
    warm_split<M>(c, c.ts->w[H_LAYER], r[rec_attn::ROW], r[rec_attn::KV_HEAD], r[rec_attn::SPLIT],
                  r[rec_attn::NUM_SPLITS], c.ts->w[f_attn_drain::WINDOW], 0, 1);
  };
#else
  auto warm = [](const int32_t*) {};
#endif
  return claim_loop(c, f_attn_drain::QUEUE, f_attn_drain::QUEUE_LEN, f_attn_drain::TASK_WAIT_BASE,
                    f_attn_drain::TASK_WAIT_TARGET, f_attn_drain::TASK_SIGNAL_BASE, AttnOffsets{M::KV_HEADS},
                    warm, run, M::NUM_LAYERS, AttnEarly<M>{c});
}

template <class M>
__device__ __forceinline__ void attn_combine(const Ctx& c) {
  using Lay = Layout<M>;
  const LaunchDesc* d = c.d;
  const int layer = c.ts->w[H_LAYER];
  const int row = c.ts->w[f_attn_combine::ROW], kvh = c.ts->w[f_attn_combine::KV_HEAD];
  const int n = c.ts->w[f_attn_combine::NUM_SPLITS];
  attn::combine_core<M::HEAD_DIM, M::GQA, M::THREADS, 0>(
      ptr<const float>(d->attn_o_part) + Lay::o_part_attn(layer, 0, 0, 0),
      ptr<const float>(d->attn_lse_part) + Lay::lse_part(layer, 0, 0, 0),
      ptr<__nv_bfloat16>(d->attn_out) + Lay::attn_out(layer, 0), M::MAX_ROWS, M::NUM_HEADS, row, kvh, n,
      reinterpret_cast<char*>(c.scratch), c.scratch_bytes, threadIdx.x);
}

}  // namespace mk
}  // namespace megac

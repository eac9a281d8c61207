// One attention split on the tensor cores, each warp streaming its own keys:
// the partial (normalised output and log-sum-exp) of the G query heads of
// one (row, kv head) over the keys [begin, end) of one split, paged K/V
// bf16. Same contract as attn_tiles::split (an empty split or an inactive
// row writes o = 0, lse = -inf, which merges exactly); its faster form.
//
// Why: attn_tiles computes on the CUDA cores with three CTA barriers per
// 64-key tile; the profiled North Mini Code step showed a 512-key split at
// ~42 us (~3 GB/s per SM), issue-bound, the slowest work per byte in the
// step. Here:
//
//   * the split's keys are cut into 16-key chunks and chunk c belongs to
//     warp c % WARPS (fixed, so the result does not depend on timing);
//   * each warp copies its own chunks (K and V rows, 16-byte cp.async, the
//     page-table entries one chunk ahead) into its own STAGES-deep slots and
//     waits only on its own copies: no CTA barrier until the final merge;
//   * scores S = Q K^T and O += P V are mma.m16n8k16: the GQA heads are the
//     16-row side (rows past G are zeros), keys / head dims the 8 columns;
//     Q stays in registers for the whole split; P goes from the score
//     accumulators straight into the A operand of P V (same fragment
//     layout) as two bf16 terms (hi + lo: ~16 bits of P); the online
//     softmax runs in fp32 in the log2 domain;
//   * at the end the warps' (m, l, O) are merged in warp order through
//     shared memory, in fp32.
//
// K/V rows sit in shared memory HD*2 + 16 bytes apart, so the 8 rows an
// ldmatrix reads fall in 8 different 16-byte bank groups.
//
// The tensor-copy form (MEGAC_ATTN_TMA, where the host passes the pools'
// tensor maps): each warp's lane 0 copies a chunk as boxes of 16 tokens x 1
// head x 64 dims (K and V, one box per 64 dims) onto the warp's own
// mbarriers, in the 128-byte swizzle (attn::swz), instead of 16-byte cp.async
// by every lane. Why: at batch 8 the splits streamed ~15-18 GB/s per SM of
// their time against the expert claims' ~31-34 beside them (bs8 8K trace,
// fourteenth session): the rate every ld.global / cp.async stream in this
// kernel hit (the SM's L1 miss handling; gemm_tc.cuh), which the copy engine
// bypasses. A box never crosses a KV block, so chunks start at multiples of
// 16 keys (the split's first chunk may begin before its first key, its last
// end past its last: those keys are masked, and their V rows zeroed in
// shared memory, so a stale page's NaN never meets a zero probability).
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "attention.cuh"
#include "attn_tiles.cuh"
#include "common.cuh"
#include "mbarrier.cuh"
#include "profile_marks.cuh"

namespace megac {
namespace attn_mma {

using bf16 = __nv_bfloat16;
using attn_tiles::Split;

// Chunks in flight per warp + the one computed.
#ifndef MEGAC_ATTN_MMA_STAGES
#define MEGAC_ATTN_MMA_STAGES 2
#endif

// Shapes this form takes; others use attn_tiles. G <= 8: the heads fill
// rows 0-7 of the 16-row side and rows 8-15 stay zero (every shape we
// build and test; more heads would need the second half's softmax).
template <int HD, int G>
constexpr bool supported() {
  return HD % 16 == 0 && HD <= 128 && G >= 1 && G <= 8;
}

// 1: the tensor-copy form where the launch has tensor maps (kv_tmaps) and
// the shape allows it (tma_shape, a block size that is a multiple of 16);
// 0: 16-byte cp.async always.
#ifndef MEGAC_ATTN_TMA
#define MEGAC_ATTN_TMA 1
#endif
// Chunks a warp's tensor-copy ring holds (in flight + the one computed).
#ifndef MEGAC_ATTN_TMA_STAGES
#define MEGAC_ATTN_TMA_STAGES 2
#endif
constexpr int kTmaStages = MEGAC_ATTN_TMA_STAGES;
constexpr int kTmaMaxWarps = 8;
static_assert(kTmaStages >= 2, "a chunk computed and one in flight");

// Head dims the boxes cut into 64-dim halves (attn::swz's layout).
template <int HD>
__host__ __device__ constexpr bool tma_shape() {
  return MEGAC_ATTN_TMA && HD % 64 == 0 && HD <= 128;
}

// Per-launch state of the warps' tensor-copy rings (in the task loop's
// shared state: the scratch is other opcodes' between splits): each warp's
// mbarriers and the chunks it has issued since the launch (slot and phase
// follow from that count, so consecutive splits continue the ring).
struct TmaState {
  uint64_t bar[kTmaMaxWarps][kTmaStages];
  uint32_t seq[kTmaMaxWarps];
  uint32_t primed[kTmaMaxWarps];  // of the coming split's first chunks, issued before its task's waits
};

// Thread 0 at launch; visible after the task loop's first barrier.
__device__ __forceinline__ void tma_init(TmaState* st) {
  for (int w = 0; w < kTmaMaxWarps; ++w) {
    for (int s = 0; s < kTmaStages; ++s) mbar_init(&st->bar[w][s], 1);
    st->seq[w] = 0;
    st->primed[w] = 0;
  }
  mbar_init_fence();
}

// Thread 0, when a task gave up after its split was primed: until the
// primed chunks have landed (no copy outlives the CTA).
__device__ __forceinline__ void tma_drain(TmaState* st) {
  for (int w = 0; w < kTmaMaxWarps; ++w)
    for (uint32_t i = 0; i < st->primed[w]; ++i) {
      const uint32_t n = st->seq[w] + i;
      while (!mbar_try_wait(&st->bar[w][n % kTmaStages], (n / kTmaStages) & 1u)) {
      }
    }
}

template <int HD, int G, int THREADS>
struct Shape {
  static constexpr int W = THREADS / 32;            // warps
  static constexpr int KPC = 16;                    // keys per chunk: one k step of P V
  static constexpr int S = MEGAC_ATTN_MMA_STAGES;
  static constexpr int PITCH = HD * 2 + 16;         // bytes between K (V) rows in a slot
  static constexpr int kTile = KPC * PITCH;         // a chunk's K (or V)
  static constexpr int kStage = 2 * kTile;          // K then V
  static constexpr int kMerge = (G * HD + 2 * G) * 4;  // a warp's O, m, l (fp32)
  static constexpr int kWarp = S * kStage > kMerge ? S * kStage : (kMerge + 15) / 16 * 16;
  static constexpr int kBytes = W * kWarp;
  static constexpr int PPL = KPC * (HD / 8) / 32;   // 16-byte pieces per lane per chunk (K; V alike)
  static constexpr int KK = HD / 16;                // k steps of Q K^T
  static constexpr int NT = HD / 8;                 // 8-dim column tiles of O
  static_assert(S >= 2, "a chunk computed and one in flight");
  static_assert(KPC * (HD / 8) % 32 == 0, "whole pieces per lane");
  // the tensor-copy form: a chunk's K (then V) as HD / 64 swizzled 2 KB
  // boxes, slots on 1024-byte boundaries (the swizzle's XOR comes from
  // address bits 7-9), the region aligned up inside the scratch
  static constexpr int kTileT = KPC * HD * 2;
  static constexpr int kStageT = 2 * kTileT;
  static constexpr int kWarpT = kTmaStages * kStageT > kMerge ? kTmaStages * kStageT : (kMerge + 1023) / 1024 * 1024;
  static constexpr int kBytesT = tma_shape<HD>() ? W * kWarpT + 1024 : 0;
};

template <int HD, int G, int THREADS>
__host__ __device__ constexpr int smem_bytes() {
  using Sh = Shape<HD, G, THREADS>;
  return Sh::kBytes > Sh::kBytesT ? Sh::kBytes : Sh::kBytesT;
}

// 1: a warp loads the page-table entries of the split's first 32 blocks at
// once before its first copies (lane j: block begin / block_size + j) and
// takes each chunk's from them, past those from the table; 0: each chunk's
// entries are loaded one chunk ahead. Why: a split of 512 keys is 4 chunks
// per warp, and the entry load issued one chunk ahead lands after the short
// compute of the chunk before, so nearly every copy waited a loaded L2 round
// trip for its entry (the profile: a 256 KB split ran ~21 us while the
// expert claims beside it streamed). Measured (H200, check variants, same
// bits): tenth session NMC 8K bs1 3.544 -> 3.540 ms, bs8 10.85 -> 10.78,
// SmolLM2 1.235 -> 1.205; eleventh 3.416 -> 3.380, 10.41 -> 10.38, 1.157 ->
// 1.133. On by default since.
#ifndef MEGAC_ATTN_AHEAD
#define MEGAC_ATTN_AHEAD 1
#endif

// Lane j < 16: the physical block of key key0 + j (0 past the split).
__device__ __forceinline__ int page_entry(const Split& a, int key0, int lane) {
  const int key = key0 + (lane & 15);
  return (lane < 16 && key < a.end) ? __ldg(a.pt + key / a.block_size) : 0;
}

// The same from `ahead` (lane j: the entry of block blk0 + j), warp-uniform call.
__device__ __forceinline__ int page_entry_ahead(const Split& a, int key0, int lane, int blk0, int ahead) {
  const int key = key0 + (lane & 15);
  const int rel = key / a.block_size - blk0;  // >= 0: key0 >= begin
  const int got = __shfl_sync(0xffffffffu, ahead, rel & 31);
  if (!(lane < 16 && key < a.end)) return 0;
  return rel < 32 ? got : __ldg(a.pt + key / a.block_size);
}

// This lane's copies of the chunk at key0 into slot `slot` (K at +0, V at
// +kTile), then one commit group (empty when !live), so group i holds the
// warp's chunk i. Keys past the split read as zeros: never a stale page's
// NaN in an mma.
template <int HD, int G, int THREADS>
__device__ __forceinline__ void issue(const Split& a, int key0, int blk, uint32_t slot, int lane, bool live) {
  using Sh = Shape<HD, G, THREADS>;
  if (live) {
    constexpr int kPieces = HD / 8;
#pragma unroll
    for (int r = 0; r < Sh::PPL; ++r) {
      const int p = lane + 32 * r, j = p / kPieces, c = p % kPieces, key = key0 + j;
      const int b = __shfl_sync(0xffffffffu, blk, j);
      const bool in = key < a.end;
      const int64_t tok = kvpool::row(b, in ? key % a.block_size : 0, a.block_size, a.kv_heads, a.kvh, a.head_major);
      const uint32_t dst = slot + j * Sh::PITCH + c * 16;
      cp_async16(dst, a.k_pool + tok * HD + c * 8, in ? 16 : 0);
      cp_async16(dst + Sh::kTile, a.v_pool + tok * HD + c * 8, in ? 16 : 0);
    }
  }
  cp_async_commit();
}

// (a, b) as two packed bf16 pairs, hi = bf16(x) and lo = bf16(x - hi).
__device__ __forceinline__ void split_bf16(float a, float b, uint32_t& hi, uint32_t& lo) {
  hi = attn::pack_bf16(a, b);
  const __nv_bfloat162 h = *reinterpret_cast<const __nv_bfloat162*>(&hi);
  lo = attn::pack_bf16(a - __low2float(h), b - __high2float(h));
}

// 1: one copy of split() for ATTN_DECODE and ATTN_DRAIN (see
// MEGAC_TC_NOINLINE in gemm_tc.cuh); 0: inlined into each.
#ifndef MEGAC_ATTN_NOINLINE
#define MEGAC_ATTN_NOINLINE 0
#endif
#if MEGAC_ATTN_NOINLINE
#define MEGAC_ATTN_SPLIT_FN __noinline__
#else
#define MEGAC_ATTN_SPLIT_FN __forceinline__
#endif

// Lane 0 (tensor-copy form): the chunk at key0 (a multiple of 16 keys, in
// KV block `blk`) into slot `slot`: K's boxes at +0, V's at +kTileT, each
// completing its bytes on `bar`.
template <int HD, int G, int THREADS>
__device__ __forceinline__ void issue_tma(const Split& a, int key0, int blk, uint32_t slot, uint64_t* bar) {
  using Sh = Shape<HD, G, THREADS>;
  mbar_arrive_expect_tx(bar, uint32_t(Sh::kStageT));
  const int off = key0 % a.block_size;  // the box's 16 tokens stay in the block: block_size % 16 == 0
  const char* maps = static_cast<const char*>(a.tmaps);
#pragma unroll
  for (int h = 0; h < HD / 64; ++h) {  // the maps' dims in memory order (megac.gpu.tensormap)
    const int c1 = a.head_major ? off : a.kvh, c2 = a.head_major ? a.kvh : off;
    attn::tma_load_4d(slot + h * 2048, maps, h * 64, c1, c2, blk, bar);
    attn::tma_load_4d(slot + Sh::kTileT + h * 2048, maps + 128, h * 64, c1, c2, blk, bar);
  }
}

// Where a split's tensor-copy ring starts in the scratch (1024-byte aligned).
__device__ __forceinline__ uint8_t* tma_region(uint8_t* sm_in) {
  return sm_in + ((1024u - (smem_addr(sm_in) & 1023u)) & 1023u);
}

// The tensor-copy form applies to split `a` (its shape, the launch's maps, its block size).
template <int HD>
__device__ __forceinline__ bool tma_ok(const Split& a) {
  return tma_shape<HD>() && a.tmaps != nullptr && a.block_size % 16 == 0;
}

// Warp `warp`'s share of a split's 16-key chunks (chunk c belongs to warp
// c % W): they start at the split's first key, or (boxes) at the multiple
// of 16 at or below it; split_impl and prime_warp walk the same chunks.
template <int W, int KPC>
struct WarpChunks {
  int kb, count, warp;
  __device__ __forceinline__ WarpChunks(const Split& a, bool boxes, int warp_) : warp(warp_) {
    kb = boxes ? a.begin & ~(KPC - 1) : a.begin;
    const int nkeys = a.end > a.begin ? a.end - kb : 0;
    const int nchunks = (nkeys + KPC - 1) / KPC;
    count = nchunks > warp ? (nchunks - warp + W - 1) / W : 0;
  }
  __device__ __forceinline__ int key0(int i) const { return kb + (warp + i * W) * KPC; }
};

// Lane `wi` (< W) of a warp that runs before a static split's waits: the
// first chunks of warp wi's share of split `a` (at most a ring's worth)
// whose keys all precede key `fresh` (the one this step writes: its K and V
// are not there before the waits), onto warp wi's ring; split_impl takes
// them from there (TmaState::primed). Why: a static split waits ~10 us for
// its Q while the memory system has room (the QKV tiles and the routing
// chain run then) and spends ~5 us of its run before its first chunk lands.
template <int HD, int G, int THREADS>
__device__ __forceinline__ void prime_warp(const Split& a, uint8_t* sm_in, TmaState* st, int wi, int fresh) {
  using Sh = Shape<HD, G, THREADS>;
  constexpr int W = Sh::W, KPC = Sh::KPC;
  uint32_t k = 0;
  if (tma_ok<HD>(a) && a.begin < a.end) {
    const uint32_t base = smem_addr(tma_region(sm_in) + wi * Sh::kWarpT);
    const WarpChunks<W, KPC> ch(a, true, wi);
    const uint32_t seq = st->seq[wi];
    for (int i = 0; i < kTmaStages && i < ch.count; ++i) {
      const int key0 = ch.key0(i);
      if (key0 + KPC > fresh) break;  // later chunks of this warp are later keys still
      const uint32_t n = seq + uint32_t(i);
      issue_tma<HD, G, THREADS>(a, key0, __ldg(a.pt + key0 / a.block_size), base + (n % kTmaStages) * Sh::kStageT,
                                &st->bar[wi][n % kTmaStages]);
      ++k;
    }
  }
  st->primed[wi] = k;
}

// Both forms of a split; kTma: the tensor-copy form (the caller checked
// tma_ok), else 16-byte cp.async by every lane.
template <int HD, int G, int THREADS, bool kTma>
__device__ __forceinline__ void split_impl(const Split& a, uint8_t* sm_in, TmaState* st) {
  using Sh = Shape<HD, G, THREADS>;
  constexpr int W = Sh::W, KPC = Sh::KPC;
  constexpr int S = kTma ? kTmaStages : Sh::S;
  constexpr int kStage = kTma ? Sh::kStageT : Sh::kStage;
  constexpr int kWarp = kTma ? Sh::kWarpT : Sh::kWarp;
  constexpr int kTile = kTma ? Sh::kTileT : Sh::kTile;
  static_assert(!kTma || W <= kTmaMaxWarps, "a tensor-copy ring per warp");
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, t4 = lane & 3;
  // stamps 12-15 (profiled builds): where a split's first chunk goes, which a
  // full layer's claimed splits wait 5-10 us for after their hand-off
  // (forty-third session: H100 stamps 8 -> 3, 1.89 -> 12.42 us)
  MEGAC_MARK(12);  // thread 0 in the split
  // the tensor-copy slots on 1024-byte boundaries
  uint8_t* sm = kTma ? tma_region(sm_in) : sm_in;
  uint8_t* mine = sm + warp * kWarp;
  const uint32_t base = smem_addr(mine);
  const WarpChunks<W, KPC> ch(a, kTma, warp);
  const int count = ch.count;  // this warp's chunks
  auto key0_of = [&](int i) { return ch.key0(i); };
  // tensor-copy ring: this warp's chunk i is its (seq0 + i)-th since the launch
  const uint32_t seq0 = kTma ? st->seq[warp] : 0u;
  const int pre = kTma ? int(st->primed[warp]) : 0;  // chunks prime_warp issued already

#if MEGAC_ATTN_AHEAD
  const int blk0 = a.begin / a.block_size;
  const int ahead = (a.begin < a.end && (blk0 + lane) * a.block_size < a.end) ? __ldg(a.pt + blk0 + lane) : 0;
  auto entry = [&](int key0) { return page_entry_ahead(a, key0, lane, blk0, ahead); };
#else
  const int blk0 = 0, ahead = 0;
  auto entry = [&](int key0) { return page_entry(a, key0, lane); };
#endif
  // the block of a chunk's keys (tensor-copy form: one block per chunk), warp-uniform call
  auto chunk_block = [&](int key0) {
    const int blk = key0 / a.block_size;
#if MEGAC_ATTN_AHEAD
    const int got = __shfl_sync(0xffffffffu, ahead, (blk - blk0) & 31);
    return blk - blk0 < 32 ? got : __ldg(a.pt + blk);
#else
    (void)blk0;
    (void)ahead;
    return __ldg(a.pt + blk);
#endif
  };
  auto slot_of = [&](int i) { return base + uint32_t(kTma ? (seq0 + i) % S : i % S) * kStage; };
  auto bar_of = [&](int i) { return &st->bar[warp][(seq0 + i) % S]; };

  // first chunks out before anything else
  if constexpr (kTma) {
    int blk[S];
#pragma unroll
    for (int i = 0; i < S; ++i) blk[i] = i < count ? chunk_block(key0_of(i)) : 0;
    MEGAC_MARK_AFTER(13, blk[0]);  // thread 0 has its first chunks' blocks (the page table read)
    if (lane == 0) {
#pragma unroll
      for (int i = 0; i < S; ++i)
        if (i < count && i >= pre) issue_tma<HD, G, THREADS>(a, key0_of(i), blk[i], slot_of(i), bar_of(i));
    }
  } else {
    int blk[S];
#pragma unroll
    for (int i = 0; i < S; ++i) blk[i] = i < count ? entry(key0_of(i)) : 0;
    MEGAC_MARK_AFTER(13, blk[0]);  // thread 0 has its first chunks' blocks (the page table read)
#pragma unroll
    for (int i = 0; i < S; ++i) issue<HD, G, THREADS>(a, key0_of(i), blk[i], base + i * kStage, lane, i < count);
  }
  MEGAC_MARK(14);  // thread 0 issued its first chunks

  // Q as the A operand (row gid; rows 8-15 zero), in registers for the split;
  // written by another CTA of this launch: through L2
  uint32_t q[Sh::KK][4];
  {
    const uint32_t* q32 = reinterpret_cast<const uint32_t*>(a.q);
#pragma unroll
    for (int kk = 0; kk < Sh::KK; ++kk) {
      const int c = kk * 16 + 2 * t4;
      q[kk][0] = gid < G ? __ldcg(q32 + (gid * HD + c) / 2) : 0u;
      q[kk][2] = gid < G ? __ldcg(q32 + (gid * HD + c + 8) / 2) : 0u;
      q[kk][1] = 0u;
      q[kk][3] = 0u;
    }
  }
  MEGAC_MARK_AFTER(15, q[0][0]);  // thread 0's Q loaded (through L2)
  const float sl2 = a.scale * attn::kLog2e;

  float o[Sh::NT][4];
#pragma unroll
  for (int n = 0; n < Sh::NT; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] = 0.f;
  float m_run = -INFINITY, l_run = 0.f;  // row gid: running max (log2 domain), sum over this thread's keys

  // ldmatrix lane addresses within a slot: K (non-transposed: key rows are
  // the B columns) and V (transposed: key rows are the B k-side); the
  // 16-byte piece p of key row r at (padded rows) r * PITCH + 16 p, or
  // (boxes) attn::swz<HD, 16>(r, p)
  const int mtx = lane >> 3, r8 = lane & 7;
  const int k_row = r8 + 8 * (mtx >> 1), k_pc = mtx & 1;
  const int v_row = r8 + 8 * (mtx & 1), v_pc = mtx >> 1;
  auto at = [&](int row, int piece) -> uint32_t {
    if constexpr (kTma)
      return attn::swz<HD, KPC>(row, piece);
    else
      return uint32_t(row * Sh::PITCH + piece * 16);
  };

  for (int i = 0; i < count; ++i) {
    int nb;  // in flight while chunk i computes
    if constexpr (kTma) {
      nb = i + S < count ? chunk_block(key0_of(i + S)) : 0;
      while (!mbar_try_wait(bar_of(i), ((seq0 + i) / S) & 1u)) {
      }
    } else {
      nb = i + S < count ? entry(key0_of(i + S)) : 0;
      cp_async_wait<S - 1>();  // this lane's copies of chunk i are in
      __syncwarp();            // and every lane's
    }
    if (i == 0) MEGAC_MARK(3);  // warp 0's first chunk landed
    const uint32_t slot = slot_of(i);
    const int key0 = key0_of(i);
    if constexpr (kTma) {
      // keys of the box outside the split: V rows zeroed (K rows are masked below)
      if (key0 < a.begin || key0 + KPC > a.end) {
        constexpr int kPieces = HD / 8;
#pragma unroll
        for (int r = 0; r < KPC * kPieces / 32; ++r) {
          const int p = lane + 32 * r, j = p / kPieces, c = p % kPieces;
          if (key0 + j < a.begin || key0 + j >= a.end)
            asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(slot + kTile + at(j, c)), "r"(0u)
                         : "memory");
        }
        // these generic writes before the copy engine refills the slot
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncwarp();
      }
    }

    // S = Q K^T: keys key0 + 0..7 (s[0]) and 8..15 (s[1])
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kk = 0; kk < Sh::KK; ++kk) {
      uint32_t b0, b1, b2, b3;
      attn::ldsm_x4(slot + at(k_row, 2 * kk + k_pc), b0, b1, b2, b3);
      attn::mma_bf16(s[0], q[kk][0], q[kk][1], q[kk][2], q[kk][3], b0, b1);
      attn::mma_bf16(s[1], q[kk][0], q[kk][1], q[kk][2], q[kk][3], b2, b3);
    }
    // scale into the log2 domain; keys outside the split: -inf
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + n * 8 + 2 * t4 + (e & 1);
        s[n][e] = key < a.end && (!kTma || key >= a.begin) ? s[n][e] * sl2 : -INFINITY;
      }

    // online softmax of row gid (s[n][0..1]; s[n][2..3] are the zero rows);
    // the chunk holds a key of the split, so the new max is finite
    {
      float mx = fmaxf(fmaxf(s[0][0], s[0][1]), fmaxf(s[1][0], s[1][1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float mn = fmaxf(m_run, mx);
      const float r = exp2f(m_run - mn);  // 0 on the warp's first chunk
      float ps = 0.f;
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          s[n][e] = exp2f(s[n][e] - mn);
          ps += s[n][e];
        }
      l_run = l_run * r + ps;
      m_run = mn;
#pragma unroll
      for (int n = 0; n < Sh::NT; ++n) {
        o[n][0] *= r;
        o[n][1] *= r;
      }
    }

    // O += P V: the score fragments are the A operand as they are. P goes
    // in as two bf16 terms, P = hi + lo (lo: what bf16 rounding of P lost),
    // so the product keeps ~16 bits of P, as fp32 P on the CUDA cores did:
    // with P in one bf16 term, SmolLM2's greedy text left transformers' at a
    // 0.13 fp32 margin. Two more MMAs per 8 dims cost nothing here: the
    // split waits on memory.
    uint32_t ph0, ph2, pl0, pl2;
    const uint32_t ph1 = 0u, ph3 = 0u, pl1 = 0u, pl3 = 0u;  // rows 8-15
    split_bf16(s[0][0], s[0][1], ph0, pl0);
    split_bf16(s[1][0], s[1][1], ph2, pl2);
#pragma unroll
    for (int np = 0; np < Sh::NT / 2; ++np) {
      uint32_t b0, b1, b2, b3;
      attn::ldsm_x4_t(slot + kTile + at(v_row, 2 * np + v_pc), b0, b1, b2, b3);
      attn::mma_bf16(o[2 * np], ph0, ph1, ph2, ph3, b0, b1);
      attn::mma_bf16(o[2 * np + 1], ph0, ph1, ph2, ph3, b2, b3);
      attn::mma_bf16(o[2 * np], pl0, pl1, pl2, pl3, b0, b1);
      attn::mma_bf16(o[2 * np + 1], pl0, pl1, pl2, pl3, b2, b3);
    }
    __syncwarp();  // every lane is done with the slot before it is refilled
    if constexpr (kTma) {
      // (no proxy fence for this write-after-read: gemm_tc.cuh's MEGAC_TC_STAGE_FENCE)
      if (lane == 0 && i + S < count) issue_tma<HD, G, THREADS>(a, key0_of(i + S), nb, slot, bar_of(i + S));
    } else {
      issue<HD, G, THREADS>(a, key0_of(i + S), nb, slot, lane, i + S < count);
    }
  }
  if constexpr (kTma) {
    if (lane == 0) {  // read again after the merge's barriers
      st->seq[warp] = seq0 + uint32_t(count);
      st->primed[warp] = 0;
    }
  } else {
    cp_async_wait<0>();  // only empty groups can remain
    __syncwarp();
  }
  MEGAC_MARK(4);  // warp 0's keys all consumed

  // this warp's (O unnormalised, m, l) into its own region, heads < G only
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
  float* wo = reinterpret_cast<float*>(mine);
  float* wm = wo + G * HD;
  float* wl = wm + G;
#pragma unroll
  for (int n = 0; n < Sh::NT; ++n) {
    const int d = n * 8 + 2 * t4;
    if (gid < G) *reinterpret_cast<float2*>(wo + gid * HD + d) = make_float2(o[n][0], o[n][1]);
  }
  if (t4 == 0 && gid < G) {
    wm[gid] = m_run;
    wl[gid] = l_run;
  }
  __syncthreads();

  // merge in warp order: o = sum_w 2^(m_w - M) O_w / L, lse = ln(L) + M ln 2;
  // every warp empty (an empty split): o = 0, lse = -inf
  for (int idx = tid; idx < G * HD; idx += THREADS) {
    const int h = idx / HD, d = idx % HD;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < W; ++w) mx = fmaxf(mx, reinterpret_cast<const float*>(sm + w * kWarp)[G * HD + h]);
    float l = 0.f, acc = 0.f;
    if (mx > -INFINITY) {
#pragma unroll
      for (int w = 0; w < W; ++w) {
        const float* rw = reinterpret_cast<const float*>(sm + w * kWarp);
        const float f = exp2f(rw[G * HD + h] - mx);  // an empty warp: exp2(-inf) = 0
        l += rw[G * HD + G + h] * f;
        acc += rw[h * HD + d] * f;
      }
    }
    a.o[idx] = l > 0.f ? acc / l : 0.f;
    if (d == 0) a.lse[h] = l > 0.f ? (mx + log2f(l)) * attn::kLn2 : -INFINITY;
  }
  // the merge's generic writes before the next split's boxes land there (a
  // claimer runs its next record without the task loop's fence)
  if constexpr (kTma) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();  // the scratch is free for the next task
  MEGAC_MARK(5);  // the warps merged, the partial written
}

// The split in the tensor-copy form where it can run (the shape, the
// launch's tensor maps, a block size the 16-token boxes tile), else
// through cp.async.
template <int HD, int G, int THREADS>
__device__ MEGAC_ATTN_SPLIT_FN void split(const Split& a, uint8_t* sm, TmaState* st) {
  if constexpr (tma_shape<HD>()) {
    if (tma_ok<HD>(a)) {
      split_impl<HD, G, THREADS, true>(a, sm, st);
      return;
    }
  }
  split_impl<HD, G, THREADS, false>(a, sm, st);
}

}  // namespace attn_mma
}  // namespace megac

// Tiny-M decode GEMM tile: Y[M, NT] = X[M, K] . W[NT, K]^T, M <= 8 tokens.
//
// Decode GEMMs are weight-streaming problems: each weight byte is used for at
// most 8 tokens, so the tensor cores only have to keep up with DRAM. The tile
// therefore swaps operands: weights are the MMA's 16-row A operand and the
// (padded) tokens its 8-column B operand (mma.sync m16n8k16, fp32 accumulate).
//
// Data path, one CTA per SM:
//   * one producer warp streams weight "stages" (16 rows x BK columns) with
//     bulk async copies into a shared-memory ring, as far ahead as the ring
//     allows, and runs straight on into the next tile's stages while the
//     consumers are still finishing this one (no refill bubble per tile);
//   * each tile's activations X[M, K] are bulk-copied once into one of two
//     buffers, so the next tile's X lands while this one computes;
//   * NC consumer warps own fixed 16-row groups of the tile over all of K, so
//     no cross-warp K reduction is needed; each folds its result into a
//     shared fp32 staging tile Ys[NT][8] that the epilogues read.
//
// Two weight layouts (template flag TILED):
//   * row-major [N, K]: a stage is 16 bulk copies, one per row segment of
//     BK*2 bytes, into rows padded for conflict-free reads. Simple, but each
//     copy is small and the copies, not DRAM, set the pace: on the H200 we
//     measured a steady ~22 M copies/s per SM whatever their size, i.e. ~50 %
//     of the streaming ceiling with 768-byte copies, ~66 % with 1 KB, ~70 %
//     with 1152 B and 86-90 % with 2 KB (BK_MAX = 1024, 4 stages of 33 KB).
//   * tiled ("stage-major"): the weight-layout pass stores each stage (16 rows
//     x BK columns) contiguously, already in fragment order, so a stage is ONE
//     bulk copy of 9-18 KB and the consumers' 16-byte reads are contiguous
//     across the warp. Element (row r, column k) of an [N, K] matrix lives at
//       stage  = (r / 16) * (K / BK) + k / BK            (16*BK elements each)
//       inside = (((k % BK) / 32 * 2 + (r % 16) / 8) * 32 + (r % 8) * 4 + (k % 32) / 8) * 8 + k % 8
//     i.e. [N/16][K/BK][BK/32][2][8][4][8]: a pure permutation, made once at
//     load time (megac/gpu/blocks/gemm.py tile_weights is the reference).
//     Measured 95-100 % of the streaming ceiling on every decode shape of
//     North Mini Code and SmolLM2 at M = 1 and 8.
//
// K is permuted inside each 32-column block so that one 16-byte shared load
// per lane yields the A fragments of two MMAs (and the matching B fragment):
// lane (g = lane/4, t = lane%4) holds columns [8t, 8t+8) of rows g and g+8;
// a dot product does not care in which order its K terms are summed, only
// that A and B agree, and they do because X is read at the same offsets.
//
// Four independent accumulators per row group keep the MMA dependency chain
// from serialising; they are summed in a fixed order, so results are
// deterministic and independent of the other rows in the batch.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "common.cuh"
#include "weight_stream.cuh"

namespace megac {
namespace gemm {

// --- configuration ------------------------------------------------------------

// Largest stage width (columns of K) that divides K, is a multiple of the
// 32-column permutation block, and keeps a stage at <= 18 KB of weights
// (576 covers SmolLM's K = 576 in one stage per row group).
constexpr int pick_bk(int k, int bk_max = 576) {
  for (int bk = bk_max; bk >= 32; bk -= 32)
    if (k % bk == 0) return bk;
  return 0;
}

// A row pitch whose remainder mod 128 bytes is 64 makes the 8 lanes of each
// quarter-warp (two rows x four 16-byte chunks) hit 32 distinct banks.
constexpr int conflict_free_pitch(int row_bytes) {
  return (row_bytes % 128 == 64) ? row_bytes : row_bytes + 64;
}

// Opt-in dynamic shared memory per CTA on sm_90 (227 KB).
constexpr int kMaxSmem = 232448;

// BK_MAX: cap on the stage width; larger means fewer, larger bulk copies
// (the row-major layout needs ~2 KB per row copy to approach the ceiling).
template <int NT_, int K_, int M_, bool TILED_ = false, int BK_MAX_ = 576, int NC_ = 4,
          int STAGES_ = 0>
struct TileCfg {
  static constexpr bool TILED = TILED_;
  static constexpr int NT = NT_;  // output features (weight rows) per tile
  static constexpr int K = K_;    // reduction length of one task (a split-K slice)
  static constexpr int M = M_;    // token rows, 1..8
  static constexpr int NC = NC_;  // consumer warps
  static constexpr int RG = NT / 16;  // 16-row groups per tile
  static constexpr int R = RG / NC;   // row groups per consumer warp
  static constexpr int BK = pick_bk(K, BK_MAX_);
  static constexpr int KC = K / (BK ? BK : 1);  // stages per row group
  static constexpr int STAGES_PER_TILE = RG * KC;

  static constexpr int W_PITCH = TILED ? BK * 2 : conflict_free_pitch(BK * 2);
  static constexpr int STAGE_BYTES = 16 * W_PITCH;
  static constexpr uint32_t STAGE_TX = 16u * BK * 2u;
  static constexpr int X_PITCH = conflict_free_pitch(K * 2);
  static constexpr int X_BYTES = ((M * X_PITCH + 127) / 128) * 128;
  static constexpr uint32_t X_TX = uint32_t(M) * K * 2u;
  static constexpr int Y_BYTES = NT * 8 * 4;

  static constexpr int FIXED_BYTES = 2 * X_BYTES + 2 * Y_BYTES + 1024;  // + barriers
  // A multiple of NC: stage j of every tile goes to warp j % NC and the
  // tile's stage count is a multiple of NC, so each slot then has a single
  // consumer warp, which never waits on a slot's phase more than one ahead
  // (an mbarrier's parity tells only two phases apart).
  static constexpr int AUTO_STAGES_RAW = (kMaxSmem - FIXED_BYTES) / STAGE_BYTES;
  static constexpr int AUTO_STAGES = (AUTO_STAGES_RAW > 16 ? 16 : AUTO_STAGES_RAW) / NC * NC;
  static constexpr int STAGES = STAGES_ ? STAGES_ : AUTO_STAGES;

  // Layout of the dynamic shared memory: ring, two X buffers, two Y tiles,
  // then the mbarriers.
  static constexpr int RING_OFF = 0;
  static constexpr int X_OFF = STAGES * STAGE_BYTES;
  static constexpr int Y_OFF = X_OFF + 2 * X_BYTES;
  static constexpr int BAR_OFF = Y_OFF + 2 * Y_BYTES;
  static constexpr int NUM_BARS = 2 * STAGES + 4;
  static constexpr int SMEM_BYTES = BAR_OFF + NUM_BARS * 8;
  static constexpr int THREADS = (NC + 1) * 32;

  static_assert(M >= 1 && M <= 8, "the token side is the MMA's n = 8");
  static_assert(NT % 16 == 0 && RG % NC == 0, "row groups must split evenly over consumer warps");
  static_assert(BK > 0, "K must be a multiple of 32");
  static_assert(STAGES >= 4, "fewer than 4 stages cannot cover DRAM latency");
  static_assert(STAGES % NC == 0, "each ring slot must belong to one consumer warp");
  static_assert(SMEM_BYTES <= kMaxSmem, "tile does not fit in shared memory");
  static_assert((K * 2) % 16 == 0, "bulk copies move multiples of 16 bytes");

  // The tile's weights inside a matrix whose rows are ldw elements long
  // (the GEMM's full K): tile n_tile, K slice `split`.
  __device__ __forceinline__ static const __nv_bfloat16* tile_weights(
      const __nv_bfloat16* mat, int n_tile, int split, int64_t ldw) {
    if constexpr (TILED)
      return mat + (int64_t(n_tile) * RG * (ldw / BK) + int64_t(split) * KC) * (16 * BK);
    else
      return mat + int64_t(n_tile) * NT * ldw + int64_t(split) * K;
  }
};

// --- shared-memory state --------------------------------------------------------

template <class Cfg>
struct TileSmem {
  uint8_t* ring;
  uint8_t* xbuf;   // 2 x X_BYTES
  float* ybuf;     // 2 x [NT][8]
  uint64_t* full;  // STAGES: weights of a stage landed
  uint64_t* empty; // STAGES: its consumer warp released it
  uint64_t* xfull;  // 2: a tile's activations landed
  uint64_t* xempty; // 2: every consumer warp finished with them

  __device__ __forceinline__ void bind(uint8_t* smem) {
    ring = smem + Cfg::RING_OFF;
    xbuf = smem + Cfg::X_OFF;
    ybuf = reinterpret_cast<float*>(smem + Cfg::Y_OFF);
    full = reinterpret_cast<uint64_t*>(smem + Cfg::BAR_OFF);
    empty = full + Cfg::STAGES;
    xfull = empty + Cfg::STAGES;
    xempty = xfull + 2;
  }

  // One thread, then a CTA barrier before any role starts.
  __device__ __forceinline__ void init_barriers() {
    for (int s = 0; s < Cfg::STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 1);
    }
    for (int b = 0; b < 2; ++b) {
      mbar_init(&xfull[b], 1);
      mbar_init(&xempty[b], Cfg::NC);
    }
    mbar_init_fence();
  }

  __device__ __forceinline__ float* ytile(int tile_seq) const {
    return ybuf + (tile_seq & 1) * (Cfg::NT * 8);
  }
};

// --- producer ---------------------------------------------------------------------

// Per-CTA streaming position, advanced identically by producer and consumers.
struct StreamPos {
  uint32_t stage_seq = 0;  // stages issued / consumed so far (all tiles)
  uint32_t tile_seq = 0;   // tiles so far
};

// Producer warp (all 32 lanes): stream one tile. `w` points at the tile's
// first weight row at its K offset (row pitch ldw elements); `x` at row 0 of
// the activations at the same K offset (row pitch ldx). Returns false once the
// watchdog or the launch's abort flag fired; the caller keeps walking its
// task list without issuing anything, so every role still finishes.
template <class Cfg>
__device__ __forceinline__ bool produce_tile(const TileSmem<Cfg>& sm, StreamPos& pos,
                                             const __nv_bfloat16* __restrict__ w, int64_t ldw,
                                             const __nv_bfloat16* __restrict__ x, int64_t ldx,
                                             uint64_t policy, const WaitSite& site) {
  const int lane = threadIdx.x & 31;
  bool ok = true;

  const uint32_t xb = pos.tile_seq & 1u;
  const uint32_t xuse = pos.tile_seq >> 1;
  if (xuse > 0) ok = mbar_wait(&sm.xempty[xb], (xuse - 1) & 1u, -1, site);
  ok = __all_sync(0xffffffffu, ok);
  if (!ok) return false;
  if (lane == 0) mbar_arrive_expect_tx(&sm.xfull[xb], Cfg::X_TX);
  __syncwarp();
  if (lane < Cfg::M)
    bulk_load(sm.xbuf + xb * Cfg::X_BYTES + lane * Cfg::X_PITCH, x + lane * ldx, Cfg::K * 2,
              &sm.xfull[xb]);

  for (int j = 0; j < Cfg::STAGES_PER_TILE; ++j) {
    const uint32_t gs = pos.stage_seq + j;
    const uint32_t slot = gs % Cfg::STAGES;
    const uint32_t use = gs / Cfg::STAGES;
    if (use > 0) ok = mbar_wait(&sm.empty[slot], (use - 1) & 1u, int32_t(slot), site);
    ok = __all_sync(0xffffffffu, ok);
    if (!ok) return false;
    const int rg = j % Cfg::RG;
    const int kc = j / Cfg::RG;
    if constexpr (Cfg::TILED) {
      if (lane == 0) {
        mbar_arrive_expect_tx(&sm.full[slot], Cfg::STAGE_TX);
        bulk_load_hint(sm.ring + slot * Cfg::STAGE_BYTES,
                       w + (int64_t(rg) * (ldw / Cfg::BK) + kc) * (16 * Cfg::BK), Cfg::STAGE_TX,
                       &sm.full[slot], policy);
      }
    } else {
      if (lane == 0) mbar_arrive_expect_tx(&sm.full[slot], Cfg::STAGE_TX);
      __syncwarp();
      if (lane < 16)
        bulk_load_hint(sm.ring + slot * Cfg::STAGE_BYTES + lane * Cfg::W_PITCH,
                       w + (rg * 16 + lane) * ldw + kc * Cfg::BK, Cfg::BK * 2, &sm.full[slot],
                       policy);
    }
  }
  pos.stage_seq += Cfg::STAGES_PER_TILE;
  pos.tile_seq += 1;
  return true;
}

// --- consumers ----------------------------------------------------------------------

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr));
  return v;
}

// D(16x8) += A(16x16, weights) . B(16x8, tokens), bf16 in, fp32 accumulate.
__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                          uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

constexpr int kAcc = 4;  // independent accumulators per row group

// One stage: 16 weight rows x BK columns against the tile's X columns
// [kc*BK, kc*BK + BK).
template <class Cfg>
__device__ __forceinline__ void mma_stage(float (&acc)[kAcc][4], uint32_t w_stage,
                                          uint32_t x_cols, int lane) {
  const int g = lane >> 2, t = lane & 3;
  // Row-major: rows g and g+8 of the padded stage; tiled: the stage is
  // already [BK/32][rows g | rows g+8][lane][8], 1 KB per 32 columns.
  const uint32_t wa = Cfg::TILED ? w_stage + lane * 16 : w_stage + g * Cfg::W_PITCH + t * 16;
  const uint32_t wb = Cfg::TILED ? wa + 512 : wa + 8 * Cfg::W_PITCH;
  constexpr int kWStep = Cfg::TILED ? 1024 : 64;
  const uint32_t xa = x_cols + g * Cfg::X_PITCH + t * 16;
  const bool token = g < Cfg::M;  // rows M..7 of B are zero padding
#pragma unroll
  for (int kk = 0; kk < Cfg::BK / 32; ++kk) {
    const uint4 a = lds128(wa + kk * kWStep);
    const uint4 b = lds128(wb + kk * kWStep);
    uint4 xv = make_uint4(0, 0, 0, 0);
    if (token) xv = lds128(xa + kk * 64);
    mma_16816(acc[(2 * kk) % kAcc], a.x, b.x, a.y, b.y, xv.x, xv.y);
    mma_16816(acc[(2 * kk + 1) % kAcc], a.z, b.z, a.w, b.w, xv.z, xv.w);
  }
}

// Consumer warp `cw` (0..NC-1, all 32 lanes): compute its row groups of one
// tile and write them to the tile's Ys[NT][8] staging (row = output feature,
// column = token). The caller then syncs the consumer warps
// (consumer_sync) before any epilogue reads Ys. Returns false after an abort;
// the caller must still call consumer_sync and go on, so barriers match.
template <class Cfg>
__device__ __forceinline__ bool consume_tile(const TileSmem<Cfg>& sm, StreamPos& pos, int cw,
                                             const WaitSite& site, bool alive) {
  const int lane = threadIdx.x & 31;
  float acc[Cfg::R][kAcc][4];
#pragma unroll
  for (int r = 0; r < Cfg::R; ++r)
#pragma unroll
    for (int a = 0; a < kAcc; ++a)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][a][i] = 0.f;

  const uint32_t xb = pos.tile_seq & 1u;
  if (alive) alive = __all_sync(0xffffffffu, mbar_wait(&sm.xfull[xb], (pos.tile_seq >> 1) & 1u, -2, site));
  const uint32_t xbase = smem_addr(sm.xbuf + xb * Cfg::X_BYTES);
  const uint32_t ring = smem_addr(sm.ring);

  for (int kc = 0; kc < Cfg::KC; ++kc) {
#pragma unroll
    for (int r = 0; r < Cfg::R; ++r) {
      const uint32_t gs = pos.stage_seq + kc * Cfg::RG + r * Cfg::NC + cw;
      const uint32_t slot = gs % Cfg::STAGES;
      if (alive)
        alive = __all_sync(0xffffffffu,
                           mbar_wait(&sm.full[slot], (gs / Cfg::STAGES) & 1u, int32_t(slot), site));
      if (alive) {
        mma_stage<Cfg>(acc[r], ring + slot * Cfg::STAGE_BYTES, xbase + kc * Cfg::BK * 2, lane);
        __syncwarp();
        if (lane == 0) mbar_arrive(&sm.empty[slot]);
      }
    }
  }
  __syncwarp();
  if (alive && lane == 0) mbar_arrive(&sm.xempty[xb]);

  float* ys = sm.ytile(pos.tile_seq);
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int r = 0; r < Cfg::R; ++r) {
    float d[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) d[i] = ((acc[r][0][i] + acc[r][1][i]) + acc[r][2][i]) + acc[r][3][i];
    const int row = (r * Cfg::NC + cw) * 16 + g;
    *reinterpret_cast<float2*>(ys + row * 8 + 2 * t) = make_float2(d[0], d[1]);
    *reinterpret_cast<float2*>(ys + (row + 8) * 8 + 2 * t) = make_float2(d[2], d[3]);
  }
  pos.stage_seq += Cfg::STAGES_PER_TILE;
  pos.tile_seq += 1;
  return alive;
}

// Named barrier 1 over the consumer warps only (the producer never joins, so
// it keeps streaming while the consumers run epilogues).
template <class Cfg>
__device__ __forceinline__ void consumer_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(Cfg::NC * 32) : "memory");
}

}  // namespace gemm
}  // namespace megac

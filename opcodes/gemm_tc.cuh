// A decode GEMM tile on the tensor cores, weights straight from global
// memory into MMA fragments: Y[rows, n0:n0+nlen] = X[rows, k0:k0+klen] .
// W[n0:n0+nlen, k0:k0+klen]^T, rows <= 8, nlen % 16 == 0, klen % 32 == 0.
//
// Weights are in the tiled device layout (megac/weights/layout.py
// device_weights): each 16-row group of a [N, K] matrix is one contiguous run
// of 1 KB blocks, one per 32 columns, each already in the A-fragment order of
// mma.m16n8k16 (first 512 bytes rows g = 0..7, then rows g + 8; lane
// g * 4 + t holds columns 8t .. 8t + 7). So a warp reads a block with two
// fully coalesced 16-byte loads per lane and feeds them to two MMAs without
// touching shared memory: no producer, no ring, no barrier per stage.
//
// Why not the CUDA-core row loop (gemm_rows.cuh): it streamed 11-14 GB/s
// per SM, a third of an SM's share of HBM, with 4 KB in flight per warp that
// it drains completely before the next loads go out, and ~25 instructions
// per 16 weight bytes at batch 1 (~145 at batch 8). Here each warp keeps
// kUnroll blocks (kUnroll KB) in flight continuously: a block's registers are
// refilled with the block kUnroll ahead as soon as its MMAs have read them.
//
// Operands are swapped as in gemm_tile.cuh: weights are the MMA's 16-row A,
// tokens the 8-column B (X padded with zeros past `rows`). The K order inside
// a 32-column block is permuted identically for A and B, so the dot products
// are exact permutations of each other. Each output depends only on its own
// token's X column: results do not depend on the batch.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <type_traits>

#include "common.cuh"
#include "profile_marks.cuh"
#include "gemm_rows.cuh"  // rows::WeightSpan
#include "gemm_tile.cuh"
#include "mbarrier.cuh"
#include "weight_stream.cuh"

namespace megac {
namespace tc {

using bf16 = __nv_bfloat16;

// 1 KB weight blocks each warp keeps in flight (Little's law: an SM's share
// of HBM, ~34 GB/s, at ~1.5 us loaded latency needs ~50 KB per SM; 8 warps
// x 8 KB = 64 KB).
#ifndef MEGAC_TC_UNROLL
#define MEGAC_TC_UNROLL 8
#endif
constexpr int kUnroll = MEGAC_TC_UNROLL;
constexpr int kAcc = 4;  // independent accumulator chains per row group
constexpr int kBlockElems = 512;  // one 16 x 32 block

// Row pitch (elements) of the staged X: a multiple of 32 columns plus, where
// needed, 64 bytes, so the two rows a quarter-warp reads hit distinct banks.
__host__ __device__ constexpr int x_pitch(int klen) { return (klen * 2) % 128 == 64 ? klen : klen + 32; }

// Shared bytes of the K-part partial sums: at most one 16-row group per warp.
__host__ __device__ constexpr int part_bytes(int nwarps) { return nwarps * 16 * 8 * 4; }

// 1: a routed up claimer pulls the layer's x_norm rows into its L1 as its
// waits pass, so the ranking hides their latency and each claim stages them
// from L1 (ld.ca) instead of an L2 round trip behind nothing yet (~1.3 us at
// batch 1); 0: each claim stages them through L2 (ld.cg). 0 by default in
// a build with the router that folds the combine (MEGAC_ROUTER_COMBINE,
// ops_gemm.cuh; its default in common.cuh): there the rows' norm is the
// claims' own wait, after the ranking, and a pull at the header's acquire
// could land before the norm's rows.
#ifndef MEGAC_UP_X_L1
#if MEGAC_ROUTER_COMBINE
#define MEGAC_UP_X_L1 0
#else
#define MEGAC_UP_X_L1 1
#endif
#endif

// Item i of an X staging (row i / per_row, 16 bytes i % per_row), read
// through L2 only (other CTAs wrote x), but a routed claim's rows: those
// (x_norm) were pulled into this SM's L1 after its acquire (ops_moe.cuh
// MEGAC_UP_X_L1), so they are this layer's.
__device__ __forceinline__ const uint4* x_src(const bf16* x, int64_t ldx, int per_row, const int32_t* rowof, int i) {
  const int m = i / per_row, c = i % per_row;
  const int64_t r = rowof != nullptr ? rowof[m] : m;  // rowof: the tile's rows gathered (routed claims)
  return reinterpret_cast<const uint4*>(x + r * ldx) + c;
}
__device__ __forceinline__ uint4 load_x(const bf16* x, int64_t ldx, int per_row, const int32_t* rowof, int i) {
  const uint4* src = x_src(x, ldx, per_row, rowof, i);
  return MEGAC_UP_X_L1 && rowof != nullptr ? __ldca(src) : __ldcg(src);
}

__device__ __forceinline__ void store_x(bf16* xs, int per_row, int pitch, int i, const uint4& v) {
  *reinterpret_cast<uint4*>(xs + (i / per_row) * pitch + (i % per_row) * 8) = v;
}

// xs[m * x_pitch(klen) + k] = x[m * ldx + k] for m < rows, k < klen.
// Whole CTA, then a barrier.
__device__ __forceinline__ void stage_x(const bf16* x, int64_t ldx, int rows, int klen, bf16* xs,
                                        const int32_t* rowof = nullptr) {
  const int per_row = klen / 8, pitch = x_pitch(klen);
  for (int i = threadIdx.x; i < rows * per_row; i += blockDim.x)
    store_x(xs, per_row, pitch, i, load_x(x, ldx, per_row, rowof, i));
  __syncthreads();
}

// How a tile's work is dealt to the warps: nlen / 16 row groups; when there
// are fewer than warps, each row group's K is cut into `parts` slices (one
// per warp) whose sums are added in slice order afterwards, so the result
// does not depend on timing. Item i is row group i % groups of slice
// i / groups; warp w takes items w, w + nwarps, ...
// 1: the walk's divisions (Deal, Walk, WalkPos: by the warps, the row
// groups, the slices, the stages an item) are a shift, and its remainders a
// mask, wherever the divisor is a power of two (every tile of the bundled
// models: 2-16 row groups, 1-4 slices, 8 warps), else the division. The
// same quotients. Why (forty-first session, H100 stamps of the profiled
// default): a primed static tile spent 0.5-0.8 us between its activations
// staged and the end of its walk's setup (its first stage landed 0.2 us
// after that), in tile_bulk's prologue: ~8 dependent 32-bit divisions
// (I2F, MUFU.RCP, F2I and fix-ups, ~25 instructions each, in the SASS),
// on every GEMM tile of every hop (router, claims, QKV, O-projection).
// 0: the divisions.
#ifndef MEGAC_TC_POW2_DIV
#define MEGAC_TC_POW2_DIV 0
#endif
// a / b and a % b for a >= 0, b > 0 (MEGAC_TC_POW2_DIV)
__host__ __device__ __forceinline__ int walk_div(int a, int b) {
#if MEGAC_TC_POW2_DIV
  if ((b & (b - 1)) == 0) {
#ifdef __CUDA_ARCH__
    return a >> (__ffs(b) - 1);
#else
    return a >> __builtin_ctz(unsigned(b));
#endif
  }
#endif
  return a / b;
}
__host__ __device__ __forceinline__ int walk_mod(int a, int b) {
#if MEGAC_TC_POW2_DIV
  if ((b & (b - 1)) == 0) return a & (b - 1);
#endif
  return a % b;
}

struct Deal {
  int groups, parts, nb;
  Deal() = default;  // uninitialized: a WalkCache slot (MEGAC_TC_WALK_CACHE)
  __host__ __device__ Deal(int nlen, int klen, int nwarps)
      : groups(nlen / 16), parts(nlen / 16 >= nwarps ? 1 : walk_div(nwarps, nlen / 16)), nb(klen / 32) {}
  __host__ __device__ int items() const { return groups * parts; }
  __host__ __device__ int first_block(int item) const { return walk_div(walk_div(item, groups) * nb, parts); }
  __host__ __device__ int end_block(int item) const { return walk_div((walk_div(item, groups) + 1) * nb, parts); }
};

__device__ __forceinline__ void zero_acc(float (&acc)[kAcc][4]) {
#pragma unroll
  for (int a = 0; a < kAcc; ++a)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[a][i] = 0.f;
}

// One 16 x 32 block: `lo` / `hi` this lane's 16 bytes of rows g and g + 8,
// `xv` its 16 bytes of X. `rel`, the block's index within its slice, picks
// the accumulators (the same for both feeds, so their sums are identical).
// The chains are (2u, 2u + 1) % kAcc for u = rel % kUnroll, that is 2 * (rel &
// 1) and the next: written as the parity so that a stage of an even number of
// blocks (kStageBlocks) keeps the index a constant after unrolling. As
// rel % kUnroll it was one only where kStageBlocks is a multiple of kUnroll:
// 10-block stages put acc in local memory (96 bytes of stack, ~60 % slower).
static_assert(kAcc == 4 && kUnroll % 2 == 0, "the chains follow the block's parity");
__device__ __forceinline__ void mma_block(float (&acc)[kAcc][4], int rel, const uint4& lo, const uint4& hi,
                                          const uint4& xv) {
  const int p = 2 * (rel & 1);
  gemm::mma_16816(acc[p], lo.x, hi.x, lo.y, hi.y, xv.x, xv.y);
  gemm::mma_16816(acc[p + 1], lo.z, hi.z, lo.w, hi.w, xv.z, xv.w);
}

// Row group `rg`'s sums, accumulators added in a fixed order, into dst
// [features][8]. d[0], d[1]: feature rg * 16 + g, tokens 2t, 2t+1; d[2],
// d[3]: feature + 8.
__device__ __forceinline__ void store_group(const float (&acc)[kAcc][4], float* dst, int rg) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  float d[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) d[i] = ((acc[0][i] + acc[1][i]) + acc[2][i]) + acc[3][i];
  const int row = rg * 16 + g;
  *reinterpret_cast<float2*>(dst + row * 8 + 2 * t) = make_float2(d[0], d[1]);
  *reinterpret_cast<float2*>(dst + (row + 8) * 8 + 2 * t) = make_float2(d[2], d[3]);
}

// An item's sums: into ys (one slice) or its slice's partial.
__device__ __forceinline__ void store_item(const float (&acc)[kAcc][4], const Deal& dl, int item, float* ys,
                                           float* part) {
  float* dst = dl.parts == 1 ? ys : part + (item / dl.groups) * (dl.groups * 16 * 8);
  store_group(acc, dst, item % dl.groups);
}

// Whole CTA, after every item is stored: a barrier, then (sliced tiles) the
// slices' partials added in slice order into ys and another barrier.
__device__ __forceinline__ void finish(const Deal& dl, float* ys, const float* part) {
  __syncthreads();
  if (dl.parts > 1) {
    const int n = dl.groups * 16 * 8;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      float v = part[i];
      for (int p = 1; p < dl.parts; ++p) v += part[p * n + i];
      ys[i] = v;
    }
    __syncthreads();
  }
}

// The tile: `w` is its first block (row group n0 / 16, block k0 / 32 of the
// matrix), `ldb` the matrix's blocks per row group (K / 32). ys[c * 8 + m]
// for c < nlen, m < 8 (columns >= rows are 0), as gemm_rows.cuh's tile()
// leaves it; `part` is part_bytes(nwarps) of scratch. Whole CTA; ends with a
// barrier.
__device__ __forceinline__ void tile(const bf16* __restrict__ w, int ldb, const bf16* xs, int rows, int nlen,
                                     int klen, float* ys, float* part) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const Deal dl(nlen, klen, nwarps);
  const int g = lane >> 2, t = lane & 3;
  const bool token = g < rows;  // B rows past the batch are zero padding
  const uint32_t xa = smem_addr(xs + g * x_pitch(klen) + t * 8);
  for (int item = warp; item < dl.items(); item += nwarps) {
    const int b0 = dl.first_block(item), b1 = dl.end_block(item);
    const bf16* wp = w + int64_t(item % dl.groups) * ldb * kBlockElems + lane * 8;
    float acc[kAcc][4];
    zero_acc(acc);
    uint4 lo[kUnroll], hi[kUnroll];  // rows g and g + 8 of kUnroll blocks
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (b0 + u < b1) {
        lo[u] = ld_stream_u4(wp + int64_t(b0 + u) * kBlockElems);
        hi[u] = ld_stream_u4(wp + int64_t(b0 + u) * kBlockElems + 256);
      }
    }
    for (int b = b0; b < b1; b += kUnroll) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (b + u < b1) {
          uint4 xv = make_uint4(0, 0, 0, 0);
          if (token) xv = gemm::lds128(xa + (b + u) * 64);
          mma_block(acc, u, lo[u], hi[u], xv);
          // the block kUnroll ahead into the registers the MMAs just read
          const int nb_next = b + u + kUnroll;
          if (nb_next < b1) {
            lo[u] = ld_stream_u4(wp + int64_t(nb_next) * kBlockElems);
            hi[u] = ld_stream_u4(wp + int64_t(nb_next) * kBlockElems + 256);
          }
        }
      }
    }
    store_item(acc, dl, item, ys, part);
  }
  finish(dl, ys, part);
}

// ---------------------------------------------------------------------------
// The same tile fed by the copy engine, one ring per warp
// ---------------------------------------------------------------------------
//
// The register-fed tile above streamed ~18 GB/s per SM on the H200 whatever
// it kept in flight (8 or 16 KB per warp: +5 %): the SM's L1 miss handling,
// not DRAM, sets the pace of ld.global (the row loop and its cp.async
// pipelines hit the same wall). Bulk copies bypass it (gemm_tile.cuh reached
// 95-100 % of the ceiling alone). Here each warp owns kStages slots of
// kStageBlocks 1 KB blocks and its lane 0 copies the warp's own stages (a
// stage is a contiguous run of its row group's blocks: one bulk copy) onto
// the warp's own mbarriers; the warp computes a stage from shared memory
// exactly as the register-fed loop does from registers (same MMAs in the same
// order: bit-identical) and its lane 0 refills the slot with the stage
// kStages ahead. No warp ever waits for another (what sank gemm_ring.cuh).
// The first kStages stages of a static task's tile may be issued before its
// waits (prime()), so HBM works while the inputs are not ready.
//
// Measured on the H200 (North Mini Code, 8K, kernel ms batch 1 / batch 8,
// same run): register-fed 5.70 / 19.15; rings of 4 x 4 KB 4.79 / 14.87, 8 x 2
// KB 5.62 / 18.89, 5 x 4 KB 4.85 / 15.23, 2 x 8 KB 4.44 / 13.65. Fewer,
// larger copies win; more stages in flight do not: the cost is per stage.
// But not past 8 KB: 2 x 10 KB (a 160 KB ring; 12 KB does not fit the
// scratch) ran 49-60 % slower (seventeenth session; not analysed beyond
// its build: the stage loop then keeps 96 bytes of stack against 32).
#ifndef MEGAC_TC_BULK
#define MEGAC_TC_BULK 1
#endif
#ifndef MEGAC_TC_STAGE_BLOCKS
#define MEGAC_TC_STAGE_BLOCKS 8
#endif
#ifndef MEGAC_TC_STAGES
#define MEGAC_TC_STAGES 2
#endif
// 1: a proxy fence before each slot refill (generic reads, then the copy
// engine's writes); 0: none. The slot's shared-memory reads have returned
// before the refill is issued (their values fed the MMAs every lane issued
// before the __syncwarp), and CUTLASS's TMA pipelines hand a slot back to the
// copy engine the same way, by a barrier alone, with no proxy fence for this
// write-after-read. Measured (H200, eleventh session, check variants, same
// bits): NMC 8K bs1 3.416 -> 3.348 ms, bs8 10.41 -> 10.39, SmolLM2 1.157 ->
// 1.146.
#ifndef MEGAC_TC_STAGE_FENCE
#define MEGAC_TC_STAGE_FENCE 0
#endif
constexpr bool kBulk = MEGAC_TC_BULK != 0;
constexpr int kStageBlocks = MEGAC_TC_STAGE_BLOCKS;
constexpr int kStages = MEGAC_TC_STAGES;
constexpr int kStageBytes = kStageBlocks * 1024;
static_assert(kStageBlocks % 2 == 0, "an odd stage makes the accumulator chain dynamic (mma_block)");
constexpr int kMaxWarps = 8;
static_assert(kStages >= 2, "a warp's ring needs a slot to read and one to fill");

// Shared bytes of the warps' rings.
__host__ __device__ constexpr int ring_bytes(int nwarps) { return kBulk ? nwarps * kStages * kStageBytes : 0; }

// Per-launch state of the rings (in the task loop's shared state, not in the
// opcodes' scratch, which other opcodes overwrite): each warp's mbarriers and
// how many stages it has issued so far (slot and phase follow from it).
struct BulkState {
  uint64_t bar[kMaxWarps][kStages];
  uint32_t seq[kMaxWarps];     // stages issued by the warp since the launch
  uint32_t primed[kMaxWarps];  // of those, issued by prime() for the coming tile
};

// Thread 0 at launch; visible after the task loop's first barrier.
__device__ __forceinline__ void bulk_init(BulkState* st) {
  if constexpr (kBulk) {
    for (int w = 0; w < kMaxWarps; ++w) {
      for (int s = 0; s < kStages; ++s) mbar_init(&st->bar[w][s], 1);
      st->seq[w] = 0;
      st->primed[w] = 0;
    }
    mbar_init_fence();
  }
}

// A warp's stages over a tile: its items (as Deal deals them) in order,
// each cut into `per_item` stages of up to kStageBlocks blocks (a short
// slice's last stages may be empty).
struct Walk : Deal {
  int per_item, total;
  Walk() = default;
  __host__ __device__ Walk(int nlen, int klen, int warp, int nwarps) : Deal(nlen, klen, nwarps) {
    const int all = items();
    const int mine = warp < all ? walk_div(all - warp + nwarps - 1, nwarps) : 0;
    per_item = (walk_div(nb + parts - 1, parts) + kStageBlocks - 1) / kStageBlocks;
    total = mine * per_item;
  }
  // stage i: its item, first block and block count (0: an empty stage)
  __host__ __device__ void stage(int i, int warp, int nwarps, int& item, int& blk0, int& nblk) const {
    item = warp + walk_div(i, per_item) * nwarps;
    blk0 = first_block(item) + walk_mod(i, per_item) * kStageBlocks;
    nblk = max(0, min(kStageBlocks, end_block(item) - blk0));
  }
};

// 1: tile_bulk and prime() walk a warp's stages with a cursor (WalkPos) that
// steps one stage at a time, Walk::stage's divisions (the item, the stage
// within it, the item's first and end block, its row group) once an item
// instead of every stage; 0: Walk::stage for each stage. Why: in the SASS,
// ~85 dependent integer instructions (five divisions) stood between a
// slot's last MMA and the bulk copy refilling it, and ~100 more before each
// stage's wait; a warp keeps two 8 KB slots in flight, so that time is part
// of every slot's round trip, and a claim's first copies waited ~1.3 us on
// prime()'s (twenty-eighth session's stamps 11 -> 10). The same stages in
// the same order: the same bits. The generated megakernel sets it per model
// (megac/codegen/megakernel.py switch_defaults: on from a hidden size of 1024;
// twenty-ninth session, with the one-row placement: North Mini Code -1.8 % at
// bs1, -1.5 % at bs8; SmolLM2 +3 % with it); 0 where nothing sets it.
#ifndef MEGAC_TC_WALK_POS
#define MEGAC_TC_WALK_POS 0
#endif

// Stage i of a warp's walk and the stages after it, one next() a stage. An
// item's blocks are worked out when the cursor reaches it (none at all for
// a one-slice item), where Walk::stage worked them out every stage. (At the
// end of a warp's walk next() works out the item past it: skipping that, or
// keeping the refill cursor in lane 0 alone, made the megakernel spill.)
struct WalkPos {
  int item, j, b0, b1, grp;  // the item, the stage within it, its blocks [b0, b1), its row group
  WalkPos() = default;
  __host__ __device__ WalkPos(const Walk& wk, int i, int warp, int nwarps) {
    const int k = i < wk.per_item ? 0 : walk_div(i, wk.per_item);
    j = i - k * wk.per_item;
    at(wk, warp + k * nwarps);
  }
  __host__ __device__ void at(const Walk& wk, int it) {
    item = it;
    if (wk.parts == 1) {  // one slice an item (every expert tile): item < groups
      b0 = 0;
      b1 = wk.nb;
      grp = it;
    } else {
      b0 = wk.first_block(it);
      b1 = wk.end_block(it);
      grp = walk_mod(it, wk.groups);
    }
  }
  __host__ __device__ int blk0() const { return b0 + j * kStageBlocks; }
  __host__ __device__ int nblk() const { return max(0, min(kStageBlocks, b1 - blk0())); }
  __host__ __device__ void next(const Walk& wk, int nwarps) {
    if (++j == wk.per_item) {
      j = 0;
      at(wk, item + nwarps);
    }
  }
};

// 1 (with MEGAC_TC_WALK_POS): prime() leaves each warp's walk and its two
// cursors (stage 0, and the first stage it did not issue) in shared memory,
// and a primed tile_bulk on the same weights takes them from there instead
// of working them out again. Why (forty-third session, H100 stamps pinned
// through tile_bulk's prologue, MEGAC_TC_BISECT): of a QKV tile's 0.86 us
// from its call to its walk set up, the Walk took 0.29, the refill cursor
// 0.19, the consuming one 0.26 (O-projection 0.22 / 0.10, router 0.22 /
// 0.16 / 0.16): dependent divisions, after the task's waits, on
// every primed tile of every hop. A static task primes before its waits,
// so the work moves off the chain; a claim primes after claiming, and its
// cursors are worked out after its copies went out, while its X loads
// are in flight. The same walk: the same bits. Measured (H100, forty-third
// session): the QKV prologue 0.86 -> 0.51 us (the cached reads still 0.16
// us each), but the step even: default 3.0285 ms median / 3.0285 mean (14
// engines alternating), this 3.0346 / 3.0334 (13), +0.2 %; the NMC slice
// against fp32 min cosine 0.99997, top-1 1.0. A tile's start is not what
// the chain waits on. 0: worked out in tile_bulk.
#ifndef MEGAC_TC_WALK_CACHE
#define MEGAC_TC_WALK_CACHE 0
#endif
#if MEGAC_TC_WALK_CACHE && MEGAC_TC_WALK_POS
struct WalkCache {
  const bf16* p;  // the weights it was worked out for (tile_bulk checks them)
  int issued;     // the stages prime() issued: `fill` is that stage
  Walk wk;
  WalkPos at, fill;
};
__shared__ WalkCache walk_cache[kMaxWarps];

// Lane 0 of each warp, in prime() after its copies went out.
__device__ __forceinline__ void walk_cache_put(const rows::WeightSpan& s, const Walk& wk, int n, int warp,
                                               int nwarps) {
  WalkCache& c = walk_cache[warp];
  c.p = s.p;
  c.issued = n;
  c.wk = wk;
  c.at = WalkPos(wk, 0, warp, nwarps);
  c.fill = WalkPos(wk, n, warp, nwarps);
}
#endif

// Until stage n of a warp's ring has landed. The copy engine always
// completes (a wrong address faults the launch): no watchdog on this wait.
__device__ __forceinline__ void wait_landed(BulkState* st, int warp, uint32_t n) {
  while (!mbar_try_wait(&st->bar[warp][n % kStages], (n / kStages) & 1u)) {
  }
}

// Lane 0: row group grp's blocks [blk0, blk0 + nblk) into the slot of the
// warp's n-th stage. An empty stage still completes its barrier's phase.
__device__ __forceinline__ void issue_blocks(const rows::WeightSpan& s, int grp, int blk0, int nblk, uint32_t n,
                                             uint8_t* ring, BulkState* st, int warp, uint64_t policy) {
  const uint32_t slot = n % kStages;
  uint64_t* bar = &st->bar[warp][slot];
  if (nblk > 0) {
    const bf16* src = s.p + (int64_t(grp) * (s.ld / 32) + blk0) * kBlockElems;
    mbar_arrive_expect_tx(bar, uint32_t(nblk) * 1024u);
    bulk_load_hint(ring + (warp * kStages + slot) * kStageBytes, src, uint32_t(nblk) * 1024u, bar, policy);
  } else {
    mbar_arrive(bar);
  }
}

// Lane 0: stage i of this warp's walk into its slot. An empty stage still
// completes its barrier's phase, so slots and phases stay in step.
__device__ __forceinline__ void issue(const rows::WeightSpan& s, const Walk& wk, int i, uint32_t base,
                                      uint8_t* ring, BulkState* st, int warp, int nwarps, uint64_t policy) {
  int item, blk0, nblk;
  wk.stage(i, warp, nwarps, item, blk0, nblk);
  issue_blocks(s, item % wk.groups, blk0, nblk, base + i, ring, st, warp, policy);
}

// Lane 0: the stage at `p` as the warp's n-th stage (its slot n % kStages).
__device__ __forceinline__ void issue_at(const rows::WeightSpan& s, const WalkPos& p, uint32_t n, uint8_t* ring,
                                         BulkState* st, int warp, uint64_t policy) {
  issue_blocks(s, p.grp, p.blk0(), p.nblk(), n, ring, st, warp, policy);
}

// Lane 0: the walk's first n stages (prime()), the cursor not stepped past
// the last (its next item's blocks would be worked out for nothing).
__device__ __forceinline__ void issue_stages(const rows::WeightSpan& s, const Walk& wk, int n, uint32_t base,
                                             uint8_t* ring, BulkState* st, int warp, int nwarps, uint64_t policy) {
  WalkPos p(wk, 0, warp, nwarps);
  for (int i = 0; i < n; ++i) {
    if (i > 0) p.next(wk, nwarps);
    issue_at(s, p, base + i, ring, st, warp, policy);
  }
}

// 1: prime() is one function every static GEMM opcode's dispatch calls
// instead of a copy of its walk's divisions inlined into each (North Mini
// Code's kernel 71,427 -> 65,470 lines of SASS); 0: inlined. The span by
// value, as tile_bulk's (by reference a noinline call puts it on the stack).
// Measured (H200, seventeenth session, check variants, three runs, same
// bits): NMC bs1 8K -1.0 / -0.3 / -0.5 %, bs8 8K -0.1 / -0.4 / -0.6 %, bs4
// 32K -0.2 / -0.3 / -1.1 %, bs8 32K -0.2 / -0.4 / +0.2 %; SmolLM2 1K bs1
// +0.7 / -0.3 %.
#ifndef MEGAC_TC_PRIME_NOINLINE
#define MEGAC_TC_PRIME_NOINLINE 1
#endif
#if MEGAC_TC_PRIME_NOINLINE
#define MEGAC_TC_PRIME_FN __noinline__
#else
#define MEGAC_TC_PRIME_FN __forceinline__
#endif

// Lane 0: a walk's first n stages.
__device__ __forceinline__ void issue_first(const rows::WeightSpan& s, const Walk& wk, int n, uint32_t base,
                                            uint8_t* ring, BulkState* st, int warp, int nwarps, uint64_t policy) {
  if (MEGAC_TC_WALK_POS)
    issue_stages(s, wk, n, base, ring, st, warp, nwarps, policy);
  else
    for (int i = 0; i < n; ++i) issue(s, wk, i, base, ring, st, warp, nwarps, policy);
}

// Every thread: each warp's lane 0 issues the warp's first `stages` (at
// most kStages) stages of the tile `s` as walk W (Walk, or Packed's packed
// stages) deals them.
template <class W>
__device__ __forceinline__ void prime_first(const rows::WeightSpan& s, uint8_t* ring, BulkState* st,
                                            int stages = kStages) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  if (lane != 0) return;
  MEGAC_MARK(12);  // thread 0 inside prime(): the call made
  const W wk(s.rows, s.cols, warp, nwarps);
  const uint64_t policy = l2_evict_first_policy();
  const uint32_t base = st->seq[warp];
  const int n = min(min(kStages, stages), wk.total);
  MEGAC_MARK_AFTER(13, n + base);  // its walk built (the divisions)
  issue_first(s, wk, n, base, ring, st, warp, nwarps, policy);
  MEGAC_MARK(14);  // its stages issued (before the call returns)
  st->primed[warp] = n;
#if MEGAC_TC_WALK_CACHE && MEGAC_TC_WALK_POS
  if constexpr (std::is_same<W, Walk>::value) walk_cache_put(s, wk, n, warp, nwarps);
#endif
}

// Before a static task's waits: its tile's first stages. The scratch's
// earlier generic writes were fenced for the async proxy at the end of the
// task before (megakernel.cuh).
__device__ MEGAC_TC_PRIME_FN void prime(const rows::WeightSpan s, uint8_t* ring, BulkState* st,
                                        int stages = kStages) {
  prime_first<Walk>(s, ring, st, stages);
}

// After a primed task's waits gave up: wait for its copies, so none lands in
// the shared memory of a CTA that has left (they always complete).
__device__ __forceinline__ void drain(BulkState* st) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if constexpr (kBulk) {
    if (lane == 0) {
      const uint32_t base = st->seq[warp];
      for (uint32_t i = 0; i < st->primed[warp]; ++i) wait_landed(st, warp, base + i);
      st->seq[warp] = base + st->primed[warp];
      st->primed[warp] = 0;
    }
  }
}

// 1: a tile whose stages were not primed before its waits (an expert
// claim's) issues its X loads, then its warps' first ring stages, then
// stores X: the latency-bound loads go ahead of the bulk copies in the SM's
// queue (a small load issued after 128 KB of copies waits ~2 us behind them),
// and the copies start a round trip sooner than after the staged X. 0: X
// staged, then the stages issued (tile_bulk).
#ifndef MEGAC_X_THEN_PRIME
#define MEGAC_X_THEN_PRIME 1
#endif

// 1: stage_x_prime stages X with cp.async, no register holding it, and
// calls prime() behind the copies: a call waits on every load still in
// flight (in the SASS the CALL's wait mask holds the X load's scoreboard),
// so with ld the claim's first weight copies went out a whole X round trip
// late (stamps 11 -> 10: ~1.0-1.3 us an expert claim, twenty-eighth
// session). 0: ld into registers, stored after the call. Measured with the
// cursor and the one-row placement (twenty-ninth session, ten interleaved
// rounds, means, the same bits): NMC bs1 +0.1 % alone, -0.8 % with the down
// claims primed (MEGAC_DOWN_PRIME); bs8 -0.1 / +0.6 %. The generated megakernel
// turns it off for a dense model, whose tiles are all primed before their
// waits (megac/codegen/megakernel.py switch_defaults): its build stays the one
// measured for it.
#ifndef MEGAC_X_ASYNC
#define MEGAC_X_ASYNC 1
#endif

// Item i of an X staging as one 16-byte cp.async (load_x's source, store_x's
// place): through L1 for a routed claim's rows, as load_x reads them.
__device__ __forceinline__ void copy_x_async(const bf16* x, int64_t ldx, int per_row, int pitch,
                                             const int32_t* rowof, bf16* xs, int i) {
  const uint4* src = x_src(x, ldx, per_row, rowof, i);
  const uint32_t dst = smem_addr(xs + (i / per_row) * pitch + (i % per_row) * 8);
  if (MEGAC_UP_X_L1 && rowof != nullptr)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
  else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}

// stage_x_prime's issue half: every thread's X copies (cp.async, nothing
// waits for them here), then prime(). The caller waits (cp.async.wait_all)
// and passes a barrier before the staged X is read.
__device__ __forceinline__ void issue_x_prime(const bf16* x, int64_t ldx, int rows, int klen, bf16* xs,
                                              const int32_t* rowof, const rows::WeightSpan& s, uint8_t* ring,
                                              BulkState* st) {
  const int per_row = klen / 8, pitch = x_pitch(klen), n = rows * per_row;
  for (int i = threadIdx.x; i < n; i += blockDim.x) copy_x_async(x, ldx, per_row, pitch, rowof, xs, i);
  prime(s, ring, st);  // lane 0 of each warp
  MEGAC_MARK(10);      // thread 0's ring stages issued
}

// stage_x, and prime() as soon as this thread's first X load is out.
__device__ __forceinline__ void stage_x_prime(const bf16* x, int64_t ldx, int rows, int klen, bf16* xs,
                                              const int32_t* rowof, const rows::WeightSpan& s, uint8_t* ring,
                                              BulkState* st) {
#if MEGAC_X_ASYNC
  issue_x_prime(x, ldx, rows, klen, xs, rowof, s, ring, st);
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  MEGAC_MARK(9);  // thread 0's X load returned
#else
  const int per_row = klen / 8, pitch = x_pitch(klen), n = rows * per_row, i0 = threadIdx.x;
  uint4 v = make_uint4(0, 0, 0, 0);
  if (i0 < n) v = load_x(x, ldx, per_row, rowof, i0);
  prime(s, ring, st);  // lane 0 of each warp; after its own warp's loads in program order
  MEGAC_MARK(10);      // thread 0's ring stages issued
  if (i0 < n) store_x(xs, per_row, pitch, i0, v);
  MEGAC_MARK(9);  // thread 0's X load returned
  for (int i = i0 + blockDim.x; i < n; i += blockDim.x) store_x(xs, per_row, pitch, i, load_x(x, ldx, per_row, rowof, i));
#endif
  __syncthreads();
}

// 1: a static GEMM task's dispatcher, after prime() and before the task's
// waits, also runs tile_bulk's prologue (a call with rows < 0: it sets up
// the walk, reads the ring's state and returns before the first stage's
// wait, writing nothing), so the prologue's instructions are in the SM's
// instruction caches when the tile runs after its waits. Why (forty-second
// session, H100 stamps 15 -> 7 of the profiled default): a primed tile
// spends 0.5-0.8 us from the call to its walk set up (736-800 ns in 3,359
// of 3,920 QKV tiles: a fixed cost); the divisions' shifts (MEGAC_TC_POW2_DIV)
// took only ~0.08 us of it, and a cold fetch of the prologue's code from L2
// while HBM streams is the candidate left (the tenth session's ~0.4 us a
// KB of code run cold). The test: whether the stamps' gap shrinks.
// Measured (H100, forty-third session, one profiled step each): it did not
// (QKV 0.80 -> 0.80 us, O-projection 0.70 -> 0.67, router 0.51 -> 0.51):
// not the fetch; MEGAC_TC_BISECT found the walk's arithmetic. 0: no such
// call.
#ifndef MEGAC_TC_WARM
#define MEGAC_TC_WARM 0
#endif

// 1 (profiled builds only): stamps pinned after each step of tile_bulk's
// prologue, to bisect its ~0.8 us (the forty-third session's H100 stamps:
// warming its code, MEGAC_TC_WARM, left QKV's 15 -> 7 at 0.80 us, so the
// instruction fetch is not it): 6 the Walk, 8 the ring's state read past
// __syncwarp, 11 the L2 policy, 9 the refill cursor, 10 the consuming one.
// Marks the static GEMM tiles do not use (the claims' 6, 8, 11 and the
// X-load's 9, 10 come first where they do: a mark keeps its first stamp).
// 0: none.
#ifndef MEGAC_TC_BISECT
#define MEGAC_TC_BISECT 0
#endif
#if MEGAC_TC_BISECT
#define MEGAC_TC_BISECT_MARK(i, v) MEGAC_MARK_AFTER(i, v)
#else
#define MEGAC_TC_BISECT_MARK(i, v) ((void)0)
#endif

// 1: tile_bulk is one function every GEMM opcode calls (one copy of its
// code, ~1,000 instructions with the walk's divisions, instead of one per
// opcode; North Mini Code's kernel 25,888 -> 18,216 instructions); 0:
// inlined into each. Why: the icache block measured ~0.4 us per KB of code
// an SM runs cold while the memory streams (H200), and an SM runs four GEMM
// opcodes a layer (QKV, expert up and down, O-projection). Measured (H200,
// tenth session, one run, kernel ms): North Mini Code 8K bs1 3.520 -> 3.478,
// bs8 10.85 -> 10.74, SmolLM2 1K bs1 1.235 -> 1.203; the same bits. The
// attention split's one copy (MEGAC_ATTN_NOINLINE) measured slower. The
// WeightSpan goes by value: by reference it went on the stack (24 bytes of
// spills around the call; the megakernel must not spill:
// tests/codegen/test_megakernel_build.py). That form, measured in the
// eleventh session (H200, one run): NMC 8K bs1 3.535 -> 3.425 ms, bs8 10.85
// -> 10.55, SmolLM2 1K bs1 1.240 -> 1.193, the same bits.
#ifndef MEGAC_TC_NOINLINE
#define MEGAC_TC_NOINLINE 1
#endif
#if MEGAC_TC_NOINLINE
#define MEGAC_TC_TILE_FN __noinline__
#else
#define MEGAC_TC_TILE_FN __forceinline__
#endif

// tile() with the weights through the warps' rings: same arguments, same
// result bits. `primed`: prime() already issued this tile's first stages.
// The span by value: a noinline call would otherwise put it on the stack.
__device__ MEGAC_TC_TILE_FN void tile_bulk(const rows::WeightSpan s, const bf16* xs, int rows, float* ys, float* part,
                                          uint8_t* ring, BulkState* st, bool primed) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  // thread 0 inside tile_bulk: the call made (mark 7: its walk set up); a
  // warming call (MEGAC_TC_WARM) stamps nothing: its task's marks are the tile's
  if (!MEGAC_TC_WARM || rows >= 0) MEGAC_MARK(15);
#if MEGAC_TC_WALK_CACHE && MEGAC_TC_WALK_POS
  // prime() worked the walk out for these weights (a warp-uniform test)
  const WalkCache* wc = &walk_cache[warp];
  const bool cached = primed && wc->p == s.p && wc->issued == int(st->primed[warp]) &&
                      wc->wk.groups == s.rows / 16 && wc->wk.nb == s.cols / 32;
  const Walk wk = cached ? wc->wk : Walk(s.rows, s.cols, warp, nwarps);
#else
  const Walk wk(s.rows, s.cols, warp, nwarps);
#endif
  MEGAC_TC_BISECT_MARK(6, wk.total);
  const int g = lane >> 2, t = lane & 3;
  const bool token = g < rows;
  const uint32_t xa = smem_addr(xs + g * x_pitch(s.cols) + t * 8);
  const uint32_t ring_w = smem_addr(ring + warp * kStages * kStageBytes);
  const uint32_t base = st->seq[warp];
  const int issued = primed ? int(st->primed[warp]) : 0;
  __syncwarp();  // every lane read seq / primed before lane 0 moves them
  MEGAC_TC_BISECT_MARK(8, base + issued);
  const uint64_t policy = lane == 0 ? l2_evict_first_policy() : 0;
  MEGAC_TC_BISECT_MARK(11, uint32_t(policy));
  float acc[kAcc][4];
#if MEGAC_TC_WALK_POS
  // lane 0's refill cursor (stage i + kStages at step i) and every lane's
  // consuming one (stage i)
#if MEGAC_TC_WALK_CACHE
  WalkPos fill = cached ? wc->fill : WalkPos(wk, issued, warp, nwarps);
#else
  WalkPos fill(wk, issued, warp, nwarps);
#endif
  MEGAC_TC_BISECT_MARK(9, fill.b1 + fill.item + fill.grp);
  // (a warming call issues nothing: a task primed with fewer stages than
  // kStages, a merging O-projection's, would get those refills twice, two
  // arrivals on one mbarrier phase)
  if (lane == 0 && (!MEGAC_TC_WARM || rows >= 0))
    for (int i = issued; i < min(kStages, wk.total); ++i) {
      issue_at(s, fill, base + i, ring, st, warp, policy);
      fill.next(wk, nwarps);
    }
#if MEGAC_TC_WALK_CACHE
  WalkPos at = cached ? wc->at : WalkPos(wk, 0, warp, nwarps);
#else
  WalkPos at(wk, 0, warp, nwarps);
#endif
  MEGAC_TC_BISECT_MARK(10, at.b1 + at.item + at.grp);
#if MEGAC_TC_WARM
  if (rows < 0) {  // the warming call (MEGAC_TC_WARM): the walk's values computed, then back
    asm volatile("" ::"r"(at.b0), "r"(at.b1), "r"(fill.item), "r"(fill.b1), "r"(xa), "r"(ring_w), "r"(issued));
    return;
  }
#endif
  // thread 0 set up its walk and issued its refills: from mark 2 to here the
  // call and the walk's setup, from here to mark 3 the first stage's wait
  // (a primed tile's first stage landed long before; the forty-first
  // session asks which half the ~1 us between marks 2 and 3 is)
  MEGAC_MARK(7);
  for (int i = 0; i < wk.total; ++i) {
    if (at.j == 0) zero_acc(acc);
    const uint32_t n = base + i;
    wait_landed(st, warp, n);
    if (i == 0) MEGAC_MARK(3);  // warp 0's first stage landed (the ring's first fill)
    const uint32_t src = ring_w + (n % kStages) * kStageBytes + lane * 16;
    const int blk0 = at.blk0(), nblk = at.nblk(), rel0 = at.j * kStageBlocks;
#pragma unroll
    for (int b = 0; b < kStageBlocks; ++b) {
      if (b >= nblk) break;
      uint4 xv = make_uint4(0, 0, 0, 0);
      if (token) xv = gemm::lds128(xa + (blk0 + b) * 64);
      mma_block(acc, rel0 + b, gemm::lds128(src + b * 1024), gemm::lds128(src + b * 1024 + 512), xv);
    }
    // the slot's reads are done (their MMAs consumed them): refill it
    if (MEGAC_TC_STAGE_FENCE) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncwarp();
    if (lane == 0 && i + kStages < wk.total) {
      issue_at(s, fill, n + kStages, ring, st, warp, policy);
      fill.next(wk, nwarps);
    }
    if (at.j == wk.per_item - 1) store_item(acc, wk, at.item, ys, part);
    at.next(wk, nwarps);
  }
#else
#if MEGAC_TC_WARM
  if (rows < 0) return;  // the warming call (MEGAC_TC_WARM): before any refill
#endif
  if (lane == 0)
    for (int i = issued; i < min(kStages, wk.total); ++i) issue(s, wk, i, base, ring, st, warp, nwarps, policy);
  for (int i = 0; i < wk.total; ++i) {
    int item, blk0, nblk;
    wk.stage(i, warp, nwarps, item, blk0, nblk);
    if (i % wk.per_item == 0) zero_acc(acc);
    const uint32_t n = base + i;
    wait_landed(st, warp, n);
    if (i == 0) MEGAC_MARK(3);  // warp 0's first stage landed (the ring's first fill)
    const uint32_t src = ring_w + (n % kStages) * kStageBytes + lane * 16;
#pragma unroll
    for (int b = 0; b < kStageBlocks; ++b) {
      if (b >= nblk) break;
      uint4 xv = make_uint4(0, 0, 0, 0);
      if (token) xv = gemm::lds128(xa + (blk0 + b) * 64);
      mma_block(acc, blk0 + b - wk.first_block(item), gemm::lds128(src + b * 1024), gemm::lds128(src + b * 1024 + 512),
                xv);
    }
    // the slot's reads are done (their MMAs consumed them): refill it
    if (MEGAC_TC_STAGE_FENCE) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncwarp();
    if (lane == 0 && i + kStages < wk.total) issue(s, wk, i + kStages, base, ring, st, warp, nwarps, policy);
    if (i % wk.per_item == wk.per_item - 1) store_item(acc, wk, item, ys, part);
  }
#endif
  __syncwarp();
  if (lane == 0) {
    st->seq[warp] = base + wk.total;
    st->primed[warp] = 0;
  }
  MEGAC_MARK(4);  // warp 0's stages all consumed
  finish(wk, ys, part);
  MEGAC_MARK(5);  // the warps' partials reduced: the tile's sums ready
}

// ---------------------------------------------------------------------------
// Short rows packed into whole stages (a split-K expert down slice)
// ---------------------------------------------------------------------------
//
// A split_down claim's down slice is every feature of the hidden size over
// the up tile's 64 or 128 intermediate features: 16-row groups of only 2 or
// 4 blocks. tile_bulk's stages never cross a row group, so its ring would
// hold 2-4 KB per slot (an SM's bytes in flight, what it streams at,
// halved or quartered: sm_stream block). Here a stage packs
// kStageBlocks / nb of the warp's row groups, one bulk copy each onto the
// slot's one barrier, so a slot holds kStageBlocks blocks again. Row groups
// are dealt round-robin to the warps (no K slicing: at least as many
// groups as warps is where it pays; fewer leave warps idle), each group's
// blocks accumulated as tile_bulk accumulates a one-slice item.
struct Packed {
  int groups, nb, pack, mine, total;
  __device__ Packed(int nlen, int klen, int warp, int nwarps)
      : groups(nlen / 16), nb(klen / 32), pack(kStageBlocks / (klen / 32 > 0 ? klen / 32 : 1)) {
    if (pack < 1) pack = 1;
    mine = warp < groups ? (groups - warp + nwarps - 1) / nwarps : 0;
    total = (mine + pack - 1) / pack;
  }
  // stage i's row groups: the warp's local groups [i * pack, i * pack + count(i))
  __device__ int count(int i) const { return min(pack, mine - i * pack); }
};

// Lane 0: stage i of this warp's packed walk into its slot.
__device__ __forceinline__ void issue(const rows::WeightSpan& s, const Packed& pk, int i, uint32_t base,
                                      uint8_t* ring, BulkState* st, int warp, int nwarps, uint64_t policy) {
  const uint32_t n = base + i, slot = n % kStages;
  uint64_t* bar = &st->bar[warp][slot];
  const int cnt = pk.count(i);
  const uint32_t bytes = uint32_t(pk.nb) * 1024u;
  mbar_arrive_expect_tx(bar, uint32_t(cnt) * bytes);
  uint8_t* dst = ring + (warp * kStages + slot) * kStageBytes;
  for (int j = 0; j < cnt; ++j) {
    const int group = warp + (i * pk.pack + j) * nwarps;
    bulk_load_hint(dst + j * bytes, s.p + int64_t(group) * (s.ld / 32) * kBlockElems, bytes, bar, policy);
  }
}

// Lane 0: a packed walk's first n stages.
__device__ __forceinline__ void issue_first(const rows::WeightSpan& s, const Packed& pk, int n, uint32_t base,
                                            uint8_t* ring, BulkState* st, int warp, int nwarps, uint64_t policy) {
  for (int i = 0; i < n; ++i) issue(s, pk, i, base, ring, st, warp, nwarps, policy);
}

// prime() for a packed tile.
__device__ __noinline__ void prime_packed(const rows::WeightSpan s, uint8_t* ring, BulkState* st) {
  prime_first<Packed>(s, ring, st);
}

// tile_bulk over packed stages: ys[c * 8 + m] for c < s.rows; `primed`:
// prime_packed issued the first stages. Whole CTA; ends with a barrier.
__device__ __noinline__ void tile_packed(const rows::WeightSpan s, const bf16* xs, int rows, float* ys, uint8_t* ring,
                                         BulkState* st, bool primed) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const Packed pk(s.rows, s.cols, warp, nwarps);
  const int g = lane >> 2, t = lane & 3;
  const bool token = g < rows;
  const uint32_t xa = smem_addr(xs + g * x_pitch(s.cols) + t * 8);
  const uint32_t ring_w = smem_addr(ring + warp * kStages * kStageBytes);
  const uint32_t base = st->seq[warp];
  const int issued = primed ? int(st->primed[warp]) : 0;
  __syncwarp();
  const uint64_t policy = lane == 0 ? l2_evict_first_policy() : 0;
  if (lane == 0)
    for (int i = issued; i < min(kStages, pk.total); ++i) issue(s, pk, i, base, ring, st, warp, nwarps, policy);
  for (int i = 0; i < pk.total; ++i) {
    const uint32_t n = base + i;
    wait_landed(st, warp, n);
    const uint32_t src = ring_w + (n % kStages) * kStageBytes + lane * 16;
    const int cnt = pk.count(i);
    for (int j = 0; j < cnt; ++j) {
      float acc[kAcc][4];
      zero_acc(acc);
      const uint32_t sj = src + j * pk.nb * 1024;
#pragma unroll
      for (int b = 0; b < kStageBlocks; ++b) {
        if (b >= pk.nb) break;
        uint4 xv = make_uint4(0, 0, 0, 0);
        if (token) xv = gemm::lds128(xa + b * 64);
        mma_block(acc, b, gemm::lds128(sj + b * 1024), gemm::lds128(sj + b * 1024 + 512), xv);
      }
      store_group(acc, ys, warp + (i * pk.pack + j) * nwarps);
    }
    __syncwarp();
    if (lane == 0 && i + kStages < pk.total) issue(s, pk, i + kStages, base, ring, st, warp, nwarps, policy);
  }
  __syncwarp();
  if (lane == 0) {
    st->seq[warp] = base + pk.total;
    st->primed[warp] = 0;
  }
  __syncthreads();
}

}  // namespace tc
}  // namespace megac

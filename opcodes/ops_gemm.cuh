// Device side of the GEMM family (megac/ops/gemm.py): QKV_PROJ, O_PROJ,
// FFN_UPGATE_ACT, FFN_DOWN, ROUTER_GEMM, LM_HEAD, and the expert tiles the
// MoE claimers run (megac/ops/moe.py). Each reads its fields through the
// generated field indices and runs one tile (gemm_rows.cuh) with its
// epilogue; only rows < the schedule's rows (or an expert tile's routed
// rows) are written.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "gemm_rows.cuh"
#include "mk_core.cuh"
#include "mk_layout.cuh"

namespace megac {
namespace mk {

using bf16 = __nv_bfloat16;

// Scratch of a GEMM tile: X staging [8][MAX_KLEN] bf16, then ys [MAX_NLEN][8] fp32.
template <class M>
struct GemmScratch {
  static constexpr int kXBytes = (8 * M::MAX_KLEN * 2 + 127) / 128 * 128;
  static constexpr int kBytes = kXBytes + M::MAX_NLEN * 8 * 4;
  __device__ static bf16* xs(const Ctx& c) { return reinterpret_cast<bf16*>(c.scratch); }
  __device__ static float* ys(const Ctx& c) { return reinterpret_cast<float*>(c.scratch + kXBytes); }
};

// One tile: stage X [rows, k0:k0+klen] from x (row pitch ldx), multiply
// with w (the tile's first weight row at column k0, pitch ldw); the result
// is in GemmScratch::ys.
template <class M>
__device__ __forceinline__ float* gemm(const Ctx& c, const bf16* w, int64_t ldw, const bf16* x, int64_t ldx, int rows,
                                       int nlen, int klen) {
  bf16* xs = GemmScratch<M>::xs(c);
  float* ys = GemmScratch<M>::ys(c);
  rows::stage_x(x, ldx, rows, klen, xs);
  rows::tile(w, ldw, xs, rows, nlen, klen, ys);
  return ys;
}

#define MK_F(op, name) (c.ts->w[f_##op::name])

template <class M>
__device__ __forceinline__ void qkv_proj(const Ctx& c) {
  using Lay = Layout<M>;
  const LaunchDesc* d = c.d;
  const int layer = c.ts->w[H_LAYER], flags = c.ts->w[H_FLAGS];
  const int n0 = MK_F(qkv_proj, N0), nlen = MK_F(qkv_proj, N_LEN);
  const int k0 = MK_F(qkv_proj, K0), klen = MK_F(qkv_proj, K_LEN);
  const bf16* w = ptr<const bf16>(d->w_qkv) + Lay::w_qkv(layer) + int64_t(n0) * M::HIDDEN + k0;
  const bf16* x = ptr<const bf16>(d->x_norm) + Lay::x_norm(layer, 0) + k0;
  const float* ys = gemm<M>(c, w, M::HIDDEN, x, M::HIDDEN, d->rows, nlen, klen);
  rows::QkvOut a;
  a.seq_pos = ptr<const int32_t>(d->seq_pos);
  a.row_active = ptr<const int32_t>(d->row_active);
  a.inv_freq = ptr<const float>(d->rope_inv_freq);
  a.page_table = ptr<const int32_t>(d->page_table) + int64_t(layer) * M::MAX_ROWS * d->max_blocks_per_seq;
  a.max_pages = d->max_blocks_per_seq;
  a.block_size = d->kv_block_size;
  a.q_heads = M::NUM_HEADS;
  a.kv_heads = M::KV_HEADS;
  a.hd = M::HEAD_DIM;
  a.rope = (flags & FLAG_ROPE) != 0;
  a.rope_half = (flags & FLAG_ROPE_HALF) != 0;
  a.q = ptr<bf16>(d->q) + Lay::q(layer, 0);
  a.q_ld = M::Q_WIDTH;
  a.k_pool = ptr<bf16>(d->k_pool);
  a.v_pool = ptr<bf16>(d->v_pool);
  rows::qkv(ys, n0, nlen, d->rows, a);
}

template <class M>
__device__ __forceinline__ void o_proj(const Ctx& c) {
  using Lay = Layout<M>;
  const LaunchDesc* d = c.d;
  const int layer = c.ts->w[H_LAYER];
  const int n0 = MK_F(o_proj, N0), nlen = MK_F(o_proj, N_LEN);
  const int k0 = MK_F(o_proj, K0), klen = MK_F(o_proj, K_LEN), split = MK_F(o_proj, SPLIT);
  const bf16* w = ptr<const bf16>(d->w_o) + Lay::w_o(layer) + int64_t(n0) * M::Q_WIDTH + k0;
  const bf16* x = ptr<const bf16>(d->attn_out) + Lay::attn_out(layer, 0) + k0;
  const float* ys = gemm<M>(c, w, M::Q_WIDTH, x, M::Q_WIDTH, d->rows, nlen, klen);
  rows::store<float>(ys, ptr<float>(d->o_part) + Lay::o_part(layer, split, 0) + n0, M::HIDDEN, d->rows, nlen);
}

template <class M>
__device__ __forceinline__ void ffn_upgate_act(const Ctx& c) {
  using Lay = Layout<M>;
  const LaunchDesc* d = c.d;
  const int layer = c.ts->w[H_LAYER];
  const int slot = ptr<const int32_t>(d->layer_slot)[layer];
  const int n0 = MK_F(ffn_upgate_act, N0), nlen = MK_F(ffn_upgate_act, N_LEN);
  const int k0 = MK_F(ffn_upgate_act, K0), klen = MK_F(ffn_upgate_act, K_LEN);
  const int out0 = MK_F(ffn_upgate_act, OUT0), xslot = MK_F(ffn_upgate_act, X_SLOT);
  const bf16* w = ptr<const bf16>(d->w_upgate) + Lay::w_upgate(slot) + int64_t(n0) * M::HIDDEN + k0;
  const bf16* x = ptr<const bf16>(d->x_norm) + Lay::x_norm(xslot, 0) + k0;
  const float* ys = gemm<M>(c, w, M::HIDDEN, x, M::HIDDEN, d->rows, nlen, klen);
  rows::silu_mul(ys, ptr<bf16>(d->ffn_act) + Lay::ffn_act(layer, 0) + out0, M::DENSE_WIDTH, d->rows, nlen);
}

template <class M>
__device__ __forceinline__ void ffn_down(const Ctx& c) {
  using Lay = Layout<M>;
  const LaunchDesc* d = c.d;
  const int layer = c.ts->w[H_LAYER];
  const int slot = ptr<const int32_t>(d->layer_slot)[layer];
  const int n0 = MK_F(ffn_down, N0), nlen = MK_F(ffn_down, N_LEN);
  const int k0 = MK_F(ffn_down, K0), klen = MK_F(ffn_down, K_LEN), split = MK_F(ffn_down, SPLIT);
  const bf16* w = ptr<const bf16>(d->w_down) + Lay::w_down(slot) + int64_t(n0) * M::DENSE_WIDTH + k0;
  const bf16* x = ptr<const bf16>(d->ffn_act) + Lay::ffn_act(layer, 0) + k0;
  const float* ys = gemm<M>(c, w, M::DENSE_WIDTH, x, M::DENSE_WIDTH, d->rows, nlen, klen);
  rows::store<float>(ys, ptr<float>(d->ffn_part) + Lay::ffn_part(layer, split, 0) + n0, M::HIDDEN, d->rows, nlen);
}

template <class M>
__device__ __forceinline__ void router_gemm(const Ctx& c) {
  using Lay = Layout<M>;
  const LaunchDesc* d = c.d;
  const int layer = c.ts->w[H_LAYER];
  const int slot = ptr<const int32_t>(d->layer_slot)[layer];
  const int n0 = MK_F(router_gemm, N0), nlen = MK_F(router_gemm, N_LEN);
  const int k0 = MK_F(router_gemm, K0), klen = MK_F(router_gemm, K_LEN), split = MK_F(router_gemm, SPLIT);
  const int xslot = MK_F(router_gemm, X_SLOT);
  const bf16* w = ptr<const bf16>(d->w_router) + Lay::w_router(slot) + int64_t(n0) * M::HIDDEN + k0;
  const bf16* x = ptr<const bf16>(d->x_norm) + Lay::x_norm(xslot, 0) + k0;
  const float* ys = gemm<M>(c, w, M::HIDDEN, x, M::HIDDEN, d->rows, nlen, klen);
  rows::store<float>(ys, ptr<float>(d->router_part) + Lay::router_part(layer, split, 0) + n0, M::NUM_EXPERTS,
                     d->rows, nlen);
}

template <class M>
__device__ __forceinline__ void lm_head(const Ctx& c) {
  using Lay = Layout<M>;
  const LaunchDesc* d = c.d;
  const int n0 = MK_F(lm_head, N0), nlen = MK_F(lm_head, N_LEN);
  const int k0 = MK_F(lm_head, K0), klen = MK_F(lm_head, K_LEN);
  const bf16* w = ptr<const bf16>(d->w_lm_head) + int64_t(n0) * M::HIDDEN + k0;
  const bf16* x = ptr<const bf16>(d->x_norm) + Lay::x_norm(M::NORM_SLOTS - 1, 0) + k0;
  const float* ys = gemm<M>(c, w, M::HIDDEN, x, M::HIDDEN, d->rows, nlen, klen);
  rows::lm_head(ys, ptr<float>(d->logits), M::VOCAB, n0, nlen, d->rows, M::LM_BN,
                ptr<ArgmaxRecord>(d->argmax_part), M::LM_TILES);
}

// A claimed expert tile: record {expert, n_tile, slot0, rows}; the routed
// rows are slots slot0 .. slot0 + rows - 1 of moe_x / moe_act / moe_out.
template <class M>
__device__ __forceinline__ void moe_up_tile(const Ctx& c) {
  using Lay = Layout<M>;
  const LaunchDesc* d = c.d;
  const int layer = c.ts->w[H_LAYER];
  const int slot = ptr<const int32_t>(d->layer_slot)[layer];
  const int nlen_full = MK_F(moe_upgate_drain, N_LEN);
  const int e = c.ts->rec[rec_moe_up::EXPERT], t = c.ts->rec[rec_moe_up::N_TILE];
  const int s0 = c.ts->rec[rec_moe_up::SLOT0], nr = c.ts->rec[rec_moe_up::ROWS];
  const int n0 = t * nlen_full;
  const int nlen = min(nlen_full, 2 * M::EXPERT_WIDTH - n0);
  const bf16* w = ptr<const bf16>(d->w_moe_upgate) + Lay::w_moe_upgate(slot, e) + int64_t(n0) * M::HIDDEN;
  const bf16* x = ptr<const bf16>(d->moe_x) + Lay::moe_x(layer, s0);
  const float* ys = gemm<M>(c, w, M::HIDDEN, x, M::HIDDEN, nr, nlen, M::HIDDEN);
  rows::silu_mul(ys, ptr<bf16>(d->moe_act) + Lay::moe_act(layer, s0) + n0 / 2, M::EXPERT_WIDTH, nr, nlen);
}

template <class M>
__device__ __forceinline__ void moe_down_tile(const Ctx& c) {
  using Lay = Layout<M>;
  const LaunchDesc* d = c.d;
  const int layer = c.ts->w[H_LAYER];
  const int slot = ptr<const int32_t>(d->layer_slot)[layer];
  const int nlen_full = MK_F(moe_down_drain, N_LEN);
  const int e = c.ts->rec[rec_moe_down::EXPERT], t = c.ts->rec[rec_moe_down::N_TILE];
  const int s0 = c.ts->rec[rec_moe_down::SLOT0], nr = c.ts->rec[rec_moe_down::ROWS];
  const int n0 = t * nlen_full;
  const int nlen = min(nlen_full, M::HIDDEN - n0);
  const bf16* w = ptr<const bf16>(d->w_moe_down) + Lay::w_moe_down(slot, e) + int64_t(n0) * M::EXPERT_WIDTH;
  const bf16* x = ptr<const bf16>(d->moe_act) + Lay::moe_act(layer, s0);
  const float* ys = gemm<M>(c, w, M::EXPERT_WIDTH, x, M::EXPERT_WIDTH, nr, nlen, M::EXPERT_WIDTH);
  rows::store<float>(ys, ptr<float>(d->moe_out) + Lay::moe_x(layer, s0) + n0, M::HIDDEN, nr, nlen);
}

}  // namespace mk
}  // namespace megac

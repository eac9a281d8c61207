// Where each buffer element of the launch descriptor lives, for a model `M`
// (the generated constants of megakernel.cu). One kernel serves every batch
// size and context bucket of the model, so the buffers are planned for the
// largest key (M::MAX_ROWS rows, M::MAX_SPLITS attention partial slots) and
// a schedule of fewer rows uses their first rows. The shapes are the
// plan's (megac/buffers.py); the generated kernel checks these strides
// against the artifact's megac_layout.h with static_asserts, so Python and
// the device cannot disagree silently.
#pragma once

#include <cstdint>

#include "generated/megac_abi.h"

namespace megac {
namespace mk {

template <class M>
struct Layout {
  static constexpr int64_t R = M::MAX_ROWS, D = M::HIDDEN, L = M::NUM_LAYERS;
  // [slots, R, D] (slot = GAMMA, as x_norm)
  MEGAC_HD static constexpr int64_t x_resid(int slot, int r) { return (slot * R + r) * D; }
  // [slots, R, D]
  MEGAC_HD static constexpr int64_t x_norm(int slot, int r) { return (slot * R + r) * D; }
  // [L, R, q_width]
  MEGAC_HD static constexpr int64_t q(int l, int r) { return (l * R + r) * M::Q_WIDTH; }
  // [L, S, R, H, hd] and [L, S, R, H]
  MEGAC_HD static constexpr int64_t o_part_attn(int l, int s, int r, int head) {
    return (((l * M::MAX_SPLITS + s) * R + r) * M::NUM_HEADS + head) * M::HEAD_DIM;
  }
  MEGAC_HD static constexpr int64_t lse_part(int l, int s, int r, int head) {
    return ((l * M::MAX_SPLITS + s) * R + r) * M::NUM_HEADS + head;
  }
  // [L, R, q_width]
  MEGAC_HD static constexpr int64_t attn_out(int l, int r) { return (l * R + r) * M::Q_WIDTH; }
  // [L, kv_heads, R, D]
  MEGAC_HD static constexpr int64_t o_part(int l, int s, int r) { return ((l * M::KV_HEADS + s) * R + r) * D; }
  // [L, R, dense_width]
  MEGAC_HD static constexpr int64_t ffn_act(int l, int r) { return (l * R + r) * M::DENSE_WIDTH; }
  // [L, ffn_splits, R, D]
  MEGAC_HD static constexpr int64_t ffn_part(int l, int s, int r) { return ((l * M::FFN_SPLITS + s) * R + r) * D; }
  // [L, router_splits, R, E]
  MEGAC_HD static constexpr int64_t router_part(int l, int s, int r) {
    return ((l * M::ROUTER_SPLITS + s) * R + r) * M::NUM_EXPERTS;
  }
  // [L, R, top_k]
  MEGAC_HD static constexpr int64_t topk(int l, int r) { return (l * R + r) * M::TOP_K; }
  // [L, R * top_k, D], [L, R * top_k, expert_width]
  MEGAC_HD static constexpr int64_t moe_x(int l, int slot) { return (l * R * M::TOP_K + slot) * D; }
  MEGAC_HD static constexpr int64_t moe_act(int l, int slot) { return (l * R * M::TOP_K + slot) * M::EXPERT_WIDTH; }
  // [L, R * top_k, MOE_OUT_TILES * D]: a split-K down's partials side by side (tile t at t * D)
  MEGAC_HD static constexpr int64_t moe_out(int l, int slot) {
    return (l * R * M::TOP_K + slot) * M::MOE_OUT_TILES * D;
  }
  // [R, vocab], [R, lm_tiles]
  MEGAC_HD static constexpr int64_t logits(int r) { return r * M::VOCAB; }
  MEGAC_HD static constexpr int64_t argmax(int r) { return r * M::LM_TILES; }
  // weights: [L, qkv_width, D], [L, D, q_width], [nd, 2 dw, D], [nd, D, dw], [nm, E, D],
  // [nm, E, 2 ew, D], [nm, E, D, ew], [slots, D]
  MEGAC_HD static constexpr int64_t w_qkv(int l) { return l * M::QKV_WIDTH * D; }
  MEGAC_HD static constexpr int64_t w_o(int l) { return l * D * M::Q_WIDTH; }
  MEGAC_HD static constexpr int64_t w_upgate(int slot) { return slot * 2 * M::DENSE_WIDTH * D; }
  MEGAC_HD static constexpr int64_t w_down(int slot) { return slot * D * M::DENSE_WIDTH; }
  MEGAC_HD static constexpr int64_t w_router(int slot) { return slot * M::NUM_EXPERTS * D; }
  MEGAC_HD static constexpr int64_t w_moe_upgate(int slot, int e) {
    return (int64_t(slot) * M::NUM_EXPERTS + e) * 2 * M::EXPERT_WIDTH * D;
  }
  MEGAC_HD static constexpr int64_t w_moe_down(int slot, int e) {
    return (int64_t(slot) * M::NUM_EXPERTS + e) * D * M::EXPERT_WIDTH;
  }
  MEGAC_HD static constexpr int64_t w_norm(int g) { return g * D; }
};

}  // namespace mk
}  // namespace megac

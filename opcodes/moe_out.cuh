// The element type of moe_out, the experts' outputs a MoE layer's combine
// reads (MOE_COMBINE, the norm that sums the experts, the QKV and router
// tiles that fold them), and its loads as fp32.
//
// MEGAC_MOE_OUT_BF16 (the generated source sets it from the model's tiles,
// geometry.py `moe_out_bf16`): 1, the down claims round each output to
// bf16 as they store it, as transformers' bf16 experts do, and every
// reader widens it back to fp32 before the score-weighted sum (the VM's
// arithmetic: a bf16 buffer times an fp32 score). Why: at batch 1 every
// QKV tile's fold reads the row's eight expert outputs (64 of its ~104 KB
// of L2 loads, ~1.2 us of its ~2.7 us fold at ~50 GB/s into one SM,
// fifty-second session), at the head of every MoE layer's attention chain;
// bf16 halves them. 0: fp32, the code from before it.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "common.cuh"  // MEGAC_COMBINE_POLL

#ifndef MEGAC_MOE_OUT_BF16
#define MEGAC_MOE_OUT_BF16 0
#endif
// the polled combine's words are fp32 (UNLANDED_F32 is an fp32 word)
#if MEGAC_MOE_OUT_BF16 && MEGAC_COMBINE_POLL
#error "MEGAC_COMBINE_POLL polls fp32 moe_out words: not with MEGAC_MOE_OUT_BF16"
#endif

namespace megac {

#if MEGAC_MOE_OUT_BF16
using moe_out_t = __nv_bfloat16;
#else
using moe_out_t = float;
#endif

// One element of moe_out as fp32 (an L2 load: other SMs wrote it).
__device__ __forceinline__ float ld_moe_out(const moe_out_t* p) {
#if MEGAC_MOE_OUT_BF16
  return __bfloat162float(__ldcg(p));
#else
  return __ldcg(p);
#endif
}

// Elements 4c .. 4c + 3 from `row` as fp32 (a 16-byte load of fp32, an
// 8-byte load of bf16; the row 16- / 8-byte aligned: D % 4 == 0).
__device__ __forceinline__ float4 ld4_moe_out(const moe_out_t* row, int c) {
#if MEGAC_MOE_OUT_BF16
  const uint2 u = __ldcg(reinterpret_cast<const uint2*>(row) + c);
  const __nv_bfloat162 a = *reinterpret_cast<const __nv_bfloat162*>(&u.x);
  const __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(&u.y);
  return make_float4(__low2float(a), __high2float(a), __low2float(b), __high2float(b));
#else
  return __ldcg(reinterpret_cast<const float4*>(row) + c);
#endif
}

}  // namespace megac

// Timestamps inside a task, for the per-task timeline of a -DMEGAC_PROFILE=1
// build (megac/gpu/profile.py): MEGAC_MARK(i), i < kProfileMarks, has thread
// 0 stamp the global timer the first time it passes that point in a task (a
// claimer: in its first claim); megakernel.cuh writes the marks out with the
// task's record and clears them for the next task. A task's record says when
// it started, when its waits ended and when it ended; the marks say where
// the run between went (the single-CTA tasks of the routing chain and the
// norm run 3-6 us for little work). Nothing in other builds.
#pragma once

#include <cstdint>

#ifndef MEGAC_PROFILE
#define MEGAC_PROFILE 0
#endif

namespace megac {

// 0-7: each opcode's own points (megac/gpu/profile.py MARK_NAMES); 8-11:
// the hand-off from a claim to its tile's first weight copy, where the
// profiles showed ~2 us a MoE layer between a routed claimer's records and
// its staged activations that no mark explained (twenty-second session);
// 12-15: inside the GEMM ring's prime() and tile_bulk's prologue (gemm_tc.cuh),
// where a claim's "ring stages issued" took ~1 us for two bulk copies and
// a primed tile's walk setup 0.6-0.8 us (forty-second session)
constexpr int kProfileMarks = 16;

#if MEGAC_PROFILE
__shared__ unsigned long long profile_marks[kProfileMarks];

__device__ __forceinline__ void profile_mark(int i) {
  if (threadIdx.x == 0 && profile_marks[i] == 0) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    profile_marks[i] = t;
  }
}
#define MEGAC_MARK(i) ::megac::profile_mark(i)
// the stamp after `v` is computed: the empty asm takes it as an input, and
// volatile asms keep their order, so the compiler cannot sink v's
// arithmetic past the timer's read
#define MEGAC_MARK_AFTER(i, v)         \
  do {                                 \
    asm volatile("" ::"r"(int(v)));    \
    ::megac::profile_mark(i);          \
  } while (0)
#else
#define MEGAC_MARK(i) ((void)0)
#define MEGAC_MARK_AFTER(i, v) ((void)0)
#endif

}  // namespace megac

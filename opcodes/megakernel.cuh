// The megakernel's body: one CTA per SM walks its task list
// (mk_core.cuh). `M` is the model (the generated constants of
// megakernel.cu), `Dispatch` the generated opcode switch: 
//
//   struct Dispatch {
//     static __device__ void resolve_fields(const Ctx&);  // dynamic fields -> values
//     static __device__ bool run(const Ctx&, int opcode);  // false: abort
//   };
#pragma once

#include <cstdint>
#include <type_traits>

#include "common.cuh"
#include "mk_core.cuh"

namespace megac {
namespace mk {

constexpr int cmax(int a) { return a; }
template <class... T>
constexpr int cmax(int a, T... rest) {
  const int b = cmax(rest...);
  return a > b ? a : b;
}

// Opcode device functions return void, or bool (false: a wait gave up).
template <class F>
__device__ __forceinline__ bool call(F f, const Ctx& c) {
  if constexpr (std::is_void_v<decltype(f(c))>) {
    f(c);
    return true;
  } else {
    return f(c);
  }
}

template <class M, class Dispatch>
__device__ __forceinline__ void megakernel_body(const LaunchDesc* __restrict__ desc) {
  extern __shared__ __align__(128) uint8_t smem[];
  TaskShared* ts = reinterpret_cast<TaskShared*>(smem);
  Ctx c{desc, ts, smem + sizeof(TaskShared), M::SCRATCH_BYTES,
        WaitSite{ptr<int32_t>(desc->status), desc->watchdog_ns, 0, 0, 0}};
  uint32_t dyn;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
  if (dyn < uint32_t(sizeof(TaskShared) + M::SCRATCH_BYTES)) {  // the host launched with too little
    if (threadIdx.x == 0) report_error(c.site.status, -1, -1, -1, int32_t(dyn), M::SCRATCH_BYTES, -1, kErrBadTask);
    return;
  }
  const int sm = blockIdx.x;
  const int n = ptr<const int32_t>(desc->task_counts)[sm];
  const int32_t* list = ptr<const int32_t>(desc->tasks) + int64_t(sm) * desc->max_tasks * TASK_WORDS;
  // The next task's words are loaded while this one runs (a load per task
  // on the critical path cost ~0.6 us of dispatch).
  int32_t next = (threadIdx.x < TASK_WORDS && n > 0) ? __ldg(list + threadIdx.x) : 0;
  int k = 0;
  for (; k < n; ++k) {
    if (threadIdx.x < TASK_WORDS) {
      ts->w[threadIdx.x] = next;
      if (k + 1 < n) next = __ldg(list + int64_t(k + 1) * TASK_WORDS + threadIdx.x);
    }
    __syncthreads();
    const int op = ts->w[H_OPCODE];
    const int32_t sig = ts->w[H_SIGNAL];  // read now: the next task's words overwrite ts->w
    c.site.task = k;
    c.site.opcode = op;
    c.site.layer = ts->w[H_LAYER];
    if (threadIdx.x == 0) {
      ts->task = k;
      ptr<int32_t>(desc->progress)[sm] = k;  // where this CTA is, for the watchdog report
      ts->ok = header_waits(c, [](const Ctx& cc) { Dispatch::resolve_fields(cc); }) ? 1 : 0;
    }
    __syncthreads();
    if (!ts->ok) break;
    const bool ok = Dispatch::run(c, op);
    __syncthreads();
    if (!ok || !ts->ok) break;
    if (threadIdx.x == 0) signal(c, sig);
  }
  // n: every task of this CTA signalled (the report then never blames it)
  if (k == n && threadIdx.x == 0) ptr<int32_t>(desc->progress)[sm] = n;
}

}  // namespace mk
}  // namespace megac

// Tests of the dependency counters (opcodes/counters.cuh), all launched one
// CTA per SM, cooperatively (the waits need every CTA resident).
#include <cstdint>

#include "common.cuh"
#include "counters.cuh"

using megac::WaitSite;

// A wait whose producer never signals. CTA 0, task 7 (opcode 5, layer 2)
// waits on counter 3; every other CTA waits on counter 4, which CTA 0 would
// signal after its own wait. CTA 0 gets `timeout_ns`, the others four times
// that, so they must leave through the abort flag, not their own watchdog.
extern "C" __global__ void counters_hang(uint32_t* counters, int32_t* status,
                                         unsigned long long timeout_ns, int* exited) {
  if (blockIdx.x == 0) {
    WaitSite site{status, timeout_ns, 7, 5, 2};
    if (megac::cta_wait_counter(counters + 3, 1, 3, site)) megac::cta_signal_counter(counters + 4);
  } else {
    WaitSite site{status, 4 * timeout_ns, 0, 6, 2};
    megac::cta_wait_counter(counters + 4, 1, 4, site);
  }
  if (threadIdx.x == 0) atomicAdd(exited, 1);
}

// Ping-pong between CTAs a and b: `trials` round trips through fresh
// counters. CTA a times each round trip on its own SM clock; rtt[t] in
// cycles. clk[0..3] = a's clock64 and globaltimer at start and end (to turn
// cycles into ns), clk[4], clk[5] = the SM ids of a and b.
extern "C" __global__ void counters_pingpong(uint32_t* ping, uint32_t* pong, int trials, int a,
                                             int b, long long* rtt, long long* clk,
                                             int32_t* status) {
  WaitSite site{status, 0, 0, 0, 0};
  if (blockIdx.x == a) {
    if (threadIdx.x == 0) {
      clk[0] = clock64();
      clk[1] = static_cast<long long>(megac::globaltimer_ns());
      clk[4] = megac::smid();
    }
    for (int t = 0; t < trials; ++t) {
      site.task = t;
      const long long t0 = clock64();
      megac::cta_signal_counter(ping + t);
      if (!megac::cta_wait_counter(pong + t, 1, t, site)) return;
      if (threadIdx.x == 0) rtt[t] = clock64() - t0;
    }
    if (threadIdx.x == 0) {
      clk[2] = clock64();
      clk[3] = static_cast<long long>(megac::globaltimer_ns());
    }
  } else if (blockIdx.x == b) {
    if (threadIdx.x == 0) clk[5] = megac::smid();
    for (int t = 0; t < trials; ++t) {
      site.task = t;
      if (!megac::cta_wait_counter(ping + t, 1, t, site)) return;
      megac::cta_signal_counter(pong + t);
    }
  }
}

// Grid-wide dependency: every CTA signals bars[t], then waits for all
// gridDim.x arrivals, `trials` times. CTA 0 records its clock at each
// release (period[t] = cycles from release t-1 to release t, i.e. one full
// arrive -> all-see cycle); every CTA records globaltimer at its arrival and
// release of each trial (arrive[t * grid + cta], release[t * grid + cta]).
extern "C" __global__ void counters_gridbar(uint32_t* bars, int trials, long long* period,
                                            long long* clk, unsigned long long* arrive,
                                            unsigned long long* release, int32_t* status) {
  WaitSite site{status, 0, 0, 0, 0};
  long long last = 0;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    clk[0] = clock64();
    clk[1] = static_cast<long long>(megac::globaltimer_ns());
    last = clk[0];
  }
  for (int t = 0; t < trials; ++t) {
    site.task = t;
    __syncthreads();
    if (threadIdx.x == 0) {
      arrive[static_cast<size_t>(t) * gridDim.x + blockIdx.x] = megac::globaltimer_ns();
      megac::signal_counter(bars + t);
    }
    if (!megac::cta_wait_counter(bars + t, gridDim.x, t, site)) return;
    if (threadIdx.x == 0) {
      release[static_cast<size_t>(t) * gridDim.x + blockIdx.x] = megac::globaltimer_ns();
      if (blockIdx.x == 0) {
        const long long now = clock64();
        period[t] = now - last;
        last = now;
      }
    }
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    clk[2] = clock64();
    clk[3] = static_cast<long long>(megac::globaltimer_ns());
  }
}

// Release/acquire: trial t is produced by CTA p = t % grid, which copies
// src[t] (words_per_trial random words) into data[t] with plain stores and
// signals flags[t]; CTAs p+1, p+grid/4, p+grid/2 (mod grid) consume it: they
// first read the stale slot (so a stale line sits in their L1), then wait,
// then compare every word with src[t]. Every CTA walks the trials in order,
// so the producer of any trial a CTA waits on is never behind it.
extern "C" __global__ void counters_relacq(const uint32_t* src, uint32_t* data, uint32_t* flags,
                                           int trials, int words_per_trial,
                                           unsigned long long* mismatches,
                                           unsigned long long* stale_sink, int32_t* status) {
  WaitSite site{status, 0, 0, 0, 0};
  const int g = gridDim.x;
  const int me = blockIdx.x;
  unsigned long long bad = 0;
  uint32_t stale = 0;
  for (int t = 0; t < trials; ++t) {
    site.task = t;
    const int p = t % g;
    const size_t base = static_cast<size_t>(t) * words_per_trial;
    if (me == p) {
      for (int w = threadIdx.x; w < words_per_trial; w += blockDim.x) data[base + w] = src[base + w];
      megac::cta_signal_counter(flags + t);
    }
    const int d = (me - p + g) % g;
    if (d == 1 || d == g / 4 || d == g / 2) {
      for (int w = threadIdx.x; w < words_per_trial; w += blockDim.x) stale ^= data[base + w];
      if (!megac::cta_wait_counter(flags + t, 1, t, site)) break;
      for (int w = threadIdx.x; w < words_per_trial; w += blockDim.x) {
        bad += (data[base + w] != src[base + w]) ? 1u : 0u;
      }
    }
  }
  if (bad) atomicAdd(mismatches, bad);
  // Keeps the stale reads alive: the compiler may not drop them.
  if (stale == 0x9e3779b9u) atomicAdd(stale_sink, 1ull);
}

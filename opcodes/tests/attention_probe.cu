// The attention test kernels with the decode stream's timing probe on
// (MEGAC_ATTN_TRACE in opcodes/attention.cuh): same entry points, own cubin.
// Read by megac/gpu/attention_trace.py.
#define MEGAC_ATTN_TRACE 1
#include "attention_test.cu"

extern "C" __device__ unsigned long long* megac_attn_trace = nullptr;

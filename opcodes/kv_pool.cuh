// The paged KV pools' layout on the device: the one place that maps (KV
// block, token of the block, KV head) to a pool row of head_dim values.
//
//   token-major (the default): [blocks][block_size][kv_heads][hd]: a token's
//     heads side by side, so one head's keys of a block are 16 pieces of
//     2 * hd bytes kv_heads * hd * 2 apart;
//   head-major (target tile kv_head_major, megac.geometry): [blocks]
//     [kv_heads][block_size][hd]: one head's keys of a block contiguous
//     (block_size * hd * 2 bytes), so a split's reads are whole runs wherever
//     the pool lands (the twenty-fourth session's slow engines had one KV
//     head's splits 50 % slower: its 128-byte pieces, 1 KB apart, spread
//     over the memory as the pool's address decided).
//
// The host allocates the head-major pool as [blocks][kv_heads][block_size]
// [hd] and works on it through a [blocks][block_size][kv_heads][hd] view
// (megac.kv.paged.PagedKVCache), so only the device and the tensor maps
// (megac.gpu.tensormap) see the difference.
#pragma once

#include <cstdint>

namespace megac {
namespace kvpool {

__host__ __device__ __forceinline__ int64_t row(int64_t block, int off, int block_size, int kv_heads, int kvh,
                                                bool head_major) {
  return head_major ? (block * kv_heads + kvh) * block_size + off : (block * block_size + off) * kv_heads + kvh;
}

}  // namespace kvpool
}  // namespace megac

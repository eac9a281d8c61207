// Host-side check of the GEMM rings' stage cursor (gemm_tc.cuh WalkPos):
// from any starting stage, stepping next() must visit the same (item, first
// block, block count, row group) as Walk::stage computes stage by stage,
// for every tile shape the tiler can emit and every warp count a CTA may
// have. Runs on the CPU (the structs are __host__ __device__): no GPU.
// Prints "ok <cases>" or the first mismatch, and exits non-zero on one.
#include <cstdio>

#include "gemm_tc.cuh"

using megac::tc::kStageBlocks;
using megac::tc::Walk;
using megac::tc::WalkPos;

int main() {
  long cases = 0;
  for (int nwarps = 1; nwarps <= megac::tc::kMaxWarps; ++nwarps)
    for (int nlen = 16; nlen <= 1024; nlen += 16)
      for (int klen = 32; klen <= 4096; klen += klen < 512 ? 32 : 224)
        for (int warp = 0; warp < nwarps; ++warp) {
          const Walk wk(nlen, klen, warp, nwarps);
          for (int i0 = 0; i0 <= wk.total && i0 < 5; ++i0) {
            WalkPos p(wk, i0, warp, nwarps);
            for (int i = i0; i < wk.total; ++i, p.next(wk, nwarps)) {
              int item, blk0, nblk;
              wk.stage(i, warp, nwarps, item, blk0, nblk);
              const int rel = blk0 - wk.first_block(item);
              const bool item_first = i % wk.per_item == 0, item_last = i % wk.per_item == wk.per_item - 1;
              if (p.item != item || p.blk0() != blk0 || p.nblk() != nblk || p.grp != item % wk.groups ||
                  p.j * kStageBlocks != rel || (p.j == 0) != item_first || (p.j == wk.per_item - 1) != item_last) {
                std::printf("mismatch nwarps %d nlen %d klen %d warp %d from %d at stage %d: "
                            "item %d/%d blk0 %d/%d nblk %d/%d grp %d/%d j %d\n",
                            nwarps, nlen, klen, warp, i0, i, p.item, item, p.blk0(), blk0, p.nblk(), nblk, p.grp,
                            item % wk.groups, p.j);
                return 1;
              }
              ++cases;
            }
          }
        }
  std::printf("ok %ld\n", cases);
  return 0;
}

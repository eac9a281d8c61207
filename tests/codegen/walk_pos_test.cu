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
  // the walk's quotients and remainders (a shift and a mask for a power of
  // two under MEGAC_TC_POW2_DIV) against the language's own
  for (int b = 1; b <= 4096; ++b)
    for (int a = 0; a < 20000; a += 1 + a / 64)
      if (megac::tc::walk_div(a, b) != a / b || megac::tc::walk_mod(a, b) != a % b) {
        std::printf("walk_div/walk_mod mismatch: %d / %d\n", a, b);
        return 1;
      }
  for (int nwarps = 1; nwarps <= megac::tc::kMaxWarps; ++nwarps)
    for (int nlen = 16; nlen <= 1024; nlen += 16)
      for (int klen = 32; klen <= 4096; klen += klen < 512 ? 32 : 224)
        for (int warp = 0; warp < nwarps; ++warp) {
          const Walk wk(nlen, klen, warp, nwarps);
          {  // Deal's and Walk's fields by plain division
            const int groups = nlen / 16, parts = groups >= nwarps ? 1 : nwarps / groups, nb = klen / 32;
            const int all = groups * parts, mine = warp < all ? (all - warp + nwarps - 1) / nwarps : 0;
            const int per_item = ((nb + parts - 1) / parts + kStageBlocks - 1) / kStageBlocks;
            bool bad = wk.groups != groups || wk.parts != parts || wk.nb != nb || wk.per_item != per_item ||
                       wk.total != mine * per_item;
            for (int it = 0; it < all && !bad; ++it)
              bad = wk.first_block(it) != (it / groups) * nb / parts || wk.end_block(it) != (it / groups + 1) * nb / parts;
            if (bad) {
              std::printf("walk fields mismatch nwarps %d nlen %d klen %d warp %d\n", nwarps, nlen, klen, warp);
              return 1;
            }
          }
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

"""Streaming-read ceiling: the bandwidth every other block is measured against.

A plain kernel reads a random buffer far larger than L2 once with 16-byte
non-caching loads and sums it; the sum is checked against torch, so every
byte was really read. Launch shapes: many CTAs (2048 threads per SM), and
one 1024-thread CTA per SM (the megakernel's shape). The best of these is
the ceiling (``is_ceiling`` lines), exported by the battery as
MEGAC_CEILING_TBPS.
"""

from __future__ import annotations

import numpy as np

from gpu.battery import bench, block_main, check, no_spills, speed_target, time_cuda
from megac.gpu.build import build_cubin
# the kernel megac bench's ceiling reads with, its data and its check: one home
from megac.gpu.ceiling import SOURCE, exact_sum, random_words


def measure(quick: bool, reps: int | None = None) -> tuple[list[dict], list[dict], float]:
    """(checks, bench lines, best TB/s)."""
    import torch  # noqa: PLC0415

    from megac.gpu.launch import load_module, launch, sm_count  # noqa: PLC0415

    cubin = build_cubin(SOURCE)
    mod = load_module(cubin)
    sms = sm_count()
    nbytes = (2 if quick else 4) << 30
    reps = reps or (30 if quick else 100)
    words = random_words(nbytes // 4, seed=1234)
    n_vec = nbytes // 16
    want = exact_sum(words)
    out = torch.zeros(1, dtype=torch.int64, device="cuda")

    shapes = [
        ("read_16B_nc.many_ctas_4x512", "ceiling_read_u4", sms * 4, 512),
        ("read_16B_nc.persistent_1x1024", "ceiling_read_u4", sms, 1024),
        ("read_16B_nc_L2_256B.many_ctas_4x512", "ceiling_read_u4_l2_256", sms * 4, 512),
        ("read_16B_nc_L2_256B.persistent_1x1024", "ceiling_read_u4_l2_256", sms, 1024),
    ]
    checks, lines = [], []
    best = 0.0
    checks.append(no_spills(cubin))
    for label, kernel, grid, block in shapes:
        def go(kernel=kernel, grid=grid, block=block):
            launch(mod, kernel, (grid,), (block,), (words, np.uint64(n_vec), out))

        out.zero_()
        go()
        torch.cuda.synchronize()
        got = int(out.item()) % (1 << 64)
        checks.append(check(f"sum.{label}", got == want, f"got {got} want {want}"))
        t = time_cuda(go, reps=reps, warmup=2, setup=out.zero_)
        line = bench(label, nbytes, t["median_us"], ceiling=None, grid=grid, block=block,
                     min_us=round(t["min_us"], 2), max_us=round(t["max_us"], 2), is_ceiling=True)
        lines.append(line)
        best = max(best, line["tbps"])
    # The best plain kernel is the ceiling: restate every line against it.
    for line in lines:
        line["pct_ceiling"] = round(100.0 * line["tbps"] / best, 2) if best else None

    # torch's own reduction, for context only (not part of the ceiling).
    t = time_cuda(lambda: words.sum(), reps=max(5, reps // 3), warmup=1)
    lines.append({**bench("torch.sum(int32) [context]", nbytes, t["median_us"], ceiling=best), "is_ceiling": False})
    return checks, lines, best


def run(quick: bool) -> dict:
    checks, lines, best = measure(quick)
    # DESIGN.md measured 4.55-4.66 TB/s on two machines; far below means a
    # throttled or shared card, and every % below would be misleading. Recorded,
    # not a failure: the correctness checks are the sums above.
    target = speed_target("ceiling_plausible", 4.0 <= best <= 5.2, f"{best:.3f} TB/s (expect 4.55-4.66)")
    return {"block": "ceiling", "checks": checks, "bench": lines, "metrics": {"ceiling_tbps": best},
            "measurements": [target]}


if __name__ == "__main__":
    raise SystemExit(block_main("ceiling", run))

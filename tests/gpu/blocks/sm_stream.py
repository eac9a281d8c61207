"""One SM's weight stream when only some SMs stream.

A batch-1 MoE layer streams its expert up tiles on ~48 SMs at ~55 GB/s
each (docs/perf-notes.md) while the other SMs wait, and a deeper ring in the
megakernel did not stream faster. Is ~55 GB/s what one SM's rings can pull,
or what the memory system gives that many SMs? Here N SMs (of all) stream ~4 MB
each through the megakernel's per-warp rings (opcodes/tests/sm_stream_test.cu)
while the rest idle: per-SM rate and the aggregate against N, for SMs taken
in %smid order (neighbours, few GPCs) or spread over the chip, and for rings
holding more in flight.

Checks: every active CTA's word sum equals torch's over its region; an idle
CTA streams nothing. Bench lines: median per-SM GB/s and aggregate TB/s.
"""

from __future__ import annotations

import numpy as np

from gpu.battery import block_main, check, no_spills
from megac.gpu.build import REPO, build_cubin

SOURCE = REPO / "opcodes" / "tests" / "sm_stream_test.cu"
KERNELS = ("sm_stream_2x8k", "sm_stream_3x8k", "sm_stream_2x12k", "sm_stream_4x4k")
# bytes per streaming SM: ~3.9 MB, a whole number of every kernel's stages per
# warp (8 warps x lcm(4, 8, 12 KB) = 192 KB), so every byte is summed
PER_SM = 21 * 8 * 24576


def active_sets(sms: int, counts) -> dict[str, np.ndarray]:
    """name -> int32[sms] of 0/1 by %smid."""
    out = {}
    for n in counts:
        a = np.zeros(sms, dtype=np.int32)
        a[:n] = 1
        out[f"first{n}"] = a
        s = np.zeros(sms, dtype=np.int32)
        s[np.unique((np.arange(n) * sms) // n)] = 1
        out[f"spread{n}"] = s
    return out


def run(quick: bool) -> dict:
    import torch  # noqa: PLC0415

    from gpu.blocks.ceiling import random_words  # noqa: PLC0415
    from megac.gpu.launch import launch, load_module, sm_count  # noqa: PLC0415

    checks, lines = [], []
    cubin = build_cubin(SOURCE)
    checks.append(no_spills(cubin))
    mod = load_module(cubin)
    sms = sm_count()
    words = random_words(sms * PER_SM // 4, seed=97)
    want = (words.view(sms, PER_SM // 4).to(torch.int64) & 0xFFFFFFFF).sum(dim=1).cpu().numpy().astype(np.uint64)
    sums = torch.zeros(sms, dtype=torch.int64, device="cuda")
    times = torch.zeros(sms * 4, dtype=torch.int64, device="cuda")
    smem_out = torch.zeros(1, dtype=torch.int32, device="cuda")
    counts = (8, 16, 32, 48, 64, 96, sms) if not quick else (16, 48, sms)
    kernels = KERNELS if not quick else KERNELS[:2]
    reps = 5 if quick else 9
    for kernel in kernels:
        launch(mod, kernel + "_smem_bytes", (1,), (1,), (smem_out,))
        torch.cuda.synchronize()
        smem = int(smem_out.item())
        for name, act_np in active_sets(sms, counts).items():
            act = torch.from_numpy(act_np).cuda()
            per, agg = [], []
            ok = True
            for _ in range(reps):
                sums.zero_()
                times.zero_()
                launch(mod, kernel, (sms,), (256,), (words, np.uint64(PER_SM), act, sums, times), shared_mem=smem,
                       cooperative=True)
                torch.cuda.synchronize()
                t = times.view(sms, 4).cpu().numpy()
                got = sums.cpu().numpy().astype(np.uint64)
                on = act_np[t[:, 0]] == 1  # this CTA's SM was active
                ok &= bool(np.array_equal(got[on], want[on])) and not got[~on].any()
                dur = (t[on, 2] - t[on, 1]).astype(np.float64)
                per.append(np.median(PER_SM / dur))  # bytes per ns = GB/s
                agg.append(on.sum() * PER_SM / (t[on, 2].max() - t[on, 1].min()) / 1e3)  # TB/s
            checks.append(check(f"checksums.{kernel}.{name}", ok, f"{int(act_np.sum())} SMs"))
            lines.append({"name": f"{kernel}.{name}", "sms": int(act_np.sum()), "smem": smem,
                          "per_sm_gbs": round(float(np.median(per)), 1), "aggregate_tbs": round(float(np.median(agg)), 3)})
    return {"checks": checks, "bench": lines}


if __name__ == "__main__":
    raise SystemExit(block_main("sm_stream", run))

"""N SMs fold the same ~104 KB of fp32 planes from L2 at once.

At the head of a batch-1 MoE layer ~88 tiles each sum the residual, four
O-projection partials and eight expert rows (13 x 8 KB) before their GEMM,
and the profiled fold takes ~3 us. Is that the SMs reading the same lines at
once (`same`), the L2's total traffic (`private`: every CTA its own copy), or
one CTA's own loads (N = 1)? And do the SMs contend less when each starts
at another plane (`async_rot`)? (opcodes/tests/fold_l2_test.cu)

Checks: every active CTA's sum equals torch's (the same plane order, fp32);
every timed round met its grid barrier. Bench lines: the median and p90 of a
CTA's fold (us) and the span from the first start to the last end.
"""

from __future__ import annotations

import numpy as np

from gpu.battery import block_main, check, no_spills
from megac.gpu.build import REPO, build_cubin

SOURCE = REPO / "opcodes" / "tests" / "fold_l2_test.cu"
PLANES, D = 13, 2048


def run(quick: bool) -> dict:
    import torch  # noqa: PLC0415

    from megac.gpu.launch import launch, load_module, sm_count  # noqa: PLC0415

    checks, lines = [], []
    cubin = build_cubin(SOURCE)
    checks.append(no_spills(cubin))
    mod = load_module(cubin)
    sms = sm_count()
    gen = torch.Generator(device="cuda").manual_seed(2051)
    planes = torch.randn(sms, PLANES, D, device="cuda", generator=gen, dtype=torch.float32)
    reps = 6 if quick else 12
    out = torch.zeros(sms, D, device="cuda")
    times = torch.zeros(reps * sms * 2, dtype=torch.int64, device="cuda")
    gate = torch.zeros(1, dtype=torch.int32, device="cuda")
    counts = (1, 8, 40, 88, sms) if not quick else (1, 88, sms)
    smem_out = torch.zeros(1, dtype=torch.int32, device="cuda")
    launch(mod, "fold_l2_async_smem_bytes", (1,), (1,), (smem_out,))
    torch.cuda.synchronize()
    refs = {}  # private -> each CTA's expected sum: the kernel's order, plane 0, then + plane p in order
    for private in (0, 1):
        src = planes if private else planes[:1].expand(sms, PLANES, D)
        refs[private] = src[:, 0].clone()
        for p in range(1, PLANES):
            refs[private] += src[:, p]
    cases = [(k, pr, n) for k in ("regs", "async", "async_rot") for pr in (0, 1) for n in counts]
    for kernel, private, n in cases:
        act_np = np.zeros(sms, dtype=np.int32)
        act_np[np.unique((np.arange(n) * sms) // n)] = 1  # spread over the chip
        act = torch.from_numpy(act_np).cuda()
        out.zero_()
        times.zero_()
        gate.zero_()
        launch(mod, f"fold_l2_{kernel}", (sms,), (256,),
               (planes, np.int32(private), act, np.int32(int(act_np.sum())), np.int32(reps), out, times, gate),
               shared_mem=int(smem_out.item()) if kernel.startswith("async") else 0, cooperative=True)
        torch.cuda.synchronize()
        on = torch.from_numpy(act_np == 1).cuda()
        same_bits = bool(torch.equal(out[on], refs[private][on])) and not out[~on].any()
        t = times.view(reps, sms, 2).cpu().numpy()[1:]  # round 0 warms the lines
        t_on = t[:, act_np == 1]
        met = bool((t_on > 0).all())
        name = f"{kernel}.{'private' if private else 'same'}.n{int(act_np.sum())}"
        checks.append(check(f"sums.{name}", same_bits and met, f"{int(act_np.sum())} CTAs"))
        dur = (t_on[..., 1] - t_on[..., 0]).astype(np.float64) / 1e3
        span = (t_on[..., 1].max(axis=1) - t_on[..., 0].min(axis=1)).astype(np.float64) / 1e3
        lines.append({"name": name, "ctas": int(act_np.sum()), "fold_us_median": round(float(np.median(dur)), 3),
                      "fold_us_p90": round(float(np.percentile(dur, 90)), 3),
                      "span_us_median": round(float(np.median(span)), 3),
                      "l2_bytes_per_round": int(act_np.sum()) * PLANES * D * 4})
    return {"checks": checks, "bench": lines}


if __name__ == "__main__":
    raise SystemExit(block_main("fold_l2", run))

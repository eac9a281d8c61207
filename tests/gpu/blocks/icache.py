"""Cold code: what an SM pays to run code it has not run lately.

The megakernel is one ~414 KB function (North Mini Code) and each SM runs a
dozen opcodes per layer; every task of the profiled step spends ~1 us before
its first load even with nothing to wait for. This block measures the
instruction fetch of cold code directly (opcodes/tests/icache_test.cu):
lane 0 of every CTA (one per SM) runs 384 KB of distinct straight-line code,
then times a 4 KB block cold and warm, and 32 KB of different blocks cold
and warm, with the SM's other warps idle and with them streaming memory.

Checks
- every CTA computed the same finite value (the same FMA chain from the
  same input), idle and under load, and no spills.
Measurements (not gated): medians over SMs and repetitions, in ns.
"""

from __future__ import annotations

import numpy as np

from gpu.battery import block_main, check, no_spills
from megac.gpu.build import REPO, build_cubin

SOURCE = REPO / "opcodes" / "tests" / "icache_test.cu"
THREADS = 256
ONE_PER_SM_SMEM = 120 * 1024
CODE_KB = 4  # one block (icache_test.cu kFma * 16 B)
SEQ_KB = 32  # blocks 1..kSeq


def run(quick: bool) -> dict:
    import torch  # noqa: PLC0415

    from megac.gpu.launch import launch, load_module, sm_count  # noqa: PLC0415

    cubin = build_cubin(SOURCE)
    checks = [no_spills(cubin)]
    mod = load_module(cubin)
    sms = sm_count()
    reps = 4 if quick else 16
    dev = "cuda"
    x0 = torch.rand(1, device=dev) + 0.5
    buf = torch.empty(2 << 30, dtype=torch.uint8, device=dev).random_()
    sink = torch.zeros(1, dtype=torch.int64, device=dev)
    metrics: dict = {}
    values = {}
    for load in (0, 1):
        out = torch.zeros(sms, dtype=torch.float32, device=dev)
        cyc = torch.zeros(sms * reps * 4, dtype=torch.int64, device=dev)
        clk = torch.zeros(sms * 4, dtype=torch.int64, device=dev)
        launch(mod, "icache_probe", (sms,), (THREADS,),
               (x0, out, cyc, clk, np.int32(reps), buf, np.int64(buf.numel() // 16), np.int32(load), sink),
               shared_mem=ONE_PER_SM_SMEM, cooperative=True)
        torch.cuda.synchronize()
        o = out.cpu()
        values[load] = float(o[0])
        checks.append(check(f"same_value_on_every_sm_load{load}", bool(torch.isfinite(o).all()) and bool((o == o[0]).all()),
                            f"{int((o != o[0]).sum())} SMs differ from SM 0"))
        c = clk.cpu().numpy().reshape(sms, 4).astype(np.float64)
        ghz = float(np.median((c[:, 2] - c[:, 0]) / np.maximum(c[:, 3] - c[:, 1], 1)))
        t = cyc.cpu().numpy().reshape(sms, reps, 4)[:, 1:, :].reshape(-1, 4)  # the first rep also loads the sweep
        med = np.median(t, axis=0) / ghz
        tag = "loaded" if load else "idle"
        metrics[f"{tag}_sm_ghz"] = round(ghz, 3)
        metrics[f"{tag}_block_{CODE_KB}kb_cold_ns"] = round(float(med[0]), 1)
        metrics[f"{tag}_block_{CODE_KB}kb_warm_ns"] = round(float(med[1]), 1)
        metrics[f"{tag}_{SEQ_KB}kb_cold_ns"] = round(float(med[2]), 1)
        metrics[f"{tag}_{SEQ_KB}kb_warm_ns"] = round(float(med[3]), 1)
        metrics[f"{tag}_cold_extra_ns_per_kb"] = round(float((med[2] - med[3]) / SEQ_KB), 1)
    checks.append(check("same_value_idle_and_loaded", values[0] == values[1], f"{values[0]} vs {values[1]}"))
    return {"block": "icache", "checks": checks, "bench": [], "metrics": metrics, "measurements": []}


if __name__ == "__main__":
    raise SystemExit(block_main("icache", run))

"""Where a decode stream's time goes, task by task (a diagnosis tool).

Runs the flash-decode test kernel built with MEGAC_ATTN_TRACE
(opcodes/tests/attention_probe.cu) for some back-to-back steps and prints,
as medians over tasks and CTAs, in SM clock cycles:

  period        task start to next task start (one CTA)
  first_tile    task start to its first tile ready
  tiles         first tile ready to last tile done
  finish        the epilogue: merge, partial store, hand-offs
  tile_wait     cycles the compute warps waited for K/V to land
  slot_wait     cycles the producer waited for a free ring slot (16-byte
                copy producers only)
  ctl_pre       the control warp before it allows the store (its counter waits)
  ctl_signal    the control warp's arrival (fence + atomic, or the fused merge)
  merge_*       with merge CTAs: their period per merge, and the part spent
                waiting for arrivals, merging and signalling

The probe's own global stores perturb what it measures by a few hundred
cycles per point: compare configurations with it, quote times from the
battery.

    python -m gpu.attention_trace --bs 1 --ctx 8192 --splits 32 --merge spread
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np

from megac.gpu import build, launch
from gpu.blocks import attention as A

PROBE = A.REPO / "opcodes" / "tests" / "attention_probe.cu"
TRACE_TASKS, TRACE_WORDS = 256, 16  # kTraceTasks and the record width in attention.cuh


def trace(bsz: int, ctx: int, splits: int, merge: str, steps: int, seed: int = 0,
          variant: str = "nmc_tma") -> dict:
    import cupy  # noqa: PLC0415
    import torch  # noqa: PLC0415

    mod = launch.load_module(build.build_cubin(PROBE))
    a = A.Attn(mod, variant)
    nsm = launch.sm_count()
    kv_bytes = bsz * ctx * 4 * a.hd * 4
    st = A.make_state(a, [ctx] * bsz, 4, 0, [splits] * bsz, gen=torch.Generator().manual_seed(seed),
                      copies=max(2, math.ceil(256e6 / kv_bytes)))
    comb = nsm - bsz * 4 * splits if merge == "combine_ctas" else 0
    phases = A.DECODE | {"spread": A.SPREAD, "combine_ctas": A.COMBINE_CTAS, "fused": A.FUSED, "none": 0}[merge]
    buf = torch.zeros(nsm * TRACE_TASKS * TRACE_WORDS, dtype=torch.int64, device="cuda")
    ptr = np.array([buf.data_ptr()], dtype=np.uint64)
    cupy.cuda.runtime.memcpy(mod.get_global("megac_attn_trace").ptr, ptr.ctypes.data, 8,
                             cupy.cuda.runtime.memcpyHostToDevice)
    for rep in range(2):  # the second launch is the one read: warm clocks, warm TLB
        buf.zero_()
        a.run(st, epoch=1 + rep * steps, phases=phases, reps=steps, comb_ctas=comb)
        torch.cuda.synchronize()
    launch.check_status(st["status"], st["counters"])
    tr = buf.view(nsm, TRACE_TASKS, TRACE_WORDS).cpu().numpy().astype(np.int64)
    comb_stats = {}
    if comb:
        # Merge CTAs record per merge: wait start, arrivals seen, merged, signalled.
        m = tr[nsm - comb:]
        m = m[:, 1:steps - 1]
        comb_stats = {"merge_period": float(np.median(np.diff(m[:, :, 0], axis=1))),
                      "merge_wait": float(np.median(m[:, :, 1] - m[:, :, 0])),
                      "merge_work": float(np.median(m[:, :, 2] - m[:, :, 1])),
                      "merge_signal": float(np.median(m[:, :, 3] - m[:, :, 2]))}
        tr = tr[: nsm - comb]
    out = {}
    per_cta = []
    for t in tr:
        t = t[t[:, 0] != 0]
        if len(t) < 2:
            continue
        per_cta.append({
            "period": np.median(np.diff(t[:, 0])), "first_tile": np.median(t[:, 1] - t[:, 0]),
            "tiles": np.median(t[:, 2] - t[:, 1]), "finish": np.median(t[:, 3] - t[:, 2]),
            "tile_wait": np.median(t[:, 4]), "slot_wait": np.median(t[:, 5]),
            "ctl_pre": np.median(t[:, 7]), "ctl_signal": np.median(t[:, 8]),
            "tiles_per_task": np.median(t[:, 6]),
        })
    out.update({k: float(np.median([c[k] for c in per_cta])) for k in per_cta[0]})
    out.update(comb_stats)
    out.update({"bs": bsz, "ctx": ctx, "splits": splits, "merge": merge, "decode_ctas": len(per_cta),
                "unit": "SM cycles"})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu.attention_trace")
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--splits", type=int, default=32)
    ap.add_argument("--merge", choices=("spread", "combine_ctas", "fused", "none"), default="spread")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--variant", choices=sorted(v for v in A.VARIANTS if v.startswith("nmc")), default="nmc_tma")
    args = ap.parse_args(argv)
    print(json.dumps(trace(args.bs, args.ctx, args.splits, args.merge, min(args.steps, TRACE_TASKS // 2),
                           variant=args.variant), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

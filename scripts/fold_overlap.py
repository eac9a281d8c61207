"""How long a profiled step's QKV and router folds take against how many folds run beside them.

Reads a `--profile` trace (.trace.json or .gz) and, for every QKV_PROJ / ROUTER_GEMM task with a
"loads and adds done" stamp (mark 0: the norm fold inside the tile), takes the fold's time (the
stamp after the task's run start) and the number of other folds whose spans overlap it, then prints
the median and p10-p90 per overlap band. A fold that is as slow alone as among 80 others is bound by
its own SM's loads, not by the L2's traffic (perf-notes, fifty-first session).

    .venv/bin/python scripts/fold_overlap.py benchmarks/profile-nmc-bs1-8k-2026-12-07-h100-session47.trace.json.gz
"""
import sys
from pathlib import Path

import numpy as np

from megac.calibrate_cli import read_trace, trace_records

BANDS = ((0, 5), (5, 20), (20, 40), (40, 60), (60, 80), (80, 10**6))


def folds(path: str) -> list[tuple[str, float, float]]:
    """(opcode, run start us, fold done us) of every folding GEMM task."""
    records = trace_records(read_trace(Path(path), "fold_overlap"), Path(path), "fold_overlap")
    return [(r["op"], r["waited_us"], r["marks_us"][0]) for r in records
            if r["op"] in ("QKV_PROJ", "ROUTER_GEMM") and r["marks_us"] and r["marks_us"][0] is not None]


def main(path: str) -> None:
    rows = folds(path)
    start = np.array([r[1] for r in rows])
    done = np.array([r[2] for r in rows])
    for name in ("QKV_PROJ", "ROUTER_GEMM"):
        mine = [i for i, r in enumerate(rows) if r[0] == name]
        print(f"{name}: {len(mine)} folds")
        overlap = {i: int(((start < done[i]) & (done > start[i])).sum()) - 1 for i in mine}
        for lo, hi in BANDS:
            t = [done[i] - start[i] for i in mine if lo <= overlap[i] < hi]
            if t:
                print(f"  {lo:>3}-{min(hi, 999) - 1:<3} beside: {len(t):5d} folds, median {np.median(t):.2f} us "
                      f"(p10 {np.percentile(t, 10):.2f}, p90 {np.percentile(t, 90):.2f})")


if __name__ == "__main__":
    main(sys.argv[1])

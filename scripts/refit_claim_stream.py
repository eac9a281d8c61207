"""Refit a bundled calibration's claimer opcode (default ATTN_DRAIN) from
measured whole steps at several contexts (megac.calibration.refit_claim_stream):
its claims' time becomes a fixed part plus a per-SM streaming rate, chosen
so the cost model predicts the recorded `megac bench --json` rows best.

    .venv/bin/python scripts/refit_claim_stream.py h200-north-mini-code \\
        benchmarks/bench-nmc-cuda-2026-12-02-h200-session9.json \\
        benchmarks/bench-nmc-128k-cuda-2026-12-02-h200-session9.json [--min-context 32768]
        [--max-context N] [--write]

Prints the mean |error| per candidate rate and the refitted model's error
on every row (also those below --min-context, which the fit does not see).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megac.calibration import Calibration, refit_claim_stream, resolve
from megac.costmodel import simulate
from megac.runtime.artifacts import load_or_compile
from megac.runtime.schedules import ScheduleSet
from megac.spec import load_spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("calibration")
    ap.add_argument("bench_json", nargs="+")
    ap.add_argument("--op", default="ATTN_DRAIN")
    ap.add_argument("--min-context", type=int, default=8192, help="rows the fit sees (the rest only reported)")
    ap.add_argument("--max-context", type=int, default=1 << 30, help="rows the fit sees, from above")
    ap.add_argument("--write", action="store_true", help="overwrite the calibration file with the refit")
    a = ap.parse_args()
    path = resolve(a.calibration)
    cal = Calibration.load(path)
    runs = [json.loads(Path(f).read_text()) for f in a.bench_json]
    models = {r["run"]["model"] for r in runs}
    if len(models) != 1:
        raise SystemExit(f"refit: the rows come from several models: {sorted(models)}")
    spec = load_spec(models.pop())
    ss = ScheduleSet(load_or_compile(spec, "tuned").schedules)
    rows = [(r["batch"], r["context"], r["kernel_ms"]) for run in runs for r in run["rows"]]
    fits = lambda c: a.min_context <= c <= a.max_context  # noqa: E731
    cases = [(ss.pick(b, c), c, ms) for b, c, ms in rows if fits(c)]
    source = f"{a.op} refit to {len(cases)} measured steps ({', '.join(Path(f).name for f in a.bench_json)})"
    out, table = refit_claim_stream(cal, a.op, cases, source=source)
    for rate, err in table.items():
        print(f"rate {rate:5.1f} GB/s per SM: mean |error| {100 * err:5.1f} %")
    print(f"{a.op}: {out.claim_fixed_us[a.op]:.2f} us per claim + {1e-3 / out.us_per_byte[a.op]:.1f} GB/s per SM")
    for b, c, ms in rows:
        pred = simulate(ss.pick(b, c), out.params(context=c)).step_us / 1e3
        seen = "fit" if fits(c) else "held out"
        print(f"batch {b} context {c:6d}: predicted {pred:6.2f} ms, measured {ms:6.2f} ({100 * (pred / ms - 1):+5.1f} %, {seen})")
    if a.write:
        out.source = f"{cal.source}; {source}"
        out.save(path)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""GPU battery: run every block under tests/gpu/blocks/ and tabulate.

    python3 -m gpu.battery --smoke|--full --out DIR [--only BLOCK ...]

The ``ceiling`` block runs first; the streaming-read ceiling it measures is
handed to the other blocks through MEGAC_CEILING_TBPS so that every
"% ceiling" in one run refers to the same measurement. Each block runs in
its own subprocess (``python3 -m gpu.blocks.<name> --quick|--full
--json PATH``) with a timeout: a block that crashes, hangs or faults the
context is recorded as failed and the battery moves on.

Also the small helpers every block module uses (timing with CUDA events,
result entries, the ``__main__`` wrapper), kept import-light: torch is
imported inside the functions that need it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[2]
BLOCKS_DIR = Path(__file__).resolve().parent / "blocks"
DATASHEET_TBPS = 4.8
CEILING_ENV = "MEGAC_CEILING_TBPS"

# Per-block subprocess timeouts (seconds). The whole --smoke run must stay
# under 3 minutes and --full under 9, cold module loads included.
TIMEOUT_QUICK_S = 75
TIMEOUT_FULL_S = 150
BUDGET_QUICK_S = 175
BUDGET_FULL_S = 530


# --------------------------------------------------------------------------
# helpers for block modules
# --------------------------------------------------------------------------


def check(name: str, ok: bool, detail: Any = "") -> dict:
    return {"name": name, "ok": bool(ok), "detail": detail if isinstance(detail, str) else json.dumps(detail)}


def no_spills(cubin) -> dict:
    """The check every block makes of its cubin: no kernel spills registers
    (ptxas's report; a spill usually means an array indexed at run time)."""
    from megac.gpu.build import resources  # noqa: PLC0415

    spills = {k: v["spill_stores"] for k, v in resources(cubin).items() if v.get("spill_stores")}
    return check("no_spills", not spills, spills or "0 spill stores")


def speed_target(name: str, met: bool, detail: Any = "") -> dict:
    """A speed target, recorded in the block's JSON (``measurements``) and in
    the battery table, never part of pass/fail: a test checks behaviour, a
    loaded or different GPU must not fail it (speed is a benchmark's verdict)."""
    return {"name": name, "met": bool(met), "detail": detail if isinstance(detail, str) else json.dumps(detail)}


def ceiling_tbps() -> float | None:
    v = os.environ.get(CEILING_ENV)
    try:
        return float(v) if v else None
    except ValueError:
        return None


def bench(name: str, nbytes: int, time_us: float, ceiling: float | None = None, **extra) -> dict:
    """One bench line: bytes that must move over the median time."""
    tbps = nbytes / (time_us * 1e-6) / 1e12 if time_us > 0 else 0.0
    ceil = ceiling if ceiling is not None else ceiling_tbps()
    d = {
        "name": name,
        "bytes": int(nbytes),
        "time_us": round(time_us, 3),
        "tbps": round(tbps, 4),
        "pct_ceiling": round(100.0 * tbps / ceil, 2) if ceil else None,
        "pct_datasheet": round(100.0 * tbps / DATASHEET_TBPS, 2),
    }
    d.update(extra)
    return d


def time_cuda(
    fn: Callable[[], None],
    reps: int = 20,
    warmup: int = 3,
    setup: Callable[[], None] | None = None,
    warm_s: float = 0.3,
) -> dict:
    """Median of per-launch CUDA-event times, in microseconds.

    Warm-up runs at least ``warmup`` launches and at least ``warm_s`` seconds:
    an idle H200 sits at a low SM clock (480 MHz seen) and needs a few hundred
    milliseconds of load before a sub-millisecond launch measures the card
    rather than its power state. ``setup`` runs before each timed launch,
    outside the events (resetting accumulators, rotating buffers).
    """
    import torch  # noqa: PLC0415

    t_end = time.time() + warm_s
    n = 0
    while n < warmup or time.time() < t_end:
        if setup:
            setup()
        fn()
        n += 1
        if n % 16 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    # Enqueue every timed launch before waiting on any: with the queue full
    # the GPU never waits for Python to issue the next launch, so the events
    # bracket the kernel and not the host's launch latency (tens of us).
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for a, b in zip(starts, ends):
        if setup:
            setup()
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    times = [a.elapsed_time(b) * 1000.0 for a, b in zip(starts, ends)]
    return {
        "median_us": statistics.median(times),
        "min_us": min(times),
        "max_us": max(times),
        "reps": reps,
        "warmup_launches": n,
    }


def block_main(name: str, run: Callable[[bool], dict], argv: list[str] | None = None) -> int:
    """``__main__`` of a block module: run it, write JSON, never raise."""
    ap = argparse.ArgumentParser(prog=f"gpu.blocks.{name}")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true")
    g.add_argument("--full", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    quick = not args.full
    t0 = time.time()
    try:
        res = run(quick)
    except Exception as e:  # noqa: BLE001  (recorded, the battery moves on)
        import traceback  # noqa: PLC0415

        res = {
            "block": name,
            "checks": [check("ran", False, f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}")],
            "bench": [],
        }
    res.setdefault("block", name)
    res.setdefault("checks", [])
    res.setdefault("bench", [])
    res.setdefault("measurements", [])
    res["wall_s"] = round(time.time() - t0, 2)
    text = json.dumps(res, indent=1, default=str)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    else:
        print(text)
    return 0 if all(c["ok"] for c in res["checks"]) else 1


# --------------------------------------------------------------------------
# the battery
# --------------------------------------------------------------------------


def discover() -> list[str]:
    names = sorted(p.stem for p in BLOCKS_DIR.glob("*.py") if not p.stem.startswith("_"))
    if "ceiling" in names:
        names.remove("ceiling")
        names.insert(0, "ceiling")
    return names


def run_block(name: str, quick: bool, out_dir: Path, timeout_s: float, env: dict) -> dict:
    js = out_dir / f"{name}.json"
    if js.exists():
        js.unlink()
    log = out_dir / f"{name}.log"
    cmd = [sys.executable, "-m", f"gpu.blocks.{name}", "--quick" if quick else "--full", "--json", str(js)]
    t0 = time.time()
    status = "ok"
    with open(log, "w") as lf:
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=lf, stderr=subprocess.STDOUT, timeout=timeout_s)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
            status = f"timed out after {timeout_s:.0f} s"
    wall = time.time() - t0
    res: dict
    if js.exists():
        try:
            res = json.loads(js.read_text())
        except json.JSONDecodeError as e:
            res = {"block": name, "checks": [check("json", False, str(e))], "bench": []}
    else:
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        why = status if rc is None else f"exited {rc} without a result"
        res = {"block": name, "checks": [check("ran", False, f"{why}\n{tail}")], "bench": []}
    if rc is None:
        res["checks"].append(check("finished", False, status))
    res["returncode"] = rc
    res["wall_s_outer"] = round(wall, 2)
    if log.exists():
        res["log_tail"] = log.read_text(errors="replace")[-4000:]
    return res


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(results: list[dict]) -> str:
    lines = []
    for r in results:
        checks = r.get("checks", [])
        npass = sum(1 for c in checks if c["ok"])
        nfail = len(checks) - npass
        lines.append(
            f"== {r['block']}: {npass} pass, {nfail} fail ({_fmt(r.get('wall_s_outer'), '.1f')} s)"
        )
        for c in checks:
            if not c["ok"]:
                lines.append(f"   FAIL {c['name']}: {str(c['detail'])[:300]}")
        for m in r.get("measurements", []):
            lines.append(f"   {'target met' if m['met'] else 'BELOW TARGET'} (not a failure) "
                         f"{m['name']}: {str(m['detail'])[:300]}")
        if r.get("bench"):
            lines.append(
                f"   {'bench':44s} {'bytes':>14s} {'us':>10s} {'TB/s':>7s} {'%ceil':>7s} {'%4.8':>7s}"
            )
        for b in r.get("bench", []):
            lines.append(
                f"   {b['name'][:44]:44s} {b.get('bytes', 0):14d} {_fmt(b.get('time_us'), '10.2f')} "
                f"{_fmt(b.get('tbps'), '7.3f')} {_fmt(b.get('pct_ceiling'), '7.1f')} "
                f"{_fmt(b.get('pct_datasheet'), '7.1f')}"
                + (f"  {b['note']}" if b.get("note") else "")
            )
        for k, v in (r.get("metrics") or {}).items():
            lines.append(f"   {k}: {v}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu.battery")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--smoke", action="store_true", help="quick sizes (<= 3 min)")
    g.add_argument("--full", action="store_true", help="full sizes (<= 9 min)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--timeout", type=float, default=None, help="per-block timeout (s)")
    args = ap.parse_args(argv)
    quick = not args.full
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    # The device tool brings back only a few files from $OUT: per-block
    # files go to a scratch folder, and results.json + battery.log hold it all.
    work = Path(tempfile.mkdtemp(prefix="megac-battery-"))
    blocks = discover()
    if args.only:
        unknown = [b for b in args.only if b not in blocks]
        if unknown:
            print(f"unknown blocks {unknown}; have {blocks}", file=sys.stderr)
            return 2
        blocks = [b for b in blocks if b in args.only]
    timeout_s = args.timeout or (TIMEOUT_QUICK_S if quick else TIMEOUT_FULL_S)
    budget = BUDGET_QUICK_S if quick else BUDGET_FULL_S
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("PYTHONUNBUFFERED", "1")
    t0 = time.time()
    results = []
    for name in blocks:
        left = budget - (time.time() - t0)
        if left < 10:
            results.append({"block": name, "checks": [check("ran", False, "battery time budget spent")], "bench": []})
            continue
        print(f"-- {name} ...", flush=True)
        r = run_block(name, quick, work, min(timeout_s, left), env)
        results.append(r)
        if name == "ceiling":
            best = max((b.get("tbps") or 0 for b in r.get("bench", []) if b.get("is_ceiling")), default=0)
            if best > 0:
                env[CEILING_ENV] = f"{best:.4f}"
        print(table([r]), flush=True)
    summary = {
        "mode": "smoke" if quick else "full",
        "ceiling_tbps": float(env[CEILING_ENV]) if env.get(CEILING_ENV) else None,
        "wall_s": round(time.time() - t0, 1),
        "results": results,
    }
    (out / "results.json").write_text(json.dumps(summary, indent=1, default=str))
    with open(out / "battery.log", "w") as f:
        for name in blocks:
            lp = work / f"{name}.log"
            if lp.exists():
                f.write(f"===== {name} =====\n" + lp.read_text(errors="replace") + "\n")
    print("\n==================== battery summary ====================")
    print(f"mode={summary['mode']} ceiling={summary['ceiling_tbps']} TB/s wall={summary['wall_s']} s")
    print(table(results))
    ok = all(c["ok"] for r in results for c in r.get("checks", []))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

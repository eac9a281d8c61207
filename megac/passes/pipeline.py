"""Run the lowering passes for every schedule key of a spec.

::

    compile_one(spec, order="tuned", rows=1, context=None) -> Schedule
    compile_schedules(spec, order="tuned", batch_sizes=None, buckets=None,
                      progress=None) -> CompileResult

``compile_schedules`` builds one schedule per (batch size, context bucket)
group: buckets whose split signature (``Geometry.split_signature``) is equal
compile to identical task words, so they share one schedule, built at the
largest bucket of the group (its buffers are sized for it). Each pass is
timed; ``requires`` runs before and ``ensures`` after every pass (``check``),
then ``megac.passes.verify.verify(schedule)`` when that module provides it.
``progress`` (a callable taking one string) hears about every schedule.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from megac.abi import H, Op
from megac.errors import MegacError
from megac.geometry import Geometry
from megac.ir import build_graph
from megac.passes import Lowering, assign, depend, encode, order, plan, select, tile
from megac.schedule import Schedule

PASSES = (tile, select, depend, order, assign, plan, encode)
PASS_NAMES = tuple(p.NAME for p in PASSES) + ("verify",)


@dataclass
class CompileResult:
    spec_name: str
    order: str
    schedules: list[Schedule]
    #: (rows, bucket) -> index into ``schedules``
    key_map: dict[tuple[int, int], int]
    pass_log: list[dict] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def pass_totals(self) -> dict[str, float]:
        """Milliseconds per pass over all schedules."""
        out: dict[str, float] = {}
        for e in self.pass_log:
            out[e["pass"]] = out.get(e["pass"], 0.0) + e["ms"]
        return out

    def schedule_for(self, rows: int, bucket: int) -> Schedule:
        return self.schedules[self.key_map[(rows, bucket)]]


def _verifier() -> Callable | None:
    try:
        from megac.passes import verify as v
    except ImportError:
        return None
    return getattr(v, "verify", None)


def graph_form(geo: Geometry) -> tuple:
    """build_graph's arguments for schedules of ``geo``: routed claims, the
    combine inside the norm, the layers that fold their norm, the split-K
    expert down projection, the attention merge inside the O-projection, the
    layers whose router folds the combine, whether every router is
    unnormalised, the layers whose QKV tiles add the combine in their fold,
    the layers whose up claims do."""
    L = range(geo.num_layers)
    return (geo.routed_claims, geo.fused_combine, tuple(l for l in L if geo.folded(l)),
            geo.split_down, geo.o_proj_merge, tuple(l for l in L if geo.router_combined(l)),
            geo.router_combine, tuple(l for l in L if geo.qkv_combined(l)), tuple(l for l in L if geo.up_combined(l)))


def lower(spec, order_name: str, rows: int, context: int, *, graph=None, check: bool = True,
          log: list | None = None) -> Lowering:
    """Run tile .. encode for one key; returns the final Lowering."""
    geo = Geometry.from_spec(spec, rows, context)
    lw = Lowering(spec=spec, geo=geo,
                  graph=graph if graph is not None else build_graph(spec, *graph_form(geo)),
                  order_name=order_name)
    for p in PASSES:
        t0 = time.perf_counter()
        if check:
            p.requires(lw)
        summary = p.run(lw)
        if check:
            p.ensures(lw)
        ms = (time.perf_counter() - t0) * 1e3
        entry = {"pass": p.NAME, "ms": round(ms, 2), "summary": summary, "rows": rows, "context": context}
        lw.log.append(entry)
        if log is not None:
            log.append(entry)
    return lw


def build_schedule(lw: Lowering, buckets: list[int] | None = None) -> Schedule:
    geo = lw.geo
    words = lw.global_words()
    ops, counts = np.unique(words[:, H.OPCODE], return_counts=True)
    per_sm = lw.task_counts.astype(np.int64)
    return Schedule(
        spec_name=lw.spec.name,
        rows=geo.rows,
        context=geo.context,
        buckets=list(buckets or [geo.context]),
        order=lw.order_name,
        num_sms=geo.num_sms,
        tasks=lw.tasks,
        task_counts=lw.task_counts,
        counters=list(lw.counters),
        num_counters=len(lw.counters),
        waves={k: list(v) for k, v in lw.waves.items()},
        layer_kinds=list(lw.layer_kinds),
        tasks_per_opcode={Op(int(o)).name: int(c) for o, c in zip(ops, counts)},
        tasks_per_sm={"min": int(per_sm.min()), "max": int(per_sm.max()), "mean": float(per_sm.mean())},
        plan=lw.plan,
        geometry=geo,
        global_order=np.stack([lw.sm, lw.slot], axis=1).astype(np.int32),
        task_node=lw.g_node.astype(np.int32),
        node_names=[nt.name for nt in lw.nodes],
        pass_times={e["pass"]: e["ms"] / 1e3 for e in lw.log},
    )


def _run_verify(sched: Schedule, log: list | None, verify: bool) -> None:
    fn = _verifier() if verify else None
    if fn is None:
        return
    t0 = time.perf_counter()
    rep = fn(sched)
    ms = (time.perf_counter() - t0) * 1e3
    summary = rep.summary() if hasattr(rep, "summary") else ""
    sched.pass_times["verify"] = ms / 1e3
    entry = {"pass": "verify", "ms": round(ms, 2), "summary": summary, "rows": sched.rows,
             "context": sched.context}
    if log is not None:
        log.append(entry)


def compile_one(spec, order: str = "tuned", rows: int = 1, context: int | None = None, *,
                verify: bool = True, check: bool = True, graph=None, log: list | None = None) -> Schedule:
    """One schedule for ``rows`` at the bucket holding ``context`` (default:
    the bucket of min(8192, max_context))."""
    ctx = context if context is not None else min(8192, spec.max_context)
    bucket = spec.context_bucket(ctx)
    lw = lower(spec, order, rows, bucket, graph=graph, check=check, log=log)
    sched = build_schedule(lw, [bucket])
    _run_verify(sched, log, verify)
    return sched


def bucket_groups(spec, rows: int, buckets: list[int]) -> list[list[int]]:
    """Buckets grouped by split signature (each group sorted, groups by size)."""
    groups: dict[tuple, list[int]] = {}
    for b in sorted(buckets):
        sig = Geometry.from_spec(spec, rows, b).split_signature
        groups.setdefault(sig, []).append(b)
    return sorted(groups.values(), key=lambda g: g[-1])


def _compile_key(spec, order: str, rows: int, group: list[int], graph, check: bool,
                 verify: bool) -> tuple[Schedule, list[dict], float]:
    """One (batch size, bucket group) schedule, its pass log and its seconds
    (a top-level function: it runs in a worker process)."""
    ts = time.perf_counter()
    log: list[dict] = []
    lw = lower(spec, order, rows, group[-1], graph=graph, check=check, log=log)
    sched = build_schedule(lw, group)
    _run_verify(sched, log, verify)
    return sched, log, time.perf_counter() - ts


def default_jobs() -> int:
    """Worker processes for compiling schedules: one per CPU this process may
    run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _mapped(fn, args: list[tuple], jobs: int):
    """``fn(*a)`` for every ``a``, in order; in ``jobs`` forked worker
    processes when there is more than one job and more than one key.

    Why processes: the schedules of different batch sizes and context buckets
    are independent, and lowering plus verifying one is pure Python (about
    1.5 s each for North Mini Code's 12); threads would share one interpreter
    lock. Fork (Linux only) hands the workers the spec and the graph without
    importing megac again; the passes use numpy, never torch's thread pool,
    which is what makes forking a process that imported torch unsafe."""
    if jobs <= 1 or len(args) <= 1 or sys.platform != "linux":
        yield from (fn(*a) for a in args)
        return
    ctx = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(max_workers=min(jobs, len(args)), mp_context=ctx) as pool:
        yield from pool.map(fn, *zip(*args))


def compile_schedules(spec, order: str = "tuned", batch_sizes: list[int] | None = None,
                      buckets: list[int] | None = None, progress: Callable[[str], None] | None = None,
                      *, verify: bool = True, check: bool = True, jobs: int = 1) -> CompileResult:
    """Every schedule of ``spec`` (see the module docstring); ``jobs`` > 1
    compiles independent schedules in that many worker processes (the
    result is the same, schedule for schedule)."""
    t0 = time.perf_counter()
    batch_sizes = sorted(set(batch_sizes or spec.target.batch_sizes))
    buckets = sorted(set(buckets or spec.resolved_context_buckets))
    for b in buckets:
        if b > spec.max_context:
            raise MegacError(f"context bucket {b} exceeds max_context {spec.max_context}")
    # one graph per form of the MoE routing (routed claims up to the target's
    # row bound; the combine inside the norm at one row)
    def form(rows):
        return graph_form(Geometry.from_spec(spec, rows, buckets[0]))

    graphs = {f: build_graph(spec, *f) for f in {form(rows) for rows in batch_sizes}}
    keys = [(rows, group) for rows in batch_sizes for group in bucket_groups(spec, rows, buckets)]
    log: list[dict] = []
    schedules: list[Schedule] = []
    key_map: dict[tuple[int, int], int] = {}
    args = [(spec, order, rows, group, graphs[form(rows)], check, verify) for rows, group in keys]
    for (rows, group), (sched, entries, seconds) in zip(keys, _mapped(_compile_key, args, jobs)):
        log.extend(entries)
        for b in group:
            key_map[(rows, b)] = len(schedules)
        schedules.append(sched)
        if progress is not None:
            ctx = f"context <= {group[-1]}" + (f" (buckets {group[0]}..{group[-1]})" if len(group) > 1 else "")
            progress(f"batch {rows}, {ctx}: {sched.num_tasks} tasks, {sched.num_counters} counters, "
                     f"{seconds * 1e3:.0f} ms")
    return CompileResult(spec.name, order, schedules, key_map, log, time.perf_counter() - t0)


__all__ = ["CompileResult", "PASSES", "PASS_NAMES", "bucket_groups", "build_schedule", "compile_one",
           "compile_schedules", "default_jobs", "lower"]

"""Per-task timeline of one megakernel step (a cubin built with
``-DMEGAC_PROFILE=1``; compiled out otherwise).

::

    buf = attach(backend)              # points the kernel's `megakernel_profile` at a buffer
    backend.decode(rows, tokens)       # the step to look at
    recs = read(buf, sched)            # one record per task that ran
    summary(recs); chrome_trace(recs)  # per-opcode totals; a Perfetto / chrome://tracing file

Thread 0 of each CTA stamps the global timer (ns) when a task's words
landed, when its header waits were done and when the CTA finished it; a
claimer also counts the records it ran and the time their own waits took.
Up to :data:`MARKS` more stamps mark points inside a task's run
(``MEGAC_MARK`` in ``opcodes/profile_marks.cuh``: where the routing chain's
and the norm's single-CTA tasks spend their microseconds; a claimer's are
its first claim's); :func:`marks_summary` gives their medians per opcode.
The global timer ticks coarsely on some chips (up to 1 µs): a mark resolves
phases of microseconds, not cycles.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from megac.abi import H, Op
from megac.errors import MegacError

SYMBOL = "megakernel_profile"
#: stamps inside a task (opcodes/profile_marks.cuh kProfileMarks)
MARKS = 16
#: uint64 words of a task's record (megakernel.cuh kProfileWords)
WORDS = 4 + MARKS
#: what each opcode's marks stand for (the points MEGAC_MARK stands at)
_GEMM_MARKS = ("activations staged", "first stage landed", "stages consumed", "partials reduced")
#: stamps 8-11 of a claim's first tile (mk_core.cuh claim_loop, ops_gemm.cuh, gemm_tc.cuh
#: stage_x_prime): the hand-off from the claim to its first weight copy; 7 stays the routed
#: claimer's records
_HANDOFF_MARKS = ("claim handed to the CTA", "X load returned", "ring stages issued", "weight span known")
#: stamp 7 of a GEMM tile on the tensor cores (gemm_tc.cuh tile_bulk): its walk set up, its refills
#: issued, before its first stage's wait (a routed claimer's 7 comes first: its records)
_WALK_MARK = "walk set up"
#: stamps 12-15 (gemm_tc.cuh): thread 0 inside prime() (the call made, its walk built, its stages
#: issued) and inside tile_bulk (the call made)
_PRIME_MARKS = ("prime: call made", "prime: walk built", "prime: stages issued", "tile: call made")
_CLAIM_MARKS = ("head atomic and record", "claim wait", *_GEMM_MARKS, "tile done", _WALK_MARK, *_HANDOFF_MARKS,
                *_PRIME_MARKS)
#: an attention split on the tensor cores (attn_mma.cuh), stamps 3-5
_ATTN_MARKS = ("", "first chunk landed", "keys consumed", "merged and written")
#: and its first chunk's way, stamps 12-15
_SPLIT_MARKS = ("split: entered", "split: page table read", "split: first chunks issued", "split: Q loaded")
MARK_NAMES = {
    "ROUTER_TOPK": ("partials summed", "logits ranked", "weights stored"),
    "ROUTE_FINALIZE": ("partials summed", "logits ranked", "weights stored", "slots written"),
    "ADD_RMSNORM": ("loads and adds", "1/rms known"),
    # a claimer's first claim; its tile's GEMM stamps 2-5 (the tensor-core tile over tiled weights)
    # routed claims (ops_moe.cuh): 0 and 1 are the ranking's (router partials summed, rows
    # ranked), 7 the records derived, before the first tile's stamps
    "MOE_UPGATE_DRAIN": ("head atomic and record / routed: partials summed", "claim wait / routed: rows ranked",
                         *_GEMM_MARKS, "tile done", "routed: records derived", *_HANDOFF_MARKS, *_PRIME_MARKS),
    "MOE_DOWN_DRAIN": _CLAIM_MARKS,
    "ATTN_DRAIN": (*_CLAIM_MARKS[:2], *_ATTN_MARKS, "tile done", "", "claim handed to the CTA", "", "", "",
                   *_SPLIT_MARKS),
    "ATTN_DECODE": ("", "", *_ATTN_MARKS, "", "", "", "", "", "", *_SPLIT_MARKS),
    # a static GEMM task's tile (stamps 2-5; a folding QKV tile 0 too, and with MEGAC_FOLD_MARKS the
    # fold's steps 8, 6, 9, 11: norm.cuh)
    **{op: ("fold: loads and adds", "", *_GEMM_MARKS, "fold: slots out", _WALK_MARK, "fold entered",
            "fold: planes summed", "", "fold: slots shared", *_PRIME_MARKS)
       for op in ("QKV_PROJ", "FFN_UPGATE_ACT", "FFN_DOWN", "ROUTER_GEMM", "LM_HEAD")},
    # a merging O-projection tile (ops_gemm.cuh gemm): its stages issued, then its input merged
    "O_PROJ": ("", "", *_GEMM_MARKS, "", _WALK_MARK, "", "", "ring stages issued", "", *_PRIME_MARKS),
}


def attach(backend):
    """A zeroed int64 [num_sms, max_tasks, WORDS] buffer on the GPU, sized for
    the backend's largest task list, and the kernel's pointer set to it."""
    import cupy as cp  # noqa: PLC0415
    import torch  # noqa: PLC0415

    sched = max(backend.schedules.schedules, key=lambda s: s.tasks.shape[1])
    buf = torch.zeros((sched.num_sms, sched.tasks.shape[1], WORDS), dtype=torch.int64, device=backend.dev)
    try:
        sym = backend.module.get_global(SYMBOL)
    except Exception as err:  # noqa: BLE001 -- cupy raises its own driver error types
        raise MegacError(f"this megakernel was built without -DMEGAC_PROFILE=1 (no {SYMBOL}: {err})") from None
    ptr = np.array([buf.data_ptr()], dtype=np.uint64)
    cp.cuda.runtime.memcpy(sym.ptr, ptr.ctypes.data, 8, cp.cuda.runtime.memcpyHostToDevice)
    backend.profile_buf = buf
    return buf


def read(buf, sched) -> list[dict]:
    """The records of the tasks ``sched`` ran (times in µs from the first
    task's start; ``marks_us``: the task's MEGAC_MARK stamps, None where
    not reached)."""
    # the kernel indexes by the launched schedule's own max_tasks
    n_sms, max_tasks = int(sched.num_sms), int(sched.max_tasks)
    a = buf.cpu().numpy().reshape(-1)[: n_sms * max_tasks * WORDS].reshape(n_sms, max_tasks, WORDS)
    counts = np.asarray(sched.task_counts)
    # the launch's own tasks only: a row the step did not reach keeps zeros
    rows = [(s, k) for s in range(sched.num_sms) for k in range(int(counts[s])) if a[s, k, 2] != 0]
    if not rows:
        return []
    t0 = min(int(a[s, k, 0]) for s, k in rows)
    out = []
    for s, k in rows:
        start, waited, end, word = (int(x) for x in a[s, k, :4])
        word &= (1 << 64) - 1
        marks = [(int(m) - t0) / 1e3 if int(m) else None for m in a[s, k, 4:]]
        op = word & 0xFF
        out.append({"sm": s, "task": k, "op": Op(op).name, "layer": int(sched.tasks[s, k, H.LAYER]),
                    "start_us": (start - t0) / 1e3, "waited_us": (waited - t0) / 1e3, "end_us": (end - t0) / 1e3,
                    "claims": (word >> 8) & 0xFFFFFF, "claim_wait_us": ((word >> 32) & 0xFFFFFFFF) / 1e3,
                    "marks_us": marks})
    return out


def marks_summary(recs: Iterable[dict]) -> dict:
    """Per opcode that stamps marks: for each mark, the median µs from the
    task's wait end to it (over the tasks that reached it), the median run,
    and the median run of the tasks that reached every mark (``run_all_us``:
    a claimer that claimed nothing stamps only the first few, so where most
    claim nothing the plain median run is theirs); named where
    :data:`MARK_NAMES` knows the points."""
    import statistics  # noqa: PLC0415

    per: dict = {}
    for r in recs:
        marks = r.get("marks_us") or []
        if not any(m is not None for m in marks):
            continue
        d = per.setdefault(r["op"], {"run": [], "marks": [[] for _ in range(MARKS)], "reached": []})
        d["run"].append(r["end_us"] - r["waited_us"])
        d["reached"].append(frozenset(i for i, m in enumerate(marks[:MARKS]) if m is not None))
        for i, m in enumerate(marks[:MARKS]):
            if m is not None:
                d["marks"][i].append(m - r["waited_us"])
    out = {}
    for op, d in per.items():
        names = MARK_NAMES.get(op, ())
        every = frozenset(i for i, v in enumerate(d["marks"]) if v)
        full = [t for t, got in zip(d["run"], d["reached"]) if got == every]
        out[op] = {"tasks": len(d["run"]), "run_us": round(statistics.median(d["run"]), 2),
                   "run_all_us": round(statistics.median(full), 2) if full else None,
                   "marks_us": {(names[i] if i < len(names) else f"mark {i}"): round(statistics.median(v), 2)
                                for i, v in enumerate(d["marks"]) if v}}
    return out


def format_marks(marks: dict) -> str:
    """:func:`marks_summary`'s medians as text: per opcode that
    stamps points inside its run, each point in time order, µs after the
    task's wait ended (a claimer's: its first claim's), and the step from
    the point before; where a task's own time goes before its data streams."""
    if not marks:
        return "inside the tasks: no marks in this trace (a build without MEGAC_MARK stamps)"
    lines = ["inside the tasks (median us after the task's wait ended; a claimer: its first claim)"]
    for op in sorted(marks):
        m = marks[op]
        run = f"run {m['run_us']:.2f} us" + (f", {m['run_all_us']:.2f} us where every mark was reached"
                                            if m.get("run_all_us") is not None else "")
        lines.append(f"  {op} ({m['tasks']} tasks, {run})")
        prev = 0.0
        for name, t in sorted(m["marks_us"].items(), key=lambda kv: kv[1]):
            lines.append(f"    {t:8.2f}  {t - prev:+7.2f}  {name or '(unnamed)'}")
            prev = t
    return "\n".join(lines)


def summary(recs: Iterable[dict]) -> dict:
    """Per opcode: tasks, header-wait µs, run µs (claimers: of which record
    waits), summed over SMs; and the step's span and busy fraction."""
    recs = list(recs)
    per: dict = {}
    for r in recs:
        d = per.setdefault(r["op"], {"tasks": 0, "wait_us": 0.0, "run_us": 0.0, "claim_wait_us": 0.0, "claims": 0})
        d["tasks"] += 1
        d["wait_us"] += r["waited_us"] - r["start_us"]
        d["run_us"] += r["end_us"] - r["waited_us"]
        d["claim_wait_us"] += r["claim_wait_us"]
        d["claims"] += r["claims"]
    span = max((r["end_us"] for r in recs), default=0.0)
    sms = len({r["sm"] for r in recs}) or 1
    for d in per.values():
        for k in ("wait_us", "run_us", "claim_wait_us"):
            d[k] = round(d[k], 1)
    work = sum(d["run_us"] - d["claim_wait_us"] for d in per.values())
    return {"span_us": round(span, 1), "sms": sms, "work_fraction": round(work / (span * sms), 4) if span else 0.0,
            "per_op": dict(sorted(per.items(), key=lambda kv: -kv[1]["run_us"]))}


def layer_table(recs: Iterable[dict], spec) -> list[dict]:
    """Where a layer's time goes, per kind of layer (``sliding/moe``,
    ``full/dense``, ...): the layer starts when the previous layer's last
    ADD_RMSNORM task ends (layer 0: the step's start); per opcode, medians
    over the layers of that kind of when its last task's wait ended
    (``ready_us``: its inputs were there) and when its last task ended
    (``done_us``), both from the layer's start, and of its slowest task's run
    (``run_us``). Rows in order of ``done_us``: the chain as it ran."""
    import statistics  # noqa: PLC0415

    recs = list(recs)
    n_layers = len(spec.layers)
    by: dict = {}
    for r in recs:
        if 0 <= r["layer"] < n_layers:
            by.setdefault(r["layer"], {}).setdefault(r["op"], []).append(r)
    starts = {0: 0.0}
    for layer in range(1, n_layers):
        norms = by.get(layer - 1, {}).get("ADD_RMSNORM")
        if norms:
            starts[layer] = max(r["end_us"] for r in norms)
    acc: dict = {}
    for layer, ops in by.items():
        if layer not in starts:
            continue
        ls = spec.layers[layer]
        kind = f"{ls.attention}/{ls.ffn}"
        t0 = starts[layer]
        for op, rs in ops.items():
            d = acc.setdefault(kind, {}).setdefault(op, {"ready": [], "done": [], "run": [], "tasks": []})
            d["ready"].append(max(r["waited_us"] for r in rs) - t0)
            d["done"].append(max(r["end_us"] for r in rs) - t0)
            d["run"].append(max(r["end_us"] - r["waited_us"] for r in rs))
            d["tasks"].append(len(rs))
    rows = []
    for kind, ops in acc.items():
        layers = max(len(d["done"]) for d in ops.values())
        for op, d in ops.items():
            rows.append({"layers": kind, "n": layers, "op": op, "tasks": int(statistics.median(d["tasks"])),
                         "ready_us": round(statistics.median(d["ready"]), 1),
                         "done_us": round(statistics.median(d["done"]), 1),
                         "run_us": round(statistics.median(d["run"]), 1)})
    return sorted(rows, key=lambda r: (-r["n"], r["layers"], r["done_us"]))


def format_layer_table(rows: list[dict]) -> str:
    """:func:`layer_table` as text: a block per kind of layer."""
    out, kind = [], None
    for r in rows:
        if r["layers"] != kind:
            kind = r["layers"]
            out.append(f"{kind} layers ({r['n']}): median us from the layer's start")
            out.append(f"  {'opcode':18s} {'tasks':>5s} {'inputs ready':>12s} {'done':>7s} {'slowest run':>11s}")
        out.append(f"  {r['op']:18s} {r['tasks']:5d} {r['ready_us']:12.1f} {r['done_us']:7.1f} {r['run_us']:11.1f}")
    return "\n".join(out)


def chrome_trace(recs: Iterable[dict], meta: dict | None = None) -> dict:
    """Chrome / Perfetto trace events: one track per SM, each task's header
    wait ("wait") and its run (the opcode's name) as separate slices;
    ``meta`` (the step's model, batch, context, order, kernel times: what
    ``megac calibrate`` needs to rebuild its schedule) goes to the trace's
    ``otherData``."""
    ev = []
    for r in recs:
        base = {"pid": 0, "tid": r["sm"], "ph": "X"}
        if r["waited_us"] > r["start_us"]:
            ev.append({**base, "name": "wait", "ts": r["start_us"], "dur": r["waited_us"] - r["start_us"],
                       "args": {"task": r["task"], "layer": r["layer"], "for": r["op"]}})
        ev.append({**base, "name": r["op"], "ts": r["waited_us"], "dur": max(r["end_us"] - r["waited_us"], 0.0),
                   "args": {"task": r["task"], "layer": r["layer"], "claims": r["claims"],
                            "claim_wait_us": r["claim_wait_us"], "marks_us": r.get("marks_us")}})
    ev += [{"pid": 0, "tid": s, "ph": "M", "name": "thread_name", "args": {"name": f"SM {s}"}}
           for s in sorted({r["sm"] for r in recs})]
    out = {"traceEvents": ev, "displayTimeUnit": "ns"}
    if meta:
        out["otherData"] = dict(meta)
    return out


def records_from_trace(trace: dict) -> list[dict]:
    """The records back from a :func:`chrome_trace` (times as written)."""
    waits: dict = {}
    runs = []
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        if e["name"] == "wait":
            waits[(e["tid"], e["args"]["task"])] = e["ts"]
        else:
            runs.append(e)
    out = []
    for e in runs:
        a = e["args"]
        s, k = e["tid"], a["task"]
        out.append({"sm": s, "task": k, "op": e["name"], "layer": a["layer"],
                    "start_us": waits.get((s, k), e["ts"]), "waited_us": e["ts"], "end_us": e["ts"] + e["dur"],
                    "claims": a["claims"], "claim_wait_us": a["claim_wait_us"],
                    "marks_us": a.get("marks_us") or [None] * MARKS})
    return sorted(out, key=lambda r: (r["sm"], r["task"]))


def step_tokens(rows, i: int) -> list[int]:
    """The token each row decodes in the ``i``-th timed or profiled step:
    a different one per row. Why: with one token for every row (as the
    profiled step had until the fourteenth session) a random-weight model
    routes every row to the same experts, so a batch-8 step moved ~9
    experts' bytes a layer instead of ~50 and its trace (6.1 ms on the H200
    at 8K) was not the step `megac bench` times (9.7 ms)."""
    return [(7 * i + 13 * j + 1) % 1000 for j in range(len(rows))]


def profile_step(backend, kv, batch: int, context: int, *, warmup: int = 5, defines: dict | None = None) -> dict:
    """One step of ``batch`` rows at ``context`` tokens on a
    ``-DMEGAC_PROFILE=1`` build of ``backend``'s megakernel (built here with
    nvcc, cached; ``defines``: more switches of that build, a device-code
    variant's), then the backend's own build back: ``records`` (see
    :func:`read`), ``kernel_ms`` of the plain build and ``profiled_ms`` of
    the instrumented one (medians over ``warmup`` steps each: the
    instrumentation's overhead)."""
    import statistics  # noqa: PLC0415

    from megac.codegen.megakernel import SOURCE  # noqa: PLC0415
    from megac.decode_bench import rows_at  # noqa: PLC0415
    from megac.gpu.build import build_cubin  # noqa: PLC0415
    from megac.resources import opcodes_dir  # noqa: PLC0415

    art = backend.artifact_dir
    plain_cubin = backend.cubin
    instrumented = build_cubin(art / SOURCE, include_dirs=[opcodes_dir(), art], defines={**(defines or {}), "MEGAC_PROFILE": 1})
    rows = rows_at(kv, batch, context)

    def median_ms() -> float:
        backend.kernel_ms.clear()
        for i in range(warmup):
            for r in rows:
                kv.append_slot(r)
            backend.decode(rows, step_tokens(rows, i))
        return statistics.median(backend.kernel_ms)

    try:
        plain = median_ms()
        backend.use_cubin(instrumented)
        buf = attach(backend)
        profiled = median_ms()
        for r in rows:
            kv.append_slot(r)
        # the profiled step's own schedule: after the warm-up steps a step at a bucket's
        # edge (1024 tokens) runs the next bucket's (reading its records with the first
        # step's schedule dropped and mislabelled tasks)
        sched = backend.schedules.for_rows(kv, rows)
        buf.zero_()
        backend.decode(rows, step_tokens(rows, warmup))
        recs = read(buf, sched)
    finally:
        backend.use_cubin(plain_cubin)
        for r in rows:
            kv.free_row(r)
    # the schedule of the rows' context bucket ran (a step at 1024 tokens plus the warm-up
    # steps runs the 2048 bucket's): megac calibrate rebuilds that one
    return {"records": recs, "kernel_ms": plain, "profiled_ms": profiled,
            "schedule_context": int(sched.geometry.context)}


def trace_meta(got: dict, *, model: str, spec, batch: int, context: int, order, device: str) -> dict:
    """A profiled step's ``chrome_trace`` meta from :func:`profile_step`'s
    result ``got``: what ``megac calibrate`` / ``megac trace`` need to
    rebuild the schedule that ran (model, batch, context, order, the context
    bucket it compiled for, the tile settings, so a later change of default
    does not rebuild another schedule: the order file's waves too) and the
    kernel times."""
    from megac.geometry import tiles_of
    from megac.passes.order import order_doc

    return {"model": model, "batch": batch, "context": context, "order": str(order),
            "order_doc": order_doc(str(order)),
            "schedule_context": got.get("schedule_context"), "tiles": tiles_of(spec),
            "kernel_ms": got["kernel_ms"], "profiled_ms": got["profiled_ms"], "device": device}


__all__ = ["MARKS", "MARK_NAMES", "SYMBOL", "WORDS", "attach", "chrome_trace", "format_layer_table", "format_marks",
           "layer_table", "marks_summary", "profile_step", "read", "records_from_trace", "step_tokens", "summary", "trace_meta"]

"""Decode-only throughput of one backend (``megac bench``).

::

    rows = run(engine, cases=[(1, 8192), (8, 8192)], steps=30, warmup=5)
    print(table(rows)); json.dumps(rows)

Prefill is skipped: each case's rows are filled with N(0, 0.01) noise KV up
to the context (a row's K/V bits do not change the bytes a step moves), then
``steps`` decode steps are timed after ``warmup`` steps; medians are
reported. Per case:

* ``kernel_ms``: the backend's own time per step where it keeps one (the
  CUDA backends: CUDA events around the launch, the seed included where the
  step graph holds it), else the step's;
* ``step_ms``: the time between consecutive steps' tokens reaching the host
  in greedy decoding where each step's tokens feed the next
  (:func:`megac.runtime.backend.run_greedy`: host words, seed, launch,
  sampling on the device, the token ids back; the megakernel pipelines it,
  queuing step i+1 before the host reads step i's tokens), and the host's
  share (``step_ms - kernel_ms``, what the kernel does not hide);
* ``bytes``: what the step must move (:mod:`megac.sol_bytes`: the weights
  it touches -- the expected distinct experts at that batch, under uniform
  routing or the per-expert routing chances given as ``expert_probs``
  (``megac.routing_skew``) -- plus the KV it reads; ``weight_bytes`` and
  ``kv_bytes`` apart), so ``TB/s = bytes / kernel time`` and the
  percentages of the streaming ceiling (measured in the same run where
  there is a GPU) and of the datasheet 4.8 TB/s;
* ``model_bytes``: the cost model's bytes for the schedule that ran, which
  add activations and partials (kept for reference; before the fortieth
  session these were ``bytes``);
* ``predicted_ms``: the cost model's step, calibrated when a calibration
  is given (``megac.calibration``).

``megac bench`` adds each row's ``order`` and ``routing``; :func:`table`
shows them when they vary (order) or differ from uniform (routing), and
:func:`ranking` lists the orders of each case fastest first.
"""

from __future__ import annotations

import statistics
from typing import Callable, Sequence

from megac import sol_bytes
from megac.errors import MegacError

DATASHEET_BPS = 4.8e12


def fill_kv_noise(kv, seed: int = 0) -> None:
    """N(0, 0.01) into both pools (what decode reads without a prefill)."""
    import torch

    g = torch.Generator(device=kv.k_pool.device).manual_seed(seed)
    for pool in (kv.k_pool, kv.v_pool):
        pool.normal_(0.0, 0.01, generator=g)


#: tokens rows_at reserves at a time (prefill-sized pieces)
FILL_PIECE = 512


def pool_blocks(spec, rows: int, longest: int) -> int:
    """KV blocks ``rows`` rows need to reach ``longest`` tokens through
    rows_at and decode steps: each row's steady state plus, per sliding
    layer, what one fill piece maps before the window lets it go (a window
    shorter than a piece holds the whole piece for a moment)."""
    from megac.kv.paged import peak_blocks_for_tokens

    bs = spec.target.kv_block_size
    piece = -(-min(FILL_PIECE, longest) // bs) + 1
    sliding = sum(1 for layer in spec.layers if layer.window is not None)
    return rows * (peak_blocks_for_tokens(spec, longest) + sliding * piece)


def timed_context(context: int, warmup: int, steps: int) -> int:
    """The context of the median timed step of a case at ``context`` (rows
    filled to ``context - 1``; each of ``warmup + steps`` steps adds a
    token): the schedule bucket that step runs is the one the case times."""
    return context + warmup + steps // 2


def rows_at(kv, batch: int, context: int) -> list[int]:
    """``batch`` fresh KV rows holding ``context - 1`` tokens (the step adds the last)."""
    rows = [kv.allocate_row() for _ in range(batch)]
    for r in rows:  # in prefill-sized pieces: sliding layers release blocks as they go
        for a in range(0, context - 1, FILL_PIECE):
            n = min(FILL_PIECE, context - 1 - a)
            kv.reserve(r, n)
            kv.advance(r, n)
    return rows


def measure_ceiling(device: str, nbytes: int = 4 << 30, repeats: int = 20, warmup_s: float = 1.0):
    """The streaming-read ceiling of ``device`` (:class:`megac.gpu.ceiling.Ceiling`:
    the fastest of the read kernel's launch shapes and torch's sum over
    ``nbytes`` of random data, medians of ``repeats`` passes after
    ``warmup_s`` s of untimed ones), or None on the CPU (no meaningful
    ceiling for the bytes the VM moves)."""
    if device != "cuda":
        return None
    from megac.gpu import ceiling

    return ceiling.measure(nbytes=nbytes, repeats=repeats, warmup_s=warmup_s)


def step_bytes(schedule, context: int, calibration=None, expert_probs=None) -> tuple[float, float]:
    """(bytes a step of ``schedule`` moves with rows at ``context`` tokens,
    predicted µs) by the cost model; ``expert_probs``: each expert's chance
    to be in a row's top-k (None: uniform routing)."""
    from megac.costmodel import CostParams, simulate

    params = calibration.params(context=context) if calibration is not None else CostParams(context=context)
    params.expert_probs = None if expert_probs is None else tuple(float(p) for p in expert_probs)
    sim = simulate(schedule, params)
    return sim.total_bytes, sim.step_us


def run(engine, cases: Sequence[tuple[int, int]], *, steps: int = 30, warmup: int = 5, ceiling: float | None = None,
        calibration=None, expert_probs=None, progress: Callable[[str, int, int], None] | None = None) -> list[dict]:
    """One row per (batch, context) case (see the module docstring);
    ``expert_probs`` as in :func:`step_bytes`."""
    from megac.runtime.backend import run_greedy

    be, kv = engine.backend, engine.kv
    out = []
    for ci, (batch, context) in enumerate(cases):
        if batch > be.max_batch_size:
            raise MegacError(f"bench: batch {batch} exceeds the backend's {be.max_batch_size}")
        rows = rows_at(kv, batch, context)
        try:
            # the schedule the timed steps run: step i decodes at context + i tokens, so a
            # case at a bucket's edge (1024) times the next bucket's schedule (2048's)
            sched = be.schedules.pick(batch, timed_context(context, warmup, steps)) if hasattr(be, "schedules") else None
            own = getattr(be, "kernel_ms", None)
            if own is not None:
                own.clear()

            def tick(i, _tokens=None, ci=ci, batch=batch, context=context):
                if progress is not None:
                    progress(f"batch {batch}, context {context}", ci * (warmup + steps) + i,
                             len(cases) * (warmup + steps))

            # the engine's steady decoding: each step's tokens feed the next
            # (pipelined on the megakernel: the host part hides behind the kernel)
            _tokens, wall = run_greedy(be, rows, [1 + r for r in rows], warmup + steps, tick)
        finally:
            for r in rows:
                kv.free_row(r)
        step_ms = statistics.median(wall[warmup:])
        kernel_ms = statistics.median(own[warmup:]) if own else step_ms
        row = {"batch": batch, "context": context, "steps": steps, "kernel_ms": round(kernel_ms, 4),
               "step_ms": round(step_ms, 4), "tok_s": round(batch * 1e3 / kernel_ms, 1),
               "tok_s_step": round(batch * 1e3 / step_ms, 1),
               "host_fraction": round(max(step_ms - kernel_ms, 0.0) / step_ms, 4)}
        spec = getattr(engine, "spec", None)
        if spec is not None:
            must = sol_bytes.step_bytes(spec, batch, context, expert_probs)
            tbs = must.total / (kernel_ms * 1e-3)
            row.update(bytes=int(must.total), weight_bytes=int(must.weights), kv_bytes=int(must.kv),
                       tb_s=round(tbs / 1e12, 3), pct_datasheet=round(100 * tbs / DATASHEET_BPS, 1))
            if ceiling:
                row.update(pct_ceiling=round(100 * tbs / ceiling, 1), sol_ms=round(must.total / ceiling * 1e3, 4))
        if sched is not None:
            # the cost model's bytes add activations and partials (it times them); kept for reference
            model_bytes, pred_us = step_bytes(sched, context, calibration, expert_probs)
            row.update(predicted_ms=round(pred_us / 1e3, 4), model_bytes=int(model_bytes))
        out.append(row)
    return out


def merge_engines(per_engine: list[list[dict]]) -> list[dict]:
    """One row per case from several engines' :func:`run` rows (the same
    cases in the same order): the median of their kernel and step times,
    the figures that follow from them recomputed, and every engine's kernel
    time kept (``engines_kernel_ms``). Why: an engine's step time depends on
    where its memory landed, ~+-2 % at batch 1 (perf-notes, thirty-ninth
    session), so one engine's median is one draw of that."""
    out = []
    for rows in zip(*per_engine):
        first = rows[0]
        if any((r["batch"], r["context"]) != (first["batch"], first["context"]) for r in rows):
            raise MegacError("bench: engines timed different cases")
        k = statistics.median(r["kernel_ms"] for r in rows)
        st = statistics.median(r["step_ms"] for r in rows)
        row = {**first, "kernel_ms": round(k, 4), "step_ms": round(st, 4), "tok_s": round(first["batch"] * 1e3 / k, 1),
               "tok_s_step": round(first["batch"] * 1e3 / st, 1),
               "host_fraction": round(max(st - k, 0.0) / st, 4),
               "engines_kernel_ms": [r["kernel_ms"] for r in rows]}
        if "bytes" in first:
            tbs = first["bytes"] / (k * 1e-3)
            row.update(tb_s=round(tbs / 1e12, 3), pct_datasheet=round(100 * tbs / DATASHEET_BPS, 1))
            if "sol_ms" in first:
                row["pct_ceiling"] = round(100 * first["sol_ms"] / k, 1)
        out.append(row)
    return out


def table(rows: list[dict]) -> str:
    cols = [("order", "order"), ("routing", "routing"), ("batch", "batch"), ("context", "context"),
            ("kernel_ms", "ms/step"), ("tok_s", "tok/s"), ("step_ms", "step ms"), ("host_fraction", "host %"),
            ("bytes", "GB"), ("tb_s", "TB/s"), ("pct_ceiling", "% ceiling"), ("pct_datasheet", "% 4.8 TB/s"),
            ("predicted_ms", "model ms"), ("engines_kernel_ms", "engines ms")]
    cols = [(k, h) for k, h in cols if any(k in r for r in rows)]
    # one order, or uniform routing, is said once in the run's facts, not per row
    if len({r.get("order") for r in rows}) < 2:
        cols = [(k, h) for k, h in cols if k != "order"]
    if all(r.get("routing", "uniform") == "uniform" for r in rows):
        cols = [(k, h) for k, h in cols if k != "routing"]

    def fmt(k, v):
        if v is None:
            return "-"
        if k == "bytes":
            return f"{v / 1e9:.3f}"
        if k == "host_fraction":
            return f"{100 * v:.1f}"
        if k == "engines_kernel_ms":  # the spread the median is taken over
            return f"{min(v):.4f}-{max(v):.4f} ({len(v)})"
        return str(v)

    cells = [[h for _, h in cols]] + [[fmt(k, r.get(k)) for k, _ in cols] for r in rows]
    w = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    lines = ["  ".join(c[i].rjust(w[i]) for i in range(len(cols))) for c in cells]
    lines.insert(1, "  ".join("-" * x for x in w))
    return "\n".join(lines)


def ranking(rows: list[dict]) -> str:
    """Per (batch, context), the orders fastest first (``kernel_ms``) with
    each one's time as a multiple of the fastest."""
    cases: dict[tuple[int, int], list[dict]] = {}
    for r in rows:
        cases.setdefault((r["batch"], r["context"]), []).append(r)
    lines = []
    for (batch, context), rs in cases.items():
        rs = sorted(rs, key=lambda r: r["kernel_ms"])
        best = rs[0]["kernel_ms"]
        ranked = ", ".join(f"{r['order']} {r['kernel_ms']} ms ({r['kernel_ms'] / best:.2f}x)" for r in rs)
        lines.append(f"batch {batch}, context {context}: {ranked}")
    return "\n".join(lines)


__all__ = ["DATASHEET_BPS", "FILL_PIECE", "fill_kv_noise", "measure_ceiling", "merge_engines", "pool_blocks", "ranking",
           "rows_at",
           "run", "step_bytes", "table", "timed_context"]

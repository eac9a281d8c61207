"""Calibrate the cost model from a measured step (the per-task timeline of
a ``MEGAC_PROFILE`` build, :mod:`megac.gpu.profile`).

::

    cal = fit(records, schedule, dispatch_us=0.53, handoff_us=0.52)
    sim = simulate(schedule, cal.params())        # the schedule's timeline at measured costs
    cal.save("h200-north-mini-code.json")         # megac schedule --calibration FILE

What is fitted, and from what (nothing from the step's span itself, so the
predicted span is a check of the model, not a restatement of the data):

* per opcode, µs per byte of its work: the measured run time of its tasks
  (from the end of its header wait to its end) over the bytes the model says
  the task moves (``costmodel.task_bytes`` / ``claimed_work``); for a
  claimer, per claimed task, its record waits and its own time excluded;
* per claimer opcode whose claims stream weights through the GEMM tile (the
  expert claims), the claim's time split by its stamps (``MEGAC_MARK``):
  µs per byte from its first stage landed to its last stage consumed, the
  rest a fixed part per claim (``claim_fixed_us``), so a larger or smaller
  tile is predicted at the rate its bytes stream, not at the traced claim's
  average (which charged ~5 µs of record, wait and staging per 196 KB);
* per claimer opcode, that own time (``claimer_us``): the dispatch plus the
  run time of its claimers that claimed nothing (the claim that finds the
  queue drained, which every claimer ends with);
* the per-task fixed cost (dispatch: the signal, the next task's words, the
  barriers -- what lies between one task's end and the next one's start)
  and the dependency hand-off latency: given, from the megakernel's
  fixed-cost measurement (a chain of NOP tasks on one SM, and across SMs:
  ``tests/gpu/megakernel_scale.fixed_cost``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from megac.abi import H, Op
from megac.costmodel import CostParams, simulate, task_bytes
from megac.errors import MegacError
from megac.ops import REGISTRY


@dataclass
class Calibration:
    #: opcode name -> µs per byte (its tasks', or claimed tasks', bytes)
    us_per_byte: dict[str, float]
    #: opcode name -> µs per task for opcodes that move no modelled bytes
    fixed_us_by_op: dict[str, float]
    fixed_us: float
    dependency_latency_us: float
    #: where the numbers came from (GPU, commit, model, batch, context)
    source: str = ""
    measured_step_us: float = 0.0
    notes: dict = field(default_factory=dict)
    #: claimer opcode name -> µs a claimer task costs beyond its claims (its
    #: dispatch and the claim that finds the queue drained)
    claimer_us: dict[str, float] = field(default_factory=dict)
    #: claimer opcode name -> µs each of its claims costs besides its bytes
    #: (refit_claim_stream; absent: the claim's whole time is per byte)
    claim_fixed_us: dict[str, float] = field(default_factory=dict)
    #: opcode name -> µs its tasks work before their header waits pass (a
    #: GEMM's first weight stages): the trace's start-to-waited where the
    #: inputs were there before the task started
    pre_us_by_op: dict[str, float] = field(default_factory=dict)
    #: claimer opcode name -> µs from its header waits to its first claim (a
    #: routed expert claimer ranks the rows itself)
    claimer_lead_us: dict[str, float] = field(default_factory=dict)
    #: the factor every fitted time was scaled by: the plain build's step over
    #: the instrumented one's, measured in the same run (1: times as traced)
    instrumentation_scale: float = 1.0
    #: B/s the streams of all SMs share (CostParams.shared_bandwidth; None:
    #: none). A trace's rates hold the contention of their moment, so under
    #: the limit they are refit as uncontended ones (rate_scale)
    shared_bandwidth_bps: float | None = None
    #: the factor the traced per-opcode rates were multiplied by to stand for
    #: uncontended ones under shared_bandwidth (refit_rate_scale; 1: as traced)
    rate_scale: float = 1.0
    #: how the streams share shared_bandwidth_bps (CostParams.bandwidth_sharing:
    #: "fcfs", settled as each starts, or "fair", max-min fair at each moment)
    bandwidth_sharing: str = "fcfs"

    def params(self, **overrides) -> CostParams:
        d = self.fixed_us
        # The dispatch (the task words, the barriers) comes before a task's waits: on
        # the SM's path where the inputs are there, hidden where the task waits for
        # them (charged after each run, it put ~0.7 µs on every hop of a chain: SmolLM2's
        # layers, eight hops each, came out 15 % long). So every opcode starts with it
        # (pre) and keeps after its waits only what it measured beyond it.
        fixed = {int(op): 0.0 for op in Op}
        fixed.update({int(Op[k]): max(v - d, 0.0) for k, v in self.fixed_us_by_op.items()})
        # a claim's fitted µs cover its whole turn of the claim loop (no dispatch of its own)
        fixed.update({int(Op[k]): self.claim_fixed_us.get(k, 0.0) for k in self.claimer_us})
        pre = {int(op): d for op in Op}
        pre.update({int(Op[k]): d + v for k, v in self.pre_us_by_op.items()})
        p = CostParams(fixed_us=d, dependency_latency_us=self.dependency_latency_us,
                       op_us_per_byte={int(Op[k]): v for k, v in self.us_per_byte.items()},
                       op_fixed_us=fixed,
                       claimer_us={int(Op[k]): max(v - d, 0.0) for k, v in self.claimer_us.items()},
                       op_pre_us=pre,
                       claimer_lead_us={int(Op[k]): v for k, v in self.claimer_lead_us.items()},
                       shared_bandwidth=self.shared_bandwidth_bps,
                       bandwidth_sharing=self.bandwidth_sharing)
        for k, v in overrides.items():
            setattr(p, k, v)
        return p

    def save(self, path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(asdict(self), indent=1, sort_keys=True))
        return path

    @classmethod
    def load(cls, path) -> "Calibration":
        try:
            data = json.loads(Path(path).read_text())
            for name in (list(data["us_per_byte"]) + list(data["fixed_us_by_op"]) + list(data.get("claimer_us", {}))
                         + list(data.get("claim_fixed_us", {})) + list(data.get("pre_us_by_op", {}))
                         + list(data.get("claimer_lead_us", {}))):
                Op[name]
            if data.get("bandwidth_sharing", "fcfs") not in ("fcfs", "fair"):
                raise ValueError(f"bandwidth_sharing {data['bandwidth_sharing']!r} is not fcfs or fair")
            return cls(**data)
        except FileNotFoundError:
            raise MegacError(f"calibration {path}: no such file") from None
        except (ValueError, KeyError, TypeError) as err:
            raise MegacError(f"calibration {path}: not a megac calibration ({type(err).__name__}: {err})") from None


#: calibrations that ship with megac (name -> megac/calibrations/NAME.json)
BUNDLED_DIR = Path(__file__).resolve().parent / "calibrations"


def bundled() -> list[str]:
    return sorted(p.stem for p in BUNDLED_DIR.glob("*.json"))


def bundled_for(model: str, device_name: str | None) -> str | None:
    """The bundled calibration measured on this GPU for this model
    (``h200-<model>`` on an H200), or None: the predicted column of ``megac
    bench`` is calibrated without being asked where a measurement exists."""
    if not device_name:
        return None
    for name in bundled():
        gpu, _, m = name.partition("-")
        if m == model and gpu.lower() in device_name.lower():
            return name
    return None


def resolve(name_or_path) -> Path:
    """A bundled calibration's name (``h200-north-mini-code``) or a path."""
    p = Path(name_or_path)
    if p.suffix == ".json" or p.exists():
        return p
    q = BUNDLED_DIR / f"{name_or_path}.json"
    if q.is_file():
        return q
    raise MegacError(f"calibration {name_or_path!r}: no such file and no bundled calibration of that name "
                     f"(bundled: {', '.join(bundled()) or 'none'})")


def check_records(records, schedule) -> None:
    """Every record must be the schedule's task at that (sm, slot): the
    trace belongs to this schedule."""
    counts = np.asarray(schedule.task_counts)
    for r in records:
        s, k = int(r["sm"]), int(r["task"])
        if s >= schedule.num_sms or k >= counts[s] or Op(int(schedule.tasks[s, k, H.OPCODE])).name != r["op"]:
            raise MegacError(f"calibration: record (SM {s}, task {k}, {r['op']}) is not this schedule's task "
                             "there: the trace was measured on another schedule (an order file changed since? "
                             "pass --order with the waves it ran)")


@dataclass
class TraceTiming:
    """What a trace says about the task loop itself (µs, medians)."""

    #: a task's start after the previous task's end on its SM
    dispatch_us: float | None
    #: a wait's pass after its last signaller's end, where the task waited
    handoff_us: float | None
    #: opcode name -> start to waits passed where the inputs were already there
    pre_us: dict[str, float]
    #: claimer opcode name -> waits passed to its first claim's records (routed ranking)
    lead_us: dict[str, float]
    #: samples behind each figure
    samples: dict[str, int]


def trace_timing(records, schedule) -> TraceTiming:
    """The task loop's own costs measured in one step's records: each static
    task's header waits are matched with the end stamps of the static tasks
    that signal their counters (counters a claimer queue completes, and
    dynamic targets, are left out), which splits a task's start-to-waited
    into work it does before waiting (where its inputs were there before it
    started) and the hand-off (where they arrived after)."""
    from megac.abi import DYN_FLAG  # noqa: PLC0415
    from megac.gpu.profile import MARK_NAMES  # noqa: PLC0415
    from megac.passes.program import Program, build_groups  # noqa: PLC0415
    from megac.passes.violations import Sink  # noqa: PLC0415

    p = Program.from_schedule(schedule)
    build_groups(p, Sink())
    rec = {(int(r["sm"]), int(r["task"])): r for r in records}
    queue_done = {c for g in p.groups for c, _ in g.signals}
    ends: dict[int, list[float]] = {}
    for i in range(p.n):
        r = rec.get((int(p.sm[i]), int(p.slot[i])))
        if p.sig[i] >= 0 and r is not None and p.claimer_group[i] < 0:
            ends.setdefault(int(p.sig[i]), []).append(r["end_us"])
    for v in ends.values():
        v.sort()
    before: dict[str, list[float]] = {}
    after: list[tuple[str, float, float]] = []  # (op, waited - satisfied, satisfied - start)
    for i in range(p.n):
        r = rec.get((int(p.sm[i]), int(p.slot[i])))
        if r is None or p.claimer_group[i] >= 0:
            continue
        sat, known = float("-inf"), True
        for c, t in ((int(p.w0[i]), int(p.t0[i])), (int(p.w1[i]), int(p.t1[i]))):
            if c < 0:
                continue
            ev = ends.get(c, [])
            if c in queue_done or t & DYN_FLAG or t <= 0 or len(ev) < t:
                known = False
                break
            sat = max(sat, ev[t - 1])
        if not known:
            continue
        if sat < r["start_us"]:
            before.setdefault(r["op"], []).append(r["waited_us"] - r["start_us"])
        else:
            after.append((r["op"], r["waited_us"] - sat, sat - r["start_us"]))
    pre = {op: float(np.median(v)) for op, v in before.items()}
    # a hand-off shows where the inputs came after the task's own pre-wait work
    hand = [w for op, w, late in after if late > pre.get(op, 0.0)]
    gaps = []
    by_sm: dict[int, list] = {}
    for r in records:
        by_sm.setdefault(int(r["sm"]), []).append(r)
    for rs in by_sm.values():
        rs.sort(key=lambda r: r["start_us"])
        gaps += [b["start_us"] - a["end_us"] for a, b in zip(rs, rs[1:])
                 if not REGISTRY[Op[b["op"]]].claimer and not REGISTRY[Op[a["op"]]].claimer]
    lead = {}
    for op, names in MARK_NAMES.items():
        j = next((n for n, name in enumerate(names) if "records derived" in name), None)
        if j is None:
            continue
        v = [r["marks_us"][j] - r["waited_us"] for r in records if r["op"] == op and int(r["claims"]) > 0
             and len(r.get("marks_us") or []) > j and r["marks_us"][j] is not None]
        if v:
            lead[op] = float(np.median(v))
    return TraceTiming(dispatch_us=float(np.median(gaps)) if gaps else None,
                       handoff_us=float(np.median(hand)) if hand else None, pre_us=pre, lead_us=lead,
                       samples={"dispatch": len(gaps), "handoff": len(hand),
                                **{f"pre {op}": len(v) for op, v in before.items()}})


def fit(records, schedule, *, dispatch_us: float | None = None, handoff_us: float | None = None,
        context: int | None = None, scale: float = 1.0, source: str = "") -> Calibration:
    """A :class:`Calibration` from the measured ``records`` of one step of
    ``schedule`` (see the module docstring). ``dispatch_us`` and
    ``handoff_us`` default to the trace's own (:func:`trace_timing`);
    ``context`` is the step's (default: the schedule's bucket), which sizes
    the attention tasks' bytes. ``scale`` multiplies every fitted time: the
    instrumented build's step is slower than the plain one (its stamps:
    +6 % on North Mini Code, +15 % on SmolLM2, twentieth session), and ``kernel_ms /
    profiled_ms`` of the same run (``megac bench --profile`` records both)
    makes the model predict the plain build's step, assuming the stamps
    slow every piece of work alike."""
    records = list(records)
    if not records:
        raise MegacError("calibration: no task records")
    check_records(records, schedule)
    timing = trace_timing(records, schedule)
    if dispatch_us is None:
        dispatch_us = timing.dispatch_us if timing.dispatch_us is not None else CostParams().fixed_us
    if handoff_us is None:
        handoff_us = timing.handoff_us if timing.handoff_us is not None else CostParams().dependency_latency_us
    geo = schedule.geometry
    params = CostParams(context=context)
    run: dict[str, list[float]] = {}
    nbytes: dict[str, list[float]] = {}
    claims: dict[str, list[int]] = {}
    stamps: dict[str, list] = {}
    tb = {}
    for r in records:
        s, k = int(r["sm"]), int(r["task"])
        d = REGISTRY[Op[r["op"]]]
        if d.claimer:
            run.setdefault(r["op"], []).append(r["end_us"] - r["waited_us"] - r["claim_wait_us"])
            claims.setdefault(r["op"], []).append(int(r["claims"]))
            if int(r["claims"]) > 0 and r.get("marks_us"):
                stamps.setdefault(r["op"], []).append(r["marks_us"])
        else:
            if (s, k) not in tb:
                tb[(s, k)] = float(task_bytes(schedule.tasks[s, k][None, :], geo, params)[0])
            run.setdefault(r["op"], []).append(r["end_us"] - r["waited_us"])
            nbytes.setdefault(r["op"], []).append(tb[(s, k)])
            if r.get("marks_us"):
                stamps.setdefault(r["op"], []).append(r["marks_us"])
    upb: dict[str, float] = {}
    fixed_by_op: dict[str, float] = {}
    claimer: dict[str, float] = {}
    claim_fixed: dict[str, float] = {}
    leads: dict[str, float] = {}
    notes: dict = {}
    for name, times in run.items():
        d = REGISTRY[Op[name]]
        total = float(np.sum(times))
        if d.claimer:
            n, b = d.claimed_work(geo, params)
            cl = np.asarray(claims[name])
            done = int(cl.sum())
            if done == 0 or b <= 0:
                continue
            # every claimer ends with a claim that finds the queue drained, and most
            # claim nothing else (SmolLM2: 123 of a layer's 132): that time is the
            # claimer's own; charged to the claims it made them 2.5x too long
            drained = float(np.mean(np.asarray(times)[cl == 0])) if (cl == 0).any() else 0.0
            per_claim = (total - drained * len(times)) / done
            upb[name] = per_claim / b
            # a claimer that ranks the rows before claiming (lead) pays it, claims or not
            lead = min(timing.lead_us.get(name, 0.0), drained)
            if lead > 0:
                leads[name] = lead
            claimer[name] = dispatch_us + drained - lead
            notes[name] = {"claimers": len(times), "claims": done, "us_per_claim": round(per_claim, 3),
                           "bytes_per_claim": b, "us_drained": round(drained, 3)}
            stream = _claim_stream_us(stamps.get(name, []), name)
            if stream is not None and 0.0 < stream < per_claim:
                # the stamps split the claim: its weights stream between its first stage
                # landing and its last consumed; the rest is per claim, whatever its size
                upb[name] = stream / b
                claim_fixed[name] = per_claim - stream
                notes[name]["us_streaming_per_claim"] = round(stream, 3)
        else:
            b = float(np.sum(nbytes[name]))
            per_task = total / len(times)
            notes[name] = {"tasks": len(times), "us_per_task": round(per_task, 3),
                           "bytes_per_task": b / len(times)}
            if b <= 0:
                fixed_by_op[name] = dispatch_us + per_task
                continue
            upb[name] = total / b
            stream = _claim_stream_us(stamps.get(name, []), name)
            if stream is not None and 0.0 < stream < per_task:
                # as for a claim: the span its weights (or keys) stream is per byte, the
                # rest (staging, the reduction, the merge) per task
                upb[name] = stream / (b / len(times))
                fixed_by_op[name] = dispatch_us + per_task - stream
                notes[name]["us_streaming_per_task"] = round(stream, 3)
    span = max(r["end_us"] for r in records)

    def sc(d):
        return {k: v * scale for k, v in d.items()}

    return Calibration(us_per_byte=sc(upb), fixed_us_by_op=sc(fixed_by_op), fixed_us=float(dispatch_us) * scale,
                       dependency_latency_us=float(handoff_us) * scale, source=source, measured_step_us=float(span),
                       notes=notes, claimer_us=sc(claimer), claim_fixed_us=sc(claim_fixed),
                       pre_us_by_op={k: round(v * scale, 3) for k, v in timing.pre_us.items()},
                       claimer_lead_us={k: round(v * scale, 3) for k, v in leads.items()},
                       instrumentation_scale=round(float(scale), 4))


def _claim_stream_us(marks: list, op_name: str) -> float | None:
    """Median µs a task (a claimer's first claim) spent streaming its
    weights or keys: from its first stage (chunk) landed to its last
    consumed (the GEMM tile's and the attention split's stamps,
    :data:`megac.gpu.profile.MARK_NAMES`); None where the opcode has no such
    stamps or no task reached them."""
    from megac.gpu.profile import MARK_NAMES  # noqa: PLC0415

    names = MARK_NAMES.get(op_name, ())
    i = next((names.index(n) for n in ("first stage landed", "first chunk landed") if n in names), None)
    j = next((names.index(n) for n in ("stages consumed", "keys consumed") if n in names), None)
    if i is None or j is None:
        return None
    spans = [m[j] - m[i] for m in marks if len(m) > j and m[i] is not None and m[j] is not None]
    return float(np.median(spans)) if spans else None


#: the per-SM streaming rates (GB/s) refit_claim_stream tries by default
REFIT_RATES_GBS = (10, 15, 20, 25, 30, 35, 40, 50, 60)


def refit_claim_stream(cal: Calibration, op_name: str, cases, rates_gbs=None, *, source: str = "",
                       step=None) -> tuple:
    """Split a claimer opcode's per-claim time into a fixed part and a
    streaming rate per SM from measured whole steps at several contexts.

    A trace at one context gives one claim size, so :func:`fit` charges a
    claim's whole time per byte: North Mini Code's attention claims at 8K
    (268 KB in 22 µs: 12 GB/s per SM, mostly latency) then made every claim
    at 128K cost 8x as long and the step +20-53 % too long. Here each
    candidate rate keeps the traced claim's time (fixed = time - bytes /
    rate) and the rate with the least mean squared relative error of the
    predicted steps over ``cases`` (``(schedule, context, measured kernel
    ms)``) wins. Returns (the refitted calibration, {rate: mean |error|});
    ``step`` is called after each simulated step.
    """
    if op_name not in cal.claimer_us:
        raise MegacError(f"calibration: {op_name} is not a calibrated claimer opcode")
    note = cal.notes.get(op_name) or {}
    b0 = float(note.get("bytes_per_claim", 0.0))
    if b0 <= 0:
        raise MegacError(f"calibration: no traced claim size for {op_name}")
    u0 = cal.claim_fixed_us.get(op_name, 0.0) + cal.us_per_byte[op_name] * b0
    rates = list(rates_gbs or REFIT_RATES_GBS)
    best, table = None, {}
    for rate in rates:
        k = 1e6 / (float(rate) * 1e9)
        trial = replace(cal, us_per_byte={**cal.us_per_byte, op_name: k},
                        claim_fixed_us={**cal.claim_fixed_us, op_name: max(u0 - k * b0, 0.0)})
        errs = []
        for sched, ctx, ms in cases:
            errs.append(simulate(sched, trial.params(context=ctx)).step_us / 1e3 / ms - 1.0)
            if step is not None:
                step()  # one simulated step (a progress bar's tick)
        table[rate] = float(np.mean(np.abs(errs)))
        sq = float(np.mean(np.square(errs)))
        if best is None or sq < best[0]:
            best = (sq, trial)
    out = best[1]
    out.notes = {**out.notes, op_name: {**note, "refit": source or "measured steps"}}
    return out, table


#: the rate scales refit_rate_scale tries (traced rate -> uncontended rate)
RATE_SCALES = (1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.8, 2.0)


def refit_rate_scale(cal: Calibration, cases, scales=None, *, step=None) -> tuple:
    """The traced per-opcode rates as uncontended ones, for a calibration
    with ``shared_bandwidth_bps``: every task's rate in a trace is what it
    got beside the others streaming then, so the shared limit would charge
    that contention twice. Each candidate scale multiplies every rate (µs
    per byte divided by it); the one with the least mean squared relative
    error of the predicted steps over ``cases`` (``(schedule, context,
    measured kernel ms)``) wins. Returns (the refitted calibration, {scale:
    mean |error|}); ``step`` is called after each simulated step."""
    if not cal.shared_bandwidth_bps:
        raise MegacError("calibration: a rate scale needs a shared bandwidth (--shared-bandwidth)")
    best, table = None, {}
    for a in list(scales or RATE_SCALES):
        a = float(a)
        if not a > 0:
            raise MegacError(f"calibration: rate scale {a} is not positive")
        trial = replace(cal, us_per_byte={k: v * cal.rate_scale / a for k, v in cal.us_per_byte.items()},
                        rate_scale=a)
        errs = []
        for sched, ctx, ms in cases:
            errs.append(simulate(sched, trial.params(context=ctx)).step_us / 1e3 / ms - 1.0)
            if step is not None:
                step()
        table[a] = float(np.mean(np.abs(errs)))
        sq = float(np.mean(np.square(errs)))
        if best is None or sq < best[0]:
            best = (sq, trial)
    return best[1], table


__all__ = ["BUNDLED_DIR", "RATE_SCALES", "REFIT_RATES_GBS", "Calibration", "bundled", "check_records", "fit",
           "refit_claim_stream", "refit_rate_scale", "resolve"]

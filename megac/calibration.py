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

    def params(self, **overrides) -> CostParams:
        fixed = {int(Op[k]): v for k, v in self.fixed_us_by_op.items()}
        # a claim's fitted µs cover its whole turn of the claim loop (no dispatch of its own)
        fixed.update({int(Op[k]): self.claim_fixed_us.get(k, 0.0) for k in self.claimer_us})
        p = CostParams(fixed_us=self.fixed_us, dependency_latency_us=self.dependency_latency_us,
                       op_us_per_byte={int(Op[k]): v for k, v in self.us_per_byte.items()},
                       op_fixed_us=fixed,
                       claimer_us={int(Op[k]): v for k, v in self.claimer_us.items()})
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
                         + list(data.get("claim_fixed_us", {}))):
                Op[name]
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
                             "there: the trace was measured on another schedule")


def fit(records, schedule, *, dispatch_us: float, handoff_us: float, source: str = "") -> Calibration:
    """A :class:`Calibration` from the measured ``records`` of one step of
    ``schedule`` (see the module docstring)."""
    records = list(records)
    if not records:
        raise MegacError("calibration: no task records")
    check_records(records, schedule)
    geo = schedule.geometry
    params = CostParams()
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
    upb: dict[str, float] = {}
    fixed_by_op: dict[str, float] = {}
    claimer: dict[str, float] = {}
    claim_fixed: dict[str, float] = {}
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
            claimer[name] = dispatch_us + drained
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
            if b <= 0:
                fixed_by_op[name] = dispatch_us + total / len(times)
            else:
                upb[name] = total / b
            notes[name] = {"tasks": len(times), "us_per_task": round(total / len(times), 3),
                           "bytes_per_task": b / len(times)}
    span = max(r["end_us"] for r in records)
    return Calibration(us_per_byte=upb, fixed_us_by_op=fixed_by_op, fixed_us=float(dispatch_us),
                       dependency_latency_us=float(handoff_us), source=source, measured_step_us=float(span),
                       notes=notes, claimer_us=claimer, claim_fixed_us=claim_fixed)


def _claim_stream_us(marks: list, op_name: str) -> float | None:
    """Median µs a claimer's first claim spent streaming its weights: from
    its first stage landed to its last stage consumed (the GEMM tile's
    stamps, :data:`megac.gpu.profile.MARK_NAMES`); None where the opcode has
    no such stamps or no claim reached them."""
    from megac.gpu.profile import MARK_NAMES  # noqa: PLC0415

    names = MARK_NAMES.get(op_name, ())
    if "first stage landed" not in names or "stages consumed" not in names:
        return None
    i, j = names.index("first stage landed"), names.index("stages consumed")
    spans = [m[j] - m[i] for m in marks if len(m) > j and m[i] is not None and m[j] is not None]
    return float(np.median(spans)) if spans else None


def refit_claim_stream(cal: Calibration, op_name: str, cases, rates_gbs=None, *, source: str = "") -> tuple:
    """Split a claimer opcode's per-claim time into a fixed part and a
    streaming rate per SM from measured whole steps at several contexts.

    A trace at one context gives one claim size, so :func:`fit` charges a
    claim's whole time per byte: North Mini Code's attention claims at 8K
    (268 KB in 22 µs: 12 GB/s per SM, mostly latency) then made every claim
    at 128K cost 8x as long and the step +20-53 % too long. Here each
    candidate rate keeps the traced claim's time (fixed = time - bytes /
    rate) and the rate with the least mean squared relative error of the
    predicted steps over ``cases`` (``(schedule, context, measured kernel
    ms)``) wins. Returns (the refitted calibration, {rate: mean |error|}).
    """
    if op_name not in cal.claimer_us:
        raise MegacError(f"calibration: {op_name} is not a calibrated claimer opcode")
    note = cal.notes.get(op_name) or {}
    b0 = float(note.get("bytes_per_claim", 0.0))
    if b0 <= 0:
        raise MegacError(f"calibration: no traced claim size for {op_name}")
    u0 = cal.claim_fixed_us.get(op_name, 0.0) + cal.us_per_byte[op_name] * b0
    rates = list(rates_gbs or (10, 15, 20, 25, 30, 35, 40, 50, 60))
    best, table = None, {}
    for rate in rates:
        k = 1e6 / (float(rate) * 1e9)
        trial = replace(cal, us_per_byte={**cal.us_per_byte, op_name: k},
                        claim_fixed_us={**cal.claim_fixed_us, op_name: max(u0 - k * b0, 0.0)})
        errs = [simulate(sched, trial.params(context=ctx)).step_us / 1e3 / ms - 1.0 for sched, ctx, ms in cases]
        table[rate] = float(np.mean(np.abs(errs)))
        sq = float(np.mean(np.square(errs)))
        if best is None or sq < best[0]:
            best = (sq, trial)
    out = best[1]
    out.notes = {**out.notes, op_name: {**note, "refit": source or "measured steps"}}
    return out, table


__all__ = ["BUNDLED_DIR", "Calibration", "bundled", "check_records", "fit", "refit_claim_stream", "resolve"]

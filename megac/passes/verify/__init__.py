"""Pass ``verify``: a static proof that one encoded schedule cannot deadlock or race.

It reads the ENCODED task words (``int32 [num_sms, max_tasks, 32]``), the
schedule's geometry and the access model (``megac.access``); it never looks at
the other passes' internals, so a bug there cannot hide itself here.

Checks, in the order :func:`verify` reports them (the first class with a
violation raises :class:`VerifyError`; :func:`check` returns them all):

1. ``structure`` -- valid opcodes, NOP only as padding, counter indices in
   ``[-1, num_counters)``, static targets >= 1, dynamic references inside the
   target-word layout, descriptor fields in range (ROUTE_FINALIZE's tile
   counts and count words exactly what the geometry and the claimers assume),
   every region inside its buffer's logical shape, claimers of one queue
   carrying identical words.
2. ``targets`` -- every wait target EQUALS the number of signals its counter
   receives in a step. Static tasks signal once; a claimer group signals what
   its claimed tasks signal (``access.queue_signal_count``: a dynamic count
   for attention splits and MoE down tiles, ``up_tiles`` per active expert).
   The schedule's counter table, when it states counts, must agree.
3. ``dynamic`` -- a device-written target word (ROUTE_FINALIZE) is written by
   exactly one task, and that task happens-before every reader through the
   reader's WAIT0 (the device reads TARGET1 and dynamic fields after WAIT0; a
   device word in TARGET0 is read before any wait and is always wrong).
4. ``deadlock`` -- the claimer rule (every input of a claimed task is produced
   before the first claimer of its queue on that producer's SM), then a greedy
   simulation of the in-order SM queues. Counters are monotone, so if one
   greedy run completes, every timing completes; otherwise the stuck SM heads
   are reported with the producer that never arrived.
5. ``hazards`` -- happens-before through counters ONLY (the device overlaps
   consecutive tasks of one SM, so program order orders no data). A wait means
   "every signaller of this counter is done", so W happens-before R iff W's
   signal counter is in the reflexive ancestor closure of R's wait counters.
   Every overlapping (writer, reader) pair must be ordered one way or the other
   (read-after-write / write-after-read), every overlapping pair of writers
   must be ordered, and a read that no writer precedes must be a step input.

Claimer groups (one per (queue, layer)) act as virtual tasks ("parts"): their
waits, signals and regions come from the claimer words (ABI) and the access
model; they are placed where their claimers are.
"""
from __future__ import annotations

import time

import numpy as np

from megac.passes.hb import HappensBefore, counter_closure, part_wait_sets
from megac.passes.program import Program, build_groups
from megac.passes.verify.deadlock import check_claimer_rule, report_deadlock, greedy_walk
from megac.passes.verify.dynamic import check_dynamic
from megac.passes.verify.hazards import check_hazards
from megac.passes.verify.structure import check_field_pairs, check_regions, check_structure
from megac.passes.verify.targets import check_targets
from megac.passes.violations import (CHECK_ORDER, KINDS, MAX_PER_KIND, STEP_OUTPUTS, Sink, Violation, VerifyError,
                                     VerifyReport)

NAME = "verify"

def check_program(p: Program, *, stop_early: bool = False) -> tuple[list[Violation], VerifyReport, dict[str, int]]:
    """Run the checks in CHECK_ORDER. With ``stop_early`` stop after the first
    class that found something (what :func:`verify` needs)."""
    t_all = time.perf_counter()
    out = Sink()
    rep = VerifyReport(tasks=p.n, counters=p.num_counters)

    def lap(name, t0):
        rep.check_ms[name] = round((time.perf_counter() - t0) * 1e3, 2)

    t0 = time.perf_counter()
    check_structure(p, out)
    if not out.of("structure"):
        build_groups(p, out)
    if not out.of("structure"):
        check_regions(p, out)
        check_field_pairs(p, out)
    rep.claimers = int((p.claimer_group >= 0).sum())
    rep.groups = len(p.groups)
    lap("structure", t0)
    # out-of-range indices make every later check meaningless
    if out.of("structure"):
        return _finish(out, rep, t_all)
    t0 = time.perf_counter()
    check_targets(p, out)
    lap("targets", t0)
    if stop_early and out.of("targets"):
        return _finish(out, rep, t_all)
    t0 = time.perf_counter()
    pw = part_wait_sets(p)
    cl, prow, _ = counter_closure(p, pw)
    hb = HappensBefore(p, cl, prow)
    used = np.zeros(p.num_counters, dtype=bool)
    for arr in (p.w0, p.w1, p.sig):
        used[arr[(arr >= 0) & (arr < p.num_counters)]] = True
    for g in p.groups:
        for c, _ in g.waits + g.signals:
            if 0 <= c < p.num_counters:
                used[c] = True
    rep.counters_used = int(used.sum())
    lap("closure", t0)
    t0 = time.perf_counter()
    check_dynamic(p, hb, out)
    lap("dynamic", t0)
    if stop_early and out.of("dynamic"):
        return _finish(out, rep, t_all)
    t0 = time.perf_counter()
    check_claimer_rule(p, out)
    sim = greedy_walk(p)
    rep.sim_rounds = sim.rounds
    rep.critical_path = sim.critical_path
    report_deadlock(p, sim, out)
    lap("deadlock", t0)
    if stop_early and out.of("deadlock"):
        return _finish(out, rep, t_all)
    t0 = time.perf_counter()
    rep.checked_pairs = check_hazards(p, hb, out)
    lap("hazards", t0)
    return _finish(out, rep, t_all)


def _finish(out: Sink, rep: VerifyReport, t_all: float):
    rep.elapsed_ms = round((time.perf_counter() - t_all) * 1e3, 1)
    return out.items, rep, dict(out.dropped)


def _raise_first(items: list[Violation], dropped: dict[str, int]) -> None:
    for cls in CHECK_ORDER:
        vs = [v for v in items if v.check == cls]
        if vs:
            raise VerifyError(vs, sum(n for k, n in dropped.items() if KINDS[k] == cls))


def verify_program(p: Program) -> VerifyReport:
    items, rep, dropped = check_program(p, stop_early=True)
    _raise_first(items, dropped)
    return rep


def check(schedule, *, access=None) -> list[Violation]:
    """Every violation of ``schedule`` (kept: MAX_PER_KIND per kind)."""
    items, _, _ = check_program(Program.from_schedule(schedule, access))
    return items


def verify(schedule, *, access=None) -> VerifyReport:
    """Prove ``schedule`` safe, or raise :class:`VerifyError` for the first
    check class (in CHECK_ORDER) that finds a violation."""
    return verify_program(Program.from_schedule(schedule, access))



def requires(lw) -> None:
    from megac.passes import PassError

    if getattr(lw, "tasks", None) is None or getattr(lw, "task_counts", None) is None:
        raise PassError(NAME, "needs the encoded task array (run encode first)")


def run(lw) -> str:
    p = Program(lw.tasks, lw.task_counts, len(lw.counters), lw.geo, counters=lw.counters)
    rep = verify_program(p)
    lw.scratch["verify"] = rep
    return rep.summary()


def ensures(lw) -> None:
    from megac.passes import PassError

    rep = lw.scratch.get("verify")
    if rep is None or rep.tasks != int(np.asarray(lw.task_counts).sum()):
        raise PassError(NAME, "did not verify every encoded task")



__all__ = ["CHECK_ORDER", "KINDS", "MAX_PER_KIND", "NAME", "STEP_OUTPUTS", "Program", "VerifyError", "VerifyReport",
           "Violation", "check", "check_program", "ensures", "requires", "run", "verify", "verify_program"]

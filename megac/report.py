"""What `megac schedule` shows: waves per layer kind, tasks per opcode and SM,
and the critical path, as a dict (``--json``) and as text."""

from __future__ import annotations

import numpy as np

from megac import abi


def schedule_report(sched, verify_report=None) -> dict:
    counts = np.asarray(sched.task_counts)
    kinds = sorted(set(sched.layer_kinds), key=sched.layer_kinds.index)
    report = {
        "model": sched.spec_name,
        "order": sched.order,
        "batch_size": sched.rows,
        "context": sched.context,
        "num_sms": sched.num_sms,
        "num_tasks": sched.num_tasks,
        "num_counters": sched.num_counters,
        "layers_per_kind": {k: sched.layer_kinds.count(k) for k in kinds},
        "waves": {k: [{"wave": name, "tasks": n} for name, n in sched.waves[k]] for k in sched.waves},
        "tasks_per_opcode": {
            op.name: int(sched.tasks_per_opcode.get(op.name, 0))
            for op in abi.Op
            if op != abi.Op.NOP and sched.tasks_per_opcode.get(op.name, 0)
        },
        "tasks_per_sm": [int(c) for c in counts],
        "tasks_per_sm_stats": {
            "min": int(counts.min()),
            "max": int(counts.max()),
            "mean": round(float(counts.mean()), 2),
        },
        "scratch_bytes": int(sched.plan.scratch_bytes),
    }
    if verify_report is not None:
        report["critical_path_tasks"] = int(verify_report.critical_path)
        report["verify"] = verify_report.summary()
    return report


def format_report(r: dict) -> str:
    lines = [
        f"{r['model']}  order={r['order']}  batch={r['batch_size']}  context<={r['context']}  "
        f"{r['num_tasks']} tasks on {r['num_sms']} SMs, {r['num_counters']} counters",
        "",
        "waves per layer (in order):",
    ]
    for kind, waves in r["waves"].items():
        n = r["layers_per_kind"].get(kind)
        seq = " -> ".join(f"{w['wave']}({w['tasks']})" for w in waves)
        lines.append(f"  {kind}{f' x{n}' if n else ''}: {seq}")
    lines += ["", "tasks per opcode:"]
    width = max(len(k) for k in r["tasks_per_opcode"])
    for name, n in r["tasks_per_opcode"].items():
        lines.append(f"  {name:<{width}} {n:>7}")
    s = r["tasks_per_sm_stats"]
    lines += ["", f"tasks per SM: min {s['min']}  mean {s['mean']}  max {s['max']}"]
    if "critical_path_tasks" in r:
        lines.append(f"critical path: {r['critical_path_tasks']} dependent tasks")
    lines.append(f"scratch: {r['scratch_bytes'] / 2**20:.1f} MiB")
    return "\n".join(lines)

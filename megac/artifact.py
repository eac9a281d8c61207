"""The compiled artifact: ``manifest.json`` + ``schedule.npz``.

``manifest.json`` records everything needed to run or inspect the schedules
without recompiling: the resolved spec and its hash, the ABI version and
opcode table, and per schedule key (batch size, context bucket) the counter
table, task counts, waves, the buffer plan and the sha256 of every array.
``schedule.npz`` holds the arrays, named ``<key>/tasks`` and
``<key>/task_counts``, plus ``<key>/global_order`` (the topological list the
cost model and tools use) and ``<key>/task_node`` (each global task's op
node, an index into the schedule's ``node_names`` in the manifest: the
``waves`` baseline cuts a loaded schedule into launches by it). ``megac_layout.h`` is every planned buffer's
shape and strides per key, ``megakernel.cu`` the model's generated
megakernel (``megac.codegen.megakernel``; its cubin is built by nvcc where
nvcc exists, cached by content).

:func:`load_artifact` checks the ABI version and every hash, so a stale or
edited artifact is refused with one line instead of running wrong.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import megac
from megac import abi
from megac.errors import MegacError
from megac.schedule import schedule_key

MANIFEST = "manifest.json"
ARRAYS = "schedule.npz"
#: C++ header of every buffer's shape and strides (megac.codegen.layout_header)
LAYOUT_HEADER = "megac_layout.h"
FORMAT_VERSION = 1


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _array_hash(a: np.ndarray) -> str:
    a = np.ascontiguousarray(a)
    return _sha256(f"{a.dtype.str}{a.shape}".encode() + a.tobytes())


def _jsonable(obj):
    if dataclasses.is_dataclass(obj):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _plan_json(plan) -> dict:
    return {
        "buffers": {
            name: {
                "dtype": b.dtype,
                "shape": list(b.shape),
                "nbytes": int(b.nbytes),
                "kind": b.kind,
                "lifetime": list(b.lifetime) if b.lifetime else None,
                "guards": list(b.guards),
                "reset_per_step": bool(b.reset_per_step),
            }
            for name, b in plan.buffers.items()
        },
        "weights": {name: _jsonable(w) for name, w in plan.weights.items()},
        "reset": list(plan.reset),
        "scratch_bytes": int(plan.scratch_bytes),
    }


def spec_hash(spec) -> str:
    return _sha256(json.dumps(spec.model_dump(mode="json"), sort_keys=True).encode())


def write_artifact(out_dir: Path, spec, schedules, *, order: str, pass_log=()) -> dict:
    """Write the artifact for ``schedules`` (one per batch size and bucket
    group) to ``out_dir``; returns the manifest."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise MegacError(f"{out_dir}: exists and is not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {}
    entries = []
    for s in schedules:
        key = schedule_key(s.rows, s.context)
        mine = {
            f"{key}/tasks": np.ascontiguousarray(s.tasks, dtype=np.int32),
            f"{key}/task_counts": np.ascontiguousarray(s.task_counts, dtype=np.int32),
            f"{key}/global_order": np.ascontiguousarray(s.global_order, dtype=np.int32),
            f"{key}/task_node": np.ascontiguousarray(s.task_node, dtype=np.int32),
        }
        arrays.update(mine)
        entries.append(
            {
                "key": key,
                "batch_size": s.rows,
                "context": s.context,
                "buckets": list(s.buckets),
                "num_sms": s.num_sms,
                "num_tasks": s.num_tasks,
                "max_tasks": s.max_tasks,
                "num_counters": s.num_counters,
                "tasks_per_opcode": dict(s.tasks_per_opcode),
                "tasks_per_sm": dict(s.tasks_per_sm),
                "waves": {k: [list(w) for w in v] for k, v in s.waves.items()},
                "layer_kinds": list(s.layer_kinds),
                "node_names": list(s.node_names),
                # [index, name, producer, static count or null, count word or null]
                "counters": [[c.index, c.name, c.producer, c.count, c.count_word] for c in s.counters],
                "plan": _plan_json(s.plan),
                "arrays": {name.split("/", 1)[1]: name for name in mine},
                "hashes": {name.split("/", 1)[1]: _array_hash(a) for name, a in mine.items()},
            }
        )
    npz_path = out_dir / ARRAYS
    # Stored, not deflated: the arrays are a few MB and the compile must stay
    # fast on two cores; the hashes, not the container, guard integrity.
    with zipfile.ZipFile(npz_path, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, a in arrays.items():
            with zf.open(name + ".npy", "w", force_zip64=True) as fh:
                np.lib.format.write_array(fh, a, allow_pickle=False)
    from megac.codegen.layout_header import render_layout_header
    from megac.codegen.megakernel import SOURCE as MEGAKERNEL, render_megakernel

    (out_dir / LAYOUT_HEADER).write_text(render_layout_header(spec.name, schedules))
    try:
        (out_dir / MEGAKERNEL).write_text(render_megakernel(spec, schedules))
        megakernel = None
    except MegacError as err:  # the VM still runs the artifact
        (out_dir / MEGAKERNEL).unlink(missing_ok=True)
        megakernel = err.message
    manifest = {
        "format": FORMAT_VERSION,
        "megac_version": megac.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "abi_version": abi.ABI_VERSION,
        "abi": abi.abi_summary(),
        "spec": spec.model_dump(mode="json"),
        "spec_hash": spec_hash(spec),
        "order": order,
        "target": spec.target.model_dump(mode="json"),
        "passes": [dict(p) for p in pass_log],
        "schedules": entries,
        "content_hashes": {name: _sha256((out_dir / name).read_bytes()) for name in (ARRAYS, LAYOUT_HEADER, MEGAKERNEL)
                           if (out_dir / name).is_file()},
        # why there is no megakernel.cu (a shape the device code does not take), or null
        "megakernel_unsupported": megakernel,
    }
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


@dataclass
class LoadedSchedule:
    key: str
    meta: dict
    tasks: np.ndarray
    task_counts: np.ndarray
    global_order: np.ndarray
    task_node: np.ndarray


@dataclass
class Artifact:
    path: Path
    manifest: dict
    schedules: dict[str, LoadedSchedule]

    def spec(self):
        from megac.spec.loader import spec_from_dict

        return spec_from_dict(self.manifest["spec"])

    def to_schedules(self) -> list:
        """The artifact's schedules as :class:`megac.schedule.Schedule` objects:
        the exact task words, task counts, global order, counter table and
        buffer plan (hash-checked by :func:`load_artifact`), with the geometry
        of each (batch size, context) key."""
        from megac.geometry import Geometry
        from megac.schedule import BufferPlan, BufferSpec, Counter, Schedule

        spec = self.spec()
        out = []
        for ls in self.schedules.values():
            m = ls.meta
            plan = m["plan"]
            buffers = {name: BufferSpec(name, b["dtype"], tuple(b["shape"]), int(b["nbytes"]), b["kind"],
                                        tuple(b["lifetime"]) if b["lifetime"] else None, list(b["guards"]),
                                        bool(b["reset_per_step"]))
                       for name, b in plan["buffers"].items()}
            counters = [Counter(int(c[0]), c[1], c[2], -1, c[3], c[4]) for c in m["counters"]]
            geo = Geometry.from_spec(spec, int(m["batch_size"]), int(m["context"]))
            out.append(Schedule(
                spec_name=spec.name, rows=int(m["batch_size"]), context=int(m["context"]),
                buckets=list(m["buckets"]), order=self.manifest.get("order", "?"), num_sms=int(m["num_sms"]),
                tasks=ls.tasks, task_counts=ls.task_counts, counters=counters, num_counters=int(m["num_counters"]),
                waves={k: [tuple(w) for w in v] for k, v in m["waves"].items()}, layer_kinds=list(m["layer_kinds"]),
                tasks_per_opcode=dict(m["tasks_per_opcode"]), tasks_per_sm=dict(m["tasks_per_sm"]),
                plan=BufferPlan(buffers, {}, list(plan["reset"])), geometry=geo, global_order=ls.global_order,
                task_node=ls.task_node, node_names=list(m["node_names"])))
        return out


def load_artifact(path: Path) -> Artifact:
    path = Path(path)
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise MegacError(f"{path}: not a megac artifact (no {MANIFEST})")
    try:
        manifest = json.loads(mpath.read_text())
    except json.JSONDecodeError as err:
        raise MegacError(f"{mpath}: corrupt JSON ({err.msg} at line {err.lineno})") from None
    if manifest.get("abi_version") != abi.ABI_VERSION:
        raise MegacError(
            f"{mpath}: built for ABI version {manifest.get('abi_version')}, this megac speaks {abi.ABI_VERSION}; recompile"
        )
    npz_path = path / ARRAYS
    if not npz_path.is_file():
        raise MegacError(f"{path}: {ARRAYS} is missing")
    if _sha256(npz_path.read_bytes()) != manifest["content_hashes"][ARRAYS]:
        raise MegacError(f"{npz_path}: content hash does not match the manifest; recompile")
    schedules = {}
    with np.load(npz_path, allow_pickle=False) as npz:
        for meta in manifest["schedules"]:
            if "task_node" not in meta["arrays"] or "node_names" not in meta:
                raise MegacError(f"{path}: written by an older megac (schedule {meta['key']} has no task_node); "
                                 "recompile")
            arrs = {field: npz[name] for field, name in meta["arrays"].items()}
            for field, a in arrs.items():
                if _array_hash(a) != meta["hashes"][field]:
                    raise MegacError(f"{npz_path}: array {meta['key']}/{field} does not match its hash")
            schedules[meta["key"]] = LoadedSchedule(meta["key"], meta, arrs["tasks"], arrs["task_counts"], arrs["global_order"],
                                                    arrs["task_node"])
    return Artifact(path, manifest, schedules)

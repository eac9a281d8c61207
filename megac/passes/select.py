"""Pass ``select``: tile -> opcode (``megac.abi.Op``), flags, int32 task words.

Opcode by node kind and flags come from the opcode registry
(``megac.ops``: ``OpDef.node_kinds`` / ``sliding`` / ``flags``; attention
lowers to ATTN_DECODE on sliding layers, and on full ones where the
geometry's ``full_static`` says; else to the ATTN_DRAIN claimer on full
ones). Header words are left for ``depend`` (no waits, no signal).

Ensures: every task has an opcode in ``abi.Op`` (not NOP), every
opcode-specific field set by ``tile`` exists for that opcode and every field
of the opcode is set, coordinates are in range.
"""

from __future__ import annotations

import numpy as np

from megac import abi
from megac.abi import H, Op
from megac.ops import REGISTRY, for_node
from megac.passes import Lowering, PassError

NAME = "select"


def opcode_for(kind: str, sliding: bool) -> Op:
    """The opcode of an IR node kind (``megac.ops`` registry: each opcode
    names the node kinds it lowers; attention by layer type)."""
    d = for_node(kind, sliding)
    if d is None:
        raise PassError(NAME, f"no opcode for node kind {kind!r}")
    return d.op


def requires(lw: Lowering) -> None:
    if not lw.nodes or any(not nt.fields for nt in lw.nodes):
        raise PassError(NAME, "needs tiles (run tile first)")


def run(lw: Lowering) -> str:
    geo = lw.geo
    counts: dict[str, int] = {}
    for nt in lw.nodes:
        op = opcode_for(nt.kind, bool(nt.kind == "attn" and geo.static_attn(nt.layer)))
        nt.op = op
        names = [name for name, _ in abi.OP_FIELDS[op]]
        missing = [f for f in names if f not in nt.fields]
        extra = [f for f in nt.fields if f not in names]
        if missing or extra:
            raise PassError(NAME, f"{nt.name}: {op.name} fields missing {missing}, unknown {extra}")
        w = np.zeros((nt.n, abi.TASK_WORDS), dtype=np.int64)
        w[:, H.OPCODE] = int(op)
        w[:, H.LAYER] = nt.layer
        w[:, [H.WAIT0, H.WAIT1, H.SIGNAL]] = abi.NO_COUNTER
        w[:, H.FLAGS] = REGISTRY[op].flags(nt, geo)
        for name in names:
            w[:, abi.field_index(op, name)] = nt.fields[name]
        nt.words = w.astype(np.int32)
        counts[op.name] = counts.get(op.name, 0) + nt.n
    top = ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:4])
    return f"{sum(counts.values())} task words ({top}, ...)"


def _check_ranges(nt, geo) -> str | None:
    """Coordinates inside the dimensions they index: the opcode's own tile
    checks, then what every opcode shares (rows, kv heads, dynamic fields)."""
    F = nt.fields

    def bad(cond):
        return bool(np.any(cond))

    op = nt.op
    problem = REGISTRY[op].check_tiles(F, geo)
    if problem:
        return problem
    if "ROW" in F and bad((F["ROW"] < 0) | (F["ROW"] >= geo.rows)):
        return "ROW outside the batch"
    if "KV_HEAD" in F and bad((F["KV_HEAD"] < 0) | (F["KV_HEAD"] >= geo.kv_heads)):
        return "KV_HEAD outside [0, kv_heads)"
    for fname in ("NUM_SPLITS", "QUEUE_LEN"):
        if fname in F and (op, fname) not in abi.DYN_CAPABLE and bad(F[fname] & abi.DYN_FLAG):
            return f"{fname} is dynamic but {op.name}.{fname} is not dyn-capable"
    return None


def ensures(lw: Lowering) -> None:
    valid = {int(o) for o in Op} - {int(Op.NOP)}
    for nt in lw.nodes:
        if nt.words is None or nt.words.shape != (nt.n, abi.TASK_WORDS):
            raise PassError(NAME, f"{nt.name}: no task words")
        ops = set(np.unique(nt.words[:, H.OPCODE]).tolist())
        if not ops <= valid or len(ops) != 1:
            raise PassError(NAME, f"{nt.name}: invalid opcode(s) {sorted(ops)}")
        if nt.claimer != (nt.op in abi.CLAIMERS):
            raise PassError(NAME, f"{nt.name}: claimer flag disagrees with {nt.op.name}")
        problem = _check_ranges(nt, lw.geo)
        if problem:
            raise PassError(NAME, f"{nt.name}: {problem}")


__all__ = ["NAME", "ensures", "opcode_for", "requires", "run"]

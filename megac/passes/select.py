"""Pass ``select``: tile -> opcode (``megac.abi.Op``), flags, int32 task words.

Opcode by node kind (attention: ATTN_DECODE on sliding layers, the
ATTN_DRAIN claimer on full ones). Flags: QKV_PROJ ROPE (+ROPE_HALF for
``rope_style: half``) on the Q and K heads of RoPE layers; ATTN_DECODE
SLIDING; ROUTER_TOPK SOFTMAX_ROUTER / RENORMALIZE from the MoE spec;
ADD_RMSNORM ADD_ATTN / ADD_FFN by block and node (parallel ``norm``: both;
sequential ``norm_attn``: ADD_ATTN, ``norm``: ADD_FFN) and LAST_LAYER on the
final norm. Header words are left for ``depend`` (no waits, no signal).

Ensures: every task has an opcode in ``abi.Op`` (not NOP), every
opcode-specific field set by ``tile`` exists for that opcode and every field
of the opcode is set, coordinates are in range.
"""

from __future__ import annotations

import numpy as np

from megac import abi
from megac.abi import Flag, H, Op
from megac.passes import Lowering, PassError

NAME = "select"

_OP_OF_KIND = {
    "qkv": Op.QKV_PROJ,
    "attn_combine": Op.ATTN_COMBINE,
    "o_proj": Op.O_PROJ,
    "ffn_upgate": Op.FFN_UPGATE_ACT,
    "ffn_down": Op.FFN_DOWN,
    "router": Op.ROUTER_GEMM,
    "topk": Op.ROUTER_TOPK,
    "route_finalize": Op.ROUTE_FINALIZE,
    "moe_gather": Op.MOE_GATHER,
    "moe_upgate": Op.MOE_UPGATE_DRAIN,
    "moe_down": Op.MOE_DOWN_DRAIN,
    "moe_combine": Op.MOE_COMBINE,
    "norm": Op.ADD_RMSNORM,
    "norm_attn": Op.ADD_RMSNORM,
    "lm_head": Op.LM_HEAD,
}


def opcode_for(kind: str, sliding: bool) -> Op:
    if kind == "attn":
        return Op.ATTN_DECODE if sliding else Op.ATTN_DRAIN
    try:
        return _OP_OF_KIND[kind]
    except KeyError:
        raise PassError(NAME, f"no opcode for node kind {kind!r}") from None


def requires(lw: Lowering) -> None:
    if not lw.nodes or any(not nt.fields for nt in lw.nodes):
        raise PassError(NAME, "needs tiles (run tile first)")


def _flags(nt, geo) -> np.ndarray:
    n = nt.n
    flags = np.zeros(n, dtype=np.int64)
    if nt.op == Op.QKV_PROJ and geo.rope[nt.layer]:
        f = Flag.ROPE | (Flag.ROPE_HALF if geo.rope_half else 0)
        flags[nt.fields["PART"] != abi.QkvPart.V] = int(f)
    elif nt.op == Op.ATTN_DECODE:
        flags[:] = int(Flag.SLIDING)
    elif nt.op == Op.ROUTER_TOPK:
        flags[:] = int((Flag.SOFTMAX_ROUTER if geo.router_softmax else 0)
                       | (Flag.RENORMALIZE if geo.router_renormalize else 0))
    elif nt.op == Op.ADD_RMSNORM:
        if nt.kind == "norm_attn":
            f = Flag.ADD_ATTN
        elif geo.block == "sequential":
            f = Flag.ADD_FFN
        else:
            f = Flag.ADD_ATTN | Flag.ADD_FFN
        if nt.kind == "norm" and nt.layer == geo.num_layers - 1:
            f |= Flag.LAST_LAYER
        flags[:] = int(f)
    return flags


def run(lw: Lowering) -> str:
    geo = lw.geo
    counts: dict[str, int] = {}
    for nt in lw.nodes:
        op = opcode_for(nt.kind, bool(nt.kind == "attn" and geo.sliding[nt.layer]))
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
        w[:, H.FLAGS] = _flags(nt, geo)
        for name in names:
            w[:, abi.field_index(op, name)] = nt.fields[name]
        nt.words = w.astype(np.int32)
        counts[op.name] = counts.get(op.name, 0) + nt.n
    top = ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:4])
    return f"{sum(counts.values())} task words ({top}, ...)"


def _check_ranges(nt, geo) -> str | None:
    """Coordinates inside the dimensions they index."""
    F = nt.fields

    def bad(cond):
        return bool(np.any(cond))

    op = nt.op
    if op in (Op.QKV_PROJ, Op.O_PROJ, Op.FFN_UPGATE_ACT, Op.FFN_DOWN, Op.ROUTER_GEMM, Op.LM_HEAD):
        n_dim, k_dim = {
            Op.QKV_PROJ: (geo.qkv_width, geo.hidden),
            Op.O_PROJ: (geo.hidden, geo.q_width),
            Op.FFN_UPGATE_ACT: (2 * geo.dense_width, geo.hidden),
            Op.FFN_DOWN: (geo.hidden, geo.dense_width),
            Op.ROUTER_GEMM: (geo.experts, geo.hidden),
            Op.LM_HEAD: (geo.vocab, geo.hidden),
        }[op]
        if bad(F["N0"] < 0) or bad(F["N_LEN"] < 1) or bad(F["N0"] + F["N_LEN"] > n_dim):
            return f"N range outside [0, {n_dim})"
        if bad(F["K0"] < 0) or bad(F["K_LEN"] < 1) or bad(F["K0"] + F["K_LEN"] > k_dim):
            return f"K range outside [0, {k_dim})"
        if op == Op.QKV_PROJ:
            straddle = (F["N0"] < geo.q_width) & (F["N0"] + F["N_LEN"] > geo.q_width)
            if bad(straddle):
                return "a QKV tile straddles the Q/KV boundary"
    if "ROW" in F and bad((F["ROW"] < 0) | (F["ROW"] >= geo.rows)):
        return "ROW outside the batch"
    if "KV_HEAD" in F and bad((F["KV_HEAD"] < 0) | (F["KV_HEAD"] >= geo.kv_heads)):
        return "KV_HEAD outside [0, kv_heads)"
    if op == Op.ATTN_DECODE and bad(F["SPLIT"] >= geo.max_splits):
        return "attention SPLIT >= max_splits"
    if op == Op.ADD_RMSNORM and bad((F["GAMMA"] < 0) | (F["GAMMA"] >= geo.norm_slots)):
        return "GAMMA outside the norm slots"
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

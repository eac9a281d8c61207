"""The opcode registry: one definition per opcode (:class:`OpDef`), the one
home of everything megac knows about it besides its numbers (which live in
:mod:`megac.abi`).

::

    from megac.ops import REGISTRY, opdef
    d = opdef(Op.QKV_PROJ)          # fields, flags, access, rules, CPU semantics, cost, device header

``passes.select`` picks opcodes by node kind from it, ``megac.access`` asks it
for regions, ``passes.verify`` for field rules, ``megac.costmodel`` for bytes,
the VM for semantics, and the megakernel's dispatch is generated from it.

Families: :mod:`megac.ops.gemm` (QKV_PROJ, O_PROJ, FFN_UPGATE_ACT, FFN_DOWN,
ROUTER_GEMM, LM_HEAD), :mod:`megac.ops.attention` (ATTN_DECODE, ATTN_DRAIN,
ATTN_COMBINE), :mod:`megac.ops.moe` (ROUTER_TOPK, ROUTE_FINALIZE, MOE_GATHER,
MOE_UPGATE_DRAIN, MOE_DOWN_DRAIN, MOE_COMBINE), :mod:`megac.ops.norm`
(ADD_RMSNORM).
"""

from __future__ import annotations

from megac.abi import Op
from megac.errors import BadTaskError
from megac.ops.attention import ATTENTION_OPS
from megac.ops.base import ClaimerOp, OpDef
from megac.ops.gemm import GEMM_OPS
from megac.ops.moe import MOE_OPS
from megac.ops.norm import NORM_OPS


class Nop(OpDef):
    """Padding: zero words are a valid program."""

    op = Op.NOP


REGISTRY: dict[Op, OpDef] = {d.op: d for d in (Nop(), *GEMM_OPS, *ATTENTION_OPS, *MOE_OPS, *NORM_OPS)}
assert set(REGISTRY) == set(Op), sorted(set(Op) - set(REGISTRY))

#: claimer definitions by the queue they drain
CLAIMER_OF_QUEUE = {d.queue: d for d in REGISTRY.values() if isinstance(d, ClaimerOp)}


def opdef(op) -> OpDef:
    """The definition of opcode ``op`` (an ``Op`` or its number)."""
    try:
        return REGISTRY[Op(int(op))]
    except ValueError:
        raise BadTaskError(f"unknown opcode {int(op)}") from None


def for_node(kind: str, sliding: bool) -> OpDef | None:
    """The opcode a node of ``kind`` lowers to (attention: by layer type)."""
    for d in REGISTRY.values():
        if kind in d.node_kinds and (d.sliding is None or d.sliding == sliding):
            return d
    return None


def claimer_for_queue(queue) -> ClaimerOp:
    return CLAIMER_OF_QUEUE[queue]


__all__ = ["CLAIMER_OF_QUEUE", "ClaimerOp", "OpDef", "REGISTRY", "claimer_for_queue", "for_node", "opdef"]

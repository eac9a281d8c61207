"""Routed claims' task words, derived from a compiled schedule, so the
device side (``MEGAC_ROUTED_CLAIMS``, opcodes/ops_moe.cuh) can be measured
on the H200 before the compiler emits them.

Each MOE_UPGATE_DRAIN task of a layer is rewritten to wait on the router
GEMM's counter alone (the wait its layer's ROUTER_TOPK tasks have) and to
rank the rows itself: ROUTE_SPLITS, NUM_ROWS, UP_TILES and X_SLOT from the
layer's ROUTER_TOPK, ROUTE_FINALIZE and MOE_GATHER words; no QUEUE_LEN word,
no claimed-task wait. Everything else is left as compiled: the top-k,
finalize and gather tasks still run (the down claims and the combine read
what finalize writes), so a routed build's result must equal the default
build's bit for bit, and its time is an upper bound on what the compiler's
form (those tasks gone) gives.
"""

from __future__ import annotations

import numpy as np

from megac import abi
from megac.abi import H, Op


def _f(op: Op, name: str) -> int:
    return abi.field_index(op, name)


def routed_claims_words(tasks: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """A copy of ``tasks [sms, max_tasks, 32]`` with every layer's up claimers
    routed (above)."""
    t = np.array(tasks, dtype=np.int32, copy=True)
    live = np.arange(t.shape[1])[None, :] < np.asarray(counts)[:, None]
    op, layer = t[..., H.OPCODE], t[..., H.LAYER]
    up = live & (op == Op.MOE_UPGATE_DRAIN)
    for l in np.unique(layer[up]):
        def one(o):
            m = live & (op == o) & (layer == l)
            if not m.any():
                raise ValueError(f"layer {l}: no {o.name} task to take the routed claims' fields from")
            return t[m][0]
        topk, fin, gat = one(Op.ROUTER_TOPK), one(Op.ROUTE_FINALIZE), one(Op.MOE_GATHER)
        if topk[H.WAIT1] >= 0 or abi.is_dyn(int(topk[H.TARGET0])):
            raise ValueError(f"layer {l}: ROUTER_TOPK waits on more than the router GEMM")
        m = up & (layer == l)
        w = t[m]
        w[:, H.WAIT0], w[:, H.TARGET0] = topk[H.WAIT0], topk[H.TARGET0]
        w[:, H.WAIT1], w[:, H.TARGET1] = -1, 0
        w[:, H.FLAGS] = topk[H.FLAGS]
        up_op = Op.MOE_UPGATE_DRAIN
        w[:, _f(up_op, "QUEUE_LEN")] = 0
        w[:, _f(up_op, "TASK_WAIT_BASE")] = -1
        w[:, _f(up_op, "TASK_WAIT_TARGET")] = 0
        w[:, _f(up_op, "ROUTE_SPLITS")] = topk[_f(Op.ROUTER_TOPK, "NUM_SPLITS")]
        w[:, _f(up_op, "NUM_ROWS")] = fin[_f(Op.ROUTE_FINALIZE, "NUM_ROWS")]
        w[:, _f(up_op, "UP_TILES")] = fin[_f(Op.ROUTE_FINALIZE, "UP_TILES")]
        w[:, _f(up_op, "X_SLOT")] = gat[_f(Op.MOE_GATHER, "X_SLOT")]
        t[m] = w
    return t


def set_routed(be, on: bool) -> None:
    """The backend's task lists routed (``on``) or as compiled, in place on
    the GPU (the descriptors and captured step graphs keep their pointers)."""
    import torch

    for s in be.schedules.schedules:
        words = routed_claims_words(s.tasks, s.task_counts) if on else np.asarray(s.tasks, dtype=np.int32)
        be.tasks[id(s)][0].copy_(torch.from_numpy(np.ascontiguousarray(words)).to(be.dev))
    torch.cuda.synchronize()

"""The routed slots of a MoE layer's rows, which the expert claims, the
combine and the norms that add the experts themselves all read (one helper
for ``ops.moe`` and ``ops.norm``, which imports nothing from ``ops.moe``)."""

from __future__ import annotations

import numpy as np

from megac.errors import BadTaskError
from megac.ops.base import OpDef


def routed_slots(vm, d: OpDef, layer: int, rows: np.ndarray, buffer: str) -> np.ndarray:
    """The routed slots ``[rows, K]`` of ``rows`` (ROUTE_FINALIZE's
    ``route_slot``), each inside ``buffer``'s slots."""
    slots = vm.st.np["route_slot"][layer, rows].astype(np.int64)
    if ((slots < 0) | (slots >= vm.st[buffer].shape[1])).any():
        raise BadTaskError(f"{d.name}: routed slot out of range", layer=layer, buffer="route_slot")
    return slots

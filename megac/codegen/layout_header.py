"""Render ``megac_layout.h``: every planned buffer's shape and strides, per
schedule key, from the buffer plan (``Schedule.plan``) -- so a device struct
cannot disagree with Python silently. ``megac compile`` writes it into the
artifact; a test parses it back and compares with the plan.
"""

from __future__ import annotations

import math

import jinja2

from megac import abi
from megac.buffers import strides
from megac.resources import templates_dir
from megac.schedule import schedule_key


def render_layout_header(spec_name: str, schedules) -> str:
    keys = []
    for s in schedules:
        bufs = []
        for name, b in s.plan.buffers.items():
            if b.kind == "scalar":
                continue
            shape = tuple(int(d) for d in b.shape)
            bufs.append({"name": name, "dtype": b.dtype, "kind": b.kind, "shape": list(shape),
                         "strides": list(strides(shape)), "numel": math.prod(shape) if shape else 0})
        keys.append({"name": schedule_key(s.rows, s.context), "rows": s.rows, "context": s.context,
                     "buffers": bufs})
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(templates_dir()), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True)
    return env.get_template("megac_layout.h.j2").render(spec_name=spec_name, keys=keys,
                                                         abi_version=abi.ABI_VERSION)


__all__ = ["render_layout_header"]

"""Render ``opcodes/generated/megac_abi.h`` from ``megac.abi``.

The C++ side never defines an offset by hand: it includes this header. A test
regenerates it and parses it back, so a stale or edited header fails CI.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jinja2

from megac import abi
from megac.resources import opcodes_dir, templates_dir

HEADER_PATH = opcodes_dir() / "generated" / "megac_abi.h"

# Pointers are uint64 so the struct layout is identical on host and device
# and can be filled from Python with ctypes/numpy by field name.
CTYPES = {"ptr": "uint64_t", "i32": "int32_t", "f32": "float", "u64": "uint64_t"}


def render_abi_header() -> str:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(templates_dir()),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )
    return env.get_template("megac_abi.h.j2").render(
        abi=abi.abi_summary(),
        header_words=abi.HEADER_WORDS,
        dyn_mask=abi.DYN_INDEX_MASK,
        watchdog_ns=abi.DEFAULT_WATCHDOG_NS,
        desc=abi.LAUNCH_DESC,
        ctypes=CTYPES,
    )


def write(path: Path = HEADER_PATH) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_abi_header())
    return path


if __name__ == "__main__":
    print(write(Path(sys.argv[1]) if len(sys.argv) > 1 else HEADER_PATH))

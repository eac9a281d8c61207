"""The artifact's C++ layout header states every planned buffer exactly as
the plan does: parse it back and compare, with strides checked against
numpy's own row-major strides; the header compiles as C++."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

from megac.artifact import LAYOUT_HEADER, load_artifact, write_artifact
from megac.passes.pipeline import compile_schedules
from megac.spec import load_spec


def _parse(text: str) -> dict:
    out: dict = {}
    key = None
    for line in text.splitlines():
        m = re.match(r"namespace (bs\d+_ctx\d+) \{", line)
        if m:
            key = m.group(1)
            out[key] = {}
            continue
        m = re.match(r"namespace (\w+) \{  // (\w+), (\w+)", line)
        if m and key:
            cur = out[key][m.group(1)] = {"dtype": m.group(2), "kind": m.group(3)}
            continue
        m = re.match(r"constexpr int64_t (SHAPE|STRIDE)\[\d+\] = \{(.*)\};", line)
        if m and key:
            vals = [int(v) for v in m.group(2).split(",") if v.strip()]
            cur[m.group(1).lower()] = vals
        m = re.match(r"constexpr int RANK = (\d+);", line)
        if m and key:
            cur["rank"] = int(m.group(1))
    return out


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    spec = load_spec("tiny-moe")
    res = compile_schedules(spec, order="tuned", batch_sizes=[1, 2])
    path = tmp_path_factory.mktemp("art")
    write_artifact(path, spec, res.schedules, order="tuned")
    return res, path


def test_layout_header_matches_the_plan(artifact):
    res, path = artifact
    text = (path / LAYOUT_HEADER).read_text()
    got = _parse(text)
    assert len(got) == len(res.schedules)
    for s in res.schedules:
        table = got[f"bs{s.rows}_ctx{s.context}"]
        planned = {n: b for n, b in s.plan.buffers.items() if b.kind != "scalar"}
        assert set(table) == set(planned)
        for name, b in planned.items():
            t = table[name]
            assert (t["dtype"], t["kind"], t["rank"]) == (b.dtype, b.kind, len(b.shape)), name
            if b.shape:
                assert tuple(t["shape"]) == tuple(b.shape), name
                if all(d > 0 for d in b.shape):
                    want = tuple(x // 4 for x in np.empty(b.shape, dtype=np.float32).strides)
                    assert tuple(t["stride"]) == want, name
    # the manifest hashes the header (an edited header is noticed)
    assert LAYOUT_HEADER in load_artifact(path).manifest["content_hashes"]


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler on this machine")
def test_layout_header_compiles(artifact, tmp_path):
    _, path = artifact
    src = tmp_path / "t.cpp"
    src.write_text(f'#include "{path / LAYOUT_HEADER}"\nstatic_assert(megac::layout::bs2_ctx'
                   f'{max(load_spec("tiny-moe").resolved_context_buckets)}::ROWS == 2, "rows");\nint main() {{}}\n')
    r = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr

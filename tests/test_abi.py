"""The generated C++ header agrees with megac/abi.py, field by field."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from megac import abi
from megac.codegen import abi_header


def test_header_on_disk_is_current():
    assert abi_header.HEADER_PATH.read_text() == abi_header.render_abi_header(), (
        "opcodes/generated/megac_abi.h is stale: run python -m megac.codegen.abi_header"
    )


def _parse(text: str) -> dict:
    out: dict = {"ops": {}, "header": {}, "flags": {}, "fields": {}, "records": {}, "desc": []}
    for name, val in re.findall(r"^\s*OP_(\w+) = (\d+),", text, re.M):
        out["ops"][name] = int(val)
    for name, val in re.findall(r"^\s*H_(\w+) = (\d+),", text, re.M):
        out["header"][name] = int(val)
    for name, val in re.findall(r"^\s*FLAG_(\w+) = (\d+),", text, re.M):
        out["flags"][name] = int(val)
    for ns, body in re.findall(r"namespace f_(\w+) \{(.*?)\}", text, re.S):
        out["fields"][ns] = {n: int(v) for n, v in re.findall(r"constexpr int (\w+) = (\d+);", body)}
    for ns, body in re.findall(r"namespace rec_(\w+) \{(.*?)\}", text, re.S):
        out["records"][ns] = {n: int(v) for n, v in re.findall(r"constexpr int (\w+) = (\d+);", body)}
    struct = re.search(r"struct LaunchDesc \{(.*?)\};", text, re.S).group(1)
    out["desc"] = re.findall(r"^\s*(\w+) (\w+);", struct, re.M)
    size, rec = re.search(r"struct alignas\((\d+)\) ArgmaxRecord \{(.*?)\};", text, re.S).groups()
    out["argmax"] = (int(size), re.findall(r"^\s*(\w+) (\w+);", rec, re.M))
    out["argmax_assert"] = re.search(r"static_assert\(sizeof\(ArgmaxRecord\) == (\d+),", text).group(1)
    out["dyn_flag"] = int(re.search(r"DYN_FLAG = (0x[0-9A-F]+);", text).group(1), 16)
    return out


def test_header_parses_back_to_the_python_abi():
    parsed = _parse(abi_header.render_abi_header())
    assert parsed["ops"] == {op.name: int(op) for op in abi.Op}
    assert parsed["header"] == {name: i for i, (name, _) in enumerate(abi.HEADER_FIELDS)}
    assert parsed["flags"] == {f.name: int(f) for f in abi.Flag if f != abi.Flag.NONE}
    for op in abi.Op:
        expected = {name: abi.field_index(op, name) for name, _ in abi.OP_FIELDS[op]}
        assert parsed["fields"].get(op.name.lower(), {}) == expected, op.name
    for q in abi.Queue:
        expected = {name: i for i, (name, _) in enumerate(abi.QUEUE_RECORDS[q])}
        assert parsed["records"][q.name.lower()] == expected
    assert [n for _, n in parsed["desc"]] == list(abi.DESC_NAMES)
    assert parsed["dyn_flag"] == abi.DYN_FLAG
    ctypes = abi_header.CTYPES
    assert parsed["argmax"] == (8, [(ctypes[c], n) for n, c, _ in abi.ARGMAX_RECORD])
    assert int(parsed["argmax_assert"]) == abi.ARGMAX_RECORD_BYTES == 8


def test_abi_invariants():
    assert abi.Op.NOP == 0 and len(abi.Op) == 17  # NOP + the 16 opcodes
    assert len(abi.HEADER_FIELDS) == abi.HEADER_WORDS == 8
    for op, fields in abi.OP_FIELDS.items():
        assert abi.HEADER_WORDS + len(fields) <= abi.TASK_WORDS
        names = [n for n, _ in fields]
        assert len(set(names)) == len(names), op
    for op, name in abi.DYN_CAPABLE:
        abi.field_index(op, name)
    w = abi.dyn(17)
    assert abi.is_dyn(w) and abi.dyn_index(w) == 17 and not abi.is_dyn(17) and not abi.is_dyn(-1)
    tw = abi.TargetWords(max_rows=8, num_layers=3)
    words = [tw.attn_queue_len] + [tw.attn_splits_full(r) for r in range(8)]
    words += [tw.attn_splits_sliding(r) for r in range(8)]
    words += [f(l) for l in range(3) for f in (tw.moe_up_count, tw.moe_down_count)]
    assert sorted(words) == list(range(tw.total))


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_header_compiles_and_descriptor_layout_is_packed(tmp_path):
    """The struct has no padding surprises: every field where Python thinks."""
    src = tmp_path / "probe.cpp"
    fields = "\n".join(
        f'  std::printf("%s %zu\\n", "{f.name}", offsetof(megac::LaunchDesc, {f.name}));'
        for f in abi.LAUNCH_DESC
    )
    fields += "".join(
        f'\n  std::printf("argmax.%s %zu\\n", "{name}", offsetof(megac::ArgmaxRecord, {name}));'
        for name, _, _ in abi.ARGMAX_RECORD
    )
    src.write_text(
        f'#include <cstddef>\n#include <cstdio>\n#include "{abi_header.HEADER_PATH}"\n'
        f'int main() {{\n{fields}\n  std::printf("sizeof %zu\\n", sizeof(megac::LaunchDesc));\n'
        f'  std::printf("argmax.sizeof %zu\\n", sizeof(megac::ArgmaxRecord));\n}}\n'
    )
    exe = tmp_path / "probe"
    subprocess.run(["g++", "-std=c++17", str(src), "-o", str(exe)], check=True)
    lines = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split("\n")
    got = dict(line.split() for line in lines if line)
    offsets = abi.descriptor_offsets()
    for name, off in offsets["fields"].items():
        assert int(got[name]) == off, name
    assert int(got["sizeof"]) == offsets["size"]
    # the VM's int32 words: value in word 0, index in word 1
    assert [int(got[f"argmax.{n}"]) for n, _, _ in abi.ARGMAX_RECORD] == [0, 4]
    assert int(got["argmax.sizeof"]) == abi.ARGMAX_RECORD_BYTES


def test_pack_descriptor_by_name():
    values = {f.name: (0.5 if f.ctype == "f32" else i + 1) for i, f in enumerate(abi.LAUNCH_DESC)}
    blob = abi.pack_descriptor(values)
    offs = abi.descriptor_offsets()
    assert len(blob) == offs["size"]
    import struct

    for i, f in enumerate(abi.LAUNCH_DESC):
        off = offs["fields"][f.name]
        if f.ctype == "f32":
            assert struct.unpack_from("<f", blob, off)[0] == 0.5
        elif f.ctype == "i32":
            assert struct.unpack_from("<i", blob, off)[0] == i + 1
        else:
            assert struct.unpack_from("<Q", blob, off)[0] == i + 1
    missing = dict(values)
    del missing["w_qkv"]
    with pytest.raises(ValueError, match="unassigned: w_qkv"):
        abi.pack_descriptor(missing)
    with pytest.raises(ValueError, match="unknown: w_bogus"):
        abi.pack_descriptor({**values, "w_bogus": 1})


def test_unlanded_word_is_a_nan_arithmetic_never_makes():
    """A polled combine waits while a moe_out word holds UNLANDED_F32, so a
    value a down tile can store must never have those bits: it is a NaN
    (reads as one if a bug lets it through), and not the NaN that float
    arithmetic produces on the GPU (0x7FFFFFFF) or on the host (0x7FC00000,
    numpy / torch), which a blown-up expert would store and which must land."""
    import numpy as np
    import torch

    bits = np.array([abi.UNLANDED_F32], dtype=np.uint32)
    assert np.isnan(bits.view(np.float32)[0])
    assert abi.UNLANDED_F32 not in (0x7FFFFFFF, 0x7FC00000, 0xFFC00000, 0xFFFFFFFF)
    made = torch.tensor([float("inf")]) - torch.tensor([float("inf")])  # a NaN as arithmetic makes one
    assert int(made.view(torch.int32)[0]) & 0xFFFFFFFF != abi.UNLANDED_F32
    assert abi.UNLANDED_F32 < 1 << 31  # fills an int32 view as it is (gpu/backend.py _unland)
    header = abi_header.render_abi_header()
    assert f"constexpr uint32_t UNLANDED_F32 = {abi.UNLANDED_F32}u;" in header

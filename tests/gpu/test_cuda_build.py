"""Every standalone device test kernel compiles for sm_90a without spilling.

Also CPU unit tests of the ptxas report parser and the build cache key.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megac.gpu import build
from megac.gpu.build import CudaBuildError, build_cubin, cache_key, parse_ptxas, resources

# the test kernels, and the product's standalone kernels (megac bench's read ceiling)
TEST_SOURCES = sorted((build.OPCODES / "tests").glob("*.cu")) + sorted(build.OPCODES.glob("*.cu"))

# file name -> {kernel: allowed spill-store bytes}. Keep empty: a spilling
# test kernel usually means a register array indexed at run time.
SPILL_WHITELIST: dict[str, dict[str, int]] = {}

needs_nvcc = pytest.mark.skipif(build.nvcc_path() is None, reason="nvcc is not on PATH")


@needs_nvcc
@pytest.mark.parametrize("source", TEST_SOURCES, ids=[p.name for p in TEST_SOURCES])
def test_compiles_without_spills(source: Path) -> None:
    cubin = build_cubin(source)
    assert cubin.is_file() and cubin.stat().st_size > 0
    kernels = resources(cubin)
    assert kernels, f"ptxas reported no entry functions for {source.name}"
    allowed = SPILL_WHITELIST.get(source.name, {})
    spilling = {
        name: k["spill_stores"] + k.get("noinline_spill_stores", 0)
        for name, k in kernels.items()
        if k["spill_stores"] + k.get("noinline_spill_stores", 0) > allowed.get(name, 0)
    }
    assert not spilling, f"{source.name}: spill stores {spilling}"


@needs_nvcc
def test_nvcc_error_is_raised_with_stderr(tmp_path: Path) -> None:
    bad = tmp_path / "bad.cu"
    bad.write_text('extern "C" __global__ void k() { this_is_not_defined(); }\n')
    with pytest.raises(CudaBuildError) as ei:
        build_cubin(bad, cache_dir=tmp_path / "cache")
    assert "this_is_not_defined" in str(ei.value)


@needs_nvcc
def test_cache_is_reused(tmp_path: Path) -> None:
    src = tmp_path / "k.cu"
    src.write_text('extern "C" __global__ void k(int* p) { p[threadIdx.x] = 1; }\n')
    a = build_cubin(src, cache_dir=tmp_path / "c")
    mtime = a.stat().st_mtime_ns
    assert build.find_prebuilt(src, cache_dir=tmp_path / "c") == a
    b = build_cubin(src, cache_dir=tmp_path / "c")
    assert b == a and b.stat().st_mtime_ns == mtime
    assert resources(a)["k"]["registers"] > 0


PTXAS_SAMPLE = """\
ptxas info    : 0 bytes gmem
ptxas info    : Function properties for _ZN5megac12report_errorEPiiiiiiii
    0 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
ptxas info    : Compiling entry function 'ws_16k' for 'sm_90a'
ptxas info    : Function properties for ws_16k
    16 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 36 registers, used 1 barriers, 1024 bytes smem, 416 bytes cmem[0]
ptxas info    : Compile time = 10.118 ms
ptxas info    : Compiling entry function 'plain' for 'sm_90a'
ptxas info    : Function properties for plain
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, used 0 barriers, 360 bytes cmem[0]
"""


def test_parse_ptxas() -> None:
    k = parse_ptxas(PTXAS_SAMPLE)
    assert set(k) == {"ws_16k", "plain"}
    assert k["ws_16k"]["registers"] == 36
    assert k["ws_16k"]["smem"] == 1024
    assert k["ws_16k"]["stack"] == 16
    assert k["ws_16k"]["spill_stores"] == 4
    assert k["ws_16k"]["spill_loads"] == 12
    assert k["ws_16k"]["barriers"] == 1
    assert k["plain"] == {
        "registers": 8,
        "smem": 0,
        "stack": 0,
        "spill_stores": 0,
        "spill_loads": 0,
        "barriers": 0,
        "noinline_spill_stores": 8,
    }


def test_parse_ptxas_empty() -> None:
    assert parse_ptxas("") == {}


def _tree(tmp_path: Path) -> tuple[Path, Path]:
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "a.cuh").write_text("#pragma once\n#define A 1\n")
    src = tmp_path / "k.cu"
    src.write_text('#include "a.cuh"\nextern "C" __global__ void k() {}\n')
    return src, inc


def test_cache_key_tracks_every_input(tmp_path: Path) -> None:
    src, inc = _tree(tmp_path)
    base = cache_key(src, include_dirs=(inc,))
    assert base == cache_key(src, include_dirs=(inc,)), "key must be deterministic"
    assert base != cache_key(src, include_dirs=(inc,), defines={"X": 1})
    assert cache_key(src, include_dirs=(inc,), defines={"X": 1}) != cache_key(
        src, include_dirs=(inc,), defines={"X": 2}
    )
    assert base != cache_key(src, include_dirs=(inc,), extra_flags=("-DNDEBUG",))
    (inc / "a.cuh").write_text("#pragma once\n#define A 2\n")
    after_header = cache_key(src, include_dirs=(inc,))
    assert after_header != base, "a header edit must change the key"
    src.write_text(src.read_text() + "// edit\n")
    assert cache_key(src, include_dirs=(inc,)) != after_header, "a source edit must change the key"


def test_cache_key_ignores_the_include_dirs_names(tmp_path: Path) -> None:
    """An artifact dir is named by its key, which hashes the compiler's whole
    text: the same generated source and headers under another name (an
    edit elsewhere in the package) keep the cubin's key; the headers'
    names inside the dir and the dirs' order still count."""
    src, inc = _tree(tmp_path)
    base = cache_key(src, include_dirs=(inc,))
    other = tmp_path / "nmc-0123456789abcdef"
    other.mkdir()
    (other / "a.cuh").write_text((inc / "a.cuh").read_text())
    assert cache_key(src, include_dirs=(other,)) == base
    (other / "a.cuh").rename(other / "b.cuh")
    assert cache_key(src, include_dirs=(other,)) != base
    (other / "a.cuh").write_text("#pragma once\n")
    assert cache_key(src, include_dirs=(inc, other)) != cache_key(src, include_dirs=(other, inc))


def test_cache_key_ignores_checkout_location() -> None:
    """Keys of repository files use repo-relative names only, so cubins built on
    one checkout (this machine) are found again on another (the GPU machine)."""
    if not TEST_SOURCES:
        pytest.skip("no opcodes/tests/*.cu yet")
    name = build._portable(TEST_SOURCES[0])
    assert name.startswith("repo:") and str(build.REPO) not in name
    assert build._portable(build.OPCODES) == "repo:opcodes"


def test_define_order_does_not_matter(tmp_path: Path) -> None:
    src, inc = _tree(tmp_path)
    assert cache_key(src, include_dirs=(inc,), defines={"A": 1, "B": 2}) == cache_key(
        src, include_dirs=(inc,), defines={"B": 2, "A": 1}
    )


def test_missing_nvcc_without_cache_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, inc = _tree(tmp_path)
    monkeypatch.setattr(build, "nvcc_path", lambda: None)
    with pytest.raises(CudaBuildError, match="nvcc not found"):
        build_cubin(src, include_dirs=(inc,), cache_dir=tmp_path / "c")

"""nvcc -> cubin for sm_90a, cached by content.

The cache key covers everything that can change the binary: the source text,
every header under opcodes/ (and under any extra include directory), the
defines and the flags. It deliberately leaves out absolute paths and the
machine, so a cubin built on the CPU machine is found again, under the same
key, in a carried ``build/`` on the GPU machine without running nvcc there.

Each cubin gets a sidecar ``<cubin>.json`` with the ptxas resource report
(registers, shared memory, spills per kernel), so a cached build still
answers "did it spill?".

Imports nothing from the GPU stack: usable on the CPU machine and in CI.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterable, Mapping

from megac.resources import cache_dir, opcodes_dir, repo_root

OPCODES = opcodes_dir()
REPO = OPCODES.parent
#: a checkout keeps its cubins in build/ (a carried build/ finds them on the
#: GPU machine); an installed megac in the user cache
DEFAULT_CACHE = (repo_root() / "build" / "cubin") if repo_root() else cache_dir() / "cubin"

ARCH_FLAGS: tuple[str, ...] = ("-gencode=arch=compute_90a,code=sm_90a",)
BASE_FLAGS: tuple[str, ...] = (
    "-cubin",
    *ARCH_FLAGS,
    "-O3",
    "-std=c++17",
    "-Xptxas",
    "-v",
    "-lineinfo",
)
HEADER_SUFFIXES = (".cuh", ".h", ".hpp", ".inc")
# A .cu may include another .cu (a probe build of a test kernel does), so the
# cache key covers every CUDA source under the include directories too.
KEYED_SUFFIXES = (*HEADER_SUFFIXES, ".cu")
NVCC_TIMEOUT_S = 600


class CudaBuildError(RuntimeError):
    """nvcc failed (or is missing); the message carries its stderr."""

    def __init__(self, message: str, stderr: str = "", command: list[str] | None = None):
        self.stderr = stderr
        self.command = command or []
        text = message
        if command:
            text += "\n  command: " + " ".join(command)
        if stderr:
            text += "\n" + stderr.rstrip()
        super().__init__(text)


# --------------------------------------------------------------------------
# ptxas report
# --------------------------------------------------------------------------

_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)'")
_PROPS_RE = re.compile(r"Function properties for (\S+)")
_FRAME_RE = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_USED_RE = re.compile(r"Used (\d+) registers")
_SMEM_RE = re.compile(r"(\d+) bytes smem")
_BARRIERS_RE = re.compile(r"used (\d+) barriers")


def parse_ptxas(stderr: str) -> dict[str, dict[str, int]]:
    """Per-kernel resources from ``-Xptxas -v`` output.

    Returns {kernel: {registers, smem, stack, spill_stores, spill_loads,
    barriers}}. Only entry functions are listed (non-inlined device functions
    have "Function properties" blocks but no "Compiling entry" line); their
    spills are added to ``noinline_spill_stores`` of every kernel, since a
    spilling callee costs whoever calls it.
    """
    kernels: dict[str, dict[str, int]] = {}
    props: dict[str, dict[str, int]] = {}
    current_entry: str | None = None
    current_props: str | None = None
    for line in stderr.splitlines():
        m = _ENTRY_RE.search(line)
        if m:
            current_entry = m.group(1)
            kernels.setdefault(
                current_entry,
                {
                    "registers": 0,
                    "smem": 0,
                    "stack": 0,
                    "spill_stores": 0,
                    "spill_loads": 0,
                    "barriers": 0,
                },
            )
            continue
        m = _PROPS_RE.search(line)
        if m:
            current_props = m.group(1)
            continue
        m = _FRAME_RE.search(line)
        if m and current_props is not None:
            props[current_props] = {
                "stack": int(m.group(1)),
                "spill_stores": int(m.group(2)),
                "spill_loads": int(m.group(3)),
            }
            continue
        m = _USED_RE.search(line)
        if m and current_entry is not None:
            k = kernels[current_entry]
            k["registers"] = int(m.group(1))
            s = _SMEM_RE.search(line)
            if s:
                k["smem"] = int(s.group(1))
            b = _BARRIERS_RE.search(line)
            if b:
                k["barriers"] = int(b.group(1))
    noinline_spills = sum(
        v["spill_stores"] for name, v in props.items() if name not in kernels
    )
    for name, k in kernels.items():
        p = props.get(name)
        if p:
            k.update(p)
        k["noinline_spill_stores"] = noinline_spills
    return kernels


# --------------------------------------------------------------------------
# cache key
# --------------------------------------------------------------------------


def _headers(include_dirs: Iterable[Path]) -> list[Path]:
    found: set[Path] = set()
    for d in include_dirs:
        d = Path(d)
        if not d.is_dir():
            continue
        for p in d.rglob("*"):
            if p.is_file() and p.suffix in KEYED_SUFFIXES:
                found.add(p.resolve())
    return sorted(found)


def _portable(p: Path) -> str:
    """Path text that is the same on every checkout of the repository."""
    p = Path(p).resolve()
    try:
        return "repo:" + p.relative_to(REPO).as_posix()
    except ValueError:
        return "abs:" + p.as_posix()


def _define_flags(defines: Mapping[str, object] | None) -> list[str]:
    out = []
    for k in sorted(defines or {}):
        v = defines[k]  # type: ignore[index]
        if v is None or v is True:
            out.append(f"-D{k}")
        else:
            out.append(f"-D{k}={v}")
    return out


def cache_key(
    source: Path,
    *,
    defines: Mapping[str, object] | None = None,
    include_dirs: Iterable[Path] = (OPCODES,),
    extra_flags: Iterable[str] = (),
) -> str:
    """sha256 over source text, every header, defines and flags."""
    source = Path(source)
    include_dirs = [Path(d) for d in include_dirs]
    h = hashlib.sha256()

    def feed(tag: str, data: bytes) -> None:
        h.update(tag.encode())
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)

    feed("source", source.read_bytes())
    # the include dirs by their place in the search order, each header by its name inside its dir: no
    # path text, so an artifact dir's name (its key, which hashes the whole compiler's text) leaves the
    # cubin's key alone when the generated source and headers are the same (a cubin prebuilt here is
    # found again after an edit elsewhere in the package, or under another cache dir)
    dirs = [OPCODES, *include_dirs]
    feed("include_dirs", str(len(dirs)).encode())
    for i, d in enumerate(dirs):
        for hdr in _headers([d]):
            feed(f"header:{i}:{hdr.relative_to(Path(d).resolve()).as_posix()}", hdr.read_bytes())
    feed("defines", "\n".join(_define_flags(defines)).encode())
    feed("flags", "\n".join([*BASE_FLAGS, *extra_flags]).encode())
    return h.hexdigest()


def cubin_path(
    source: Path,
    *,
    defines: Mapping[str, object] | None = None,
    include_dirs: Iterable[Path] = (OPCODES,),
    extra_flags: Iterable[str] = (),
    cache_dir: Path | None = None,
) -> Path:
    key = cache_key(source, defines=defines, include_dirs=include_dirs, extra_flags=extra_flags)
    cache = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE
    return cache / f"{Path(source).stem}-{key[:20]}.cubin"


def find_prebuilt(
    source: Path,
    *,
    defines: Mapping[str, object] | None = None,
    include_dirs: Iterable[Path] = (OPCODES,),
    extra_flags: Iterable[str] = (),
    cache_dir: Path | None = None,
) -> Path | None:
    """The cached cubin for exactly these inputs, or None."""
    p = cubin_path(
        source,
        defines=defines,
        include_dirs=include_dirs,
        extra_flags=extra_flags,
        cache_dir=cache_dir,
    )
    return p if p.is_file() and p.stat().st_size > 0 else None


def report(cubin: Path) -> dict:
    """The sidecar of a built cubin: {"kernels": parse_ptxas(...), "stderr", "command"}."""
    side = Path(str(cubin) + ".json")
    if not side.is_file():
        return {"kernels": {}, "stderr": "", "command": []}
    return json.loads(side.read_text())


def nvcc_path() -> str | None:
    return shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None
    )


def build_cubin(
    source: Path,
    *,
    defines: Mapping[str, object] | None = None,
    include_dirs: Iterable[Path] = (OPCODES,),
    extra_flags: Iterable[str] = (),
    cache_dir: Path | None = None,
    force: bool = False,
) -> Path:
    """Compile ``source`` to a cubin (sm_90a) or return the cached one.

    Raises CudaBuildError with nvcc's stderr when the compile fails, or when
    nvcc is missing and no cached cubin exists.
    """
    source = Path(source).resolve()
    include_dirs = [Path(d).resolve() for d in include_dirs]
    extra_flags = list(extra_flags)
    out = cubin_path(
        source,
        defines=defines,
        include_dirs=include_dirs,
        extra_flags=extra_flags,
        cache_dir=cache_dir,
    )
    if not force and out.is_file() and out.stat().st_size > 0:
        return out

    nvcc = nvcc_path()
    if nvcc is None:
        raise CudaBuildError(f"nvcc not found and no cached cubin for {source} at {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".cubin.tmp", dir=out.parent)
    os.close(fd)
    cmd = [
        nvcc,
        *BASE_FLAGS,
        *extra_flags,
        *_define_flags(defines),
        *[f"-I{d}" for d in include_dirs],
        str(source),
        "-o",
        tmp,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=NVCC_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        os.unlink(tmp)
        raise CudaBuildError(f"nvcc timed out after {NVCC_TIMEOUT_S} s on {source}", command=cmd) from e
    if proc.returncode != 0:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise CudaBuildError(
            f"nvcc failed on {source} (exit {proc.returncode})", stderr=proc.stderr, command=cmd
        )
    kernels = parse_ptxas(proc.stderr)
    side = {
        "source": _portable(source),
        "kernels": kernels,
        "stderr": proc.stderr,
        "command": [Path(nvcc).name, *cmd[1:-3], _portable(source)],
    }
    # Sidecar first, cubin last: a present cubin always has its report.
    Path(str(out) + ".json").write_text(json.dumps(side, indent=1))
    os.replace(tmp, out)
    return out


def resources(cubin: Path) -> dict[str, dict[str, int]]:
    """Per-kernel ptxas resources recorded when ``cubin`` was built."""
    return report(cubin).get("kernels", {})


def spills(cubin: Path) -> dict[str, int]:
    """{kernel: spill store bytes} for kernels that spill (empty when none)."""
    return {
        name: k.get("spill_stores", 0) + k.get("noinline_spill_stores", 0)
        for name, k in resources(cubin).items()
        if k.get("spill_stores", 0) + k.get("noinline_spill_stores", 0) > 0
    }


def build_main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Build cubins (sm_90a) into the cache.")
    ap.add_argument("sources", nargs="*", type=Path, help="default: opcodes/tests/*.cu")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME[=VALUE]")
    args = ap.parse_args(argv)
    defines: dict[str, object] = {}
    for d in args.defines:
        k, _, v = d.partition("=")
        defines[k] = v if v else None
    sources = args.sources or sorted((OPCODES / "tests").glob("*.cu"))
    rc = 0
    for src in sources:
        try:
            p = build_cubin(src, defines=defines or None, force=args.force)
        except CudaBuildError as e:
            print(f"FAIL {src}: {e}")
            rc = 1
            continue
        for name, k in resources(p).items():
            print(
                f"{src.name:28s} {name:36s} regs={k['registers']:3d} smem={k['smem']:6d} "
                f"stack={k['stack']:4d} spill_st={k['spill_stores']:4d} spill_ld={k['spill_loads']:4d}"
            )
        print(f"  -> {_portable(p)}")
    return rc


if __name__ == "__main__":
    raise SystemExit(build_main())

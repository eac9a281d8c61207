"""Compile or load: the artifact is the contract between ``megac compile``
and everything that runs a model.

::

    got = load_or_compile(spec, "tuned")           # Compiled(spec, schedules, path, cached)
    got = load_or_compile(spec, "tuned", artifact="out/north-mini-code")   # exactly that artifact

Every compiled artifact lands in the user's cache directory
(:func:`megac.resources.cache_dir`) under ``artifacts/<spec name>-<key>``, where the key
hashes what decides the task words: the resolved spec (model and target),
the wave order, the ABI version, the batch sizes and the compiler itself (the
text of every module that lowers, plus the wave-order files). A second
``megac serve`` or ``megac generate`` of the same model loads the artifact
instead of compiling; an artifact named with ``--artifact`` is loaded as it
is, after checking that it was built for the same model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from megac import abi
from megac.errors import MegacError
from megac.resources import cache_dir, schedules_dir, templates_dir

log = logging.getLogger("megac.runtime")

#: spec fields that decide the task words and the weights' shapes (an
#: artifact built for another value cannot serve this model)
_MODEL_FIELDS = ("block", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "q_width", "layers",
                 "rope_style", "dense_intermediate_size", "moe", "vocab_size", "tie_embeddings", "target")


def _compiler_fingerprint() -> str:
    """Hash of the compiler's own text: an edited pass, opcode definition,
    code generator or template must not be served from a stale cache entry
    (the artifact holds the generated megakernel.cu)."""
    root = Path(__file__).resolve().parents[1]
    files = sorted([*root.glob("*.py"), *(root / "passes").rglob("*.py"), *(root / "ops").glob("*.py"),
                    *(root / "spec").glob("*.py"), *(root / "codegen").rglob("*.py")])
    files += sorted(schedules_dir().glob("*.yaml")) + sorted(templates_dir().glob("*.j2"))
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def artifact_key(spec, order: str, batch_sizes) -> str:
    from megac.artifact import spec_hash

    if Path(order).suffix in (".yaml", ".yml"):
        # an order file of one's own: an edit must not be served from the cache
        order = {"file": str(order), "text": hashlib.sha256(Path(order).read_bytes()).hexdigest()}
    text = json.dumps({"spec": spec_hash(spec), "order": order, "abi": abi.ABI_VERSION,
                       "batch_sizes": sorted(int(b) for b in batch_sizes), "compiler": _compiler_fingerprint()},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class Compiled:
    spec: object
    schedules: list
    path: Path
    #: True: loaded from an existing artifact, nothing compiled
    cached: bool
    seconds: float = 0.0


def check_artifact_model(art, spec) -> None:
    """One line when the artifact was built for another model than ``spec``."""
    built = art.spec()
    a, b = built.model_dump(), spec.model_dump()
    for f in _MODEL_FIELDS:
        if a.get(f) != b.get(f):
            raise MegacError(f"artifact {art.path}: built for {built.name}, whose {f} differs from the model "
                             f"{spec.name}; recompile it for this model")


def load_or_compile(spec, order: str = "tuned", *, batch_sizes=None, artifact: str | Path | None = None,
                    progress: Callable[[str], None] | None = None) -> Compiled:
    """The schedules of ``spec``: from ``artifact`` (checked against the
    model), from the cache, or compiled now (then written to the cache)."""
    from megac.artifact import load_artifact

    t0 = time.perf_counter()
    say = progress or (lambda msg: None)
    if artifact is not None:
        art = load_artifact(Path(artifact))
        check_artifact_model(art, spec)
        say(f"loaded artifact {art.path} ({len(art.schedules)} schedules, order {art.manifest.get('order')}) "
            f"in {time.perf_counter() - t0:.1f} s")
        return Compiled(spec, art.to_schedules(), art.path, True, time.perf_counter() - t0)
    sizes = sorted(set(batch_sizes or spec.target.batch_sizes))
    path = cache_path(spec, order, sizes)
    if (path / "manifest.json").is_file():
        try:
            art = load_artifact(path)
            schedules = art.to_schedules()
        except MegacError as err:  # a damaged cache entry: compile again
            log.warning("cached artifact %s unusable (%s); recompiling", path, err)
        else:
            say(f"reusing the compiled artifact {path} (no compile; loaded in {time.perf_counter() - t0:.1f} s)")
            return Compiled(spec, schedules, path, True, time.perf_counter() - t0)
    say(f"compiling {spec.name} ({order}, batch sizes {sizes}) ...")
    res = compile_into(path, spec, order, sizes, progress=progress)
    say(f"compiled in {time.perf_counter() - t0:.1f} s; artifact cached at {path}")
    return Compiled(spec, res.schedules, path, False, time.perf_counter() - t0)


def cache_path(spec, order: str, batch_sizes=None) -> Path:
    """Where the cache keeps the artifact of ``spec`` for ``order``."""
    sizes = sorted(set(batch_sizes or spec.target.batch_sizes))
    return cache_dir() / "artifacts" / f"{spec.name}-{artifact_key(spec, order, sizes)}"


def compile_into(path: Path, spec, order: str, batch_sizes=None, *, progress=None, strict: bool = False,
                 jobs: int = 1):
    """Compile ``spec`` and write the artifact to ``path`` atomically (a
    reader never sees half an artifact); returns the compile result. A write
    that fails is a warning (the schedules are in memory) unless ``strict``.
    ``jobs``: worker processes for the schedules (``megac compile`` uses one
    per CPU; a server keeps 1, since forking a process that runs threads is
    unsafe)."""
    from megac.artifact import write_artifact
    from megac.passes.pipeline import compile_schedules

    sizes = sorted(set(batch_sizes or spec.target.batch_sizes))
    res = compile_schedules(spec, order=order, batch_sizes=sizes, progress=progress, jobs=jobs)
    path = Path(path)
    try:
        if path.exists() and not path.is_dir():
            raise MegacError(f"{path}: exists and is not a directory")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
        try:
            write_artifact(tmp, spec, res.schedules, order=order, pass_log=res.pass_log)
            if path.exists():
                shutil.rmtree(path)
            tmp.rename(path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as err:
        if strict:
            raise MegacError(f"{path}: cannot write the artifact ({err.strerror or err})") from None
        log.warning("could not cache the artifact in %s (%s)", path, err)
    res.path = path
    return res


__all__ = ["Compiled", "artifact_key", "cache_path", "check_artifact_model", "compile_into", "load_or_compile"]

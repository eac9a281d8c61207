"""Prebuild megakernel cubins for the GPU machine, two compiles at a time.

    PYTHONPATH=.:tests .venv/bin/python scripts/prebuild_builds.py SPEC[:BUILD[+BUILD]] ...

SPEC: a bundled spec name, nmc-slice (the check's North Mini Code slice),
nmc-slice-NAME (the slice under the TILES set NAME of
tests/gpu/megakernel_scale.py) or nmc-NAME (that TILES set);
BUILD: a tests/gpu/megakernel_scale.py VARIANTS name or `profile` (nothing:
the headers' default). Each line printed names the cubin (in build/cubin,
which scripts/dev_s24.sh packs and carries). Unlike gpu.megakernel_check
--prebuild it builds variants of any spec (the tiny models and the slice
that a variant's verification runs), and two at a time.
"""
import os, sys, time
from concurrent.futures import ProcessPoolExecutor

os.environ.setdefault("MEGAC_CACHE_DIR", os.getcwd() + "/.gpucache")
sys.path[:0] = [".", "tests"]


def spec_named(name):
    """A bundled spec, the check's slice (nmc-slice), or a TILES set (nmc-NAME)."""
    from gpu import megakernel_scale as scale
    from gpu.megakernel_check import slice_spec
    from megac.spec import load_spec
    if name == "nmc-slice":
        return slice_spec()
    if name.startswith("nmc-slice-"):  # the slice under a TILES set
        return slice_spec(name[len("nmc-slice-"):])
    if name.startswith("nmc-"):
        return scale.tile_spec(name[4:], scale.TILES[name[4:]])
    return load_spec(name)


def job(args):
    name, dname = args
    from gpu import megakernel_scale as scale
    spec = spec_named(name)
    defines = {}
    for d in dname.split("+") if dname else []:
        defines.update(scale.PROFILE if d == "profile" else scale.VARIANTS[d])
    t0 = time.time()
    c = scale.variant_cubin(spec, defines)
    return f"{name} [{dname or 'default'}]: {c} ({time.time() - t0:.0f} s)"


if __name__ == "__main__":
    jobs = [tuple(j.split(":")) if ":" in j else (j, "") for j in sys.argv[1:]]
    # artifacts first, serially (two processes compiling one spec's artifact would race)
    from megac.runtime.artifacts import load_or_compile
    for n in dict.fromkeys(n for n, _ in jobs):
        load_or_compile(spec_named(n), "tuned")
    with ProcessPoolExecutor(2) as ex:
        for line in ex.map(job, jobs):
            print(line, flush=True)

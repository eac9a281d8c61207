"""Where the host part of a megakernel decode step goes (issue 12's host
overhead): North Mini Code with random weights, batch B at context C, the
bench's own loop (``decode_and_sample``, greedy) under cProfile, with and
without the step graph. Prints the kernel and wall medians and the
functions that take the wall time beside the kernel.

    source scripts/gpu_env.sh && python3 -m gpu.host_profile --batch 1 --context 8192

``--backend cpu --model tiny-moe`` is a dry run of the driver on the CPU VM.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time


def profile_steps(model: str, backend: str, batch: int, context: int, steps: int) -> list[dict]:
    """The bench loop profiled without, then with the step graph (one engine);
    then the pipelined loop (decode_greedy_run) timed."""
    import torch

    from megac.decode_bench import fill_kv_noise, rows_at
    from megac.engine.build import EngineOptions, build_engine
    from megac.runtime.backend import decode_and_sample
    from megac.sampling import RowSampling, SamplingParams
    from megac.spec import load_spec
    from megac.weights import random_weights

    spec = load_spec(model)
    dev = "cuda" if backend == "cuda" else "cpu"
    w = random_weights(spec, seed=0, dtype=torch.bfloat16 if dev == "cuda" else torch.float32, device=dev)
    eng = build_engine(spec, w, EngineOptions(backend=backend, max_batch_size=max(batch, 1),
                                              max_model_len=min(context + 64 + 3 * steps + 32, spec.max_context)))
    fill_kv_noise(eng.kv)
    be, kv = eng.backend, eng.kv
    rows = rows_at(kv, batch, context)
    greedy = [RowSampling(SamplingParams(temperature=0.0), None)] * batch
    tokens = [1 + r for r in rows]

    def step():
        nonlocal tokens
        for r in rows:
            kv.append_slot(r)
        t0 = time.perf_counter()
        tokens, _ = decode_and_sample(be, rows, tokens, greedy)
        return (time.perf_counter() - t0) * 1e3

    res = []
    for graph in (False, True):
        if hasattr(be, "step_graph"):
            be.step_graph = graph
        for _ in range(5):
            step()
        own = getattr(be, "kernel_ms", None)
        if own is not None:
            own.clear()
        prof = cProfile.Profile()
        prof.enable()
        wall = [step() for _ in range(steps)]
        prof.disable()
        text = io.StringIO()
        st = pstats.Stats(prof, stream=text)
        st.sort_stats("tottime").print_stats(25)
        st.sort_stats("cumulative").print_stats(35)
        kernel = statistics.median(own) if own else None
        res.append({"model": model, "batch": batch, "context": context, "step_graph": graph,
                    "step_ms": round(statistics.median(wall), 4),
                    "kernel_ms": None if kernel is None else round(kernel, 4), "profile": text.getvalue()})
        print(f"== step graph {graph}: step {res[-1]['step_ms']} ms, kernel {res[-1]['kernel_ms']} ms", flush=True)
        print(res[-1]["profile"], flush=True)
    if hasattr(be, "decode_greedy_run"):  # the pipelined loop megac bench times
        be.step_graph = True
        be.kernel_ms.clear()
        got, walls = be.decode_greedy_run(rows, tokens, steps + 5)
        kernel = statistics.median(be.kernel_ms[5:])
        res.append({"model": model, "batch": batch, "context": context, "step_graph": True, "pipelined": True,
                    "step_ms": round(statistics.median(walls[5:]), 4), "kernel_ms": round(kernel, 4),
                    "profile": ""})
        print(f"== pipelined: step {res[-1]['step_ms']} ms, kernel {res[-1]['kernel_ms']} ms", flush=True)
    for r in rows:
        kv.free_row(r)
    del eng, be, kv, w
    if dev == "cuda":
        torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(prog="gpu.host_profile")
    ap.add_argument("--model", default="north-mini-code")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default=None, help="directory for host_profile.json")
    a = ap.parse_args()
    res = profile_steps(a.model, a.backend, a.batch, a.context, a.steps)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "host_profile.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

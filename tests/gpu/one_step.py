"""Decode steps of a model on the megakernel and nothing else, for an
external profiler (Nsight Compute / Systems) to attach to:

    ncu -k megakernel -c 1 --section WarpStateStats python3 -m gpu.one_step smollm2-135m --batch 1 --context 1024

Random weights drawn on the GPU, KV filled with N(0, 0.01) noise up to
the context, ``--steps`` decode steps (the first ones warm up).
"""

from __future__ import annotations

import argparse
import sys


def main() -> int:
    import torch

    from gpu import megakernel_scale as scale
    from megac.spec import load_spec
    from megac.weights import random_weights

    ap = argparse.ArgumentParser(prog="gpu.one_step")
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                    help="build the megakernel with these -D switches (opcodes/ MEGAC_*)")
    a = ap.parse_args()
    spec = load_spec(a.model)
    w = random_weights(spec, seed=0, dtype=torch.bfloat16, device="cuda")
    eng = scale.engine(spec, w, "cuda", max_batch_size=8, max_model_len=min(a.context + 64, spec.max_context),
                       num_kv_blocks=40000)
    if a.define:
        defines = {k: int(v) if v.lstrip("-").isdigit() else v for k, v in (d.split("=", 1) for d in a.define)}
        eng.backend.use_cubin(scale.variant_cubin(spec, defines))
    scale._noise_kv(eng)
    rows = scale._rows_at(eng.kv, a.batch, a.context)
    for i in range(a.steps):
        for r in rows:
            eng.kv.append_slot(r)
        eng.backend.decode(rows, [(11 * i + r) % 1000 for r in rows])
    print(f"{a.model}: {a.steps} steps, kernel ms {[round(x, 3) for x in eng.backend.kernel_ms]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Prefill speed on the GPU (the PyTorch prefill the serving engine runs
between decode steps): tokens/s of ``prefill_row`` over one prompt cut in
chunks of each size, then a cProfile of one chunk's host calls.

    source scripts/gpu_env.sh && python3 -m gpu.prefill_profile --out "$OUT"

``--model tiny-moe --device cpu`` is a dry run of the driver here.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path


def profile_prefill(model: str = "north-mini-code", device: str = "cuda", tokens: int = 4096,
                    chunks: tuple[int, ...] = (256, 1024, 4096), attentions: tuple[str, ...] | None = None) -> dict:
    """``attentions``: the GPU prefill's attention, ``fused`` and/or
    ``reference`` (megac.prefill.FUSED_ATTENTION_ON_GPU), each timed over
    every chunk size in this one process; default: the one megac uses."""
    import torch

    import megac.prefill as P

    from megac.kv.paged import PagedKVCache
    from megac.prefill import prefill_row
    from megac.spec import load_spec
    from megac.weights import random_weights

    spec = load_spec(model)
    tokens = min(tokens, spec.max_context)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    w = random_weights(spec, seed=0, dtype=dtype, device=device)
    bs = spec.target.kv_block_size
    kv = PagedKVCache(spec, max_rows=1, num_blocks=spec.num_layers * (tokens // bs + 2), max_context=tokens,
                      dtype=dtype, block_size=bs, device=device)
    ids = [3 + (7 * i) % (min(spec.vocab_size, 30000) - 3) for i in range(tokens)]

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def run(chunk: int) -> float:
        row = kv.allocate_row()
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            for s in range(0, tokens, chunk):
                prefill_row(w, spec, kv, row, ids[s: s + chunk])
        sync()
        kv.free_row(row)
        return time.perf_counter() - t0

    as_set = P.FUSED_ATTENTION_ON_GPU
    attentions = attentions or ("fused" if as_set else "reference",)
    out: dict = {"model": model, "tokens": tokens, "rows": []}
    for attn in attentions:
        P.FUSED_ATTENTION_ON_GPU = attn == "fused"
        run(chunks[0])  # warm-up (allocator, kernels' first launch)
        for chunk in chunks:
            if chunk > tokens:
                continue
            s = run(chunk)
            out["rows"].append({"attention": attn, "chunk": chunk, "seconds": round(s, 3), "tok_s": round(tokens / s, 1)})
            print(json.dumps(out["rows"][-1]), flush=True)
    P.FUSED_ATTENTION_ON_GPU = attentions[0] == "fused"  # the profile below: the first one's
    row = kv.allocate_row()
    prof = cProfile.Profile()
    prof.enable()
    with torch.no_grad():
        prefill_row(w, spec, kv, row, ids[:chunks[0]])
        sync()
    prof.disable()
    P.FUSED_ATTENTION_ON_GPU = as_set
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    out["profile"] = text.getvalue()
    print(out["profile"], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog="gpu.prefill_profile")
    ap.add_argument("--model", default="north-mini-code")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--attention", default=None,
                    help="comma list: fused, reference (the GPU prefill's attention; default: the one megac uses)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    res = profile_prefill(a.model, a.device, a.tokens, attentions=tuple(a.attention.split(",")) if a.attention else None)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "prefill_profile.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

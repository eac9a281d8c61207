"""GPU check of the ``graphs`` baseline (megac.baselines.graphs), JSON out.

    # on the GPU machine (wheels carried in .whl, as scripts/gpu_megakernel.sh installs them)
    PYTHONPATH=/tmp/site:.:tests python3 -c "import json; from gpu.graphs_check import check_graphs; \
        print(json.dumps(check_graphs(), indent=1))"
    PYTHONPATH=/tmp/site:.:tests python3 -m gpu.graphs_check --out DIR   # DIR/graphs_check.json

``check_graphs()``:

* ``tiny``: tiny-moe and tiny-llama, bf16 random weights on the GPU, a
  ragged batch of 3 rows decoding 16 steps (tiny-moe crosses its sliding
  window of 8): each step's logits against the reference backend in fp32 on
  the CPU (same weights, upcast): the worst cosine and the greedy tokens
  that agree; and the graph-replayed logits against the same backend run
  eagerly on the GPU (same kernels, no graph): the largest difference.
* ``nmc_slice_fp32``: North Mini Code's first five layers (every layer
  kind) at real widths in fp32, eager, rows at 300, 5000 and 8191 tokens of
  noise KV: the logits against the reference decode step over the same
  cache (max relative error; the kernels' indexing without bf16 noise).
* ``nmc``: North Mini Code's shape, random weights, rows at 8K context with
  N(0, 0.01) KV noise: at batch 1 and 8, the median device time per step
  over 30 graph replays after 5 warm-up steps (CUDA events), the wall time
  per step (decode_sample, as ``megac bench``), tok/s; at batch 1 also the
  cosine of one step's logits against the reference decode step (bf16, on
  the GPU) over the same cache (bf16 rounding through 49 layers and flipped
  expert choices keep it near 0.92 with random weights; the fp32 slice is
  the exactness check); ``linear_us``: the measured µs per matrix of each
  projection candidate (cuBLAS, Triton GEMV configs); ``profile_bs1``:
  device time per kernel in one step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

DEV = "cuda"
# fp32 tl.dot in IEEE precision (default TF32) for the fp32 slice check; bf16 kernels are unaffected
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")


def _cosine(a, b) -> float:
    import torch

    return float(torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0))


def _kv(spec, rows: int, blocks: int, dtype, device):
    from megac.kv.paged import PagedKVCache

    return PagedKVCache(spec, max_rows=rows, num_blocks=blocks, dtype=dtype, device=device)


def _prompts(spec, lens, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, spec.vocab_size, (n,), generator=g).tolist() for n in lens]


def tiny_case(name: str, steps: int = 16) -> dict:
    import torch

    from megac.baselines.graphs import GraphsBackend
    from megac.runtime.backend import ReferenceBackend
    from megac.spec import load_spec
    from megac.weights.random import random_weights

    spec = load_spec(name)
    w = random_weights(spec, seed=3, dtype=torch.bfloat16, device=DEV)
    w32 = w.to(torch.float32, "cpu")  # before the graphs backend fuses w's Q/K/V (same values either way)
    lens = [5, 13, 2]
    backends = {
        "graph": GraphsBackend(spec, w, _kv(spec, 3, 256, torch.bfloat16, DEV), max_batch_size=3),
        "eager": GraphsBackend(spec, w, _kv(spec, 3, 256, torch.bfloat16, DEV), max_batch_size=3, use_graphs=False),
        "ref": ReferenceBackend(spec, w32, _kv(spec, 3, 256, torch.float32, "cpu")),
    }
    rows = [0, 1, 2]
    for be in backends.values():
        for r, p in zip(rows, _prompts(spec, lens)):
            be.kv.allocate_row(r)
            be.prefill(r, p)
    worst_cos, agree, total, max_eager_diff = 1.0, 0, 0, 0.0
    tokens = [7, 8, 9]
    for _ in range(steps):
        out = {k: be.decode(rows, tokens).float().cpu() for k, be in backends.items()}
        worst_cos = min(worst_cos, min(_cosine(out["graph"][i], out["ref"][i]) for i in range(len(rows))))
        ga, ra = out["graph"].argmax(-1), out["ref"].argmax(-1)
        agree += int((ga == ra).sum())
        total += len(rows)
        max_eager_diff = max(max_eager_diff, float((out["graph"] - out["eager"]).abs().max()))
        tokens = ra.tolist()  # all three follow the reference's greedy path
    return {"worst_cosine_vs_reference": round(worst_cos, 6), "greedy_agree": f"{agree}/{total}",
            "max_abs_diff_graph_vs_eager": max_eager_diff,
            "graphs_captured": len([g for g in backends["graph"]._graphs.values() if g[2] is not None])}


def nmc_case(batches=(1, 8), context: int = 8192, steps: int = 30, warmup: int = 5, profile: bool = True) -> dict:
    import torch

    from megac.baselines.graphs import GraphsBackend
    from megac.decode_bench import fill_kv_noise, rows_at
    from megac.kv.paged import blocks_for_tokens
    from megac.reference import decode_step
    from megac.sampling import RowSampling, SamplingParams
    from megac.spec import load_spec
    from megac.weights.random import random_weights

    spec = load_spec("north-mini-code")
    t0 = time.perf_counter()
    w = random_weights(spec, seed=0, dtype=torch.bfloat16, device=DEV)
    per_row = blocks_for_tokens(spec, context + warmup + steps + 2)
    kv = _kv(spec, max(batches), max(batches) * per_row + 16, torch.bfloat16, DEV)
    be = GraphsBackend(spec, w, kv, max_batch_size=max(batches))
    fill_kv_noise(kv)
    out: dict = {"setup_s": round(time.perf_counter() - t0, 1),
                 "weights_gb": round(w.nbytes() / 1e9, 2)}
    rows_out = []
    for batch in batches:
        rows = rows_at(kv, batch, context)
        be.kernel_ms.clear()
        wall = []
        tokens = [11 + r for r in rows]
        greedy = [RowSampling(SamplingParams(temperature=0.0), None)] * batch
        for i in range(warmup + steps):
            for r in rows:
                kv.append_slot(r)
            torch.cuda.synchronize()
            t = time.perf_counter()
            tokens, _ = be.decode_sample(rows, tokens, greedy)  # as megac bench: only token ids cross
            wall.append((time.perf_counter() - t) * 1e3)
        ms = statistics.median(be.kernel_ms[warmup:])
        row = {"batch": batch, "context": context, "graph_ms": round(ms, 4), "tok_s": round(batch * 1e3 / ms, 1),
               "step_ms_wall": round(statistics.median(wall[warmup:]), 4)}
        if batch == 1:  # the same step again through the reference, over the same cache
            for r in rows:
                kv.append_slot(r)
            g = be.decode(rows, tokens)
            for r in rows:
                kv.seq_pos[r] -= 1  # step back: the reference rewrites the same slot
            ref = decode_step(be.weights, spec, kv, tokens, rows).float().cpu()
            row["cosine_vs_reference"] = round(_cosine(g, ref), 6)
            row["same_argmax"] = bool(g.argmax(-1).eq(ref.argmax(-1)).all())
        rows_out.append(row)
        for r in rows:
            kv.free_row(r)
    out["steps"] = rows_out
    out["linear_us"] = {f"{role}@{b}": t for (role, b), t in be.linear.timings.items()}  # per matrix, per candidate
    out["max_memory_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
    if profile:
        out["profile_bs1"] = _profile(be, kv, context)
    return out


def _profile(be, kv, context: int, replays: int = 5) -> dict:
    """Device time per step by kernel (torch.profiler over graph replays), top 16."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from megac.decode_bench import rows_at

    rows = rows_at(kv, 1, context)
    for _ in range(2):
        kv.append_slot(rows[0])
        be.decode(rows, [5])
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            kv.append_slot(rows[0])
            be.decode(rows, [5])
        torch.cuda.synchronize()
    kv.free_row(rows[0])
    evs = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    evs.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in evs) / replays
    return {"kernel_us_per_step": round(total, 1),
            "top": [{"name": e.key[:90], "us": round(e.self_device_time_total / replays, 1),
                     "calls": e.count // replays} for e in evs[:16]]}


def nmc_slice_case(contexts=(300, 5000, 8191), steps: int = 2) -> dict:
    """North Mini Code's first five layers (dense full, three sliding MoE, a
    NoPE full MoE) at real widths in fp32 on the GPU, eager: the step's
    logits against the reference decode step over the same cache (noise KV,
    a ragged batch): the kernels' indexing at real widths, without bf16 noise."""
    import torch

    from megac.baselines.graphs import GraphsBackend
    from megac.decode_bench import fill_kv_noise, rows_at
    from megac.kv.paged import blocks_for_tokens
    from megac.reference import decode_step
    from megac.spec import load_spec
    from megac.weights.random import random_weights
    from models import variant

    base = load_spec("north-mini-code")
    spec = variant(base, "nmc-slice", layers=[l.model_dump() for l in base.layers[:5]])
    w = random_weights(spec, seed=1, dtype=torch.float32, device=DEV)
    kv = _kv(spec, len(contexts), len(contexts) * blocks_for_tokens(spec, max(contexts) + steps + 2) + 8,
             torch.float32, DEV)
    be = GraphsBackend(spec, w, kv, max_batch_size=len(contexts), use_graphs=False)
    fill_kv_noise(kv)
    rows = [rows_at(kv, 1, c)[0] for c in contexts]
    worst_rel, worst_cos, tokens = 0.0, 1.0, [17, 18, 19]
    for _ in range(steps):
        for r in rows:
            kv.append_slot(r)
        got = be.decode(rows, tokens)
        for r in rows:
            kv.seq_pos[r] -= 1
        want = decode_step(be.weights, spec, kv, tokens, rows).float().cpu()
        worst_rel = max(worst_rel, float((got - want).abs().max() / want.abs().max()))
        worst_cos = min(worst_cos, min(_cosine(got[i], want[i]) for i in range(len(rows))))
        tokens = want.argmax(-1).tolist()
    return {"contexts": list(contexts), "max_rel_err": worst_rel, "worst_cosine": round(worst_cos, 8)}


def check_graphs() -> dict:
    import torch

    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "grouped_mm": hasattr(torch, "_grouped_mm")}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    out["tiny"] = {name: tiny_case(name) for name in ("tiny-moe", "tiny-llama")}
    out["nmc_slice_fp32"] = nmc_slice_case()
    out["nmc"] = nmc_case()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res = check_graphs()
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "graphs_check.json").write_text(text)


if __name__ == "__main__":
    main()

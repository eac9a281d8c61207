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
* ``nmc``: North Mini Code's shape, random weights, rows at 8K context with
  N(0, 0.01) KV noise: at batch 1 and 8, the median device time per step
  over 30 graph replays after 5 warm-up steps (CUDA events), the wall time
  per step, tok/s; at batch 1 also the cosine of one step's logits against
  the reference decode step (bf16, on the GPU) over the same cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

DEV = "cuda"


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


def nmc_case(batches=(1, 8), context: int = 8192, steps: int = 30, warmup: int = 5) -> dict:
    import torch

    from megac.baselines.graphs import GraphsBackend
    from megac.decode_bench import fill_kv_noise, rows_at
    from megac.kv.paged import blocks_for_tokens
    from megac.reference import decode_step
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
        for i in range(warmup + steps):
            for r in rows:
                kv.append_slot(r)
            torch.cuda.synchronize()
            t = time.perf_counter()
            logits = be.decode(rows, tokens)  # advances the rows
            wall.append((time.perf_counter() - t) * 1e3)
            tokens = logits.argmax(-1).tolist()
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
    out["max_memory_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
    return out


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

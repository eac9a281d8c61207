"""Checks of the generated megakernel on a GPU, one subprocess-friendly
entry per check, JSON out (tests/gpu/test_megakernel.py runs them; a GPU
session runs them all at once).

    # here: cubins into build/cubin (carry it)
    MEGAC_CACHE_DIR=$PWD/.gpucache PYTHONPATH=.:tests python3 -m gpu.megakernel_check --prebuild
    # or only some specs (MEGAC_VARIANTS=a,b narrows the variant builds too)
    ... --prebuild tiny-moe smollm2-135m north-mini-code
    PYTHONPATH=.:tests python3 -m gpu.megakernel_check --run tiny hang smollm2 --out DIR

Checks:
  tiny     tiny-llama and tiny-moe, bf16 random weights: the megakernel's
           greedy tokens and logits against the CPU VM's (same weights, bf16)
           for a ragged batch; two runs bit-identical; each prompt alone
           gives the same bits as in the batch.
  hang     a schedule with one target raised by 1 raises MegakernelHang
           within 3 s naming the task, the counter and the producer; the
           next step runs correctly (MEGAC_HANG_VARIANT: that VARIANTS
           build's waits).
  rng      the counter-based random weights: the same bits on CPU and GPU.
  orders   tiny-moe under the three wave orders: bit-identical tokens and logits.
  sampling sampling on the GPU (tiny-moe): greedy tokens from the argmax
           records equal the argmax of the step's logits; seeded
           temperature/top-p/top-k tokens drawn on the GPU equal the CPU
           sampler's on the same logits and noise stream; seeded generation
           is the same batched as alone, and seed-dependent.
  nmc_slice  North Mini Code layers 0, 1, 4 at real widths against fp32.
  (and the larger checks of gpu.megakernel_scale: batch, configs, contexts,
  nmc_full, speed)
  smollm2  SmolLM2-135M-Instruct (real weights, bf16): greedy text of 20
           chat prompts against transformers' bf16 greedy on the GPU; where
           they part, the reference's top-2 logit margin there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

from gpu import megakernel_scale as scale

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
    "What is 12 times 7?", "Name a famous physicist.", "Translate 'good morning' into Spanish.",
    "What color is the sky on a clear day?", "Give me a synonym for 'happy'.", "Who wrote Hamlet?",
    "What is the boiling point of water in Celsius?", "Explain what a CPU does in one sentence.",
    "What is the largest planet in our solar system?", "Write a Python function that adds two numbers.",
    "How many days are in a leap year?", "What is photosynthesis?", "Name three kinds of fruit.",
    "What does HTML stand for?", "Tell me a fun fact about octopuses.", "What is the square root of 81?",
    "Describe a cat in five words.",
]


def _noise_step(eng):
    """fp32 logits of one decode step of 2 rows at 100 tokens of seeded KV noise."""
    scale._noise_kv(eng)
    return scale.step_logits_per_setup(eng, {"own": lambda: None}, 2, 100)["own"]


def _tiny_vs_vm(spec) -> dict:
    """A small model on the GPU against the CPU VM: greedy tokens, logits'
    cosine, repeat and batch invariance (MEGAC_CHECK_VARIANT: that VARIANTS
    build of the model)."""
    import torch

    from megac.weights import random_weights
    from megac.weights.layout import LaidOutWeights

    w = random_weights(spec, seed=7, dtype=torch.bfloat16)
    prompts = [[(17 * i + 3 * j) % spec.vocab_size for j in range(n)] for i, n in enumerate((5, 37, 12))]
    t0 = time.perf_counter()
    gpu = scale.engine(spec, w, "cuda", max_batch_size=8, max_model_len=256)
    variant = os.environ.get("MEGAC_CHECK_VARIANT")  # a VARIANTS build instead of the default
    if variant:
        scale.use_cubin(gpu.backend, scale.variant_cubin(spec, scale.VARIANTS[variant]))
    # one step over noise before any request (an engine's first: the adopter's below is its first too)
    first = _noise_step(gpu)
    a = scale.generate_all(gpu, prompts, 8)
    b = scale.generate_all(gpu, prompts, 8)
    alone = [scale.generate_all(gpu, [p], 8)[0] for p in prompts]
    vm_eng = scale.engine(spec, w, "cpu", max_batch_size=8, max_model_len=256)
    vm = scale.generate_all(vm_eng, prompts, 8)
    # each row alone on the VM too: one-row schedules may differ from the batch's by design (a
    # tile set for one row, router_combine), and the GPU's must still be the VM's
    vm_alone = [scale.generate_all(vm_eng, [p], 8)[0] for p in prompts]
    # an engine that adopts these laid-out weights (LaidOutWeights: how check tiles times builds of a
    # model that fits the GPU once) steps the same noise rows to the same bits
    adopter = scale.engine(spec, LaidOutWeights.take(gpu.backend), "cuda", max_batch_size=8, max_model_len=256)
    if variant:
        scale.use_cubin(adopter.backend, scale.variant_cubin(spec, scale.VARIANTS[variant]))
    adopted_equal = bool(torch.equal(first, _noise_step(adopter)))
    del adopter
    cos, same_tok = [], []
    for g, v in zip(a, vm):
        same_tok.append(g.tokens == v.tokens)
        for x, y in zip(g.logits, v.logits):
            cos.append(scale.cosine(x, y))
    alone_cos = [scale.cosine(x, y) for g, v in zip(alone, vm_alone) for x, y in zip(g.logits, v.logits)]
    return {
        "tokens_equal_vm": same_tok,
        "min_cos_vs_vm": min(cos),
        "alone_tokens_equal_vm": [g.tokens == v.tokens for g, v in zip(alone, vm_alone)],
        "alone_min_cos_vs_vm": min(alone_cos),
        "repeat_bit_identical": all(torch.equal(x, y) for g, h in zip(a, b) for x, y in zip(g.logits, h.logits)),
        "alone_equals_batch": all(torch.equal(x, y) for g, h in zip(a, alone) for x, y in zip(g.logits, h.logits)),
        "adopted_step_bit_identical": adopted_equal,
        "gpu_tokens": [g.tokens for g in a],
        "vm_tokens": [v.tokens for v in vm],
        "kernel_ms_median": scale.median(gpu.backend.kernel_ms),
        "seconds": round(time.perf_counter() - t0, 2),
    }


def tiny_spec(name: str, tiles: str | None = None):
    """Tiny model ``name``; ``tiles``: a scale.TILES name, that tile set."""
    from megac.spec import load_spec
    from models import variant

    spec = load_spec(name)
    if not tiles:
        return spec
    return variant(spec, f"{name}-{tiles}", target=scale.tile_target(spec, scale.TILES[tiles]))


def check_tiny() -> dict:
    """The tiny models against the VM (_tiny_vs_vm); MEGAC_TINY_TILES (a
    scale.TILES name): under that tile set."""
    tiles = os.environ.get("MEGAC_TINY_TILES")
    return {name: _tiny_vs_vm(tiny_spec(name, tiles)) for name in ("tiny-llama", "tiny-moe")}


def fused_spec(name: str, gather: bool = False):
    """``name`` with the top-k ranked inside ROUTE_FINALIZE (target tile
    fused_topk: no ROUTER_TOPK tasks) and, with ``gather``, the rows copied
    to their slots there too (fused_gather: no MOE_GATHER tasks)."""
    from megac.spec import load_spec
    from models import variant

    spec = load_spec(name)
    tiles = {**(spec.target.tiles or {}), "fused_topk": 1, **({"fused_gather": 1} if gather else {})}
    return variant(spec, f"{name}-fused-{'routing' if gather else 'topk'}",
                   target={**spec.target.model_dump(), "tiles": tiles})


def check_fused_topk() -> dict:
    """The top-k inside ROUTE_FINALIZE (one hop less per MoE layer), and
    with it the gather (another): tiny-moe against the VM as check_tiny;
    North Mini Code's greedy tokens and logits equal the default build's bit
    for bit (the same sums in the same order, only the task that does them
    differs); the three builds' median kernel ms at batch 1 and 8, 8K."""
    import gc

    import torch

    from megac.spec import load_spec
    from megac.weights import random_weights

    out = {"tiny_moe": _tiny_vs_vm(fused_spec("tiny-moe")),
           "tiny_moe_gather": _tiny_vs_vm(fused_spec("tiny-moe", gather=True))}
    base, fused, both = (load_spec("north-mini-code"), fused_spec("north-mini-code"),
                         fused_spec("north-mini-code", gather=True))
    w = random_weights(base, seed=0, dtype=torch.bfloat16, device=scale.DEV)
    prompts = [[(31 * i + 7 * j) % 1000 + 3 for j in range(n)] for i, n in enumerate((9, 40, 17))]
    got = {}
    for name, spec in (("default", base), ("fused", fused), ("both", both)):
        eng = scale.engine(spec, w, max_batch_size=8, max_model_len=256)
        got[name] = scale.generate_all(eng, prompts, 8)
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    a = got["default"]
    for name in ("fused", "both"):
        b = got[name]
        out[f"nmc_{name}_tokens_equal"] = [x.tokens == y.tokens for x, y in zip(a, b)]
        out[f"nmc_{name}_logits_bit_identical"] = all(torch.equal(x, y) for g, h in zip(a, b)
                                                      for x, y in zip(g.logits, h.logits))
    out["nmc_tokens"] = [x.tokens for x in a]
    del got, a, b, w
    gc.collect()
    torch.cuda.empty_cache()
    out["kernel_ms"] = scale._kernel_ms_of({"default": base, "fused": fused, "both": both})
    return out


def check_routed() -> dict:
    """Routed claims at every batch size: tiny-moe against the VM as
    check_tiny; North Mini Code's greedy tokens and logits equal the default
    schedule's bit for bit (the same sums in the same order: the claimers
    rank as ROUTE_FINALIZE does and read the rows the gather would have
    copied); median kernel ms of both at batch 1, 2, 4 and 8, 8K, one engine
    after the other, twice (default, routed, default, routed), and of routed
    claims with attention splits of 256 tokens (more SMs on attention, now
    the longer chain of a layer)."""
    import gc

    import torch

    from megac.spec import load_spec
    from megac.weights import random_weights

    out = {"tiny_moe": _tiny_vs_vm(scale.routed_spec("tiny-moe"))}
    base, routed = load_spec("north-mini-code"), scale.routed_spec("north-mini-code")
    w = random_weights(base, seed=0, dtype=torch.bfloat16, device=scale.DEV)
    prompts = [[(31 * i + 7 * j) % 1000 + 3 for j in range(n)] for i, n in enumerate((9, 40, 17))]
    got = {}
    for name, spec in (("default", base), ("routed", routed)):
        eng = scale.engine(spec, w, max_batch_size=8, max_model_len=256)
        got[name] = scale.generate_all(eng, prompts, 8)
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    a, b = got["default"], got["routed"]
    out["nmc_tokens_equal"] = [x.tokens == y.tokens for x, y in zip(a, b)]
    out["nmc_logits_bit_identical"] = all(torch.equal(x, y) for g, h in zip(a, b) for x, y in zip(g.logits, h.logits))
    out["nmc_tokens"] = [x.tokens for x in a]
    del got, a, b, w
    gc.collect()
    torch.cuda.empty_cache()
    out["kernel_ms"] = scale._kernel_ms_of({"default": base, "routed": routed, "default_2": base,
                                            "routed_2": routed,
                                            "routed_s256": scale.routed_spec("north-mini-code", split_tokens=256)},
                                           batches=(1, 2, 4, 8))
    return out


def check_sampling() -> dict:
    import torch

    from megac import abi
    from megac.runtime.backend import decode_and_sample
    from megac.runtime.step import greedy_from_records
    from megac.sampling import RowSampling, SamplingParams, make_stream, sample_row
    from megac.spec import load_spec
    from megac.weights import random_weights

    spec = load_spec("tiny-moe")
    w = random_weights(spec, seed=7, dtype=torch.bfloat16)
    eng = scale.engine(spec, w, max_batch_size=8, max_model_len=256)
    be = eng.backend
    on_gpu = hasattr(be, "buf")  # a CPU dry run (MEGAC_CHECK_DEVICE=cpu) has no argmax records to read
    prompts = [[(13 * i + 5 * j) % spec.vocab_size for j in range(n)] for i, n in enumerate((3, 9, 30, 17, 5, 22))]
    rows = [eng.kv.allocate_row() for _ in prompts]
    toks = []
    for r, p in zip(rows, prompts):
        toks.append(int(torch.argmax(be.prefill(r, p))))
    # tiny-moe's tied random embeddings put the current token ~15 logits
    # above the rest: temperatures 6-8 make the draws spread over many tokens
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=8.0, top_p=0.9, seed=11),
             SamplingParams(temperature=6.0, top_k=20, seed=12), SamplingParams(temperature=0.0, logit_bias={3: 40.0}),
             SamplingParams(temperature=7.0, min_p=0.05, presence_penalty=5.0, seed=13),
             SamplingParams(temperature=8.0, seed=14)]
    streams = [make_stream(p.seed) if not p.greedy else None for p in kinds]
    outs: list[list[int]] = [[] for _ in kinds]
    greedy_ok = records_ok = sampled_ok = 0
    greedy_n = sampled_n = 0
    mismatches = []
    distinct: set = set()
    for step in range(24):
        for r in rows:
            eng.kv.append_slot(r)
        samples = [RowSampling(p, s, outs[i]) for i, (p, s) in enumerate(zip(kinds, streams))]
        got, logits = decode_and_sample(be, rows, toks, samples, keep_logits=True)
        if on_gpu:
            rec = be.buf["argmax_part"][: len(rows)]
            records_ok += greedy_from_records(rec).cpu().tolist() == abi.argmax_reduce(rec.cpu().numpy())[0].tolist()
        for i, p in enumerate(kinds):
            if p.greedy:
                greedy_n += 1
                x = logits[i].clone()
                for t, bias in (p.logit_bias or {}).items():
                    x[t] += bias
                greedy_ok += got[i] == int(torch.argmax(x))
            else:
                cpu_stream = make_stream(p.seed)
                cpu_stream.step = streams[i].step - 1
                want = sample_row(logits[i], p, cpu_stream, outs[i])
                sampled_n += 1
                distinct.add(want)
                sampled_ok += got[i] == want
                if got[i] != want:
                    mismatches.append([step, i, got[i], want])
        toks = got
        for i, t in enumerate(got):
            outs[i].append(t)
    for r in rows:
        eng.kv.free_row(r)
    from megac.engine.generate import generate

    gp = [[(7 * i + j) % spec.vocab_size for j in range(6 + 5 * i)] for i in range(5)]
    seeds = [100 + i for i in range(5)]
    batched = generate(eng, gp, max_tokens=12, temperature=8.0, top_p=0.95, seed=seeds, eos_token_ids=[])
    alone = [generate(eng, [p], max_tokens=12, temperature=8.0, top_p=0.95, seed=[s], eos_token_ids=[])[0]
             for p, s in zip(gp, seeds)]
    other = generate(eng, gp, max_tokens=12, temperature=8.0, top_p=0.95, seed=[s + 50 for s in seeds],
                     eos_token_ids=[])
    return {
        "steps": 24,
        "on_gpu": on_gpu,
        "records_equal_host_reduction_steps": records_ok,
        "greedy_equal_logits_argmax": [greedy_ok, greedy_n],
        "sampled_equal_cpu_sampler": [sampled_ok, sampled_n],
        "mismatches": mismatches[:10],
        "distinct_sampled_tokens": len(distinct),
        "seeded_batched_equals_alone": [b.tokens == a.tokens for b, a in zip(batched, alone)],
        "other_seeds_differ": sum(b.tokens != o.tokens for b, o in zip(batched, other)),
        "tokens": [b.tokens for b in batched],
    }


def check_hang() -> dict:
    import dataclasses

    import numpy as np
    import torch

    from megac.abi import H, is_dyn
    from megac.gpu.backend import MegakernelHang
    from megac.spec import load_spec
    from megac.weights import random_weights

    spec = load_spec("tiny-llama")
    w = random_weights(spec, seed=7, dtype=torch.bfloat16)
    eng = scale.engine(spec, w, "cuda", max_batch_size=1, max_model_len=256)
    be = eng.backend
    variant = os.environ.get("MEGAC_HANG_VARIANT")  # a VARIANTS build's waits (its watchdog paths) instead
    if variant:
        scale.use_cubin(be, scale.variant_cubin(spec, scale.VARIANTS[variant]))
    sched = be.schedules.pick(1, 64)
    t = sched.tasks.copy()
    live = [(s, j) for s in range(t.shape[0]) for j in range(int(sched.task_counts[s]))
            if t[s, j, H.WAIT0] >= 0 and not is_dyn(int(t[s, j, H.TARGET0]))]
    s, j = live[len(live) // 2]
    t[s, j, H.TARGET0] += 1
    broken = dataclasses.replace(sched, tasks=t)
    good = be.schedules.schedules
    be.schedules.schedules = [broken if x is sched else x for x in good]
    be.tasks[id(broken)] = (torch.from_numpy(np.ascontiguousarray(t)).cuda(), be.tasks[id(sched)][1])
    be.watchdog_ns = 1_000_000_000
    be._desc_cache.clear()
    row = eng.kv.allocate_row()
    be.prefill(row, [1, 2, 3])
    eng.kv.append_slot(row)
    t0 = time.perf_counter()
    res = {"task": [int(s), int(j)], "counter": int(t[s, j, H.WAIT0])}
    try:
        be.decode([row], [4])
        res["raised"] = False
    except MegakernelHang as err:
        res.update(raised=True, message=str(err), seconds=round(time.perf_counter() - t0, 2), record=err.record,
                   missing=err.missing[:4])
        root = str(err).split("Root cause:", 1)[-1].split(". Chain:")[0] if "Root cause:" in str(err) else ""
        res["root_names_broken_task"] = f"counter {res['counter']} " in root and "no task left" in root
        # the first wait to expire reports: the broken task itself (its
        # counter's producers all ran: nothing is missing) or a task
        # downstream, whose awaited counter lacks a producer that never ran
        res["reporter_is_broken_task"] = [err.record["sm"], err.record["task"]] == res["task"]
    be.schedules.schedules = good
    be._desc_cache.clear()
    be.watchdog_ns = 2_000_000_000
    eng.kv.free_row(row)
    prompts = [[5, 6, 7, 8]]
    after = scale.generate_all(eng, prompts, 4)
    vm = scale.generate_all(scale.engine(spec, w, "cpu", max_batch_size=1, max_model_len=256), prompts, 4)
    res["next_launch_tokens"] = after[0].tokens
    res["next_launch_matches_vm"] = after[0].tokens == vm[0].tokens
    return res


def check_smollm2() -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from megac.loading import load_model
    from megac.weights.gguf import smollm2_gguf_path

    loaded = load_model(None, dtype=torch.bfloat16)
    spec, tok = loaded.spec, loaded.tokenizer
    prompts = []
    for c in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids))
    n = 24
    eng = scale.engine(spec, loaded.weights, "cuda", max_batch_size=8, max_model_len=512)
    outs = scale.generate_all(eng, prompts, n)
    path = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.bfloat16).cuda().eval()
    rows, div = [], []
    for p, o, text in zip(prompts, outs, PROMPTS):
        with torch.no_grad():
            seq = torch.tensor([p], device="cuda")
            ref, margins, tops = [], [], []
            for _ in range(n):
                lg = model(seq).logits[0, -1].float()
                top = torch.topk(lg, 2)
                ref.append(int(top.indices[0]))
                margins.append(float(top.values[0] - top.values[1]))
                tops.append(float(top.values[0]))
                seq = torch.cat([seq, top.indices[:1].view(1, 1)], dim=1)
        first = next((i for i, (a, b) in enumerate(zip(o.tokens, ref)) if a != b), None)
        div.append((p, ref, o.tokens, first))
        rows.append({"prompt": text, "equal": first is None, "first_divergence": first,
                     "ref_margin_there": margins[first] if first is not None else None,
                     "ref_top_logit_there": tops[first] if first is not None else None,
                     "megakernel": tok.decode(o.tokens), "transformers": tok.decode(ref)})
    # at each divergence: the fp32 model's view of the two candidates (same prefix)
    del model
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32).cuda().eval()
    for r, (p, ref, mine, first) in zip(rows, div):
        if first is None:
            continue
        with torch.no_grad():
            lg = model(torch.tensor([p + ref[:first]], device="cuda")).logits[0, -1].float()
        r["fp32_margin_ref_over_megakernel"] = float(lg[ref[first]] - lg[mine[first]])
        r["fp32_argmax_is"] = ("megakernel" if int(lg.argmax()) == mine[first] else
                               "transformers_bf16" if int(lg.argmax()) == ref[first] else "neither")
    return {"prompts": len(rows), "identical": sum(r["equal"] for r in rows), "rows": rows,
            "kernel_ms_median": scale.median(eng.backend.kernel_ms)}


def check_orders() -> dict:
    """The three wave orders run the same tiles: identical tokens and logits."""
    import torch

    from megac.spec import load_spec
    from megac.weights import random_weights

    spec = load_spec("tiny-moe")
    w = random_weights(spec, seed=11, dtype=torch.bfloat16)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6] * 7]
    got = {}
    for order in ("tuned", "interleaved", "attention-first"):
        eng = scale.engine(spec, w, "cuda", order=order, max_batch_size=2, max_model_len=128)
        got[order] = scale.generate_all(eng, prompts, 8)
    ref = got["tuned"]
    return {order: scale.same_bits(ref, outs) for order, outs in got.items()}


def check_waves() -> dict:
    """The waves baseline (one launch per wave, megac.gpu.waves) runs the
    same tiles as the persistent megakernel, whose every sum has a fixed
    order: identical tokens and logits (tiny-moe, three orders and the split
    claimer wave of schedules/experiments/full-attn-half.yaml, whose later
    claimers join the attention wave's launch; batch 2), and North Mini
    Code's step time both ways (batch 1 and 8, 8K)."""
    import torch

    from megac.resources import schedules_dir
    from megac.spec import load_spec
    from megac.weights import random_weights

    spec = load_spec("tiny-moe")
    w = random_weights(spec, seed=11, dtype=torch.bfloat16)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6] * 7]
    out = {}
    split = str(schedules_dir() / "experiments" / "full-attn-half.yaml")
    for order in ("tuned", "interleaved", "attention-first", split):
        ref = scale.generate_all(scale.engine(spec, w, "cuda", order=order, max_batch_size=2, max_model_len=128),
                                 prompts, 8)
        eng = scale.engine(spec, w, "waves", order=order, max_batch_size=2, max_model_len=128)
        got = scale.generate_all(eng, prompts, 8)
        key = Path(order).stem
        out[key] = scale.same_bits(ref, got)
        out[f"{key}_graph_mode"] = eng.backend.graph_mode
        # the launches that ran were the waves' (the step graph would replay the persistent kernel)
        out[f"{key}_wave_graphs"] = len(eng.backend._graphs) if eng.backend.graph_mode == "graph" else -1
        out[f"{key}_step_graphs"] = len(eng.backend._step_graphs)
    out["nmc"] = scale.waves_step_times()
    return out


def check_rng() -> dict:
    """The counter-based weights are the same bits on the CPU and the GPU."""
    import torch

    from megac.weights.random import draw

    out = {}
    for name, shape, std, mean, dtype in (("a", (3, 1000), 1.0, 0.0, torch.float32),
                                          ("layers.7.experts_up", (5, 768, 64), 0.02, 0.0, torch.bfloat16),
                                          ("norm", (2048,), 0.1, 1.0, torch.bfloat16)):
        c = draw(5, name, shape, std, mean, dtype)
        g = draw(5, name, shape, std, mean, dtype, device="cuda").cpu()
        out[name] = bool(torch.equal(c, g))
    return out


def slice_spec(tiles: str | None = None):
    """North Mini Code layers [0, 1, 4]; ``tiles``: a scale.TILES name, that tile set."""
    from megac.spec import load_spec
    from models import variant

    full = load_spec("north-mini-code")
    extra = {"target": scale.tile_target(full, scale.TILES[tiles])} if tiles else {}
    return variant(full, "nmc-slice" + (f"-{tiles}" if tiles else ""),
                   layers=[full.layers[i].model_dump() for i in (0, 1, 4)], **extra)


def check_nmc_slice() -> dict:
    """North Mini Code layers [0, 1, 4] at real widths (1.82B parameters),
    random weights drawn on the GPU (bf16): the megakernel's logits against
    the fp32 reference (megac.reference, plain PyTorch) on the same weights,
    teacher-forced, expert choices compared (gpu.megakernel_scale).
    MEGAC_CHECK_TILES (a scale.TILES name): that tile set of the slice;
    MEGAC_CHECK_ROWS=1: the first prompt alone (the batch-1 schedule)."""
    import torch

    from megac.weights import random_weights

    spec = slice_spec(os.environ.get("MEGAC_CHECK_TILES"))
    w = random_weights(spec, seed=0, dtype=torch.bfloat16, device="cuda")
    prompts = [[5, 17, 1234, 99, 255000], [7, 8000, 42]][:int(os.environ.get("MEGAC_CHECK_ROWS", "2"))]
    variant = os.environ.get("MEGAC_CHECK_VARIANT")  # a VARIANTS build of the slice
    return scale.routed_comparison(spec, w, prompts, 8, defines=scale.VARIANTS[variant] if variant else None)


def check_serve() -> dict:
    """``megac serve --backend cuda`` (SmolLM2, real weights): plain and
    streamed chat, the openai client, 8 concurrent requests against each
    alone (gpu.serve_check)."""
    from gpu.serve_check import check_serve as run

    return run()


def check_serve_burst() -> dict:
    """``serve`` with ``--decode-burst 4``: steady greedy batches decode 4
    pipelined steps at a time (the engine's burst path on the GPU)."""
    from gpu.serve_check import check_serve as run

    return run(port=8733, extra=("--decode-burst", "4"))


def check_serve_fault() -> dict:
    """A watchdog hang provoked mid-serving (MEGAC_FAULT_HANG_STEPS): that
    request errors, the server recovers (gpu.serve_check)."""
    from gpu.serve_check import check_serve_fault as run

    return run()


def check_serve_fault_burst() -> dict:
    """The serve_fault check with --decode-burst 4: the hang falls inside a
    burst; its requests error, the rest are served."""
    from gpu.serve_check import check_serve_fault as run

    return run(port=8734, extra=("--decode-burst", "4"))


def check_prefix_turns() -> dict:
    """A 3-turn conversation on North Mini Code with a 2K-token shared
    prefix, with and without the prefix cache (gpu.prefix_check). Small
    because NMC prefill (the PyTorch path) runs ~130 tokens/s on the H200:
    the 10-turn, 6K version ran past a 10-minute call."""
    from gpu.prefix_check import check_prefix_turns as run

    return run(turns=3, prefix_tokens=2048)


def check_prefix_turns10() -> dict:
    """Issue 13's full case: a 10-turn conversation over a 6K-token shared
    prefix on North Mini Code, cached against uncached (the grouped-GEMM
    prefill makes the uncached side affordable)."""
    from gpu.prefix_check import check_prefix_turns as run

    return run(turns=10, prefix_tokens=6144)


def check_graphs() -> dict:
    """The ``graphs`` baseline's own check (tests/gpu/graphs_check.py)."""
    from gpu.graphs_check import check_graphs as run

    return run()


CHECKS = {"serve": check_serve, "serve_burst": check_serve_burst, "serve_fault": check_serve_fault, "serve_fault_burst": check_serve_fault_burst, "prefix_turns": check_prefix_turns, "prefix_turns10": check_prefix_turns10, "fused_topk": check_fused_topk, "routed": check_routed, "tiny": check_tiny, "hang": check_hang, "smollm2": check_smollm2,
          "sampling": check_sampling, "graphs": check_graphs, "waves": check_waves,
          "orders": check_orders, "rng": check_rng, "nmc_slice": check_nmc_slice, **scale.CHECKS}


#: TILES sets checked as a default would be (the tiny models under them and the NMC slice): the folds
#: (rcomb, rcqc, rcqcfc, uc), the full layer's static attention (fs) and the experts' outputs in bf16 (mob16);
#: --prebuild builds both forms
CHECKED_AS_DEFAULT = ("rcomb", "rcqc", "rcqcfc", "uc", "fs", "mob16")


def prebuild(only: list[str] | None = None) -> None:
    """Artifacts and cubins of the models the checks compile (build here,
    carry build/cubin): the same compile as on the GPU gives the same
    megakernel.cu, hence the same cubin cache key. ``only``: those spec
    names alone (the full set is ~8 minutes here and ~34 MB; a carry holds
    64 MiB with the wheels and half the GGUF)."""
    from megac.codegen.megakernel import SOURCE
    from megac.gpu.build import build_cubin
    from megac.resources import opcodes_dir
    from megac.passes.order import ORDERS
    from megac.runtime.artifacts import load_or_compile
    from megac.spec import load_spec
    from models import variant

    full = load_spec("north-mini-code")
    specs = [load_spec(n) for n in ("tiny-llama", "tiny-moe", "smollm2-135m")] + [
        *[tiny_spec(n, t) for n in ("tiny-llama", "tiny-moe") for t in CHECKED_AS_DEFAULT],
        full, slice_spec(), *[slice_spec(n) for n in ("sd8", "sd8_up128", "split8", "merge", "split1_merge", "plain", "plain_nofold",
                                             "plain_unrouted", "nomerge", "plain_merge", "split_nofold",
                                             "split_unrouted", "split1_own", "kvh", *CHECKED_AS_DEFAULT)],
        *scale.config_specs(), *[scale.context_spec(hd) for hd in scale.CONTEXT_HEAD_DIMS], *[scale.split_spec(t, m) for t, m in scale.SPLITS],
        *[scale.tile_spec(n, t) for n, t in scale.TILES.items()],
        *[fused_spec(n, g) for n in ("tiny-moe", "north-mini-code") for g in (False, True)],
        *[scale.routed_spec(n) for n in ("tiny-moe", "north-mini-code")],
        scale.routed_spec("north-mini-code", split_tokens=256)]
    for spec in specs:
        if only and spec.name not in only:
            continue
        if spec.name == "north-mini-code-routed8":  # check profile with MEGAC_PROFILE_ROUTED
            print(f"{spec.name} [profile]: {scale.variant_cubin(spec, scale.PROFILE)}", flush=True)
        if spec.name in scale.VARIANT_MODELS:
            builds = {**scale.variants_for(spec), "profile": scale.PROFILE}
            if spec.moe:  # check profile's MEGAC_PROFILE_VARIANTS
                for v in filter(None, os.environ.get("MEGAC_PROFILE_VARIANTS", "").split(",")):
                    builds[f"profile+{v}"] = {**scale.VARIANTS[v], **scale.PROFILE}
            for v, defines in builds.items():
                if defines:
                    print(f"{spec.name} [{v}]: {scale.variant_cubin(spec, defines)}", flush=True)
        # check profile's MEGAC_PROFILE_TILES (their profiled builds)
        if spec.name in [f"nmc-{n}" for n in os.environ.get("MEGAC_PROFILE_TILES", "").split(",") if n]:
            order = os.environ.get("MEGAC_PROFILE_ORDER", "tuned")  # check profile's order for tile specs
            print(f"{spec.name} [profile]: {scale.variant_cubin(spec, scale.PROFILE, order)}", flush=True)
            if order != "tuned":  # the timed plain build of that order too
                print(f"{spec.name} ({order}): {scale.variant_cubin(spec, {}, order)}", flush=True)
        # check order_variants (on MEGAC_ORDER_TILES' tile set where named)
        order_tiles = os.environ.get("MEGAC_ORDER_TILES", "default")
        if spec.name == ("north-mini-code" if order_tiles == "default" else f"nmc-{order_tiles}"):
            for order in scale.variant_orders():
                for v, defines in scale.variants_for(spec).items():
                    print(f"{spec.name} ({order}) [{v}]: {scale.variant_cubin(spec, defines, order)}", flush=True)
        # the orders and waves checks (tiny-moe) and megac bench --order all (NMC) run every order;
        # a TILES entry with an "order" runs that one in check tiles
        tile_set = scale.TILES.get(spec.name[4:], {}) if spec.name.startswith("nmc-") else {}
        tile_order = tile_set.get("order")
        if "variant" in tile_set:  # check tiles runs that build
            print(f"{spec.name} [{tile_set['variant']}]: "
                  f"{scale.variant_cubin(spec, scale.VARIANTS[tile_set['variant']], tile_order or 'tuned')}", flush=True)
        for order in ORDERS if spec.name in ("tiny-moe", "north-mini-code") else (tile_order or "tuned",):
            t0 = time.perf_counter()
            got = load_or_compile(spec, order)
            # into the build/cubin cache (what travels), even where the artifact has its own
            cubin = build_cubin(got.path / SOURCE, include_dirs=[opcodes_dir(), got.path])
            print(f"{spec.name} ({order}): {cubin} ({time.perf_counter() - t0:.1f} s)", flush=True)


def _release_gpu_memory() -> None:
    """What one check left behind (engines, weights) before the next."""
    import gc

    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(prog="gpu.megakernel_check")
    ap.add_argument("--prebuild", nargs="*", default=None, metavar="SPEC",
                    help="build the cubins here (all the checks' models, or the named specs)")
    ap.add_argument("--run", nargs="*", default=[])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.prebuild is not None:
        prebuild(args.prebuild or None)
    results = {}
    for name in args.run:
        t0 = time.perf_counter()
        try:
            results[name] = {"ok": True, "result": CHECKS[name]()}
        except Exception as err:  # noqa: BLE001 -- report every check
            results[name] = {"ok": False, "error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()}
        results[name]["seconds"] = round(time.perf_counter() - t0, 2)
        _release_gpu_memory()
        print(json.dumps({name: results[name]}, indent=1, default=str)[:6000], flush=True)
        if args.out:  # after every check: a run cut short by its time limit keeps what finished
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "megakernel_check.json").write_text(json.dumps(results, indent=1, default=str))
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

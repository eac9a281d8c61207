"""The megakernel's larger GPU checks (run through gpu.megakernel_check):

  batch     tiny-moe, 8 ragged prompts: for every batch size 1..8 each row's
            tokens and logits are the bits it gets alone.
  configs   four further small models in the envelope (two cohere2_moe, two
            llama: head dims 32/64/128, GQA 1..4 and MQA, 16/32 experts,
            top-4/8, softmax and sigmoid routers, windows 16/32, tied and
            untied): megakernel (bf16 weights) against transformers (fp32, the
            same bf16-rounded weights) on the GPU, teacher-forced.
  contexts  a tiny MoE with a 128K context (window 1000, 64-token pages):
            rows of 1, 1021, 4093 and 32765
            tokens decoded together (the last three cross a context bucket
            mid-generation, sliding layers evict), then one 131000-token row;
            against the fp32 reference (megac.reference.decode_row on the
            GPU, bf16-rounded weights), teacher-forced.
  nmc_full  North Mini Code, 49 layers, random weights drawn on the GPU:
            64 greedy steps of 4 rows (7, 30, 1020 and 2040 tokens: the last
            two cross context buckets mid-generation), then a layer-by-layer
            fp32 reference of each whole sequence (each layer upcast in turn)
            taking the kernel's expert choices (differences listed with their
            router-logit margins), per-step logits cosine, top-1 agreement.
  speed     decode step time, KV filled with noise (prefill skipped): NMC
            batch 1 and 8 at 8K, SmolLM2's shape (random weights: the same
            bytes) batch 1 at 1K and 8K, a per-opcode profile; the per-task
            fixed cost (chains of NOP tasks on one SM and across SMs).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

#: a CPU dry run of the check code: MEGAC_CHECK_DEVICE=cpu (VM backend)
DEV = os.environ.get("MEGAC_CHECK_DEVICE", "cuda")


def engine(spec, weights, backend=None, **kw):
    """An engine on ``backend`` (default: the megakernel, or the VM in a CPU
    dry run) with EngineOptions ``kw``."""
    from megac.engine.build import EngineOptions, build_engine

    backend = backend or ("cuda" if DEV == "cuda" else "cpu")
    # MEGAC_PLACEMENT_TRIALS: every cuda engine's placement tuned (megac.gpu.placement; default off,
    # as every measurement before the thirty-ninth session)
    kw.setdefault("placement_trials", int(os.environ.get("MEGAC_PLACEMENT_TRIALS", "0")))
    return build_engine(spec, weights, EngineOptions(backend=backend, **kw))


def generate_all(eng, prompts, n):
    """Greedy, ``n`` tokens per prompt, no EOS, logits kept."""
    from megac.engine.generate import generate

    return generate(eng, prompts, max_tokens=n, eos_token_ids=[], return_logits=True)



def cosine(a, b) -> float:
    import torch

    return float(torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0))


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None



# ---------------------------------------------------------------- batch
def check_batch() -> dict:
    import torch

    from megac.spec import load_spec
    from megac.weights import random_weights

    spec = load_spec("tiny-moe")
    w = random_weights(spec, seed=21, dtype=torch.bfloat16)
    lens = (1, 3, 17, 33, 64, 5, 40, 100)
    prompts = [[(31 * i + 7 * j + 1) % spec.vocab_size for j in range(n)] for i, n in enumerate(lens)]
    eng = engine(spec, w, max_batch_size=8, max_model_len=512)
    alone = [generate_all(eng, [p], 8)[0] for p in prompts]
    out = {}
    for b in range(1, 9):
        got = generate_all(eng, prompts[:b], 8)
        out[b] = all(g.tokens == a.tokens and all(torch.equal(x, y) for x, y in zip(g.logits, a.logits))
                     for g, a in zip(got, alone))
    return {"batch_equals_alone": out, "all": all(out.values())}


# ---------------------------------------------------------------- configs
def config_specs():
    from models import variant

    moe = "tiny-moe"
    sl = lambda w, ffn="moe", rope=True: {"attention": "sliding", "window": w, "rope": rope, "ffn": ffn}  # noqa: E731
    full = lambda ffn="moe", rope=True: {"attention": "full", "window": None, "rope": rope, "ffn": ffn}  # noqa: E731
    return [
        variant(moe, "cfg-moe-a", hidden_size=256, num_heads=8, num_kv_heads=2, head_dim=32, q_width=256,
                dense_intermediate_size=384, tie_embeddings=False, logit_scale=1.0,
                moe={"num_experts": 16, "top_k": 4, "expert_intermediate_size": 64, "router": "softmax",
                     "renormalize": False},
                layers=[full("dense"), sl(16), sl(16), full(rope=False), sl(16)]),
        variant(moe, "cfg-moe-b", hidden_size=128, num_heads=4, num_kv_heads=4, head_dim=64, q_width=256,
                dense_intermediate_size=256, logit_scale=0.25,
                moe={"num_experts": 32, "top_k": 8, "expert_intermediate_size": 48, "router": "sigmoid",
                     "renormalize": True},
                layers=[sl(32, "dense"), sl(32), full(rope=False)]),
        variant("tiny-llama", "cfg-llama-a", hidden_size=192, num_heads=6, num_kv_heads=2, head_dim=32, q_width=192,
                dense_intermediate_size=320, tie_embeddings=False, num_layers=3, layers=[full("dense")] * 3),
        variant("tiny-llama", "cfg-llama-b", hidden_size=256, num_heads=4, num_kv_heads=1, head_dim=128,
                q_width=512, dense_intermediate_size=512, num_layers=2, layers=[full("dense")] * 2),
    ]


def check_configs() -> dict:
    import torch

    from megac.weights import random_weights
    from models import hf_model

    out = {}
    for spec in config_specs():
        w = random_weights(spec, seed=5, dtype=torch.bfloat16)
        prompts = [[(13 * i + 5 * j + 2) % spec.vocab_size for j in range(n)] for i, n in enumerate((5, 40, 77))]
        steps = 10
        eng = engine(spec, w, max_batch_size=4, max_model_len=256)
        outs = generate_all(eng, prompts, steps)
        del eng
        model = hf_model(spec, w.to(torch.float32)).to(DEV).eval()
        cos, top1, free_equal, disagree = [], [], [], []
        with torch.no_grad():
            for p, o in zip(prompts, outs):
                seq = torch.tensor([p + o.tokens[:-1]], device=DEV)
                ref = model(input_ids=seq, use_cache=False).logits[0].float().cpu()
                for t in range(steps):
                    r = ref[len(p) - 1 + t]
                    cos.append(cosine(o.logits[t], r))
                    top1.append(int(r.argmax()) == o.tokens[t])
                    if not top1[-1]:  # the reference's margin of its choice over the megakernel's
                        disagree.append(round(float(r.max() - r[o.tokens[t]]), 5))
                g = model.generate(torch.tensor([p], device=DEV), max_new_tokens=steps, do_sample=False,
                                   min_new_tokens=steps)
                free_equal.append(g[0, len(p):].tolist() == o.tokens)
        out[spec.name] = {"min_cos": min(cos), "top1_agreement": sum(top1) / len(top1),
                          "greedy_equal_transformers": free_equal, "disagreement_margins": disagree}
        del model
        torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------- contexts
def context_spec(head_dim: int = 16):
    """tiny-moe with full and sliding (window 1000: a split's first key is
    rarely a multiple of 16) layers to 128K; ``head_dim`` 64 or 128: heads
    whose splits copy K/V in tensor-copy boxes (attn_mma.cuh), 16 the
    cp.async path."""
    from models import variant

    lay = [{"attention": "full", "window": None, "rope": True, "ffn": "dense"},
           {"attention": "sliding", "window": 1000, "rope": True, "ffn": "moe"},
           {"attention": "full", "window": None, "rope": False, "ffn": "moe"},
           {"attention": "sliding", "window": 1000, "rope": True, "ffn": "moe"}]
    base = __import__("megac.spec", fromlist=["load_spec"]).load_spec("tiny-moe")
    extra = {} if head_dim == 16 else {"head_dim": head_dim, "q_width": base.num_heads * head_dim}
    return variant(base, "ctx-moe" if head_dim == 16 else f"ctx-moe-hd{head_dim}", layers=lay, max_context=131072,
                   target={**base.target.model_dump(), "kv_block_size": 64, "attn_split_tokens": 1024}, **extra)


#: context_spec head sizes check contexts runs (16: cp.async splits; 64, 128: tensor-copy boxes)
CONTEXT_HEAD_DIMS = (16, 64, 128)


def _reference_run(w32, spec, prompt, tokens, chunk=4096):
    """fp32 reference logits of ``prompt`` then each of ``tokens[:-1]``."""
    import torch

    from megac.kv.paged import PagedKVCache
    from megac.prefill import prefill_row
    from megac.reference import decode_row

    n = len(prompt) + len(tokens)
    bs = spec.target.kv_block_size
    kv = PagedKVCache(spec, max_rows=1, num_blocks=(n + bs - 1) // bs * spec.num_layers + 8 * spec.num_layers,
                      dtype=torch.float32, max_context=spec.max_context, block_size=bs, device=DEV)
    row = kv.allocate_row()
    for a in range(0, len(prompt), chunk):
        lg = prefill_row(w32, spec, kv, row, prompt[a:a + chunk])
    out = [lg.cpu()]
    for t in tokens[:-1]:
        out.append(decode_row(w32, spec, kv, row, t).cpu())
    return out


def check_contexts() -> dict:
    """context_spec at each CONTEXT_HEAD_DIMS head size (labels suffixed
    _hd64 / _hd128), prompts to 128K, against the fp32 reference. With
    64 / 128 the KV pools start as NaN, so a key the splits must mask (past
    the row's last, or before a sliding window's first in a box) that leaked
    into a sum would show."""
    out = {}
    for hd in CONTEXT_HEAD_DIMS:
        got = _contexts(context_spec(hd), nan_pool=hd != 16)
        out.update({(k if hd == 16 else f"{k}_hd{hd}"): v for k, v in got.items()})
    return out


def _contexts(spec, nan_pool: bool) -> dict:
    import torch

    from megac.weights import random_weights

    w = random_weights(spec, seed=9, dtype=torch.bfloat16, device=DEV)
    w32 = w.to(torch.float32)
    g = torch.Generator().manual_seed(3)
    res = {}
    for label, lens, steps in (("mixed", (1, 1021, 4093, 32765), 8), ("128k", (131000,), 4)):
        prompts = [torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for n in lens]
        eng = engine(spec, w, max_batch_size=len(lens), max_model_len=spec.max_context, prefill_chunk=4096,
                      kv_cache_memory_gb=8.0, prefix_caching=False)
        if nan_pool:
            eng.backend.kv.k_pool.fill_(float("nan"))
            eng.backend.kv.v_pool.fill_(float("nan"))
        t0 = time.perf_counter()
        outs = generate_all(eng, prompts, steps)
        buckets = sorted({s.context for s in eng.backend.schedules.schedules})
        del eng
        torch.cuda.empty_cache()
        rows = []
        for p, o in zip(prompts, outs):
            ref = _reference_run(w32, spec, p, o.tokens)
            cos = [cosine(a, b) for a, b in zip(o.logits, ref)]
            rows.append({"len": len(p), "min_cos": min(cos),
                         "top1": sum(int(r.argmax()) == t for r, t in zip(ref, o.tokens)) / len(ref)})
        res[label] = {"rows": rows, "seconds": round(time.perf_counter() - t0, 1), "buckets": buckets}
    return res


# ---------------------------------------------------------------- NMC, 49 layers
def nmc_reference(w, spec, seq, dtype=None, routes=None):
    """fp32 logits [len(seq), vocab] of ``seq`` through every layer of the
    bf16 weights ``w`` (on the GPU), one layer upcast to ``dtype`` (fp32) at a
    time; ``routes`` (a list) receives each MoE layer's top-k sets and the
    router gap between the k-th and (k+1)-th logit."""
    import torch

    from megac.reference import apply_rope, attention, hf_rms_norm, layer_forward, rope_cos_sin

    dtype = dtype or torch.float32
    pos = torch.arange(len(seq), device=DEV)
    cos, sin = rope_cos_sin(spec, pos, dtype)
    x = w.embed[torch.tensor(seq, device=DEV)].to(dtype)
    for i, (ls, lw) in enumerate(zip(spec.layers, w.layers)):
        def attend(q, k, v, ls=ls):
            if ls.rope:
                q, k = apply_rope(q, cos, sin, spec.rope_style), apply_rope(k, cos, sin, spec.rope_style)
            return attention(q, k, v, pos, pos, ls.window, spec.head_dim ** -0.5)
        lw = lw.map(lambda t: t.to(dtype))
        if routes is not None and lw.router is not None:
            h = hf_rms_norm(x, lw.input_norm, spec.norm_eps)
            lg = torch.nn.functional.linear(h, lw.router).float()
            top = lg.topk(spec.moe.top_k + 1, dim=-1)
            routes.append((top.indices[:, :-1].sort(dim=-1).values.cpu(),
                           (top.values[:, -2] - top.values[:, -1]).cpu()))
        x = layer_forward(x, lw, spec, i, attend)
    hn = hf_rms_norm(x, w.final_norm.to(dtype), spec.norm_eps)
    head = w.lm_head_weight
    out = torch.cat([torch.nn.functional.linear(hn[a:a + 16], head.to(dtype)) for a in range(0, len(seq), 16)])
    return (out * spec.logit_scale).float()


class _Routes:
    """Patches megac.reference.route: ``record`` keeps each call's expert ids;
    ``force`` makes each call (MoE layers in order) take the given ids and
    notes where its own top-k set differs and by how much (the logit of its
    own k-th choice minus the lowest of the forced ones: a near-tie when
    small)."""

    def __init__(self):
        import megac.baselines.moe as M
        import megac.reference as R

        # the prefill's grouped experts route through baselines.moe's own
        # binding of the reference's route: patch both names
        self.R, self.M, self.orig = R, M, R.route
        self.recorded, self.forced, self.diffs = [], None, []

    def __enter__(self):
        self.R.route = self.M.reference_route = self._route
        return self

    def __exit__(self, *exc):
        self.R.route = self.M.reference_route = self.orig

    def _route(self, h, router, moe):
        import torch

        if self.forced is None:
            ids, w = self.orig(h, router, moe)
            self.recorded.append(ids.cpu())
            return ids, w
        ids = self.forced.pop(0).to(h.device)
        lg = torch.nn.functional.linear(h, router).float()
        own = lg.topk(moe.top_k, dim=-1)
        differ = (own.indices.sort(-1).values != ids.sort(-1).values).any(-1)
        if bool(differ.any()):
            margin = own.values[:, -1] - lg.gather(1, ids).min(-1).values
            self.diffs.append((int(differ.sum()), float(margin[differ].max())))
        else:
            self.diffs.append((0, 0.0))
        sel = lg.gather(1, ids)
        if moe.router == "softmax":
            w = torch.softmax(sel, dim=-1)
        else:
            w = torch.sigmoid(sel)
            if moe.renormalize:
                w = w / w.sum(-1, keepdim=True)
        return ids, w.to(h.dtype)


def routed_comparison(spec, w, prompts, steps: int, max_len: int = 1024, defines: dict | None = None) -> dict:
    """Greedy decode of ``prompts`` (one batch) on the megakernel, capturing
    its expert choices (prefill: the PyTorch prefill's; steps: the kernel's
    ``topk_ids``); then per row an fp32 reference of the whole sequence that
    takes those expert choices (listing every MoE layer where its own top-k
    differs, with the logit margin: near-ties), and the logits cosine per step.
    Random weights make routing flips cascade (bf16 PyTorch against fp32
    differs as much as the kernel does); with the choices shared, what is
    left is the arithmetic."""
    import torch

    eng = engine(spec, w, max_batch_size=len(prompts), max_model_len=max_len, kv_cache_memory_gb=4.0)
    be, kv = eng.backend, eng.kv
    if defines:  # a VARIANTS build of the same source
        use_cubin(be, variant_cubin(spec, defines))
    moe_layers = [i for i, ls in enumerate(spec.layers) if ls.ffn == "moe"]
    rows = [kv.allocate_row() for _ in prompts]
    routes = {r: [[] for _ in moe_layers] for r in rows}
    logits = {r: [] for r in rows}
    for r, p in zip(rows, prompts):
        with _Routes() as rec:
            logits[r].append(be.prefill(r, p).float().cpu())
        for j, ids in enumerate(rec.recorded):
            routes[r][j].append(ids)
    toks = {r: [int(logits[r][0].argmax())] for r in rows}
    seen = []  # (rows, context) of the schedule each step ran: buckets crossed mid-generation
    for _ in range(steps - 1):
        for r in rows:
            kv.append_slot(r)
        sched = be.schedules.for_rows(kv, rows)
        if not seen or seen[-1] != (sched.rows, sched.context):
            seen.append((sched.rows, sched.context))
        out = be.decode(rows, [toks[r][-1] for r in rows])
        ids = be.buf["topk_ids"].cpu()
        for i, r in enumerate(rows):
            logits[r].append(out[i].float())
            toks[r].append(int(out[i].argmax()))
            for j, layer in enumerate(moe_layers):
                routes[r][j].append(ids[layer, i:i + 1].long())
    kms = median(be.kernel_ms)
    del eng, be, kv
    torch.cuda.empty_cache()
    res = []
    with torch.no_grad():
        for r, p in zip(rows, prompts):
            seq = p + toks[r][:-1]
            with _Routes() as f:
                f.forced = [torch.cat(x) for x in routes[r]]
                ref = nmc_reference(w, spec, seq).cpu()
            at = [len(p) - 1 + t for t in range(steps)]
            cos = [cosine(logits[r][t], ref[a]) for t, a in enumerate(at)]
            ties = [(moe_layers[j], n, round(m, 5)) for j, (n, m) in enumerate(f.diffs) if n]
            res.append({"len": len(p), "min_cos": min(cos), "median_cos": median(cos),
                        "top1_agreement": sum(int(ref[a].argmax()) == toks[r][t] for t, a in enumerate(at)) / steps,
                        "positions": len(seq), "expert_choice_differences": sum(n for _, n, _ in ties),
                        "max_near_tie_margin": max((m for _, _, m in ties), default=0.0),
                        "differences_layer_count_margin": ties[:40]})
    return {"rows": res, "min_cos": min(x["min_cos"] for x in res), "kernel_ms_median": kms,
            "schedules_in_order": seen}


def check_nmc_full() -> dict:
    import torch

    from megac.spec import load_spec
    from megac.weights import random_weights

    spec = load_spec("north-mini-code")
    tiles = os.environ.get("MEGAC_CHECK_TILES")  # a TILES name: that tile set instead
    if tiles:
        spec = tile_spec(tiles, TILES[tiles])
    t0 = time.perf_counter()
    w = random_weights(spec, seed=0, dtype=torch.bfloat16, device=DEV)
    drawn = time.perf_counter() - t0
    # the last two rows cross the 1024 and 2048 context buckets mid-generation
    # (NMC's schedules differ there: (rows, 1024) -> (rows, 2048) -> (rows, 262144))
    g = torch.Generator().manual_seed(1)
    prompts = [[5, 17, 1234, 99, 255000, 7, 7], [(97 * j + 11) % spec.vocab_size for j in range(30)],
               torch.randint(0, spec.vocab_size, (1020,), generator=g).tolist(),
               torch.randint(0, spec.vocab_size, (2040,), generator=g).tolist()]
    out = routed_comparison(spec, w, prompts, 64, max_len=4096)
    out.update(draw_s=round(drawn, 1), gpu_mem_peak_gb=round(torch.cuda.max_memory_allocated() / 2 ** 30, 1))
    return out


# ---------------------------------------------------------------- every opcode's output
#: buffers compared exactly (ids, slots, queue records); the rest are floats
EXACT = ("topk_ids", "route_slot", "moe_up_queue", "moe_down_queue")


def compare_step(spec, prompts, tokens, batch: int) -> dict:
    """One decode step of ``prompts`` (then ``tokens``) on the megakernel and
    on the CPU VM in checked mode, from the same KV bits (the GPU prefill's,
    copied), every step-written buffer poisoned first on both (NaN, or
    abi.INT_POISON): per buffer, the same elements written (NaN where
    neither wrote), exact equality for ids, slots and queue records, the
    worst difference relative to the buffer's largest value for floats; the
    final counters equal; the same step again on fresh rows bit-identical."""
    import numpy as np
    import torch

    from megac import abi
    from megac.engine.build import EngineOptions, build_engine
    from megac.runtime.artifacts import load_or_compile
    from megac.weights import random_weights

    art = load_or_compile(spec, "tuned", batch_sizes=[batch])
    w = random_weights(spec, seed=17, dtype=torch.bfloat16)
    opts = dict(max_batch_size=batch, max_model_len=512, artifact=str(art.path), prefix_caching=False)
    gpu = build_engine(spec, w, EngineOptions(backend="cuda", **opts))
    vm = build_engine(spec, w, EngineOptions(backend="cpu", mode="checked", **opts))
    gb, vb = gpu.backend, vm.backend

    def rows_of(eng):
        rows = [eng.kv.allocate_row() for _ in prompts]
        for r, p in zip(rows, prompts):
            eng.backend.prefill(r, p)
        return rows

    g_rows, v_rows = rows_of(gpu), rows_of(vm)
    assert g_rows == v_rows and np.array_equal(gpu.kv.page_table, vm.kv.page_table)
    vm.kv.k_pool.copy_(gpu.kv.k_pool.cpu())
    vm.kv.v_pool.copy_(gpu.kv.v_pool.cpu())
    sched = gb.schedules.for_rows(gpu.kv, g_rows)
    for eng, rows in ((gpu, g_rows), (vm, v_rows)):
        for r in rows:
            eng.kv.append_slot(r)
    gb.poison = True
    g_logits = gb.decode(g_rows, tokens)
    v_logits = vb.decode(v_rows, tokens)
    st = vb.decode_step(vb.schedules.for_rows(vm.kv, v_rows)).st
    snap = {n: t.detach().cpu().clone() for n, t in gb.buf.items()}
    out = {"schedule": [sched.rows, sched.context], "buffers": {}}
    for name in gb._written:
        g, v = snap[name], st[name]
        if g.shape != v.shape:
            out["buffers"][name] = {"error": f"shape {list(g.shape)} vs {list(v.shape)}"}
            continue
        if name == "argmax_part":  # (value bits, index): the index exact, the value a logit
            gv, vv = g[..., 0].view(torch.float32), v[..., 0].to(torch.int32).view(torch.float32)
            out["buffers"][name] = {"index_exact": bool(torch.equal(g[..., 1], v[..., 1].to(g.dtype))),
                                    "value_max_rel_diff": float((gv - vv).abs().max() / vv.abs().max())}
            continue
        if not g.is_floating_point():
            out["buffers"][name] = {"exact": bool(torch.equal(g, v.to(g.dtype)))}
            continue
        gf, vf = g.float(), v.float()
        # NaN: written by neither; +-inf (an empty split's lse) must coincide too
        same_nan = bool(torch.equal(torch.isnan(gf), torch.isnan(vf))) and bool(
            torch.equal(torch.isinf(gf) & ~torch.isnan(gf), torch.isinf(vf) & ~torch.isnan(vf))) and bool(
            torch.equal(gf[torch.isinf(gf)], vf[torch.isinf(gf)]))
        ok = torch.isfinite(vf) & torch.isfinite(gf)
        scale = float(vf[ok].abs().max()) if bool(ok.any()) else 0.0
        worst = float((gf[ok] - vf[ok]).abs().max()) if bool(ok.any()) else 0.0
        out["buffers"][name] = {"same_elements_written": same_nan, "written": int(ok.sum()),
                                "max_rel_diff": worst / scale if scale else worst}
    gc_ = gb.buf["counters"].cpu().numpy().view(np.uint32)[: sched.num_counters].astype(np.int64)
    out["counters_equal"] = bool(np.array_equal(gc_, st.counters[: sched.num_counters]))
    out["logits_max_rel_diff"] = float((g_logits - v_logits).abs().max() / v_logits.abs().max())
    out["int_poison_left_in_exact_buffers"] = {n: int((snap[n] == abi.INT_POISON).sum()) for n in EXACT if n in snap}
    # the same step on fresh rows: bit-identical buffers
    for r in g_rows:
        gpu.kv.free_row(r)
    rows2 = rows_of(gpu)
    for r in rows2:
        gpu.kv.append_slot(r)
    g2 = gb.decode(rows2, tokens)
    same = {n: bool(torch.equal(torch.nan_to_num(snap[n].float(), nan=7.0),
                                torch.nan_to_num(gb.buf[n].detach().cpu().float(), nan=7.0)))
            for n in gb._written}
    out["repeat_bit_identical"] = all(same.values()) and bool(torch.equal(g2, g_logits))
    out["repeat_differs_in"] = [n for n, v in same.items() if not v]
    return out


def check_opcodes() -> dict:
    from megac.spec import load_spec
    from models import variant

    moe = load_spec("tiny-moe")
    lay = [{"attention": "full", "window": None, "rope": True, "ffn": "dense"},
           {"attention": "sliding", "window": 8, "rope": True, "ffn": "moe"}]
    spec = variant(moe, "replay-moe", layers=lay, tie_embeddings=False)
    llama = variant("tiny-llama", "replay-llama", num_layers=1,
                    layers=[{"attention": "full", "window": None, "rope": True, "ffn": "dense"}])
    prompts = [[(7 * i + 3 * j) % 256 for j in range(n)] for i, n in enumerate((5, 40, 19))]
    return {"replay-moe": compare_step(spec, prompts, [11, 12, 13], 4),
            "replay-llama": compare_step(llama, prompts[:1], [9], 1)}


# ---------------------------------------------------------------- speed
def _step_times(eng, batch: int, context: int, steps: int = 30) -> dict:
    import torch

    be, kv = eng.backend, eng.kv
    rows = _rows_at(kv, batch, context)
    be.kernel_ms.clear()
    wall = []
    for i in range(steps + 5):
        for r in rows:
            kv.append_slot(r)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        be.decode(rows, [(11 * i + r) % 1000 for r in rows])  # advances the rows
        wall.append((time.perf_counter() - t0) * 1e3)
    touched = _experts_touched(be, rows, getattr(be, "spec", None))
    for r in rows:
        kv.free_row(r)
    k = median(be.kernel_ms[5:])
    s = median(wall[5:])
    out = {"batch": batch, "context": context, "kernel_ms": round(k, 4), "step_ms": round(s, 4),
           "tok_s_kernel": round(batch * 1e3 / k, 1), "tok_s_step": round(batch * 1e3 / s, 1)}
    if touched is not None:
        out["experts_touched"] = touched
    return out


def _experts_touched(be, rows: list[int], spec) -> int | None:
    """The (expert, layer) pairs the last step's rows routed to (``topk_ids``,
    MoE layers only), past one row, else None. Why: two builds with other
    bits decode other tokens, so at batch > 1 their rows share other experts
    and their steps move other bytes (forty-seventh session: +0.9 % expert
    bytes between the default and norc at batch 8); A/B timings there are
    read against this count."""
    import torch

    ids = getattr(be, "buf", {}).get("topk_ids")
    if ids is None or spec is None or spec.moe is None or len(rows) < 2:
        return None
    moe_layers = [i for i, ls in enumerate(spec.layers) if ls.ffn == "moe"]
    got = ids[moe_layers][:, rows, :].to(torch.int64).cpu()
    return int(sum(torch.unique(got[i]).numel() for i in range(len(moe_layers))))


def engine_addresses(eng) -> dict:
    """Where an engine's KV pools, weights and step buffers landed (device
    addresses, hex): engines of one spec run ~2.58 or ~2.66 ms at batch 1
    (thirty-second session), and these are what differs between them."""
    be, kv = eng.backend, eng.kv
    w = [t.data_ptr() for t in getattr(be, "kernel_weights", {}).values()]
    b = [t.data_ptr() for t in getattr(be, "buf", {}).values() if hasattr(t, "data_ptr")]
    return {"k_pool": hex(kv.k_pool.data_ptr()), "v_pool": hex(kv.v_pool.data_ptr()),
            "weights": [hex(min(w)), hex(max(w))] if w else None, "buffers": [hex(min(b)), hex(max(b))] if b else None}


def _noise_kv(eng):
    """N(0, 0.01) KV noise: the same fill as ``megac bench``."""
    from megac.decode_bench import fill_kv_noise

    fill_kv_noise(eng.kv)


def _rows_at(kv, batch: int, context: int) -> list[int]:
    from megac.decode_bench import rows_at

    return rows_at(kv, batch, context)


def _run_fake(eng, sched, tasks, counts, num_counters, batch, context, steps=12, watchdog_s=1.0):
    """Median kernel ms of ``batch`` fresh rows at ``context`` decoded with
    ``sched``'s task list replaced by ``tasks``/``counts`` (the other
    schedules untouched); None when it hangs."""
    import numpy as np
    import torch

    from megac.gpu.backend import MegakernelHang

    be, kv = eng.backend, eng.kv
    fake = dataclasses.replace(sched, tasks=np.ascontiguousarray(tasks, dtype=np.int32),
                               task_counts=np.asarray(counts, dtype=np.int32), num_counters=int(num_counters))
    if be.buf["counters"].numel() < num_counters:
        be.reserve_counters(int(num_counters))
    be.tasks[id(fake)] = (torch.from_numpy(fake.tasks).to(be.dev), torch.from_numpy(fake.task_counts).to(be.dev))
    good, wd = be.schedules.schedules, be.watchdog_ns
    be.schedules.schedules = [fake if x is sched else x for x in good]
    be.watchdog_ns = int(watchdog_s * 1e9)
    be._desc_cache.clear()
    be.kernel_ms.clear()
    rows = _rows_at(kv, batch, context)
    try:
        for _ in range(steps):
            for r in rows:
                kv.append_slot(r)
            be.decode(rows, [1] * len(rows))
        return median(be.kernel_ms[3:])
    except MegakernelHang:
        return None
    finally:
        for r in rows:
            kv.free_row(r)
        be.schedules.schedules, be.watchdog_ns = good, wd
        be._desc_cache.clear()
        del be.tasks[id(fake)]


def fixed_cost(eng, n: int = 4096) -> dict:
    """Per-task fixed cost: ``n`` NOP tasks on one SM (dispatch only), and a
    chain of ``n`` NOP tasks dealt k mod S over the SMs, each waiting on the
    one before (dispatch + a cross-SM counter hand-off); against the same
    launch with no tasks."""
    import numpy as np

    from megac import abi
    from megac.abi import H, Op

    be = eng.backend
    sched = be.schedules.pick(1, be.schedules.schedules[0].context)
    S = sched.num_sms
    res = {}
    for kind in ("empty", "one_sm", "chain"):
        per = {"empty": 0, "one_sm": n, "chain": (n + S - 1) // S}[kind]
        t = np.zeros((S, max(per, 1), abi.TASK_WORDS), dtype=np.int32)
        t[:, :, [H.WAIT0, H.WAIT1, H.SIGNAL]] = -1
        t[:, :, H.OPCODE] = int(Op.NOP)
        counts = np.zeros(S, dtype=np.int32)
        if kind == "one_sm":
            counts[0] = n
        elif kind == "chain":
            for k in range(n):
                s, j = k % S, k // S
                t[s, j, H.SIGNAL] = k
                if k:
                    t[s, j, H.WAIT0], t[s, j, H.TARGET0] = k - 1, 1
                counts[s] = j + 1
        res[kind + "_ms"] = _run_fake(eng, sched, t, counts, max(n, 1), 1, 1, steps=25)
    return {"tasks": n, "dispatch_us_per_task": round((res["one_sm_ms"] - res["empty_ms"]) * 1e3 / n, 4),
            "chained_us_per_task": round((res["chain_ms"] - res["empty_ms"]) * 1e3 / n, 4), **res}


def op_profile(eng, batch: int, context: int) -> dict:
    """Where a step's time goes: the whole step; every task with its waits
    cleared (no dependencies: the pure work at full parallelism); and, per
    opcode that claims nothing, only that opcode's tasks (the rest NOPs, no
    waits), with their task count."""
    import numpy as np

    from megac import abi
    from megac.abi import H, Op

    be, kv = eng.backend, eng.kv
    rows = _rows_at(kv, batch, context)
    sched = be.schedules.for_rows(kv, rows)
    for r in rows:
        kv.free_row(r)
    run = lambda t, c: _run_fake(eng, sched, t, c, sched.num_counters, batch, context)  # noqa: E731
    t0, counts = np.asarray(sched.tasks), np.asarray(sched.task_counts)
    live = np.arange(t0.shape[1])[None, :] < counts[:, None]
    out = {"batch": batch, "context": context, "tasks": int(counts.sum()),
           "full_ms": run(t0, counts)}
    free = t0.copy()
    free[:, :, H.WAIT0] = -1
    free[:, :, H.WAIT1] = -1
    out["no_waits_ms"] = run(free, counts)
    ops = sorted({int(o) for o in t0[live][:, H.OPCODE]})
    for op in ops:
        if op in abi.CLAIMERS or op == int(Op.NOP):
            continue
        only = free.copy()
        other = live & (t0[:, :, H.OPCODE] != op)
        only[other, H.OPCODE] = int(Op.NOP)
        out[Op(op).name] = {"tasks": int((live & ~other).sum()),
                            "ms": run(only, counts)}
    return out


def host_profile(eng, batch: int, context: int, steps: int = 20, top: int = 25) -> dict:
    """Where the host's part of a step goes: cProfile over ``steps`` greedy
    decode_sample steps (the serving path), the top functions by own time
    and by cumulative time, and wall vs kernel ms per step."""
    import cProfile
    import io
    import pstats

    import torch

    from megac.sampling import RowSampling, SamplingParams

    be, kv = eng.backend, eng.kv
    rows = _rows_at(kv, batch, context)
    greedy = [RowSampling(SamplingParams(temperature=0.0), None) for _ in rows]
    toks = [1] * len(rows)

    def one():
        for r in rows:
            kv.append_slot(r)
        return be.decode_sample(rows, toks, greedy)[0]

    for _ in range(3):
        one()
    torch.cuda.synchronize()
    be.kernel_ms.clear()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        one()
    prof.disable()
    wall = (time.perf_counter() - t0) * 1e3 / steps
    for r in rows:
        kv.free_row(r)
    out = {"wall_ms_per_step": round(wall, 3), "kernel_ms": round(median(be.kernel_ms), 3)}
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
        out[key] = buf.getvalue().splitlines()[-top - 2:]
    return out


def check_speed() -> dict:
    import torch

    from megac.spec import load_spec
    from megac.weights import random_weights

    out = {}
    spec = load_spec("north-mini-code")
    w = random_weights(spec, seed=0, dtype=torch.bfloat16, device=DEV)
    eng = engine(spec, w, max_batch_size=8, max_model_len=8192 + 64, num_kv_blocks=40000)
    _noise_kv(eng)
    out["nmc"] = [_step_times(eng, b, 8192) for b in (1, 8)]
    out["fixed_cost"] = fixed_cost(eng)
    out["nmc_profile_bs1"] = op_profile(eng, 1, 8192)
    out["nmc_host_bs1"] = host_profile(eng, 1, 8192)
    del eng, w
    torch.cuda.empty_cache()
    # SmolLM2's shape with random weights: the same bytes move as with the real ones
    spec = load_spec("smollm2-135m")
    eng = engine(spec, random_weights(spec, seed=0, dtype=torch.bfloat16, device=DEV), max_batch_size=1,
                  max_model_len=8192)
    _noise_kv(eng)
    out["smollm2"] = [_step_times(eng, 1, c) for c in (1024, 8192 - 64)]
    out["smollm2_profile_bs1"] = op_profile(eng, 1, 1024)
    return out


#: device-code variants the speed push compares (compile-time switches of
#: opcodes/, MEGAC_* macros; see docs/perf-notes.md); "default" is the
#: headers' own setting
VARIANTS = {
    "default": {},  # tensor-core GEMM (bulk-copy rings 2 x 8 KB), tensor-core attention splits
    # the twenty-eighth session's default: the ring walk's divisions every stage, the count and scan
    # placement, X loaded into registers, the down claims' rings started after their waits
    "s28_default": {"MEGAC_TC_WALK_POS": 0, "MEGAC_ROUTED_ONE_ROW": 0, "MEGAC_X_ASYNC": 0, "MEGAC_DOWN_PRIME": 0},
    # the GEMM rings walked with a cursor: the stage divisions once an item (gemm_tc.cuh WalkPos)
    "walkpos": {"MEGAC_TC_WALK_POS": 1},
    "walkpos_rank": {"MEGAC_TC_WALK_POS": 1, "MEGAC_TOPK_RANK_HALVES": 1},  # and the ranking on two threads a logit
    # and a one-row routed claimer placing its experts by their ids (ops_moe.cuh MEGAC_ROUTED_ONE_ROW)
    "walkpos_1row": {"MEGAC_TC_WALK_POS": 1, "MEGAC_ROUTED_ONE_ROW": 1},
    # rings of 4 x 4 KB a warp with the cursor: the same bytes in flight, a slot refilled after half the
    # bytes (2 x 8 KB won when each stage paid its divisions: "the cost is per stage")
    "walkpos_4x4": {"MEGAC_TC_WALK_POS": 1, "MEGAC_TC_STAGES": 4, "MEGAC_TC_STAGE_BLOCKS": 4},
    # and X staged by cp.async so the prime call does not wait for it (gemm_tc.cuh MEGAC_X_ASYNC)
    "wp_x": {"MEGAC_TC_WALK_POS": 1, "MEGAC_ROUTED_ONE_ROW": 1, "MEGAC_X_ASYNC": 1},
    "walkpos_x": {"MEGAC_TC_WALK_POS": 1, "MEGAC_X_ASYNC": 1},
    # and a down claim whose expert's up tiles still run primes its ring before its wait (ops_moe.cuh
    # MEGAC_DOWN_PRIME)
    "wp_dp": {"MEGAC_TC_WALK_POS": 1, "MEGAC_ROUTED_ONE_ROW": 1, "MEGAC_DOWN_PRIME": 1},
    "wp_x_dp": {"MEGAC_TC_WALK_POS": 1, "MEGAC_ROUTED_ONE_ROW": 1, "MEGAC_X_ASYNC": 1, "MEGAC_DOWN_PRIME": 1},
    # rings of 2 x 10 KB a warp (160 KB an SM) with the cursor: alone an SM streams faster with more in
    # flight (twenty-second session's sm_stream), and a stage's cost is now smaller
    # every down claim primes before its wait (MEGAC_DOWN_PRIME 2), its counter unread until then
    "dp2": {"MEGAC_DOWN_PRIME": 2},
    # a claimed attention split (a full layer's at batch 1) primes its first chunks before its wait
    # (ops_attention.cuh MEGAC_ATTN_CLAIM_PRIME), as a static split does
    "acp": {"MEGAC_ATTN_CLAIM_PRIME": 1},
    "dp2_acp": {"MEGAC_DOWN_PRIME": 2, "MEGAC_ATTN_CLAIM_PRIME": 1},
    # a routed up claimer whose first index is past every claim the step can have stops before it
    # ranks (ops_moe.cuh MEGAC_UP_DRAINED_STOP): a drained claimer ~3.2 us -> ~1 us
    "uds": {"MEGAC_UP_DRAINED_STOP": 1},
    "uds_acp": {"MEGAC_UP_DRAINED_STOP": 1, "MEGAC_ATTN_CLAIM_PRIME": 1},
    "wp_st10": {"MEGAC_TC_WALK_POS": 1, "MEGAC_ROUTED_ONE_ROW": 1, "MEGAC_TC_STAGE_BLOCKS": 10},
    "walkpos_3x6": {"MEGAC_TC_WALK_POS": 1, "MEGAC_TC_STAGES": 3, "MEGAC_TC_STAGE_BLOCKS": 6},  # 144 KB in flight
    "rows": {"MEGAC_TC_GEMM": 0},  # row-major weights, the CUDA-core row GEMM
    "regs": {"MEGAC_TC_BULK": 0},  # tensor-core tile, weights straight into registers
    "attn_tiles": {"MEGAC_ATTN_MMA": 0},  # attention splits on the CUDA cores (attn_tiles.cuh)
    "attn3": {"MEGAC_ATTN_MMA_STAGES": 3},  # tensor-core splits, 2 chunks in flight per warp
    # the splits' K/V through 16-byte cp.async by every lane (the default: tensor-copy boxes where the
    # launch has the pools' tensor maps; MEGAC_KV_TMAPS=0 takes the same path in the default build)
    "attn_cpasync": {"MEGAC_ATTN_TMA": 0},
    "attn_tma3": {"MEGAC_ATTN_TMA_STAGES": 3},  # tensor-copy rings of 3 chunks per warp
    # a static split's first tensor-copy chunks issued when it runs (the default issues them before its
    # waits at batch 1, older keys only: ops_attention.cuh attn_prime); at every batch size
    "attn_noprime": {"MEGAC_ATTN_PRIME": 0},
    # stages per warp a merging O-projection tile primes before its waits (default 1)
    "merge_p0": {"MEGAC_MERGE_PRIME": 0},
    "merge_p2": {"MEGAC_MERGE_PRIME": 2},
    # an O-projection tile's weights pulled into L2 while the task before it (its SM's attention
    # split) runs
    "oproj_l2": {"MEGAC_PREFETCH": 2, "MEGAC_OPROJ_L2": 1},
    "attn_prime_all": {"MEGAC_ATTN_PRIME_ROWS": 65536},
    # a split's page-table entries one chunk ahead (the default loads them at once up front)
    "attn_behind": {"MEGAC_ATTN_AHEAD": 0},
    # the GEMM tile inlined into each opcode (the default shares one copy: less cold code); the
    # attention split shared as well
    "tc_inline": {"MEGAC_TC_NOINLINE": 0},
    "attn_noinline": {"MEGAC_ATTN_NOINLINE": 1},
    # a proxy fence before each ring slot's refill (the default has none, as CUTLASS's TMA pipelines)
    "stage_fence": {"MEGAC_TC_STAGE_FENCE": 1},
    # smaller bulk-copy stages: less in flight per SM (2 x 8 KB x 8 warps = 128 KB by default), so
    # less queueing in the memory system for the latency-bound tasks beside the streams
    "st4": {"MEGAC_TC_STAGE_BLOCKS": 4},
    "st6": {"MEGAC_TC_STAGE_BLOCKS": 6},
    "st4x3": {"MEGAC_TC_STAGE_BLOCKS": 4, "MEGAC_TC_STAGES": 3},
    # deeper rings, in the shared memory the default leaves (~53 KB of 227): if an SM streams at
    # what its ring holds over the loaded latency, more in flight streams faster
    # a routed up claim's rows staged through L2 as each claim starts (the default pulls them into
    # the claimer's L1 while it ranks: gemm_tc.cuh MEGAC_UP_X_L1)
    "up_x_cg": {"MEGAC_UP_X_L1": 0},
    # the launch descriptor read from global memory (the default copies it into shared memory at the
    # CTA's start: megakernel.cuh MEGAC_DESC_SMEM)
    "desc_global": {"MEGAC_DESC_SMEM": 0},
    # the descriptor in shared memory, its layer-slot and RoPE tables read from global memory
    "desc_only": {"MEGAC_DESC_TABLES": 0},
    # an unprimed tile (an expert claim) stages its X, then issues its first ring stages (the default
    # issues them between its X loads and stores: gemm_tc.cuh MEGAC_X_THEN_PRIME)
    "x_then_ring": {"MEGAC_X_THEN_PRIME": 0},
    # (stages of an even number of blocks: gemm_tc.cuh mma_block)
    "st10": {"MEGAC_TC_STAGE_BLOCKS": 10},
    "st6x3": {"MEGAC_TC_STAGE_BLOCKS": 6, "MEGAC_TC_STAGES": 3},
    "st4x5": {"MEGAC_TC_STAGE_BLOCKS": 4, "MEGAC_TC_STAGES": 5},
    # a static split's keys toward L2 before its waits (ops_attention.cuh); 2: evict_last
    "attn_warm": {"MEGAC_ATTN_WARM": 1},
    "attn_warm_last": {"MEGAC_ATTN_WARM": 2},
    # ADD_RMSNORM's gamma toward L2 before its waits (ops_norm.cuh)
    "norm_warm": {"MEGAC_NORM_WARM": 1},
    # the abort flag read once per 16 polls (the default reads it before every poll: two dependent
    # round trips a poll, so a hop's wait ends up to a round trip later; common.cuh SpinBound)
    "abort16": {"MEGAC_ABORT_EVERY": 16},
    # a counter's signal as fence.acq_rel.gpu + a relaxed reduction (the default: fence.sc.gpu + add)
    "sig_acqrel": {"MEGAC_SIGNAL_ACQREL": 1},
    # a task's two waits polled together (mk_core.cuh header_waits; the default waits one, then the other)
    "pair": {"MEGAC_WAIT_PAIR": 1},
    "hops": {"MEGAC_ABORT_EVERY": 16, "MEGAC_SIGNAL_ACQREL": 1, "MEGAC_WAIT_PAIR": 1},
    # ROUTER_TOPK's rank counted on two threads per logit (moe_routing.cuh); MoE models only
    "rank_halves": {"MEGAC_TOPK_RANK_HALVES": 1},
    # one row summed and ranked by warp 0 in registers (warp reductions), and a routed claimer's
    # placement from them, one barrier (moe_routing.cuh, ops_moe.cuh); MoE models only
    "topk_warp": {"MEGAC_TOPK_WARP": 1},
    # and the first claim's X copies and ring stages issued by the whole CTA before the claim loop
    # hands the record over (ops_moe.cuh MEGAC_UP_FIRST_EARLY; refused beside router_combine, the
    # default since the forty-fifth session: its claims wait on the norm after the ranking)
    "topk_warp_fe": {"MEGAC_TOPK_WARP": 1, "MEGAC_UP_FIRST_EARLY": 1},
    # a down claimer takes one claim at most while the layer's down claims fit one an SM
    # (ops_moe.cuh MEGAC_DOWN_ONE_CLAIM); and with the one-row ranking on warp 0
    "dc1": {"MEGAC_DOWN_ONE_CLAIM": 1},
    "topk_warp_dc1": {"MEGAC_TOPK_WARP": 1, "MEGAC_DOWN_ONE_CLAIM": 1},
    # a claim whose counter the first (acquire) read finds met goes on from it, no second read
    # (mk_core.cuh MEGAC_CLAIM_ONE_READ); and with the one-row ranking on warp 0
    "one_read": {"MEGAC_CLAIM_ONE_READ": 1},
    "topk_warp_or": {"MEGAC_TOPK_WARP": 1, "MEGAC_CLAIM_ONE_READ": 1},
    # a routed up claimer stops after one claim where the layer's claims fit one an SM (ops_moe.cuh
    # MEGAC_UP_ONE_CLAIM): its next task (an O-projection tile, a late down claim) a round trip sooner;
    # and with the one-row ranking on warp 0 and the one read
    "uc1": {"MEGAC_UP_ONE_CLAIM": 1},
    "topk_warp_or_uc1": {"MEGAC_TOPK_WARP": 1, "MEGAC_CLAIM_ONE_READ": 1, "MEGAC_UP_ONE_CLAIM": 1},
    # (those three are the default since the thirty-sixth session, with TILES s35's tiles and order:
    # the variants above build what the default does) the build before: all three off
    "off35": {"MEGAC_TOPK_WARP": 0, "MEGAC_CLAIM_ONE_READ": 0, "MEGAC_UP_ONE_CLAIM": 0},
    # the combine polls the down tiles' outputs instead of their counter (common.cuh MEGAC_COMBINE_POLL)
    "cpoll": {"MEGAC_COMBINE_POLL": 1},
    # a down claim takes two adjacent records but for the queue's last 26 / 16 (mk_core.cuh MEGAC_DOWN_PAIRS)
    "dpair": {"MEGAC_DOWN_PAIRS": 26},
    "dpair16": {"MEGAC_DOWN_PAIRS": 16},
    # a routed up claim takes two adjacent up tiles but for the layer's last 56 / 48 claims (mk_core.cuh
    # MEGAC_UP_PAIRS; with 128-row up tiles: the ~19 early claimers 1 MB each, the late ones 512 KB);
    # upair_dpair: and the down claims paired as dpair's
    "upair": {"MEGAC_UP_PAIRS": 56},
    "upair48": {"MEGAC_UP_PAIRS": 48},
    "upair_dpair": {"MEGAC_UP_PAIRS": 56, "MEGAC_DOWN_PAIRS": 26},
    # a timing probe (norm.cuh MEGAC_SLOTS_EARLY: its reads are not ordered, its values may be the last
    # step's): the folds' slots and scores loaded before the task's waits, one L2 round trip off the
    # QKV and router tiles that start both of a MoE layer's chains
    "slots_early": {"MEGAC_SLOTS_EARLY": 1},
    # profile builds: stamps inside the folds (norm.cuh MEGAC_FOLD_MARKS; no other effect)
    "fold_marks": {"MEGAC_FOLD_MARKS": 1},
    # a QKV tile primes one stage a warp / none / its whole ring before its waits (ops_gemm.cuh
    # MEGAC_QKV_PRIME; the same bits; 1 the default where the QKV tiles fold the combine since the
    # fifty-second session, qkvp_ring the code before it)
    "qkvp1": {"MEGAC_QKV_PRIME": 1},
    "qkvp0": {"MEGAC_QKV_PRIME": 0},
    "qkvp_ring": {"MEGAC_QKV_PRIME": -1},
    # a one-row routed up claimer reads its claims' wait (the norm's counter) while it ranks (ops_moe.cuh
    # MEGAC_UP_WAIT_EARLY; the same bits)
    "up_wait_early": {"MEGAC_UP_WAIT_EARLY": 1},
    # a wait keeps 2 / 4 polls of its counter in flight, a round trip / D apart (counters.cuh
    # MEGAC_POLL_DEPTH; a count is seen ~a round trip / D after it lands, not ~one); poll_ns0: one
    # poll in flight, no sleep between polls (MEGAC_POLL_SLEEP_NS 0). The same bits.
    "poll2": {"MEGAC_POLL_DEPTH": 2, "MEGAC_POLL_GAP_CYCLES": 800},
    "poll4": {"MEGAC_POLL_DEPTH": 4, "MEGAC_POLL_GAP_CYCLES": 400},
    "poll_ns0": {"MEGAC_POLL_SLEEP_NS": 0},
    # one poll in flight, 200 / 800 ns between a poll's return and the next: fewer polls against the
    # counter's L2 slice (the signaller's add is served there), each count seen later
    "poll_ns200": {"MEGAC_POLL_SLEEP_NS": 200},
    "poll_ns800": {"MEGAC_POLL_SLEEP_NS": 800},
    # a one-row routed claimer polls the router's partials instead of its counter; a layer's finalize
    # writes the layer before's back to unlanded (common.cuh MEGAC_ROUTER_POLL; the same bits)
    "router_poll": {"MEGAC_ROUTER_POLL": 1},
    # a timing probe on router_poll (common.cuh MEGAC_PROBE_UP_NO_NORM: the polling claimers' claims skip
    # their wait on the norm; wrong logits): how much of the expert chain's head the norm still gates
    "rpoll_nonorm": {"MEGAC_ROUTER_POLL": 1, "MEGAC_PROBE_UP_NO_NORM": 1},
    # and with the claims' wait on the norm read while warp 0 polls and ranks (MEGAC_UP_WAIT_EARLY)
    "router_poll_uwe": {"MEGAC_ROUTER_POLL": 1, "MEGAC_UP_WAIT_EARLY": 1},
    # the polling claimer waits on its claims' norm first, then reads the partials (MEGAC_ROUTER_POLL 2: no polls
    # while the router runs, the claims' wait met before the ranking; fifty-fourth session)
    "router_poll_norm": {"MEGAC_ROUTER_POLL": 2},
    # the polls in the full-attention layers alone (common.cuh MEGAC_ROUTER_POLL_FULL: the fifty-fourth
    # session's profiles gave the poll -1.1 us a full layer, +1.7 us a sliding one)
    "router_poll_full": {"MEGAC_ROUTER_POLL": 1, "MEGAC_ROUTER_POLL_FULL": 1},
    "router_poll_norm_full": {"MEGAC_ROUTER_POLL": 2, "MEGAC_ROUTER_POLL_FULL": 1},
    # a probe of the poll build's fixed costs: MEGAC_ROUTER_POLL's code with no layer polling (the masks
    # emptied; every finalize still writes the partials back): rpf lost 1.09 % (fifty-fifth session, H100)
    # where the profiles gave its full layers -1.1 us and left its sliding layers as the default's
    "router_poll_none": {"MEGAC_ROUTER_POLL": 1, "MEGAC_ROUTER_POLL_FULL": 1, "MEGAC_FULL_LAYERS_LO": 0,
                         "MEGAC_FULL_LAYERS_HI": 0},
    # a timing probe (norm.cuh MEGAC_PROBE_FOLD_HALF: wrong sums): the vector folds (the QKV tiles', the norm
    # task's) load half their partial sets and expert rows, the bytes bf16 planes would leave them
    "fold_half": {"MEGAC_PROBE_FOLD_HALF": 1},
    # a timing probe (mk_core.cuh MEGAC_PROBE_QKV_NO_WAIT: wrong logits): the folding QKV tiles skip their header
    # waits, the bound of any pipelined layer boundary on the attention chain
    "qkv_no_wait": {"MEGAC_PROBE_QKV_NO_WAIT": 1},
    # a QKV tile's weights toward L2 as the tile starts, before its waits (the layer before's tail)
    # (ops_gemm.cuh MEGAC_QKV_L2); 2: evict_last
    "qkvl2": {"MEGAC_QKV_L2": 1},
    "qkvl2e": {"MEGAC_QKV_L2": 2},
    # and the SM's next O-projection tile toward L2 (megakernel.cuh MEGAC_OPROJ_AHEAD): as the QKV tile
    # starts (1: the tail), or as the task after it starts (2: the routing hole)
    "qkvl2_ot": {"MEGAC_QKV_L2": 1, "MEGAC_OPROJ_AHEAD": 1},
    "qkvl2_oh": {"MEGAC_QKV_L2": 1, "MEGAC_OPROJ_AHEAD": 2},
    # a routed claimer loads all 8 router partials of its logits at once (moe_routing.cuh
    # MEGAC_TOPK_WARP_SPLITS; 4: two L2 round trips at batch 1)
    "rs8": {"MEGAC_TOPK_WARP_SPLITS": 8},
    # the GEMM walk's divisions as shifts and masks for powers of two (gemm_tc.cuh MEGAC_TC_POW2_DIV)
    "p2div": {"MEGAC_TC_POW2_DIV": 1},
    "p2div_rs8": {"MEGAC_TC_POW2_DIV": 1, "MEGAC_TOPK_WARP_SPLITS": 8},
    # tile_bulk's prologue run before a static GEMM task's waits (gemm_tc.cuh MEGAC_TC_WARM)
    "tcwarm": {"MEGAC_TC_WARM": 1},
    # stamps pinned through tile_bulk's prologue (gemm_tc.cuh MEGAC_TC_BISECT; profiled builds)
    "tcbisect": {"MEGAC_TC_BISECT": 1},
    # prime() leaves the walk and its cursors for tile_bulk (gemm_tc.cuh MEGAC_TC_WALK_CACHE)
    "tcwc": {"MEGAC_TC_WALK_CACHE": 1},
    "tcwc_bisect": {"MEGAC_TC_WALK_CACHE": 1, "MEGAC_TC_BISECT": 1},
    # the step's per-row words (seq_pos, row_active) copied into shared memory at launch
    # (megakernel.cuh MEGAC_DESC_ROWS)
    "rowsmem": {"MEGAC_DESC_ROWS": 1},
    # the residual form of COMBINE_IN loads an element's rows together (ops_norm.cuh MEGAC_RESID_BATCH)
    "rbatch": {"MEGAC_RESID_BATCH": 1},
    # ROUTER_TOPK starts the selected experts' first bytes toward L2 (ops_moe.cuh); MoE models only
    "pf_up16": {"MEGAC_TOPK_PREFETCH_UP_KB": 16},
    "pf_up32": {"MEGAC_TOPK_PREFETCH_UP_KB": 32},
    "pf_up64": {"MEGAC_TOPK_PREFETCH_UP_KB": 64},
    "pf_up32_dn24": {"MEGAC_TOPK_PREFETCH_UP_KB": 32, "MEGAC_TOPK_PREFETCH_DOWN_KB": 24},
    # a down claim whose inputs are not ready pulls its whole tile toward L2 before its wait
    # (ops_moe.cuh); 2: evict_last
    "down_l2": {"MEGAC_DOWN_CLAIM_L2": 1},
    "down_l2_last": {"MEGAC_DOWN_CLAIM_L2": 2},
    # the tensor-core tile's prime inlined into every caller (gemm_tc.cuh; one copy since the
    # seventeenth session)
    "prime_inline": {"MEGAC_TC_PRIME_NOINLINE": 0},
    # the opcodes' scratch where every build before the eighteenth session had it: right after
    # TaskShared's 960 bytes, 64 bytes past a 128-byte line (mk_core.cuh; 1024-aligned by default)
    "scratch64": {"MEGAC_SCRATCH_ALIGN": 64},
    # the tensor-core tile's bulk-copy ring 1024-aligned in the scratch (ops_gemm.cuh; 128 by default,
    # where North Mini Code's ring lands 512 bytes past a 1 KB line)
    "ring1024": {"MEGAC_TC_RING_ALIGN": 1024},
    # ADD_RMSNORM's planes through 32-bit loads (norm.cuh's add_rmsnorm; float4 loads by default since
    # the nineteenth session; its sum of squares runs in another order, so its bits may differ from the
    # default's by a few ulp of the scale)
    "norm_scalar": {"MEGAC_NORM_VEC": 0},
}
#: variants that change nothing in a dense model (not built for one)
MOE_ONLY_VARIANTS = {"uds", "up_x_cg", "rank_halves", "topk_warp", "topk_warp_fe", "dc1", "topk_warp_dc1", "walkpos_rank", "walkpos_1row", "wp_x", "pf_up16", "pf_up32", "pf_up64", "pf_up32_dn24", "down_l2", "down_l2_last"}
#: the per-task timeline build (megac/gpu/profile.py)
PROFILE = {"MEGAC_PROFILE": 1}
VARIANT_MODELS = ("north-mini-code", "smollm2-135m")


def variants_for(spec) -> dict:
    """The VARIANTS a check builds for ``spec``: MEGAC_VARIANTS (comma list)
    narrows them (``default`` always stays, the baseline of the comparison)."""
    import os

    pick = os.environ.get("MEGAC_VARIANTS")
    names = [v for v in VARIANTS if not pick or v == "default" or v in pick.split(",")]
    if not spec.moe:
        names = [v for v in names if v not in MOE_ONLY_VARIANTS]
    return {v: VARIANTS[v] for v in names}


def variant_cubin(spec, defines, order: str = "tuned"):
    """The megakernel cubin of ``spec`` (its ``order`` artifact) built with
    ``defines`` (cached in build/cubin; built here where nvcc exists)."""
    from megac.codegen.megakernel import SOURCE
    from megac.gpu.build import build_cubin
    from megac.resources import opcodes_dir
    from megac.runtime.artifacts import load_or_compile

    got = load_or_compile(spec, order)
    return build_cubin(got.path / SOURCE, include_dirs=[opcodes_dir(), got.path], defines=defines or None)


def use_cubin(be, cubin) -> None:
    """Swap the backend's megakernel for another build of the same source."""
    be.use_cubin(cubin)


def interleaved_kernel_ms(eng, cubins: dict, cases, rounds: int = 2, steps: int = 12) -> dict:
    """build name -> {"bs{b}_ctx{ctx}": median kernel ms} over ``cases``
    ((batch, context) pairs), the builds swapped round-robin on one engine
    for ``rounds`` rounds, so drift of the machine hits all alike."""
    times: dict = {v: {f"bs{b}_ctx{ctx}": [] for b, ctx in cases} for v in cubins}
    for _ in range(rounds):
        for v, cubin in cubins.items():
            use_cubin(eng.backend, cubin)
            for b, ctx in cases:
                times[v][f"bs{b}_ctx{ctx}"].append(_step_times(eng, b, ctx, steps=steps)["kernel_ms"])
    out = {v: {k: median(x) for k, x in t.items()} for v, t in times.items()}
    if os.environ.get("MEGAC_VARIANT_RAW"):  # every round's median too, for the spread
        for v, t in times.items():
            out[v].update({k + "_rounds": [round(y, 4) for y in x] for k, x in t.items()})
    return out


#: the bit checks' prompts: 8 rows decoding together (batch 8: long expert queues)
BIT_PROMPTS = [[(31 * i + 7 * j) % 1000 + 3 for j in range(5 + 3 * i)] for i in range(8)]


def greedy_bits(eng, cubin) -> list:
    """``eng`` on ``cubin``: 4 greedy tokens of each BIT_PROMPTS row, logits kept."""
    use_cubin(eng.backend, cubin)
    return generate_all(eng, BIT_PROMPTS, 4)


def same_bits(ref: list, got: list) -> bool:
    """Every row's tokens and logits of ``got`` equal ``ref``'s bit for bit."""
    import torch

    return all(a.tokens == b.tokens and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
               for a, b in zip(ref, got))


def _cases(text: str) -> tuple:
    """"B:CTX,B:CTX" -> ((B, CTX), ...)."""
    return tuple(tuple(int(x) for x in c.split(":")) for c in text.split(",") if c)


def step_logits_per_setup(eng, setups: dict, batch: int, context: int) -> dict:
    """One decode step of ``batch`` noise rows at ``context``, run once per
    setup (name -> a callable that prepares the engine: a build swapped in,
    a host word order) on the same rows and KV (the rows rewound after
    each): name -> fp32 logits. The step rewrites the same new token's K/V
    every time."""
    import torch

    kv, be = eng.kv, eng.backend
    rows = _rows_at(kv, batch, context)
    for r in rows:
        kv.append_slot(r)
    toks = [(17 * r + 5) % 1000 for r in rows]
    got = {}
    for name, setup in setups.items():
        setup()
        got[name] = be.decode(rows, toks).float().clone()
        for r in rows:
            kv.seq_pos[r] -= 1
    torch.cuda.synchronize()
    for r in rows:
        kv.free_row(r)
    return got


def step_logits_per_build(eng, cubins: dict, batch: int, context: int) -> dict:
    """:func:`step_logits_per_setup` over builds: build name -> fp32 logits."""
    return step_logits_per_setup(eng, {v: (lambda c=c: use_cubin(eng.backend, c)) for v, c in cubins.items()},
                                 batch, context)


#: attention queue orders check queue_order times (the host's, first, is row, split, kv head
#: since the fourteenth session; row, kv head, split before)
QUEUE_ORDERS = ("row-split-head", "row-head-split", "split-row-head")


def queue_order_host_words(order: str):
    """megac.runtime.step.host_words with the attention queue's records
    permuted into ``order`` (fields named by their initials); the records
    are the same, so the step's bits are."""
    import numpy as np

    from megac.runtime import step

    orig = step.host_words
    cols = dict(zip(("row", "head", "split"), step._ATTN_COLS[:3]))

    def host_words(geo, positions, targets, attn_queue):
        n = orig(geo, positions, targets, attn_queue)
        if n and order != QUEUE_ORDERS[0]:
            keys = [attn_queue[:n, cols[k]] for k in reversed(order.split("-"))]
            attn_queue[:n] = attn_queue[:n][np.lexsort(keys)]
        return n

    return host_words


def check_queue_order() -> dict:
    """Median kernel ms of North Mini Code's default build with the full
    layers' attention queue in each of QUEUE_ORDERS (interleaved, 2 rounds;
    MEGAC_QUEUE_CASES "B:CTX,...", default batch 8 at 8K and 32K, batch 4 at
    32K), and whether one step's logits over noise rows are the same bits in
    every order. Why: the four kv heads of a split read the same KV pages
    (heads interleaved in a block); claimed one after another they read them
    at about the same time (row / split / kv head, the host's order since the
    fourteenth session, measured 0.4-1.2 % faster than row / kv head / split)."""
    import os

    import torch

    from megac.decode_bench import pool_blocks
    from megac.runtime import step
    from megac.spec import load_spec
    from megac.weights import random_weights

    cases = _cases(os.environ.get("MEGAC_QUEUE_CASES", "8:8192,8:32768,4:32768"))
    spec = load_spec("north-mini-code")
    w = random_weights(spec, seed=0, dtype=torch.bfloat16, device=DEV)
    longest = max(ctx for _, ctx in cases)
    eng = engine(spec, w, max_batch_size=8, max_model_len=longest + 64,
                 num_kv_blocks=max(40000, pool_blocks(spec, 8, longest + 64)))
    _noise_kv(eng)
    orig = step.host_words
    use = {o: (lambda o=o: setattr(step, "host_words", queue_order_host_words(o))) for o in QUEUE_ORDERS}
    times: dict = {o: {f"bs{b}_ctx{c}": [] for b, c in cases} for o in QUEUE_ORDERS}
    try:
        for _ in range(2):
            for o in QUEUE_ORDERS:
                use[o]()
                for b, c in cases:
                    times[o][f"bs{b}_ctx{c}"].append(_step_times(eng, b, c, steps=12)["kernel_ms"])
        bits = step_logits_per_setup(eng, use, *cases[0])
    finally:
        step.host_words = orig
    first = bits[QUEUE_ORDERS[0]]
    return {o: {**{k: median(x) for k, x in times[o].items()}, "step_bits_equal": bool(torch.equal(bits[o], first))}
            for o in QUEUE_ORDERS}


def check_variants() -> dict:
    """Median kernel ms of every VARIANTS build, interleaved (round-robin
    over the variants, 2 rounds) so drift of the machine hits all alike:
    North Mini Code batch 1 and 8 at 8K, SmolLM2 batch 1 at 1K; and for
    North Mini Code whether each build's greedy tokens and logits over 8
    rows equal the default build's bit for bit."""
    import torch

    from megac.spec import load_spec
    from megac.weights import random_weights

    import os

    out = {}
    nmc_cases = _cases(os.environ.get("MEGAC_VARIANT_CASES", "1:8192,8:8192"))
    step_bits = _cases(os.environ.get("MEGAC_VARIANT_STEP_BITS", ""))
    models = (("north-mini-code", nmc_cases), ("smollm2-135m", ((1, 1024),)))
    if os.environ.get("MEGAC_VARIANT_MODELS"):
        models = tuple(m for m in models if m[0] in os.environ["MEGAC_VARIANT_MODELS"].split(","))
    for model, cases in models:
        spec = load_spec(model)
        cubins = {v: variant_cubin(spec, d) for v, d in variants_for(spec).items()}
        w = random_weights(spec, seed=0, dtype=torch.bfloat16, device=DEV)
        longest = max(ctx for _, ctx in cases + (step_bits if spec.moe else ()))
        from megac.decode_bench import pool_blocks

        eng = engine(spec, w, max_batch_size=8, max_model_len=min(longest + 64, spec.max_context),
                     num_kv_blocks=max(40000, pool_blocks(spec, 8, longest + 64)))
        _noise_kv(eng)
        out[model] = interleaved_kernel_ms(eng, cubins, cases, rounds=int(os.environ.get("MEGAC_VARIANT_ROUNDS", "2")))
        if spec.moe:
            # every build must give the default's bits
            ref = None
            for v, cubin in cubins.items():
                got = greedy_bits(eng, cubin)
                ref = ref or got
                out[model][v]["bits_equal_default"] = same_bits(ref, got)
            # and the same logits for one step over long noise rows (many attention splits)
            for b, ctx in step_bits:
                got = step_logits_per_build(eng, cubins, b, ctx)
                first = next(iter(got.values()))
                for v in cubins:
                    out[model][v][f"step_bits_bs{b}_ctx{ctx}"] = bool(torch.equal(got[v], first))
        print(json.dumps({model: out[model]}), flush=True)
        del eng, w
        torch.cuda.empty_cache()
    return out


#: the wave orders check order_variants crosses with the device-code variants
#: (names of bundled orders or order files relative to the repository)
VARIANT_ORDERS = ("tuned", "schedules/experiments/oproj-before-down.yaml")


def variant_orders() -> list[str]:
    import os

    pick = os.environ.get("MEGAC_VARIANT_ORDERS")
    return pick.split(",") if pick else list(VARIANT_ORDERS)


def check_order_variants() -> dict:
    """North Mini Code, every (wave order, VARIANTS build) pair: median
    kernel ms at batch 1 and 8, 8K (MEGAC_TILE_BATCHES / MEGAC_TILE_CONTEXTS:
    others), interleaved over the builds (2 rounds)
    within one engine per order (one after the other: two engines of this
    model do not fit beside each other), on the same random weights; and
    whether each pair's greedy tokens and logits over 8 rows equal the first
    pair's bit for bit (the orders run the same tiles, so they must)."""
    import gc

    import torch

    from megac.spec import load_spec
    from megac.weights import random_weights

    from megac.decode_bench import pool_blocks

    # MEGAC_ORDER_TILES: a TILES name, the orders of that tile set (e.g. fold)
    tiles = os.environ.get("MEGAC_ORDER_TILES", "default")
    spec = tile_spec(tiles, TILES[tiles]) if tiles != "default" else load_spec("north-mini-code")
    w = random_weights(spec, seed=0, dtype=torch.bfloat16, device=DEV)
    batches, contexts = _tile_grid()
    cases = tuple((b, c) for b in batches for c in contexts)
    out, ref = {}, None
    for i, order in enumerate(variant_orders()):
        eng = engine(spec, w, max_batch_size=max(batches), max_model_len=max(contexts) + 64,
                     num_kv_blocks=max(40000, pool_blocks(spec, max(batches), max(contexts) + 64)), order=order)
        _noise_kv(eng)
        cubins = {v: variant_cubin(spec, d, order) for v, d in variants_for(spec).items()}
        times = interleaved_kernel_ms(eng, cubins, cases)
        for v, cubin in cubins.items():
            # an order named twice (the first again last, for the drift between) keeps both rows
            key = f"{Path(order).stem}:{v}" + (f"#{i}" if f"{Path(order).stem}:{v}" in out else "")
            got = greedy_bits(eng, cubin)
            ref = ref or got
            out[key] = {**times[v], "bits_equal_first": same_bits(ref, got), "addr": engine_addresses(eng)}
            print(json.dumps({key: out[key]}), flush=True)
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    del w
    torch.cuda.empty_cache()
    return out


#: attention split settings of North Mini Code compared by check_splits
#: (target.attn_split_tokens, target.attn_max_splits)
SPLITS = ((512, 32), (256, 32), (128, 64), (1024, 32), (768, 32))


def routed_spec(name: str, bound: int = 8, split_tokens: int | None = None):
    """``name`` with routed claims in schedules of at most ``bound`` rows
    (target tile routed_claims: every expert up claimer ranks the rows itself,
    no ROUTER_TOPK, no MOE_GATHER); ``split_tokens``: another
    attn_split_tokens too."""
    from megac.spec import load_spec
    from models import variant

    spec = load_spec(name)
    target = {**spec.target.model_dump(), "tiles": {**(spec.target.tiles or {}), "routed_claims": bound}}
    if split_tokens:
        target["attn_split_tokens"] = split_tokens
    suffix = f"-s{split_tokens}" if split_tokens else ""
    return variant(spec, f"{name}-routed{bound}{suffix}", target=target)


def split_spec(tokens: int, max_splits: int):
    from megac.spec import load_spec
    from models import variant

    spec = load_spec("north-mini-code")
    if (tokens, max_splits) == (spec.target.attn_split_tokens, spec.target.attn_max_splits):
        return spec
    target = {**spec.target.model_dump(), "attn_split_tokens": tokens, "attn_max_splits": max_splits}
    return variant(spec, f"nmc-split{tokens}", target=target)


def _kernel_ms_of(specs: dict, steps: int = 15, batches=(1, 8), bits: bool = False, contexts=(8192,),
                  orders: dict | None = None, defines: dict | None = None) -> dict:
    """Median kernel ms at ``batches`` (1 and 8) and ``contexts`` (8K), of each North Mini Code spec
    variant in ``specs`` (name -> spec), one engine after the other on the
    same random weights (the variants share every weight shape). ``bits``:
    also whether each one's greedy tokens and logits over 8 rows equal the
    first one's bit for bit. ``orders``: name -> wave order (default tuned);
    ``defines``: name -> a VARIANTS build's switches (default: the plain build)."""
    import gc

    import torch

    from megac.decode_bench import pool_blocks
    from megac.weights import random_weights
    from megac.weights.layout import LaidOutWeights, LayoutMismatch

    out = {}
    w = ref = ref1 = None
    orders, defines = orders or {}, defines or {}
    # where the model fits the GPU once but not twice (North Mini Code on an 80 GB H100), each engine
    # adopts the one before's laid-out weights (LaidOutWeights: the same tensors, the same addresses),
    # or, where its gate/up interleave differs, draws the same seeded weights afresh
    fresh = False
    for name, spec in specs.items():
        if w is None:
            w = random_weights(spec, seed=0, dtype=torch.bfloat16, device=DEV)
            if not out:
                fresh = _fits_once(w)
        order = orders.get(name, "tuned")

        def build(w):
            return engine(spec, w, max_batch_size=8, max_model_len=max(contexts) + 64,
                          num_kv_blocks=max(40000, pool_blocks(spec, max(batches), max(contexts) + 64)),
                          order=order, decode_only=fresh)
        try:
            eng = build(w)
        except LayoutMismatch:
            w = None
            gc.collect()
            torch.cuda.empty_cache()
            eng = build(random_weights(spec, seed=0, dtype=torch.bfloat16, device=DEV))
        if fresh:
            w = None
        _noise_kv(eng)
        if defines.get(name):  # another build of the same source (VARIANTS switches)
            use_cubin(eng.backend, variant_cubin(spec, defines[name], order))
        out[name] = {}
        for c in contexts:
            for b in batches:
                key = f"bs{b}" + ("" if contexts == (8192,) else f"_ctx{c}")
                got = _step_times(eng, b, c, steps=steps)
                out[name][key] = got["kernel_ms"]
                if "experts_touched" in got:  # past one row: the routing's bytes differ between builds
                    out[name][f"{key}_experts"] = got["experts_touched"]
        if bits and not fresh:  # a decode-only engine cannot prefill
            cubin = variant_cubin(spec, defines.get(name, {}), order)
            got = greedy_bits(eng, cubin)
            ref = ref or got
            out[name]["bits_equal_first"] = same_bits(ref, got)
            # and one row alone (the batch-1 schedule: what o_proj_merge changes)
            use_cubin(eng.backend, cubin)
            got1 = generate_all(eng, BIT_PROMPTS[:1], 4)
            ref1 = ref1 or got1
            out[name]["bits_equal_first_1row"] = same_bits(ref1, got1)
        out[name]["addr"] = engine_addresses(eng)
        print(json.dumps({name: out[name]}), flush=True)
        if fresh:
            w = LaidOutWeights.take(eng.backend)
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    return out


def waves_step_times() -> dict:
    """North Mini Code at 8K, batch 1 and 8: median kernel ms of the
    persistent megakernel and of the waves baseline (one launch per wave, in
    a CUDA graph), the same random weights, one engine after the other."""
    import gc

    import torch

    from megac.spec import load_spec
    from megac.weights import random_weights

    spec = load_spec("north-mini-code")
    w = random_weights(spec, seed=0, dtype=torch.bfloat16, device=DEV)
    out = {}
    for backend in ("cuda", "waves"):
        eng = engine(spec, w, backend, max_batch_size=8, max_model_len=8192 + 64, num_kv_blocks=40000)
        _noise_kv(eng)
        out[backend] = {f"bs{b}": _step_times(eng, b, 8192, steps=15)["kernel_ms"] for b in (1, 8)}
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    return out


def check_step_graph() -> dict:
    """The step graph (the seed and the launch as one CUDA graph): tokens
    and logits bit-identical to the separate launches (tiny-moe, batch 2),
    and North Mini Code's kernel and whole-step ms both ways at 8K, batch 1
    and 8 (megac bench's loop: decode_bench.run)."""
    import gc

    import torch

    from megac import decode_bench as db
    from megac.spec import load_spec
    from megac.weights import random_weights

    spec = load_spec("tiny-moe")
    w = random_weights(spec, seed=11, dtype=torch.bfloat16)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6] * 7]
    out = {}
    eng = engine(spec, w, "cuda", max_batch_size=2, max_model_len=128)
    eng.backend.step_graph = False
    ref = generate_all(eng, prompts, 8)
    eng.backend.step_graph = True
    got = generate_all(eng, prompts, 8)
    out["bit_identical"] = same_bits(ref, got)
    out["graphs_captured"] = len(eng.backend._step_graphs)
    out["still_on"] = eng.backend.step_graph
    del eng
    spec = load_spec("north-mini-code")
    w = random_weights(spec, seed=0, dtype=torch.bfloat16, device=DEV)
    eng = engine(spec, w, max_batch_size=8, max_model_len=8192 + 64, num_kv_blocks=40000)
    _noise_kv(eng)
    for on in (False, True, False, True):
        eng.backend.step_graph = on
        rows = db.run(eng, [(1, 8192), (8, 8192)], steps=20, warmup=5)
        for r in rows:
            out.setdefault(f"{'graph' if on else 'separate'}_bs{r['batch']}", []).append(
                {k: r[k] for k in ("kernel_ms", "step_ms", "host_fraction")})
        print(json.dumps({"step_graph": on, "rows": rows}), flush=True)
    del eng, w
    gc.collect()
    torch.cuda.empty_cache()
    return out


def check_pipeline() -> dict:
    """The pipelined greedy loop (CudaBackend.decode_greedy_run: step i+1
    queued before the host reads step i's tokens, which reach step i+1 on
    the device; the graphs baseline's likewise): the tokens of the same
    steps run one by one (tiny-moe, prompts prefilled twice into separate
    rows, batch 1 and 3), and North
    Mini Code's kernel and step ms both ways at 8K, batch 1 and 8."""
    import functools
    import gc

    import torch

    from megac.runtime.backend import run_greedy_steps
    from megac.spec import load_spec
    from megac.weights import random_weights

    spec = load_spec("tiny-moe")
    w = random_weights(spec, seed=11, dtype=torch.bfloat16)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6] * 7, [7] * 12]
    out: dict = {}
    for kind in ("cuda", "graphs"):
        eng = engine(spec, w, kind, max_batch_size=8, max_model_len=256)
        be, kv = eng.backend, eng.kv
        for n in (1, 3):
            a, b = [kv.allocate_row() for _ in range(n)], [kv.allocate_row() for _ in range(n)]
            first = []
            for i in range(n):
                first.append(int(be.prefill(a[i], prompts[i]).argmax()))
                be.prefill(b[i], prompts[i])
            piped, _ = be.decode_greedy_run(a, first, 12)
            plain, _ = run_greedy_steps(be, b, first, 12)
            key = f"bs{n}" if kind == "cuda" else f"graphs_bs{n}"
            out[f"{key}_equal"] = piped == plain
            out[f"{key}_tokens"] = piped[:4]
            for r in a + b:
                kv.free_row(r)
        del eng, be, kv
    spec = load_spec("north-mini-code")
    w = random_weights(spec, seed=0, dtype=torch.bfloat16, device=DEV)
    eng = engine(spec, w, max_batch_size=8, max_model_len=8192 + 64, num_kv_blocks=40000)
    _noise_kv(eng)
    be, kv = eng.backend, eng.kv
    for batch in (1, 8):
        for mode in ("one_by_one", "pipelined", "one_by_one", "pipelined"):
            rows = _rows_at(kv, batch, 8192)
            be.kernel_ms.clear()
            run = be.decode_greedy_run if mode == "pipelined" else functools.partial(run_greedy_steps, be)
            _, walls = run(rows, [1 + r for r in rows], 25)
            out.setdefault(f"{mode}_bs{batch}", []).append(
                {"kernel_ms": round(median(be.kernel_ms[5:]), 4), "step_ms": round(median(walls[5:]), 4)})
            for r in rows:
                kv.free_row(r)
    print(json.dumps(out), flush=True)
    del eng, be, kv, w
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _tile_grid() -> tuple:
    """(batches, contexts) of checks tiles and splits: MEGAC_TILE_BATCHES /
    MEGAC_TILE_CONTEXTS (comma lists), else batch 1 and 8 at 8K."""
    batches = tuple(int(b) for b in os.environ.get("MEGAC_TILE_BATCHES", "1,8").split(","))
    contexts = tuple(int(c) for c in os.environ.get("MEGAC_TILE_CONTEXTS", "8192").split(","))
    return batches, contexts


def check_splits() -> dict:
    """North Mini Code with other attention splits (more, shorter or fewer,
    longer ATTN_DECODE / ATTN_DRAIN tasks): median kernel ms at batch 1 and
    8, 8K. MEGAC_SPLITS ("tokens:max_splits,..."; the first again last, for
    the drift between), MEGAC_TILE_BATCHES / MEGAC_TILE_CONTEXTS: others."""
    import os

    pick = _cases(os.environ.get("MEGAC_SPLITS", ""))
    if not pick:
        return _kernel_ms_of({f"{t}x{m}": split_spec(t, m) for t, m in SPLITS})
    specs = {f"{t}x{m}": split_spec(t, m) for t, m in pick}
    specs[f"{pick[0][0]}x{pick[0][1]}_2"] = split_spec(*pick[0])
    batches, contexts = _tile_grid()
    return _kernel_ms_of(specs, batches=batches, contexts=contexts)


#: North Mini Code tile settings compared by check_tiles (target.tiles)
TILES = {
    "default": {},
    # the router folds the previous layer's MoE combine (COMBINE_IN) instead of its norm, unnormalised:
    # its waits are the down claims' and the O-projection's, two hops less before the up claims rank
    # (forty-fourth session; the finalize scales the weights by 1 / rms)
    "rcomb": {"router_combine": 1},
    "norc": {"router_combine": 0, "qkv_combine": 0},  # the default before the forty-fifth session
    # and the folded QKV tiles add the MoE combine themselves (NORM_IN with ADD_MOE): they wait on the
    # down claims and the O-projection, not on MOE_COMBINE (forty-fifth session; the default's bits)
    "qc": {"qkv_combine": 1},
    "rcqc": {"router_combine": 1, "qkv_combine": 1},
    # and the norm sums the experts itself (fused_combine): no MOE_COMBINE at batch 1, the norm that
    # gates the up claims' rows waits on the down claims directly (the same bits as rcqc)
    "rcqcfc": {"router_combine": 1, "qkv_combine": 1, "fused_combine": 1},
    # and the routed up claims fold the norm with the combine themselves (NORM_IN with ADD_MOE on the
    # claimer, forty-sixth session): no claim waits on the norm, whose x_norm nothing reads then
    "uc": {"up_combine": 1},
    "up96": {"moe_up_bn": 96},  # 16 expert up/gate tiles: 128 claims at batch 1, one per SM
    "up64": {"moe_up_bn": 64},
    "r16": {"router_splits": 16},  # router GEMM over 16 SMs instead of 4
    # router GEMM over 8 SMs: 64 KB tiles, still one round of partial loads for a routed claimer
    # (kSplitsAtOnce 8); the router's stream is ~1.7 of the ~13 us from a layer's combine to its
    # first expert byte (thirty-first session); another split-K sum of the logits: other bits
    "r8": {"router_splits": 8},
    "up96_r16": {"moe_up_bn": 96, "router_splits": 16},
    # the MoE combine inside the norm at batch 1 (geometry.fused_combine_at): a hop and a task less
    "fused_combine": {"fused_combine": 1},
    # fewer, longer expert claims: the marks put ~7 us (up, routed) and ~4.6 us (down) of
    # every claim before its first stage lands and stream ~65-78 GB/s per SM after
    # O-projection tiles of 128 features (64 tiles of 256 KB; the calibrated model's pick, twenty-first session)
    "o128": {"o_proj_bn": 128},
    "up128_o128": {"moe_up_bn": 128, "o_proj_bn": 128},
    "up128": {"moe_up_bn": 128},  # 12 up tiles per expert: 96 claims at batch 1 (the default before 256)
    "up192": {"moe_up_bn": 192},  # 8 up tiles per expert: 64 claims at batch 1
    "up256": {"moe_up_bn": 256},  # 6 up tiles per expert: 48 claims at batch 1
    "dn256": {"moe_down_bn": 256},  # 8 down tiles per expert
    # 16 down tiles per expert (128 claims at batch 1, 192 KB each): a claim primed before its wait
    # (MEGAC_DOWN_PRIME) then holds two of its three stages a warp when the up tiles end
    "dn128": {"moe_down_bn": 128},
    # a row's MoE combine over 8 / 16 feature ranges on as many SMs (one round of loads each, where one
    # task loads the whole row's 64 KB in two at the end of every MoE layer; the calibrated cost model
    # predicts -1.8 % at batch 1)
    "cs8": {"combine_splits": 8},
    "cs16": {"combine_splits": 16},
    # the thirty-second session's small batch-1 gains together: the combine over 8 SMs, the router over
    # 8, and a full layer's up claimers before its claimed attention (the order full-up-first)
    "cs8_fuf": {"combine_splits": 8, "order": "schedules/experiments/full-up-first.yaml"},
    "cs8_r8_fuf": {"combine_splits": 8, "router_splits": 8, "order": "schedules/experiments/full-up-first.yaml"},
    # the thirty-third session's batch-1 candidate (router over 8 SMs, the combine over 8 ranges at
    # batch 1, a full layer's up claimers first at batch 1): against the default bs1 even, bs8 -0.4 %
    "s33": {"routed_combine_splits": 8, "router_splits": 8, "order": "schedules/experiments/routed-full-up-first.yaml"},
    # the thirty-fourth session's builds as tile sets (check tiles: engines alternating): the one-row
    # ranking on warp 0, and with the first claim issued before the hand-off; with smaller up tiles,
    # whose claims the shorter first claim favours
    "w": {"variant": "topk_warp"},
    "fe": {"variant": "topk_warp_fe"},
    "up128_fe": {"moe_up_bn": 128, "variant": "topk_warp_fe"},
    "up192_fe": {"moe_up_bn": 192, "variant": "topk_warp_fe"},
    # one down claim an SM at batch 1, with the 128-row up tiles whose doubled down claims ended
    # their layers (thirty-fourth session's profile) and with the default tiles
    "dc1": {"variant": "dc1"},
    "up128_dc1": {"moe_up_bn": 128, "variant": "dc1"},
    "up128_wdc1": {"moe_up_bn": 128, "variant": "topk_warp_dc1"},
    "wdc1": {"variant": "topk_warp_dc1"},
    # the thirty-fifth session: LM head tiles of 512 / 1024 vocab rows (512 / 256 tasks instead of 1024),
    # so an SM pays a tile's start (prime, wait, X) and end (warp skew, epilogue, ~7 us) 4 / 2 times
    # instead of 8 while the head streams at ~93 % of what the bulk copies reach on 132 SMs
    "lm512": {"lm_bn": 512},
    "lm1024": {"lm_bn": 1024},
    # a met claim's counter read once (mk_core.cuh MEGAC_CLAIM_ONE_READ): the late down claims' first
    # copies a round trip sooner; and with the one-row ranking on warp 0
    "or": {"variant": "one_read"},
    "wor": {"variant": "topk_warp_or"},
    # a routed up claimer stops after one claim (MEGAC_UP_ONE_CLAIM): the O-projection tiles and late
    # down claims behind up claims start ~1 us sooner; and with topk_warp and the one read
    "uc1": {"variant": "uc1"},
    "woruc1": {"variant": "topk_warp_or_uc1"},
    # and every small batch-1 gain so far together: the thirty-third session's candidate (router over 8
    # SMs, the combine over 8 ranges, a full layer's up claimers first), the one-row ranking on warp 0,
    # a met claim's counter read once, one up claim an SM and the 1024-row LM head tiles
    "s35": {"routed_combine_splits": 8, "router_splits": 8, "order": "schedules/experiments/routed-full-up-first.yaml",
            "variant": "topk_warp_or_uc1", "lm_bn": 1024},
    # s35 is the default since the thirty-sixth session (geometry.py, tuned.yaml, the three switches
    # on); the default before it, and s35 with the LM head tiles of before
    "old35": {"routed_combine_splits": 0, "router_splits": 4, "order": "schedules/experiments/tuned-session35.yaml",
              "variant": "off35", "lm_bn": 256},
    "lm256": {"lm_bn": 256},
    # the combine polls its inputs (thirty-eighth session): one hop of each MoE layer's chain without
    # the down claims' fence, atomic and counter poll
    "cpoll": {"variant": "cpoll"},
    # 128-row down tiles claimed two at a time but for the queue's last 26 (16): the early claimers keep
    # 256-row tiles, the ~30 SMs that ask after the up tiles end share the tail in halves (thirty-eighth
    # session's reading of layer 22); dn128 alone (every claim 128 rows) lost ~3 %
    "dn128p": {"moe_down_bn": 128, "variant": "dpair"},
    "dn128p16": {"moe_down_bn": 128, "variant": "dpair16"},
    # the next layer's QKV weights toward L2 in this layer's tail (fortieth session's H200 trace: the
    # tail carries under 1 TB/s, the next QKV phase ~4 TB/s from HBM)
    "qkvl2": {"variant": "qkvl2"},
    "qkvl2e": {"variant": "qkvl2e"},
    "qkvl2_ot": {"variant": "qkvl2_ot"},
    "qkvl2_oh": {"variant": "qkvl2_oh"},
    "rs8": {"variant": "rs8"},
    "p2div": {"variant": "p2div"},
    "tcwarm": {"variant": "tcwarm"},
    "tcbisect": {"variant": "tcbisect"},
    "tcwc": {"variant": "tcwc"},
    "rowsmem": {"variant": "rowsmem"},
    "rbatch": {"variant": "rbatch"},
    "p2div_rs8": {"variant": "p2div_rs8"},
    # and a sliding layer's O-projection on its attention SMs at batch 1 (routed-oproj-on-attn.yaml): two
    # 128-feature tiles an attention SM, or one of 256, instead of tiles queued behind up claims
    "dn128p_oa": {"moe_down_bn": 128, "variant": "dpair", "order": "schedules/experiments/routed-oproj-on-attn.yaml"},
    "dn128p_o256_oa": {"moe_down_bn": 128, "o_proj_bn": 256, "variant": "dpair",
                       "order": "schedules/experiments/routed-oproj-on-attn.yaml"},
    # on the new default: the batch-1 combine over 16 ranges of 4 KB (r16 above: the router over 16 SMs)
    "rcs16": {"routed_combine_splits": 16},
    "up192_dn256": {"moe_up_bn": 192, "moe_down_bn": 256},
    "up256_dn256": {"moe_up_bn": 256, "moe_down_bn": 256},
    "up256_dn512": {"moe_up_bn": 256, "moe_down_bn": 512},
    "up384_dn256": {"moe_up_bn": 384, "moe_down_bn": 256},
    "up384_dn512": {"moe_up_bn": 384, "moe_down_bn": 512},
    # QKV tiles of half / a quarter of a head: 80 / 160 tasks instead of 40, so
    # attention (and at batch 8 every SM) waits less at a layer's start
    "qkv64": {"qkv_bn": 64},  # North Mini Code's default since the fourteenth session
    "qkv32": {"qkv_bn": 32},
    "qkv128": {"qkv_bn": 128},  # whole heads, the default before
    # the norm folded into the QKV and router tiles at batch 1 (geometry.norm_fold_at): each
    # stages the norm of its x_norm slot itself, no hop through the ADD_RMSNORM task
    "fold": {"norm_fold": 1},
    # the norms as tasks at batch 1 too (the default before the nineteenth session)
    "nofold": {"norm_fold": 0},
    # the expert down projection split-K inside the up claims (geometry.split_down_at): at
    # batch 1 / up to 8; with 128-feature up tiles (96 claims at batch 1)
    "sd1": {"split_down": 1},
    "sd8": {"split_down": 8},
    "sd8_up128": {"split_down": 8, "moe_up_bn": 128},
    "sd8_up64": {"split_down": 8, "moe_up_bn": 64},
    "sd1_up128": {"split_down": 1, "moe_up_bn": 128},
    "sd4_up128": {"split_down": 4, "moe_up_bn": 128},
    # and attention splits of 256 tokens (twice the splits, each half as long: the attention
    # chain ended the split layers)
    "sd8_up128_a256": {"split_down": 8, "moe_up_bn": 128, "attn_split_tokens": 256},
    "a256": {"attn_split_tokens": 256},
    # both chains shorter at once (forty-seventh session): smaller up claims end the expert chain's up
    # phase sooner, smaller attention splits the attention chain's
    "up128_a256": {"moe_up_bn": 128, "attn_split_tokens": 256},
    # QKV tiles of 128 KB (160 at batch 1, on more SMs than 80): each fits its SM's primed ring whole, so
    # it streams in the layer before's tail and its SM is free for the up claims sooner
    "qkv32_up128": {"qkv_bn": 32, "moe_up_bn": 128},
    # and the routing waves before the QKV tiles (the router first on its SMs)
    "qkv32_rf": {"qkv_bn": 32, "order": "schedules/experiments/router-first.yaml"},
    "qkv32_up128_rf": {"qkv_bn": 32, "moe_up_bn": 128, "order": "schedules/experiments/router-first.yaml"},
    # a sliding layer's attention splits on its QKV SMs, so ~50 SMs take the up claims as routing ends
    "upfree": {"order": "schedules/experiments/up-free.yaml"},
    "upfirstb": {"order": "schedules/experiments/up-first-b.yaml"},
    # and smaller up claims with it (96 of 512 KB / 64 of 768 KB): under tuned up128 lost because too few
    # SMs were free to take them at once (~19 at ~5 us); up-free frees ~50
    "upfree_up128": {"order": "schedules/experiments/up-free.yaml", "moe_up_bn": 128},
    "upfree_up192": {"order": "schedules/experiments/up-free.yaml", "moe_up_bn": 192},
    # a full layer's attention splits as static tasks (geometry full_static, batch 1) on its QKV SMs
    # before their up claimers (primed, no claim hops); with up-free's sliding layers too
    "fs": {"full_static_attn": 1, "order": "schedules/experiments/full-static.yaml"},
    "fsuf": {"full_static_attn": 1, "order": "schedules/experiments/up-free-static.yaml"},
    # every MoE layer's norm on its finalize SM (no QKV tile of the next layer behind it; the forty-ninth
    # session's fs trace: the norm SM's QKV tile ends ~10 us after the rest and gates its KV head's
    # attention), re-timed on today's default (the thirty-third session's, even, was on another)
    "nfin": {"order": "schedules/experiments/routed-norm-on-finalize.yaml"},
    "fs_nfin": {"full_static_attn": 1, "order": "schedules/experiments/full-static-norm-fin.yaml"},
    # tensor-copy rings of 3 chunks a warp (attn_tma3): a batch-1 static split primes 3 of its warps' 4
    # chunks before its wait, in the layer's head where the memory system has room (forty-ninth session)
    "tma3": {"variant": "attn_tma3"},
    # a full layer's claimed attention before its up claimers again (tuned without moe_routed_full)
    "faf": {"order": "schedules/experiments/full-attn-first.yaml"},
    # guided self-scheduling of the batch-1 up claims (fiftieth session): 128-row up tiles, the layer's
    # first claims two at a time (1 MB, for the ~19 SMs that claim as routing ends), its last 56 (48)
    # alone (512 KB, for the QKV SMs that claim ~7 us later), so the late claims end with the early
    # ones; up128p_dn128p: and the down claims paired as dn128p's
    "up128p": {"moe_up_bn": 128, "variant": "upair"},
    "up128p48": {"moe_up_bn": 128, "variant": "upair48"},
    "up128p_dn128p": {"moe_up_bn": 128, "moe_down_bn": 128, "variant": "upair_dpair"},
    # the slots-early timing probe on the default tiles (not a candidate: its logits may differ)
    "se": {"variant": "slots_early"},
    "qp1": {"variant": "qkvp1"},
    "qp0": {"variant": "qkvp0"},
    "qpring": {"variant": "qkvp_ring"},
    "uwe": {"variant": "up_wait_early"},
    "pd2": {"variant": "poll2"},
    "pd4": {"variant": "poll4"},
    "pns0": {"variant": "poll_ns0"},
    "pns200": {"variant": "poll_ns200"},
    "pns800": {"variant": "poll_ns800"},
    # a counter's release as fence.acq_rel + a relaxed add (counters.cuh MEGAC_SIGNAL_ACQREL; last timed in
    # the twenty-seventh session, on a kernel 10 % slower)
    "sacq": {"variant": "sig_acqrel"},
    # no attention split primes its first chunks before its waits (the QKV tiles' lighter prime won: bytes
    # in a layer's head lengthen the round trips of the chains that run there)
    "anp": {"variant": "attn_noprime"},
    "rpoll": {"variant": "router_poll"},
    "rpnn": {"variant": "rpoll_nonorm"},
    "rpn2": {"variant": "router_poll_norm"},
    "rpf": {"variant": "router_poll_full"},
    "rpn2f": {"variant": "router_poll_norm_full"},
    "rpnone": {"variant": "router_poll_none"},
    # the folds' planes halved (a timing probe: what bf16 O-projection partials and expert rows would be worth)
    "fh": {"variant": "fold_half"},
    # the attention chain started before the layer before ends (a timing probe)
    "qnw": {"variant": "qkv_no_wait"},
    # the experts' outputs in bf16 (geometry.py moe_out_bf16, moe_out.cuh): the QKV tiles' and the norm's folds
    # read 32 KB of expert rows, not 64 (other bits)
    "mob16": {"moe_out_bf16": 1},
    # and the norm summing the experts itself (fused_combine, the forty-fifth session's +0.7 % when the
    # norm ended before the claimers ranked): the norm the polling claims wait on a hop sooner
    "rpfc": {"fused_combine": 1, "variant": "router_poll"},
    # and the claims' wait on that norm read while the claimer polls (up_wait_early): what rpnn probes, as a
    # candidate (the same bits as the default)
    "rpfcu": {"fused_combine": 1, "variant": "router_poll_uwe"},
    # and the norm on the finalize SM (no QKV tile there): with fused_combine the norm still ends a hop and ~3 us
    # after the down claims, and the SM that runs it starts its next QKV tile that late, the last of its KV
    # head's (fifty-fourth session, the session-52 trace: the norm SM's tile ends ~10 us after the median)
    "rpfcun": {"fused_combine": 1, "variant": "router_poll_uwe",
               "order": "schedules/experiments/routed-norm-on-finalize.yaml"},
    # the router over 16 SMs (r16) with QKV tiles priming one stage a warp: today's router tile spends ~1 us
    # of its ~3.6 us on the MMA over its 64 KB, on the MoE chain every layer (fifty-second session's H100 stamps)
    "qp1_r16": {"router_splits": 16, "variant": "qkvp1"},
    # O-projection tiles of 256 features (32 of 512 KB: one per attention SM of a sliding layer at
    # batch 1, for orders that put the O-projection there)
    "sd8_up128_o256": {"split_down": 8, "moe_up_bn": 128, "o_proj_bn": 256},
    "sd1_up128_o256": {"split_down": 1, "moe_up_bn": 128, "o_proj_bn": 256},
    "o256": {"o_proj_bn": 256},
    # with the order that puts a sliding layer's O-projection on its attention SMs
    "sd8_up128_o256_oa": {"split_down": 8, "moe_up_bn": 128, "o_proj_bn": 256,
                          "order": "schedules/experiments/split-oproj-on-attn.yaml"},
    # the split configuration of the twenty-fourth session (128-row up tiles, its own O-projection
    # tiles, the tuned order's moe_split waves): at batch 1 (the automatic bound, -1), and up to 8
    # rows (the fp32 slice check runs 2 rows). The up tiles are every schedule's (moe_up_bn): the
    # expert weights are interleaved once; the twenty-fourth and twenty-fifth sessions' runs of
    # these entries had split_up_bn 128 beside 256-row plain tiles, the batch-1 step pairing the
    # wrong gate/up rows (fp32 slice at one row: cosine 0.64)
    "split1": {"split_down": -1, "moe_up_bn": 128, "split_o_proj_bn": 256},
    "split8": {"split_down": 8, "moe_up_bn": 128, "split_o_proj_bn": 256},
    # the O-projection after the MoE combine on the SMs leaving the claims, 128 tiles of 64 features
    # (each a whole ring primed before its wait)
    "split1_o64_last": {"split_down": -1, "moe_up_bn": 128, "split_o_proj_bn": 64,
                        "order": "schedules/experiments/split-oproj-last.yaml"},
    "split1_o128_last": {"split_down": -1, "moe_up_bn": 128, "split_o_proj_bn": 128,
                         "order": "schedules/experiments/split-oproj-last.yaml"},
    # the same with a static split's first chunks issued when it runs
    "split1_noprime": {"split_down": -1, "moe_up_bn": 128, "split_o_proj_bn": 256, "variant": "attn_noprime"},
    # the default before the twenty-fifth session at batch 1: no split, no merge
    "plain": {"split_down": 0, "o_proj_merge": 0},
    # and without the batch-1 norm fold, and without routed claims too (the fp32 slice at one row)
    "plain_nofold": {"split_down": 0, "o_proj_merge": 0, "norm_fold": 0},
    # the split without the merge, the merge without the split (the fp32 slice at one row)
    "nomerge": {"o_proj_merge": 0},
    "plain_merge": {"split_down": 0, "o_proj_merge": 1},
    "split_nofold": {"norm_fold": 0},
    "split_unrouted": {"norm_fold": 0, "routed_claims": 0},
    "plain_unrouted": {"split_down": 0, "o_proj_merge": 0, "norm_fold": 0, "routed_claims": 0},
    # the default with the O-projection's weights pulled into L2 during its SM's attention split
    "oproj_l2": {"variant": "oproj_l2"},
    # the O-projection tiles merging their KV head's attention splits at batch 1 (no ATTN_COMBINE
    # task and hop: geometry.o_proj_merge_at), in the plain and the split configuration
    "merge": {"o_proj_merge": 1},
    "split1_merge": {"split_down": -1, "moe_up_bn": 128, "split_o_proj_bn": 256, "o_proj_merge": 1},
    "split8_merge": {"split_down": 8, "moe_up_bn": 128, "split_o_proj_bn": 256, "o_proj_merge": 1},
    "split1_merge_p0": {"split_down": -1, "moe_up_bn": 128, "split_o_proj_bn": 256, "o_proj_merge": 1,
                        "variant": "merge_p0"},
    # the batch-1 split on its own 128-row up tiles beside the plain 256-row ones of the other
    # batch sizes (the expert weights interleaved in chunks of 64, geometry.moe_chunk_rows)
    "split1_own": {"split_down": -1, "split_up_bn": 128, "split_o_proj_bn": 256},
    # and its O-projection in 64 tiles of 128 features, half on the attention SMs, half on the
    # first QKV SMs (twenty-seventh session: the O-projection's share of the bandwidth doubled)
    "split1_own_oqkv": {"split_down": -1, "split_up_bn": 128, "split_o_proj_bn": 128,
                        "order": "schedules/experiments/split-oproj-attn-qkv.yaml"},
    # the KV pools head-major (a KV head's keys of a block contiguous: opcodes/kv_pool.cuh)
    "kvh": {"kv_head_major": 1},
    "split1_own_kvh": {"split_down": -1, "split_up_bn": 128, "split_o_proj_bn": 256, "kv_head_major": 1},
    "split1_merge_p2": {"split_down": -1, "moe_up_bn": 128, "split_o_proj_bn": 256, "o_proj_merge": 1,
                        "variant": "merge_p2"},
    # the GEMM ring cursor with the one-row placement (twenty-eighth session: a claim streamed ~65 GB/s per
    # SM, the expert up phase bound by it), alone, with 128-feature up tiles (96 claims at batch 1: ~7 us a
    # claim before its first byte lost to fewer, longer claims before), and with the split on its own up tiles
    "wp": {"variant": "walkpos_1row"},
    "wp_up128": {"moe_up_bn": 128, "variant": "walkpos_1row"},
    "wp_split1_own": {"split_down": -1, "split_up_bn": 128, "split_o_proj_bn": 256, "variant": "walkpos_1row"},
}


def tile_target(spec, tiles: dict) -> dict:
    """``spec``'s target with a TILES entry applied: its tile settings, the
    target fields beside them (attention splits); its "order" and "variant"
    (the wave order and the VARIANTS build check tiles runs) are not target."""
    target = {k: tiles[k] for k in ("attn_split_tokens", "attn_max_splits") if k in tiles}
    tiles = {k: v for k, v in tiles.items() if k not in target and k not in ("order", "variant")}
    return {**spec.target.model_dump(), **target, "tiles": {**(spec.target.tiles or {}), **tiles}}


def tile_spec(name: str, tiles: dict):
    from megac.spec import load_spec
    from models import variant

    spec = load_spec("north-mini-code")
    if not tiles:
        return spec
    return variant(spec, f"nmc-{name}", target=tile_target(spec, tiles))


def check_tiles() -> dict:
    """North Mini Code with other tile sizes (target.tiles): median kernel ms
    at batch 1 and 8, 8K, the default first and again last (the drift
    between); MEGAC_TILES (comma list of TILES names) narrows them. Each
    build's greedy tokens and logits over 8 rows must equal the default's
    bit for bit: a tile's features are the same dot products whatever the
    tile's size. MEGAC_TILE_BATCHES / MEGAC_TILE_CONTEXTS (comma lists): other
    batch sizes / contexts."""
    import os

    pick = os.environ.get("MEGAC_TILES")
    names = [n for n in (pick.split(",") if pick else TILES) if n != "default"]
    # NAME#i: NAME again in an engine of its own (engines of one spec differ by a few %: A/B/A/B runs)
    base = {n: n.split("#")[0] for n in ["default", *names, "default_2"]}
    base["default_2"] = "default"
    specs = {n: tile_spec(b, TILES[b]) for n, b in base.items()}
    orders = {n: TILES[b].get("order", "tuned") for n, b in base.items()}
    defines = {n: VARIANTS[TILES[b]["variant"]] for n, b in base.items() if "variant" in TILES[b]}
    batches, contexts = _tile_grid()
    return _kernel_ms_of(specs, bits=True, batches=batches, contexts=contexts, orders=orders, defines=defines)


def check_gemm_env() -> dict:
    """Each GEMM opcode alone (op_profile, no waits), North Mini Code batch
    1, 8K: the default build (tensor-core tile over tiled weights,
    gemm_tc.cuh) against the rows build (row-major weights, the CUDA-core
    row loop of gemm_rows.cuh)."""
    import torch

    from megac.spec import load_spec
    from megac.weights import random_weights

    spec = load_spec("north-mini-code")
    w = random_weights(spec, seed=0, dtype=torch.bfloat16, device=DEV)
    eng = engine(spec, w, max_batch_size=8, max_model_len=8192 + 64, num_kv_blocks=40000)
    _noise_kv(eng)
    out = {}
    for v in ("default", "rows", "regs"):
        use_cubin(eng.backend, variant_cubin(spec, VARIANTS[v]))
        out[v] = {"smem_bytes": eng.backend.smem, **op_profile(eng, 1, 8192)}
    del eng, w
    torch.cuda.empty_cache()
    return out


def check_profile() -> dict:
    """One profiled step (the MEGAC_PROFILE build, through
    megac.gpu.profile.profile_step as ``megac bench --profile``) of North
    Mini Code at batch 1, 8K, and SmolLM2 at batch 1, 1K: the per-opcode
    summary; the raw records and a Perfetto trace go to $OUT when it is set.
    MEGAC_PROFILE_VARIANTS (comma list of VARIANTS names, North Mini Code
    only) profiles those builds of the same step too, keyed "NAME:VARIANT"."""
    import torch

    from megac.gpu import profile
    from megac.spec import load_spec
    from megac.weights import random_weights

    out = {}
    extra = [v for v in os.environ.get("MEGAC_PROFILE_VARIANTS", "").split(",") if v]
    models = [("north-mini-code", 1, 8192), ("smollm2-135m", 1, 1024)]
    if os.environ.get("MEGAC_PROFILE_ROUTED"):  # North Mini Code with routed claims too
        models.insert(1, ("north-mini-code-routed8", 1, 8192))
    if os.environ.get("MEGAC_PROFILE_CASES"):  # North Mini Code at these "B:CTX,..." instead
        models = [("north-mini-code", b, ctx) for b, ctx in _cases(os.environ["MEGAC_PROFILE_CASES"])]
    # MEGAC_PROFILE_TILES (comma list of TILES names): those tile settings of North Mini Code
    # too, at each North Mini Code case (a spec named nmc-NAME)
    tiles = [n for n in os.environ.get("MEGAC_PROFILE_TILES", "").split(",") if n]
    models += [(f"nmc-{n}", b, ctx) for n in tiles for m, b, ctx in list(models) if m == "north-mini-code"]
    if os.environ.get("MEGAC_PROFILE_TILES_ONLY"):  # the tile sets' steps alone (the default's profiled before)
        models = [m for m in models if m[0] != "north-mini-code"]
    from megac.decode_bench import pool_blocks

    seen: dict[str, int] = {}
    for model, b, ctx in models:
        # a tile set named twice profiles a second engine (engines of one spec differ by a few %)
        seen[model] = seen.get(model, 0) + 1
        again = "" if seen[model] == 1 else f"#{seen[model] - 1}"
        if model == "north-mini-code-routed8":
            spec = routed_spec("north-mini-code")
        elif model.startswith("nmc-"):
            spec = tile_spec(model[4:], TILES[model[4:]])
        else:
            spec = load_spec(model)
        w = random_weights(spec, seed=0, dtype=torch.bfloat16, device=DEV)
        # MEGAC_PROFILE_ORDER: a wave order (name or YAML path) for the tile specs' steps
        order = os.environ.get("MEGAC_PROFILE_ORDER", "tuned") if model.startswith("nmc-") else "tuned"
        # decode-only where the weights fit the GPU only once (North Mini Code on an H100): the
        # engine consumes them
        eng = engine(spec, w, max_batch_size=8, max_model_len=min(max(ctx, 8192) + 64, spec.max_context),
                     num_kv_blocks=max(40000, pool_blocks(spec, 8, max(ctx, 8192) + 64)), order=order,
                     decode_only=_fits_once(w))
        _noise_kv(eng)
        be = eng.backend
        for v in ["default", *(extra if spec.moe else [])]:
            key = (model if v == "default" else f"{model}:{v}") + again
            # the path `megac bench --profile` takes (its build is PROFILE's, prebuilt), from the
            # variant's own plain build (its kernel_ms; a routed build's words)
            use_cubin(be, variant_cubin(spec, VARIANTS[v], order))
            got = profile.profile_step(be, eng.kv, b, ctx, warmup=10, defines=VARIANTS[v])
            recs, plain, timed = got["records"], got["kernel_ms"], got["profiled_ms"]
            out[key] = {"kernel_ms": plain, "kernel_ms_profiled": timed, "addr": engine_addresses(eng), **profile.summary(recs),
                        "inside_tasks": profile.marks_summary(recs), "layers": profile.layer_table(recs, spec)}
            if os.environ.get("OUT"):
                name = f"profile-{model}-bs{b}-ctx{ctx}" + ("" if v == "default" else f"-{v}") + again.replace("#", "-")
                (Path(os.environ["OUT"]) / f"{name}.json").write_text(json.dumps(recs))
                # what megac trace / calibrate need to rebuild the schedule (as megac bench --profile writes)
                meta = {**profile.trace_meta(got, model=spec.name, spec=spec, batch=b, context=ctx, order=order,
                                             device=torch.cuda.get_device_name()), "variant": v}
                (Path(os.environ["OUT"]) / f"{name}.trace.json").write_text(json.dumps(profile.chrome_trace(recs, meta)))
            print(json.dumps({key: out[key]})[:3000], flush=True)
        del eng, w, be
        torch.cuda.empty_cache()
    return out


def _fits_once(w) -> bool:
    """Whether weights ``w`` fit the GPU beside what is free only once, not
    twice (North Mini Code on an 80 GB H100): engines there are decode-only
    and hand their laid-out weights on (LaidOutWeights)."""
    import torch

    return DEV == "cuda" and torch.cuda.mem_get_info()[0] < 1.15 * w.nbytes()


def _nmc_probe_engine(decode_only=None):
    """One North Mini Code engine for the probes (modes, kvorder, tunehold,
    placement): the seeded random weights, 8 rows up to 8K + 64, never
    placement-tuned, KV noise in its pools. ``decode_only`` None: where the
    weights fit the GPU only once. Returns (engine, whether decode-only)."""
    import torch

    from megac.decode_bench import pool_blocks
    from megac.spec import load_spec
    from megac.weights import random_weights

    spec = load_spec("north-mini-code")
    w = random_weights(spec, seed=0, dtype=torch.bfloat16, device=DEV)
    decode_only = _fits_once(w) if decode_only is None else decode_only
    eng = engine(spec, w, max_batch_size=8, max_model_len=8192 + 64, placement_trials=0,
                 num_kv_blocks=max(40000, pool_blocks(spec, 8, 8192 + 64)), decode_only=decode_only)
    del w
    _noise_kv(eng)
    return eng, decode_only


def rehome(eng, what: str) -> dict:
    """Move one group of an engine's device memory to fresh allocations (the
    new one made before the old is freed, so it cannot land on the same
    pages): ``words`` (the uploaded words and per-step zeroed counters: one
    buffer), ``buffers`` (the other step buffers), ``tasks`` (the task
    lists), ``weights`` (every kernel weight that fits twice in what is
    free), ``kv`` (the two pools); ``none`` moves nothing (the descriptors
    and step graphs are rebuilt, as after every move). Same contents, so the
    same bits; returns the moved groups' sizes. For the modes probe: engines
    of one spec at the same virtual addresses run ~2.57 or ~2.67 ms
    (thirty-second to thirty-sixth sessions); if moving a group changes an
    engine's time and moving none does not, placement is why."""
    import torch

    be = eng.backend
    moved = {}

    def fresh(t):
        new = torch.empty_like(t)
        new.copy_(t)
        return new

    if what == "buffers":
        words = be._words.untyped_storage().data_ptr()
        for n, t in list(be.buf.items()):
            if t.untyped_storage().data_ptr() != words:
                be.buf[n] = fresh(t)
                moved[n] = t.numel() * t.element_size()
    elif what == "words":
        moved["words"] = be._words.numel() * 4
        be.reserve_counters(int(be.buf["counters"].shape[0]))  # zeroed and restaged every step anyway
    elif what == "tasks":
        be.tasks = {k: (fresh(a), fresh(b)) for k, (a, b) in be.tasks.items()}
        moved["tasks"] = sum(a.numel() * 4 for a, _ in be.tasks.values())
    elif what == "weights":
        # smallest first, each old tensor freed (and handed back to the driver) before the next is
        # sized against what is free: a list of the items would hold every old tensor to the end
        for n in sorted(be.kernel_weights, key=lambda k: be.kernel_weights[k].numel()):
            t = be.kernel_weights[n]
            size = t.numel() * t.element_size()
            if size + (2 << 30) < torch.cuda.mem_get_info()[0]:
                be.kernel_weights[n] = fresh(t)
                moved[n] = size
            del t
            torch.cuda.empty_cache()
    elif what == "kv":
        for n in ("k_pool", "v_pool"):
            t = getattr(eng.kv, n)
            setattr(eng.kv, n, fresh(t))
            moved[n] = t.numel() * t.element_size()
    elif what != "none":
        raise ValueError(what)
    be._desc_cache.clear()
    be._step_graphs = {}
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return moved


#: the modes probe's moves (MEGAC_MODE_SEQ: others), each timed twice after it
MODE_SEQ = ("none", "none", "words", "words", "words", "buffers", "buffers", "buffers", "tasks", "tasks",
            "kv", "kv", "kv", "weights", "weights", "none", "words", "buffers", "kv")


def check_modes() -> dict:
    """One North Mini Code engine at bs1 8K, timed (20 steps) four times
    unmoved (does an engine keep its mode?), then after each move
    (``rehome``) of MEGAC_MODE_SEQ in turn. Bits: every move's step logits
    over the same rows and KV equal the step's just before it."""
    import os

    import torch

    eng, _ = _nmc_probe_engine()

    def ms():
        return _step_times(eng, 1, 8192, steps=20)["kernel_ms"]

    out = {"unmoved": [ms() for _ in range(4)], "moves": []}
    print(json.dumps(out), flush=True)
    seq = os.environ.get("MEGAC_MODE_SEQ")
    for i, what in enumerate(seq.split(",") if seq else MODE_SEQ):
        moved = {}
        got = step_logits_per_setup(eng, {"before": lambda: None,
                                          "after": lambda: moved.update(rehome(eng, what))}, 1, 8192)
        row = {"move": i, "moved": what, "bytes": sum(moved.values()), "tensors": len(moved),
               "bits_equal": bool(torch.equal(got["before"], got["after"])), "ms": [ms(), ms()]}
        out["moves"].append(row)
        print(json.dumps(row), flush=True)
    out["free_gb"] = round(torch.cuda.mem_get_info()[0] / 2 ** 30, 1)
    out["bits_equal_every_move"] = all(r["bits_equal"] for r in out["moves"])
    return out


def check_placement() -> dict:
    """Placement tuning (megac.gpu.placement) on North Mini Code, 8K:
    MEGAC_PLACEMENT_ENGINES engines (default 6) one after the other on the
    same weights (adopted where the model fits the GPU only once); per
    engine the ms of every placement tried at bs1, the step re-measured (20
    steps) at bs1 and bs8 before tuning and after, and one bs1 step's logits
    over the same rows and KV before and after tuning (bit-identical)."""
    import gc

    import torch

    from megac.decode_bench import pool_blocks
    from megac.gpu.placement import tune_engine
    from megac.spec import load_spec
    from megac.weights import random_weights
    from megac.weights.layout import LaidOutWeights

    spec = load_spec("north-mini-code")
    w = random_weights(spec, seed=0, dtype=torch.bfloat16, device=DEV)
    fresh = _fits_once(w)
    trials = int(os.environ.get("MEGAC_PLACEMENT_TRIALS_TRIED", "8"))
    out = {"engines": []}
    for i in range(int(os.environ.get("MEGAC_PLACEMENT_ENGINES", "6"))):
        eng = engine(spec, w, max_batch_size=8, max_model_len=8192 + 64, placement_trials=0,
                     num_kv_blocks=max(40000, pool_blocks(spec, 8, 8192 + 64)), decode_only=fresh)
        if fresh:
            w = None
        _noise_kv(eng)

        def times():
            return {f"bs{b}": _step_times(eng, b, 8192, steps=20)["kernel_ms"] for b in (1, 8)}

        before, rep = times(), {}
        got = step_logits_per_setup(eng, {"before": lambda: None,
                                          "after": lambda: rep.update(tune_engine(eng, trials).to_json())}, 1, 8192)
        row = {"engine": i, "before": before, "after": times(), "placement": rep,
               "bits_equal": bool(torch.equal(got["before"], got["after"]))}
        out["engines"].append(row)
        print(json.dumps(row), flush=True)
        if fresh:
            w = LaidOutWeights.take(eng.backend)
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    e = out["engines"]
    out["bits_equal_every_engine"] = all(r["bits_equal"] for r in e)
    for b in ("bs1", "bs8"):
        out[f"median_{b}"] = {k: median([r[k][b] for r in e]) for k in ("before", "after")}
    return out


def check_tunehold() -> dict:
    """Why a tuned placement did not hold (check placement): one North Mini
    Code engine, bs1 8K, each timing the median of 20 steps on a fresh row
    (_step_times), twice. Before tuning; tuning with every losing placement
    freed at once (no graveyard), its loop timed by _step_times itself;
    right after it; after the allocator's cache is emptied; then the same
    with the losers kept to the end (the product's tune_engine); and the
    kept placement timed through tune_engine's own loop (MEGAC_TUNEHOLD_TRIALS
    placements each)."""
    import torch

    from megac.gpu import placement as pl

    eng, _ = _nmc_probe_engine()
    trials = int(os.environ.get("MEGAC_TUNEHOLD_TRIALS", "6"))

    def ms():
        return _step_times(eng, 1, 8192, steps=20)["kernel_ms"]

    out = {"before": [ms(), ms()]}
    print(json.dumps(out), flush=True)
    got, chosen = pl.tune(eng.backend, ms, trials)  # losers freed at once
    out["no_graveyard"] = {"loop": got, "chosen": chosen, "right_after": [ms(), ms()]}
    torch.cuda.empty_cache()
    out["no_graveyard"]["after_empty_cache"] = [ms(), ms()]
    print(json.dumps(out["no_graveyard"]), flush=True)
    got, chosen = pl.tune(eng.backend, ms, trials, free_bytes=lambda: torch.cuda.mem_get_info()[0],
                          synchronize=torch.cuda.synchronize)
    out["graveyard"] = {"loop": got, "chosen": chosen, "right_after": [ms(), ms()]}
    torch.cuda.empty_cache()
    out["graveyard"]["after_empty_cache"] = [ms(), ms()]
    print(json.dumps(out["graveyard"]), flush=True)
    rep = pl.tune_engine(eng, trials)
    out["tune_engine"] = {**rep.to_json(), "after": [ms(), ms()]}
    print(json.dumps(out["tune_engine"]), flush=True)
    return out


#: check kvorder's sequence: a block order for the timed row (asc: lowest ids first, as a fresh pool
#: hands them out; desc; r<seed>: shuffled) or a move (rehome's group) before the next timing
KV_ORDER_SEQ = ("asc", "asc", "desc", "desc", "r1", "r1", "r2", "asc", "tasks", "asc", "asc", "tasks", "asc",
                "buffers", "asc", "desc", "buffers", "desc")


def check_kvorder() -> dict:
    """What the step's time follows at bs1 8K (North Mini Code, one engine):
    the order of the blocks the timed row's KV lands in (the pool's free
    list set before each timing: ascending ids, descending, shuffled), or
    the placement of the task lists and step buffers (rehome), each timing
    twice (20 steps) on a row allocated afresh in the same order
    (MEGAC_KV_ORDER_SEQ: another sequence)."""
    import random as rnd

    eng, _ = _nmc_probe_engine()
    alloc = eng.kv.allocator
    seq = os.environ.get("MEGAC_KV_ORDER_SEQ")
    out = {"rows": []}
    order = "asc"
    for what in (seq.split(",") if seq else KV_ORDER_SEQ):
        if what in ("tasks", "buffers", "words", "kv", "none"):
            rehome(eng, what)
            row = {"moved": what, "order": order}
        else:
            order = what
            row = {"order": order}
        ms = []
        for _ in range(2):
            free = sorted(alloc._free)
            if order == "asc":
                alloc._free = free[::-1]  # pop() gives the lowest id first
            elif order == "desc":
                alloc._free = free
            else:
                rnd.Random(int(order[1:])).shuffle(free)
                alloc._free = free
            ms.append(_step_times(eng, 1, 8192, steps=20)["kernel_ms"])
        row["ms"] = ms
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
    return out


CHECKS = {"queue_order": check_queue_order, "step_graph": check_step_graph, "pipeline": check_pipeline, "tiles": check_tiles, "opcodes": check_opcodes, "variants": check_variants, "profile": check_profile, "splits": check_splits, "order_variants": check_order_variants, "batch": check_batch, "configs": check_configs, "contexts": check_contexts, "nmc_full": check_nmc_full,
          "speed": check_speed, "gemm_env": check_gemm_env, "modes": check_modes,
          "placement": check_placement, "kvorder": check_kvorder,
          "tunehold": check_tunehold}

"""The CPU VM (fast mode) against transformers' own models, batch invariance,
the engine (sampling, EOS, schedule choice) and the VM's pieces.

Reference models are tiny random ``Cohere2MoeForCausalLM`` / ``LlamaForCausalLM``
written with ``save_pretrained`` and loaded by megac from that directory; the
reference logits are transformers' full recompute of every prefix."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from megac import abi  # noqa: E402
from megac.errors import MegacError  # noqa: E402
from megac.kv import PagedKVCache  # noqa: E402
from megac.passes.pipeline import compile_one, compile_schedules  # noqa: E402
from megac.prefill import prefill  # noqa: E402
from megac.spec import load_spec  # noqa: E402
from megac.abi import split_range  # noqa: E402
from megac.vm import DecodeStep, DeviceState, VMWeights  # noqa: E402
from megac.engine.generate import generate  # noqa: E402
from engines import run, vm_engine  # noqa: E402
from megac.vm.interp import coalesced_runs  # noqa: E402
from megac.weights import kernel_weights, load_hf, random_weights  # noqa: E402
from models import hf_last_logits, hf_model, save_checkpoint, variant  # noqa: E402

ORDERS = ("tuned", "interleaved", "attention-first")
RTOL = 1e-4
STEPS = 32
LENGTHS = (1, 9, 37)  # ragged; 37 > the sliding window (8) and > 2 KV blocks (16)

_S = {"attention": "sliding", "window": 8, "rope": True}


def _spec(name: str):
    moe = load_spec("tiny-moe")
    if name == "moe":  # dense RoPE prefix, sliding MoE, full NoPE MoE layer 4, sigmoid w/o renorm
        return variant(moe, "vm-moe", tie_embeddings=False)
    if name == "moe-tied":  # tied head, logit_scale 0.5
        return moe
    if name == "llama":
        return variant("tiny-llama", "vm-llama", tie_embeddings=False)
    if name == "softmax":
        return variant(moe, "vm-softmax", moe={"router": "softmax", "renormalize": False, "top_k": 3},
                       tie_embeddings=False)
    if name == "sigmoid-renorm":
        return variant(moe, "vm-renorm", moe={"renormalize": True}, tie_embeddings=False)
    if name == "nope-dense":  # two dense prefix layers, the full one NoPE; untied, logit scale
        layers = [
            {"attention": "full", "window": None, "rope": False, "ffn": "dense"},
            {**_S, "ffn": "dense"},
            {**_S, "ffn": "moe"},
            {"attention": "full", "window": None, "rope": False, "ffn": "moe"},
            {**_S, "ffn": "moe"},
        ]
        return variant(moe, "vm-nope-dense", layers=layers, tie_embeddings=False, logit_scale=0.125)
    if name == "sliding-splits":  # several sliding splits per row (empty ones for short rows)
        layers = [{"attention": "full", "window": None, "rope": True, "ffn": "dense"}] + \
                 [{"attention": "sliding", "window": 24, "rope": True, "ffn": "moe"}] * 2
        return variant(moe, "vm-sliding-splits", layers=layers, tie_embeddings=False,
                       target={**moe.target.model_dump(), "attn_split_tokens": 8, "kv_block_size": 4})
    if name == "llama-mqa":
        return variant("tiny-llama", "vm-llama-mqa", num_kv_heads=1, tie_embeddings=False, num_layers=3,
                       layers=[{"attention": "full", "window": None, "rope": True, "ffn": "dense"}] * 3)
    raise KeyError(name)


def _prompts(spec, lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for n in lengths]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


_CKPT: dict = {}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(spec, weights, hf model) per variant, saved and re-loaded once."""

    def get(name):
        if name not in _CKPT:
            spec = _spec(name)
            d = tmp_path_factory.mktemp(spec.name)
            model = save_checkpoint(spec, d, seed=11)
            spec2, w = load_hf(d)
            # a checkpoint carries no target: keep the test's small pages and splits
            spec2 = spec2.model_copy(update={"target": spec.target})
            _CKPT[name] = (spec2, w, model)
        return _CKPT[name]

    yield get
    _CKPT.clear()


def _check_against_hf(model, prompts, outs, steps, rtol=RTOL):
    worst = 0.0
    for i, (p, o) in enumerate(zip(prompts, outs)):
        seq = list(p)
        assert len(o.tokens) == steps, (i, len(o.tokens))
        for s in range(steps):
            ref = hf_last_logits(model, seq)
            worst = max(worst, _rel(o.logits[s], ref))
            assert int(ref.argmax()) == o.tokens[s], f"row {i} step {s}: greedy token differs"
            seq.append(o.tokens[s])
    assert worst <= rtol, worst
    return worst


# --------------------------------------------------------------------------- vs transformers
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", ["moe", "llama"])
def test_fp32_matches_transformers(ckpt, name, order):
    """fp32 logits within 1e-4 of transformers at every step and the same greedy
    tokens for 32 steps, ragged prompts (one longer than the sliding window)."""
    spec, w, model = ckpt(name)
    compiled = compile_schedules(spec, order=order, batch_sizes=[1, 2, 4])
    eng = vm_engine(spec, w, compiled)
    prompts = _prompts(spec)
    outs = generate(eng, prompts, max_tokens=STEPS, eos_token_ids=[], return_logits=True)
    _check_against_hf(model, prompts, outs, STEPS)
    assert set(eng.backend.schedules_used) == {(4, max(spec.resolved_context_buckets))}


def test_the_global_cursor_order_matches_transformers(ckpt):
    """The experiment order whose SM cursor carries on from layer to layer
    (``sm_cursor: global``) places the same tasks on other SMs: the same
    results."""
    from megac.resources import schedules_dir

    spec, w, model = ckpt("moe")
    order = str(schedules_dir() / "experiments" / "tuned-global-cursor.yaml")
    eng = vm_engine(spec, w, compile_schedules(spec, order=order, batch_sizes=[1, 2, 4]))
    prompts = _prompts(spec)
    outs = generate(eng, prompts, max_tokens=8, eos_token_ids=[], return_logits=True)
    _check_against_hf(model, prompts, outs, 8)


def test_a_placed_wave_order_matches_transformers(ckpt):
    """The experiment order that runs the O-projection on the attention
    SMs (``{wave: o_proj, sms_of: attn}``) changes only where tasks run:
    the same results, in the VM's checked mode too (every read against the
    counters' happens-before order)."""
    from megac.resources import schedules_dir

    spec, w, model = ckpt("moe")
    order = str(schedules_dir() / "experiments" / "oproj-on-attention.yaml")
    prompts = _prompts(spec)
    for mode in ("fast", "checked"):
        eng = vm_engine(spec, w, compile_schedules(spec, order=order, batch_sizes=[1, 2, 4]), mode=mode)
        outs = generate(eng, prompts, max_tokens=6, eos_token_ids=[], return_logits=True)
        _check_against_hf(model, prompts, outs, 6)


def test_a_split_claimer_wave_matches_transformers(ckpt):
    """``{wave: attn, share: 0.5, rest_after: moe_upgate}``: half the SMs
    claim a full layer's attention before their expert claims, the others
    after them (the waiters on attention follow only the first half): the
    same results, in the VM's checked mode too (every read against the
    counters' happens-before order), on 132 SMs and on 5 (3 claimers
    before the expert claims, 2 after)."""
    from megac.resources import schedules_dir

    spec, w, model = ckpt("moe")
    order = str(schedules_dir() / "experiments" / "full-attn-half.yaml")
    prompts = _prompts(spec)
    for sms, mode in ((132, "fast"), (132, "checked"), (5, "checked")):
        sp = spec.model_copy(update={"target": spec.target.model_copy(update={"num_sms": sms})})
        eng = vm_engine(sp, w, compile_schedules(sp, order=order, batch_sizes=[1, 2, 4]), mode=mode)
        outs = generate(eng, prompts, max_tokens=6, eos_token_ids=[], return_logits=True)
        _check_against_hf(model, prompts, outs, 6)


@pytest.mark.parametrize("name", ["moe-tied", "softmax", "sigmoid-renorm", "nope-dense", "sliding-splits",
                                  "llama-mqa"])
def test_fp32_variants_match_transformers(ckpt, name):
    spec, w, model = ckpt(name)
    prompts = _prompts(spec, (5, 30, 2))
    steps = 16
    outs = run(spec, w, compile_schedules(spec, order="tuned", batch_sizes=[4]), prompts, max_tokens=steps,
               eos_token_ids=[], return_logits=True)
    _check_against_hf(model, prompts, outs, steps)


def test_sliding_splits_really_split(ckpt):
    """The 'sliding-splits' variant has several static sliding splits, some empty."""
    spec, _, _ = ckpt("sliding-splits")
    sched = compile_one(spec, "tuned", rows=2, context=64)
    geo = sched.geometry
    assert geo.sliding_static_splits == 3
    assert geo.attn_splits(min(5, geo.max_window)) == 1  # a short row: two empty splits


@pytest.mark.parametrize("name", ["moe", "llama"])
def test_bf16_close_to_transformers(name):
    """bf16 weights, activations and KV: cosine similarity of logits >= 0.99
    with transformers in bf16 at every step.

    (On tiny random MoE models a router near-tie -- top-2/top-3 logits within
    ~1e-4 -- can route one row differently in any two bf16 implementations;
    weight seed 2 has one such step, cos 0.949, where transformers' bf16 and
    fp32 happen to agree. Seed 4 has none.)"""
    spec = _spec(name)
    w = random_weights(spec, seed=4, dtype=torch.bfloat16)
    model = hf_model(spec, w)
    prompts = _prompts(spec, (4, 30, 11))
    outs = run(spec, w, compile_schedules(spec, order="tuned", batch_sizes=[4]), prompts, max_tokens=12,
               eos_token_ids=[], return_logits=True)
    worst = 1.0
    for p, o in zip(prompts, outs):
        seq = list(p)
        for s, tok in enumerate(o.tokens):
            ref = hf_last_logits(model, seq)
            cos = float(torch.nn.functional.cosine_similarity(o.logits[s], ref, dim=0))
            worst = min(worst, cos)
            seq.append(tok)
    assert worst >= 0.99, worst


# --------------------------------------------------------------------------- batch invariance
@pytest.mark.parametrize("name", ["moe", "llama"])
def test_batch_invariance(ckpt, name):
    """Each prompt alone (batch-1 schedule) and inside a ragged batch (batch-4
    schedule, one inactive row, rows finishing at different steps): the same
    tokens and bit-identical fp32 logits."""
    spec, w, _ = ckpt(name)
    eng = vm_engine(spec, w, compile_schedules(spec, order="interleaved", batch_sizes=[1, 2, 4]))
    prompts = _prompts(spec, (3, 40, 17), seed=5)
    batch = generate(eng, prompts, max_tokens=12, eos_token_ids=[], return_logits=True)
    for i, p in enumerate(prompts):
        alone = generate(eng, [p], max_tokens=12, eos_token_ids=[], return_logits=True)[0]
        assert alone.tokens == batch[i].tokens
        for a, b in zip(alone.logits, batch[i].logits):
            assert torch.equal(a, b)
    # a row that stops early (EOS = its 4th token) shrinks the batch to the
    # batch-2 schedule; the other rows are unaffected, bit for bit
    toks = batch[0].tokens
    j = next(j for j in range(2, len(toks)) if toks[j] not in toks[:j])
    eos = toks[j]
    eng.backend.schedules_used.clear()
    shrink = generate(eng, prompts, max_tokens=12, eos_token_ids=[eos], return_logits=True)
    assert shrink[0].tokens == toks[:j] and shrink[0].finish_reason == "stop"
    for i in (1, 2):
        n = len(shrink[i].tokens)
        assert shrink[i].tokens == batch[i].tokens[:n]
        for a, b in zip(shrink[i].logits, batch[i].logits):
            assert torch.equal(a, b)
    assert any(r == 2 for r, _ in eng.backend.schedules_used)


def test_orders_and_sm_counts_give_identical_bits(ckpt):
    """The three wave orders and different SM counts run the same tiles: the
    VM's fp32 logits are bit-identical across all of them."""
    spec, w, _ = ckpt("moe")
    prompts = _prompts(spec, (6, 21), seed=3)
    ref = None
    from megac.resources import schedules_dir

    split = str(schedules_dir() / "experiments" / "full-attn-half.yaml")
    for order, sms in (("tuned", 132), ("interleaved", 132), ("attention-first", 132), ("tuned", 7), (split, 7),
                       (split, 132)):
        sp = spec.model_copy(update={"target": spec.target.model_copy(update={"num_sms": sms})})
        outs = run(sp, w, compile_schedules(sp, order=order, batch_sizes=[2], buckets=[1024]), prompts, max_tokens=6,
                   eos_token_ids=[], return_logits=True)
        got = [torch.stack(o.logits) for o in outs]
        if ref is None:
            ref = got
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), (order, sms)


def test_bf16_batch_invariance():
    spec = _spec("moe")
    w = random_weights(spec, seed=4, dtype=torch.bfloat16)
    eng = vm_engine(spec, w, compile_schedules(spec, order="tuned", batch_sizes=[1, 4], buckets=[1024]))
    prompts = _prompts(spec, (2, 19, 33), seed=8)
    batch = generate(eng, prompts, max_tokens=6, eos_token_ids=[], return_logits=True)
    for i, p in enumerate(prompts):
        alone = generate(eng, [p], max_tokens=6, eos_token_ids=[], return_logits=True)[0]
        assert alone.tokens == batch[i].tokens
        assert all(torch.equal(a, b) for a, b in zip(alone.logits, batch[i].logits))


# --------------------------------------------------------------------------- engine
def _tiny_engine(**kw):
    spec = _spec("llama")
    w = random_weights(spec, seed=3)
    return spec, vm_engine(spec, w, compile_schedules(spec, order="tuned", batch_sizes=[1, 2]), **kw)


def test_engine_sampling_eos_and_groups():
    spec, eng = _tiny_engine()
    prompts = _prompts(spec, (4, 7, 2), seed=9)
    # more prompts than the largest batch size: consecutive groups
    a = generate(eng, prompts, max_tokens=6, temperature=0.8, top_p=0.9, top_k=20, seed=[1, 2, 3], eos_token_ids=[])
    b = generate(eng, prompts, max_tokens=6, temperature=0.8, top_p=0.9, top_k=20, seed=[1, 2, 3], eos_token_ids=[])
    assert [o.tokens for o in a] == [o.tokens for o in b]
    assert all(len(o.tokens) == 6 and o.finish_reason == "length" for o in a)
    # a request's sampled tokens do not depend on its batch (own generator)
    alone = generate(eng, [prompts[1]], max_tokens=6, temperature=0.8, top_p=0.9, top_k=20, seed=[2],
                         eos_token_ids=[])
    assert alone[0].tokens == a[1].tokens
    c = generate(eng, prompts, max_tokens=6, temperature=0.8, top_p=0.9, top_k=20, seed=[7, 8, 9], eos_token_ids=[])
    assert [o.tokens for o in c] != [o.tokens for o in a]
    # EOS stops a row and is not returned
    g = generate(eng, [prompts[0]], max_tokens=6, eos_token_ids=[])[0]
    e = generate(eng, [prompts[0]], max_tokens=6, eos_token_ids=[g.tokens[2]])[0]
    assert e.finish_reason == "stop" and e.tokens == g.tokens[: g.tokens.index(g.tokens[2])]
    with pytest.raises(MegacError):
        generate(eng, [[]])


def test_engine_picks_schedules():
    spec, eng = _tiny_engine()
    pick = eng.backend.schedules.pick
    s = pick(1, 10)
    assert s.rows == 1
    assert pick(2, 10).rows == 2
    with pytest.raises(MegacError):
        pick(3, 10)
    with pytest.raises(MegacError):
        pick(1, spec.max_context + 1)


def test_vm_backend_protocol():
    """``VMBackend`` drives the engine's shared cache like the reference backend."""
    from megac.vm import VMBackend

    spec = _spec("moe")
    w = random_weights(spec, seed=5)
    comp = compile_schedules(spec, order="tuned", batch_sizes=[1, 2], buckets=[1024])
    kv = PagedKVCache(spec, max_rows=2, num_blocks=200, dtype=torch.float32)
    be = VMBackend(spec, w, kv, comp)
    assert be.name == "vm" and be.max_batch_size == 2
    from megac.runtime.backend import Backend

    assert isinstance(be, Backend)
    prompts = _prompts(spec, (4, 11), seed=1)
    rows = [kv.allocate_row() for _ in prompts]
    lg = torch.stack([be.prefill(r, p) for r, p in zip(rows, prompts)])
    ref = run(spec, w, comp, prompts, max_tokens=5, eos_token_ids=[], return_logits=True)
    for s in range(4):
        for i in range(2):
            assert torch.equal(lg[i], ref[i].logits[s])
        if s == 3:
            break
        toks = lg.argmax(-1).tolist()
        for r in rows:
            kv.append_slot(r)  # the engine reserves the slot first (idempotent)
        lg = be.decode(rows, toks)
    # one row alone uses the batch-1 schedule, bit-identical to that row's
    # logits in the batched run
    kv.append_slot(rows[1])
    before = dict(be.schedules_used)
    lg1 = be.decode([rows[1]], [int(lg[1].argmax())])
    assert lg1.shape == (1, spec.vocab_size)
    assert {k: n - before.get(k, 0) for k, n in be.schedules_used.items() if n != before.get(k, 0)} == {(1, 1024): 1}
    assert torch.equal(lg1[0], ref[1].logits[4])


def test_engine_runs_an_artifact(tmp_path):
    """``megac compile``'s artifact (manifest + schedule.npz) runs in the VM
    with the same bits as the in-memory schedules it was written from."""
    from megac.artifact import load_artifact, write_artifact

    spec = _spec("moe")
    w = random_weights(spec, seed=5)
    comp = compile_schedules(spec, order="interleaved", batch_sizes=[1, 2], buckets=[1024])
    write_artifact(tmp_path / "art", spec, comp.schedules, order="interleaved")
    art = load_artifact(tmp_path / "art")
    spec2, scheds = art.spec(), art.to_schedules()
    assert spec2 == spec and len(scheds) == 2
    prompts = _prompts(spec, (4, 11), seed=1)
    a = run(spec, w, comp, prompts, max_tokens=5, eos_token_ids=[], return_logits=True)
    b = run(spec2, w, scheds, prompts, max_tokens=5, eos_token_ids=[], return_logits=True)
    for x, y in zip(a, b):
        assert x.tokens == y.tokens and all(torch.equal(p, q) for p, q in zip(x.logits, y.logits))


# --------------------------------------------------------------------------- pieces
def test_weights_layout_and_consuming_build():
    spec = _spec("moe")
    w = random_weights(spec, seed=4)
    geo = compile_one(spec, "tuned", rows=1, context=64).geometry
    ref = kernel_weights(w, spec, chunk=geo.upgate_bn // 2, moe_chunk=geo.moe_up_bn // 2)
    consumed = random_weights(spec, seed=4)
    vw = VMWeights.from_weights(consumed, spec, geo, consume=True)
    for k, t in ref.items():
        assert torch.equal(vw.tensors[k], t), k
    # the canonical layers were given up as they were copied (one copy at the peak)
    assert all(lw.q is None and lw.o is None for lw in consumed.layers)
    assert all(consumed.layers[i].experts_gate is None and consumed.layers[i].experts_down is None
               for i in spec.moe_layers) and spec.moe_layers
    bf = VMWeights.from_weights(w, spec, geo, dtype=torch.bfloat16)
    assert bf.tensors["w_qkv"].dtype == torch.bfloat16 and bf.compute("w_qkv").dtype == torch.float32


def test_device_state_follows_the_plan():
    spec = _spec("moe")
    sched = compile_one(spec, "tuned", rows=2, context=64)
    w = random_weights(spec, seed=1)
    st = DeviceState(sched, VMWeights.from_weights(w, spec, sched.geometry))
    for f in abi.LAUNCH_DESC:
        assert f.name in st.desc, f.name
        b = sched.plan.buffers[f.name]
        v = st.desc[f.name]
        if f.name in ("k_pool", "v_pool"):
            assert v is None  # bound from the KV cache each step
        elif b.kind == "scalar":
            assert isinstance(v, (int, float))
        elif b.dtype == "argmax":
            assert tuple(v.shape) == tuple(b.shape) + (abi.ARGMAX_RECORD_WORDS,) and v.dtype == torch.int32
        else:
            assert tuple(v.shape) == tuple(b.shape), f.name
    assert st["x_norm"].dtype == torch.float32  # fp32 mode: bf16 buffers are fp32
    st16 = DeviceState(sched, VMWeights.from_weights(w, spec, sched.geometry, dtype=torch.bfloat16))
    assert st16["x_norm"].dtype == torch.bfloat16 and st16["o_part"].dtype == torch.float32
    assert st16["attn_o_part"].dtype == torch.float32 and st16["q"].dtype == torch.bfloat16
    assert math.isclose(st["attn_scale"], spec.head_dim ** -0.5)


def test_decode_step_matches_reference_and_host_words():
    """One step of the VM vs megac.reference on the same cache; host words."""
    from megac.reference import decode_step

    spec = _spec("moe")
    w = random_weights(spec, seed=6)
    sched = compile_one(spec, "tuned", rows=4, context=64)
    step = DecodeStep(DeviceState(sched, VMWeights.from_weights(w, spec, sched.geometry)))
    prompts = _prompts(spec, (3, 40), seed=2)
    kv = PagedKVCache(spec, max_rows=3, num_blocks=200, dtype=torch.float32)
    kv.allocate_row()  # kv rows 1, 2: not the schedule's row numbers
    rows, lg = prefill(w, spec, kv, prompts)
    tok = lg.argmax(-1).tolist()
    import copy

    kv2 = copy.deepcopy(kv)
    got = step(kv, rows, tok)
    ref = decode_step(w, spec, kv2, tok, rows)
    assert _rel(got, ref) < 1e-5
    st, geo, tw = step.st, sched.geometry, sched.geometry.target_words
    T = st.np["targets"]
    assert T[tw.attn_splits_full(0)] == geo.attn_splits(4) and T[tw.attn_splits_full(1)] == geo.attn_splits(41)
    assert T[tw.attn_splits_full(2)] == 1 and st.np["row_active"].tolist() == [1, 1, 0, 0]
    assert T[tw.attn_queue_len] == geo.kv_heads * sum(geo.attn_splits(n) for n in (4, 41, 1, 1))
    assert T[tw.attn_splits_sliding(1)] == geo.attn_splits(min(41, geo.max_window))
    # the pool holds the step's K/V where the reference wrote them
    for layer in range(spec.num_layers):
        for r in rows:
            k1, _ = kv.gather(layer, r, int(kv.seq_pos[r]) - 1, int(kv.seq_pos[r]))
            k2, _ = kv2.gather(layer, r, int(kv2.seq_pos[r]) - 1, int(kv2.seq_pos[r]))
            assert torch.allclose(k1, k2, rtol=1e-5, atol=1e-6)


def test_split_range_tiles_the_visible_span():
    # every split count tiles the span exactly once, empty splits sit at the end
    for seq in range(1, 140, 7):
        for win in (0, 8, 24, 100):
            for ns in range(1, 7):
                for bs in (1, 4, 16):
                    got = [split_range(seq, win, ns, sp, bs) for sp in range(ns + 2)]
                    cover = sorted(p for b, e in got for p in range(b, e))
                    lo = max(0, seq - win) if win else 0
                    assert cover == list(range(lo, seq))
                    assert all(b == e == seq for b, e in got[ns:])
    for seq, win, ns, bs in ((70, 0, 3, 16), (70, 24, 3, 4), (5, 24, 3, 4)):
        got = [split_range(seq, win, ns, s, bs) for s in range(ns)]
        cover = sorted(p for b, e in got for p in range(b, e))
        lo = max(0, seq - win) if win else 0
        assert cover == list(range(lo, seq))


def test_coalesced_runs_break_on_dependencies():
    spec = _spec("llama")
    sched = compile_one(spec, "tuned", rows=2, context=64)
    words = sched.global_words()
    runs = coalesced_runs(words)
    assert runs[0][0] == 0 and runs[-1][1] == len(words)
    for a, b in runs:
        assert len(set(words[a:b, abi.H.OPCODE].tolist())) == 1
        assert len(set(words[a:b, abi.H.LAYER].tolist())) == 1
        sig = set(words[a:b, abi.H.SIGNAL].tolist()) - {-1}
        for c in (abi.H.WAIT0, abi.H.WAIT1):
            w = set(words[a:b, c].tolist()) - {-1}
            # a run never waits on a counter it signals itself
            assert not (w & sig)
    assert len(runs) < len(words) / 4
    fake = np.zeros((3, abi.TASK_WORDS), dtype=np.int32)
    fake[:, abi.H.OPCODE] = int(abi.Op.ADD_RMSNORM)
    fake[:, [abi.H.WAIT0, abi.H.WAIT1, abi.H.SIGNAL]] = -1
    fake[0, abi.H.SIGNAL] = 5
    fake[2, abi.H.WAIT0] = 5
    assert coalesced_runs(fake) == [(0, 2), (2, 3)]

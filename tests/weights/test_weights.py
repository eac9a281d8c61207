"""Weights: HF checkpoint loading (the tensor names transformers 5 writes),
random weights, kernel layouts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from megac import abi  # noqa: E402
from megac.errors import MegacError  # noqa: E402
from megac.spec import load_spec  # noqa: E402
from megac.weights import (  # noqa: E402
    ModelWeights,
    canonical_from_kernel,
    kernel_weights,
    load_hf,
    load_hf_weights,
    random_weights,
)
from megac.weights.layout import (  # noqa: E402
    KERNEL_WEIGHT_FIELDS,
    deinterleave_gate_up,
    interleave_gate_up,
    rope_inv_freq,
    upgate_row_map,
)
from models import save_checkpoint, variant  # noqa: E402


def _same(a: ModelWeights, b: ModelWeights) -> None:
    na, nb = dict(a.tensors()), dict(b.tensors())
    assert na.keys() == nb.keys()
    for k in na:
        assert na[k].dtype == nb[k].dtype, k
        assert torch.equal(na[k], nb[k]), k


@pytest.fixture(scope="module")
def moe_spec():
    return load_spec("tiny-moe")


@pytest.fixture(scope="module")
def llama_spec():
    return load_spec("tiny-llama")


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory, moe_spec):
    d = tmp_path_factory.mktemp("moe")
    save_checkpoint(moe_spec, d, seed=3)
    return d


# ------------------------------------------------------------------ names


def _expected_names(spec, *, fused: bool) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not spec.tie_embeddings:
        names.add("lm_head.weight")
    for i, ls in enumerate(spec.layers):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight"} | {f"{p}self_attn.{x}_proj.weight" for x in "qkvo"}
        if spec.block == "sequential":
            names.add(p + "post_attention_layernorm.weight")
        if ls.ffn == "dense":
            names |= {f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        else:
            names.add(p + "mlp.gate.weight")
            if fused:
                names |= {p + "mlp.experts.gate_up_proj", p + "mlp.experts.down_proj"}
            else:
                names |= {f"{p}mlp.experts.{e}.{x}_proj.weight"
                          for e in range(spec.moe.num_experts) for x in ("gate", "up", "down")}
    return names


def test_names_transformers_writes(tmp_path, moe_spec, llama_spec, moe_ckpt):
    """What save_pretrained of transformers 5 actually writes: per-expert names
    by default, fused ones with save_original_format=False, no lm_head when tied."""
    assert set(load_file(moe_ckpt / "model.safetensors")) == _expected_names(moe_spec, fused=False)
    fused = tmp_path / "fused"
    save_checkpoint(moe_spec, fused, seed=3, original_format=False)
    assert set(load_file(fused / "model.safetensors")) == _expected_names(moe_spec, fused=True)
    llama = tmp_path / "llama"
    save_checkpoint(llama_spec, llama)
    assert set(load_file(llama / "model.safetensors")) == _expected_names(llama_spec, fused=False)
    untied_spec = variant(llama_spec, tie_embeddings=False)
    untied = tmp_path / "untied"
    save_checkpoint(untied_spec, untied)
    assert set(load_file(untied / "model.safetensors")) == _expected_names(untied_spec, fused=False)


def test_load_per_expert_and_fused(tmp_path, moe_spec, moe_ckpt):
    ref = random_weights(moe_spec, seed=3)
    spec, w = load_hf(moe_ckpt)
    assert spec.model_dump(exclude={"name", "target"}) == moe_spec.model_dump(exclude={"name", "target"})
    _same(w, ref)
    save_checkpoint(moe_spec, tmp_path / "fused", seed=3, original_format=False)
    _same(load_hf_weights(tmp_path / "fused", moe_spec), ref)


def test_load_sharded_llama_untied(tmp_path, llama_spec):
    spec = variant(llama_spec, tie_embeddings=False)
    save_checkpoint(spec, tmp_path, seed=5, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    w = load_hf_weights(tmp_path)
    assert w.lm_head is not None
    _same(w, random_weights(spec, seed=5))


def test_load_dtype(moe_ckpt, moe_spec):
    w = load_hf_weights(moe_ckpt, moe_spec, dtype=torch.bfloat16)
    assert w.dtype == torch.bfloat16 and all(t.dtype == torch.bfloat16 for _, t in w.tensors())
    _same(w, random_weights(moe_spec, seed=3).to(torch.bfloat16))


def _rewrite(src, dst, edit):
    dst.mkdir()
    sd = load_file(src / "model.safetensors")
    edit(sd)
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text((src / "config.json").read_text())


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda sd: sd.__setitem__("model.layers.0.self_attn.q_proj.bias", torch.zeros(64)),
         "model.layers.0.self_attn.q_proj.bias"),
        (lambda sd: sd.__setitem__("model.layers.9.input_layernorm.weight", torch.zeros(64)),
         "model.layers.9.input_layernorm.weight"),
        (lambda sd: sd.__setitem__("model.foo.weight", torch.zeros(1)), "model.foo.weight"),
        (lambda sd: sd.pop("model.layers.2.self_attn.k_proj.weight"), "model.layers.2.self_attn.k_proj.weight"),
        (lambda sd: sd.pop("model.layers.3.mlp.experts.5.up_proj.weight"),
         "model.layers.3.mlp.experts.5.up_proj.weight"),
        (lambda sd: sd.__setitem__("model.layers.1.mlp.gate_proj.weight", torch.zeros(96, 64)),
         "model.layers.1.mlp.gate_proj.weight"),
        (lambda sd: sd.__setitem__("model.layers.0.mlp.gate.weight", torch.zeros(8, 64)),
         "model.layers.0.mlp.gate.weight"),
        (lambda sd: sd.__setitem__("model.layers.1.mlp.experts.8.up_proj.weight", torch.zeros(32, 64)),
         "model.layers.1.mlp.experts.8.up_proj.weight"),
        (lambda sd: sd.__setitem__("model.layers.1.mlp.experts.0.up_proj.weight", torch.zeros(33, 64)),
         "model.layers.1.mlp.experts.0.up_proj.weight"),
        (lambda sd: sd.__setitem__("model.layers.1.post_attention_layernorm.weight", torch.zeros(64)),
         "model.layers.1.post_attention_layernorm.weight"),
        (lambda sd: sd.__setitem__("lm_head.weight", torch.zeros(256, 64)), "lm_head.weight"),
        (lambda sd: sd.__setitem__("model.layers.1.mlp.experts.gate_up_proj", torch.zeros(8, 64, 64)),
         "model.layers.1.mlp.experts"),
        (lambda sd: sd.__setitem__("model.layers.0.self_attn.o_proj.weight", torch.zeros(64, 65)),
         "layers.0.o"),
    ],
)
def test_refusals_name_the_tensor(tmp_path, moe_ckpt, edit, needle):
    bad = tmp_path / "bad"
    _rewrite(moe_ckpt, bad, edit)
    with pytest.raises(MegacError) as err:
        load_hf_weights(bad)
    msg = str(err.value)
    assert needle in msg and "\n" not in msg, msg


def test_tied_lm_head_equal_to_embed_is_accepted(tmp_path, moe_ckpt, moe_spec):
    d = tmp_path / "tied"
    _rewrite(moe_ckpt, d, lambda sd: sd.__setitem__("lm_head.weight", sd["model.embed_tokens.weight"].clone()))
    w = load_hf_weights(d)
    assert w.lm_head is None


def test_index_problems(tmp_path, llama_spec):
    save_checkpoint(llama_spec, tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.extra.weight"] = next(iter(index["weight_map"].values()))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(MegacError, match="model.layers.0.extra.weight"):
        load_hf_weights(tmp_path)


def test_no_safetensors(tmp_path, llama_spec):
    from megac.spec.hf import write_hf_config

    write_hf_config(llama_spec, tmp_path)
    with pytest.raises(MegacError, match="no \\*.safetensors"):
        load_hf_weights(tmp_path)


# ------------------------------------------------------------------ canonical


def test_model_weights_basics(moe_spec, llama_spec):
    for spec in (moe_spec, llama_spec, load_spec("smollm2-135m")):
        w = random_weights(spec, seed=1)
        w.validate(spec)
        assert w.num_params() == spec.num_params
        b = w.to(torch.bfloat16)
        assert b.dtype == torch.bfloat16 and w.dtype == torch.float32
        assert w.to(torch.float32) is w
        # the same device named another way is no move either (a decode-only
        # engine frees the weights it consumes only if nobody holds a twin)
        assert w.to(torch.float32, "cpu") is w and w.to(device=torch.device("cpu")) is w
        assert b.lm_head_weight is b.embed
    w = random_weights(moe_spec, seed=1)
    w.layers[2].k = w.layers[2].k[:, :10]
    with pytest.raises(MegacError, match="layers.2.k: shape"):
        w.validate(moe_spec)


# ------------------------------------------------------------------ random


def test_random_deterministic(moe_spec):
    a = random_weights(moe_spec, seed=7)
    _same(a, random_weights(moe_spec, seed=7))
    b = random_weights(moe_spec, seed=8)
    assert not torch.equal(a.layers[1].q, b.layers[1].q)
    # bf16 = the fp32 draw rounded; a subset reproduces the same tensors
    _same(random_weights(moe_spec, seed=7, dtype=torch.bfloat16), a.to(torch.bfloat16))
    part = random_weights(moe_spec, seed=7, layers=[4])
    assert torch.equal(part.layers[4].experts_down, a.layers[4].experts_down)
    assert part.layers[3].q.numel() == 0
    # tensors are distinct draws (no two share a generator)
    assert not torch.equal(a.layers[1].experts_gate, a.layers[1].experts_up)
    assert not torch.equal(a.layers[1].q[:32], a.layers[1].k)


def test_random_scales_keep_activations_o1():
    """A deep NMC-shaped model: the residual stays O(1) through many layers,
    logits are finite, and router top-k is decided by clear gaps."""
    from megac.reference import apply_rope, attention, hf_rms_norm, layer_forward, lm_logits, route, rope_cos_sin

    base = load_spec("tiny-moe")
    spec = variant(base, layers=[l.model_dump() for l in base.layers * 4])  # 24 layers
    w = random_weights(spec, seed=0)
    n = 40
    pos = torch.arange(n)
    cos, sin = rope_cos_sin(spec, pos, torch.float32)
    x = w.embed[pos]
    gaps = []
    for i, (ls, lw) in enumerate(zip(spec.layers, w.layers)):
        def attend(q, k, v, ls=ls):
            if ls.rope:
                q, k = apply_rope(q, cos, sin, spec.rope_style), apply_rope(k, cos, sin, spec.rope_style)
            return attention(q, k, v, pos, pos, ls.window, spec.head_dim ** -0.5)
        if lw.is_moe:
            h = hf_rms_norm(x, lw.input_norm, spec.norm_eps)
            top = torch.nn.functional.linear(h, lw.router).sort(dim=-1, descending=True).values
            gaps.append(top[:, spec.moe.top_k - 1] - top[:, spec.moe.top_k])
            _, wts = route(h, lw.router, spec.moe)
            assert (wts > 0.01).all()
        x = layer_forward(x, lw, spec, i, attend)
    rms = x.pow(2).mean(-1).sqrt()
    assert 0.3 < float(rms.min()) and float(rms.max()) < 5.0, rms
    assert torch.isfinite(lm_logits(x, w, spec)).all()
    assert float((torch.cat(gaps) > 1e-3).float().mean()) > 0.99


# ------------------------------------------------------------------ layouts


def test_interleave_pattern():
    width, hidden = 10, 3
    gate = torch.arange(width, dtype=torch.float32)[:, None].expand(width, hidden)
    up = gate + 100
    fused = interleave_gate_up(gate, up, chunk=4)
    col = fused[:, 0].tolist()
    assert col == [0, 1, 2, 3, 100, 101, 102, 103, 4, 5, 6, 7, 104, 105, 106, 107, 8, 9, 108, 109]
    assert upgate_row_map(10, 4).tolist() == [0, 1, 2, 3, 10, 11, 12, 13, 4, 5, 6, 7, 14, 15, 16, 17,
                                              8, 9, 18, 19]
    g2, u2 = deinterleave_gate_up(fused, chunk=4)
    assert torch.equal(g2, gate) and torch.equal(u2, up)
    # default chunk 64: [gate 0..63 | up 0..63 | gate 64..127 | ...]
    m = upgate_row_map(192)
    assert m[:64].tolist() == list(range(64)) and m[64:128].tolist() == list(range(192, 256))
    assert m[128:192].tolist() == list(range(64, 128))


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-llama"])
@pytest.mark.parametrize("chunk", [64, 16, 5])
def test_layout_round_trip(name, chunk):
    spec = load_spec(name)
    w = random_weights(spec, seed=2)
    kw = kernel_weights(w, spec, chunk=chunk)
    assert set(kw) == set(KERNEL_WEIGHT_FIELDS)
    assert set(KERNEL_WEIGHT_FIELDS) <= set(abi.DESC_NAMES)
    _same(canonical_from_kernel(kw, spec, chunk=chunk), w)

    L, d = spec.num_layers, spec.hidden_size
    assert kw["w_qkv"].shape == (L, spec.qkv_width, d)
    assert torch.equal(kw["w_qkv"][1, spec.q_width:spec.q_width + spec.kv_width], w.layers[1].k)
    assert kw["w_o"].shape == (L, d, spec.q_width)
    assert kw["w_norm"].shape == (2 * L + 1, d)
    assert torch.equal(kw["w_norm"][2 * L], w.final_norm)
    assert kw["w_lm_head"] is kw["w_embed"]  # tied
    nd, nm = len(spec.dense_layers), len(spec.moe_layers)
    if spec.block == "sequential":
        assert torch.equal(kw["w_norm"][L + 1], w.layers[1].post_attn_norm)
    else:
        assert torch.equal(kw["w_norm"][L:2 * L], torch.ones(L, d))
    assert kw["w_upgate"].shape == (nd, 2 * (spec.dense_intermediate_size or 0), d)
    dense0 = w.layers[spec.dense_layers[0]]
    assert torch.equal(kw["w_upgate"][0][:min(chunk, spec.dense_intermediate_size)],
                       dense0.gate[:chunk])
    slots = kw["layer_slot"].tolist()
    assert kw["layer_slot"].dtype == torch.int32
    for i, ls in enumerate(spec.layers):
        stack = spec.dense_layers if ls.ffn == "dense" else spec.moe_layers
        assert stack[slots[i]] == i
    if spec.moe:
        E, ew = spec.moe.num_experts, spec.moe.expert_intermediate_size
        assert kw["w_router"].shape == (nm, E, d)
        assert kw["w_moe_upgate"].shape == (nm, E, 2 * ew, d)
        assert kw["w_moe_down"].shape == (nm, E, d, ew)
        m = spec.moe_layers[1]
        assert torch.equal(kw["w_moe_upgate"][1, 3, :min(chunk, ew)], w.layers[m].experts_gate[3, :chunk])
        assert torch.equal(kw["w_moe_upgate"][1, 3, min(chunk, ew):2 * min(chunk, ew)],
                           w.layers[m].experts_up[3, :chunk])
    else:
        assert kw["w_router"].shape[0] == 0 and kw["w_moe_upgate"].shape[0] == 0


def test_untied_layout():
    spec = variant("tiny-llama", tie_embeddings=False)
    w = random_weights(spec, seed=2)
    kw = kernel_weights(w, spec)
    assert kw["w_lm_head"] is w.lm_head
    _same(canonical_from_kernel(kw, spec), w)


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-llama", "smollm2-135m", "north-mini-code"])
def test_rope_inv_freq_matches_transformers(name):
    from transformers import AutoModelForCausalLM

    from megac.spec.hf import to_transformers_config

    spec = load_spec(name)
    cfg = to_transformers_config(spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    rotary = type(model.model.rotary_emb)
    ref, _ = rotary.compute_default_rope_parameters(cfg)
    got = rope_inv_freq(spec)
    assert got.dtype == torch.float32 and torch.equal(got, ref)


def test_gemm_stage_tiling_round_trips_and_makes_stages_contiguous():
    from megac.weights.layout import tile_gemm_weights, untile_gemm_weights

    g = torch.Generator().manual_seed(7)
    n, k, bk = 48, 192, 64
    w = torch.randn(3, n, k, generator=g)
    t = tile_gemm_weights(w, bk)
    assert t.shape == w.shape and torch.equal(untile_gemm_weights(t, bk), w)
    # stage (row group rg, k chunk kc) is one contiguous run of 16*bk elements,
    # holding exactly that stage's elements; row 8h+g's 8 columns 32kk+8t.. lie
    # at offset ((kk*2 + h)*8 + g)*32 + t*8 inside it
    flat = t[1].reshape(-1)
    for rg in range(n // 16):
        for kc in range(k // bk):
            stage = flat[(rg * (k // bk) + kc) * 16 * bk:][: 16 * bk]
            ref = w[1, rg * 16:(rg + 1) * 16, kc * bk:(kc + 1) * bk]
            assert torch.equal(stage.sort().values, ref.reshape(-1).sort().values)
            for h, gg, kk, tt in ((0, 0, 0, 0), (1, 3, 1, 2), (1, 7, 0, 3)):
                off = ((kk * 2 + h) * 8 + gg) * 32 + tt * 8
                assert torch.equal(stage[off:off + 8], ref[8 * h + gg, 32 * kk + 8 * tt:32 * kk + 8 * tt + 8])
    with pytest.raises(MegacError, match="BK % 32"):
        tile_gemm_weights(w, 48)


def _lowbias32_uniform(i: int, key: int) -> float:
    """The generator's element i, in plain Python integers and numpy fp32."""
    x = (i * 0x9E3779B9 + key) & 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    x ^= x >> 16
    f = np.float32
    u = f(x >> 8) * f(2.0 ** -24)
    return float(u * f(2 * 3.0 ** 0.5) - f(3.0 ** 0.5))


def test_random_draw_is_the_documented_hash():
    """Every element is the counter hash of its index (an independent
    integer implementation), across chunk boundaries; moments are those of
    U[-sqrt 3, sqrt 3)."""
    import hashlib

    from megac.weights import random as rnd

    n = rnd._CHUNK + 1000
    got = rnd.draw(3, "layers.0.q", (n,))
    key = int.from_bytes(hashlib.blake2b(b"3:layers.0.q", digest_size=4).digest(), "little")
    rng = np.random.default_rng()
    for i in [0, 1, 2, rnd._CHUNK - 1, rnd._CHUNK, n - 1, *rng.integers(0, n, 50).tolist()]:
        assert float(got[i]) == _lowbias32_uniform(int(i), key), i
    assert abs(float(got.mean())) < 3e-3 and abs(float(got.std()) - 1.0) < 3e-3
    assert float(got.min()) >= -(3.0 ** 0.5) and float(got.max()) < 3.0 ** 0.5
    scaled = rnd.draw(3, "layers.0.q", (n,), std=0.02, mean=1.0)
    assert torch.equal(scaled, (got * torch.tensor(0.02)) + torch.tensor(1.0))


def test_relayout_tiles_the_stacks_in_place_and_leaves_the_embedding():
    """relayout_ puts element (r, k) of every GEMM matrix at block
    (r // 16) * (K / 32) + k // 32, offset ((r % 16 // 8) * 8 + r % 8) * 32 +
    (k % 32 // 8) * 8 + k % 8 (the A-fragment order gemm_tc.cuh reads),
    rewrites the stacked fields in their own storage, gives the tied LM head
    a copy of its own and restores everything on the way back."""
    from megac.weights.layout import GEMM_WEIGHT_FIELDS, LAYOUT_ROW_MAJOR, LAYOUT_TILED, relayout_

    g = torch.Generator().manual_seed(11)
    kw = {f: torch.randn(2, 32, 96, generator=g) for f in GEMM_WEIGHT_FIELDS}
    kw["w_lm_head"] = kw["w_embed"] = torch.randn(48, 64, generator=g)
    ref = {f: t.clone() for f, t in kw.items()}
    ptrs = {f: kw[f].data_ptr() for f in GEMM_WEIGHT_FIELDS if f != "w_lm_head"}
    relayout_(kw, LAYOUT_ROW_MAJOR, LAYOUT_TILED)
    assert all(kw[f].data_ptr() == p for f, p in ptrs.items())
    assert torch.equal(kw["w_embed"], ref["w_embed"]) and kw["w_lm_head"] is not kw["w_embed"]
    for f in GEMM_WEIGHT_FIELDS:
        w, t = ref[f].reshape(-1, *ref[f].shape[-2:]), kw[f].reshape(-1, kw[f].shape[-1] * kw[f].shape[-2])
        n, k = w.shape[-2:]
        for m in range(w.shape[0]):
            for r, c in ((0, 0), (5, 37), (9, 8), (15, 31), (n - 1, k - 1), (17, 60)):
                off = ((r // 16) * (k // 32) + c // 32) * 512 + (((r % 16) // 8) * 8 + r % 8) * 32 + \
                    ((c % 32) // 8) * 8 + c % 8
                assert t[m, off] == w[m, r, c], (f, m, r, c)
    relayout_(kw, LAYOUT_TILED, LAYOUT_ROW_MAJOR)
    assert all(torch.equal(kw[f], ref[f]) for f in kw)
    with pytest.raises(MegacError, match="unknown device weight layout 7"):
        relayout_(kw, LAYOUT_ROW_MAJOR, 7)


def test_cuda_without_an_index_names_the_current_device(monkeypatch):
    """``weights.to(device="cuda")`` of weights already on ``cuda:0`` must be
    a no-op (it built a second ModelWeights over the same tensors, so a
    consuming layout freed nothing): "cuda" names the current device."""
    from megac.weights.canonical import _same_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert _same_device("cuda", torch.device("cuda", 0))
    assert _same_device("cuda:0", torch.device("cuda", 0))
    assert not _same_device("cuda:1", torch.device("cuda", 0))
    assert not _same_device("cuda", torch.device("cpu"))
    assert _same_device("cpu", torch.device("cpu"))


def test_a_tile_of_whole_chunks_pairs_gate_and_up_rows_feature_by_feature():
    """A 128-row tile of gate/up interleaved in chunks of 32 (two chunks)
    pairs gate row i with up row i of its 64 features, read back from the
    interleaved matrix itself; the expert's short last chunk too; a tile
    that starts inside a chunk, or cuts one, pairs nothing."""
    from megac.weights.layout import interleave_gate_up, tile_gate_up_rows

    width, chunk = 100, 32
    gate = torch.arange(width, dtype=torch.float32)[:, None] * torch.ones(1, 4)
    fused = interleave_gate_up(gate, gate + 1000.0, chunk)
    for n0, n1 in ((0, 128), (128, 200), (64, 128)):
        g, u = tile_gate_up_rows(width, chunk, n0, n1)
        rows = fused[n0:n1, 0]
        assert torch.equal(rows[g], torch.arange(n0 // 2, n1 // 2, dtype=torch.float32))
        assert torch.equal(rows[u], rows[g] + 1000.0)
    assert tile_gate_up_rows(width, chunk, 32, 160) is None  # starts inside a chunk
    assert tile_gate_up_rows(width, chunk, 0, 96) is None    # cuts the second chunk


def test_consumed_stacks_that_do_not_fit_wait_in_host_memory(monkeypatch):
    """A decode-only engine builds each stack from sources still on the GPU
    (random weights are drawn there). Where a stack does not fit beside its
    sources, they move to host memory first (North Mini Code's expert
    stacks on an 80 GB H100); the stacks are the same either way, and on
    the sources' device. The free memory is simulated: the expert stacks
    are told they do not fit, everything else that it does."""
    from megac.weights import layout

    spec = load_spec("tiny-moe")
    ew, d, E = spec.moe.expert_intermediate_size, spec.hidden_size, spec.moe.num_experts
    nm = len(spec.moe_layers)
    upgate_bytes = nm * E * 2 * ew * d * 4  # fp32 random weights
    free = upgate_bytes - 1  # the gate/up stack does not fit, the down stack (half of it) does
    monkeypatch.setattr(layout, "STACK_MARGIN_BYTES", 0)
    monkeypatch.setattr(layout, "_device_free_bytes", lambda device: free)
    calls = []
    real = layout._make_room

    def spy(layers, names, stack_bytes, device):
        moved = real(layers, names, stack_bytes, device)
        calls.append((names, stack_bytes, moved))
        return moved

    monkeypatch.setattr(layout, "_make_room", spy)
    want = kernel_weights(random_weights(spec, seed=5), spec)
    w = random_weights(spec, seed=5)
    got = kernel_weights(w, spec, consume=True)
    assert [c for c in calls if c[2]] == [(("experts_gate", "experts_up"), upgate_bytes, True)]
    assert all(stack_bytes <= free for names, stack_bytes, moved in calls if not moved)
    for f in KERNEL_WEIGHT_FIELDS:
        assert torch.equal(got[f], want[f]), f
        assert got[f].device == want[f].device
    assert all(lw.experts_gate is None and lw.experts_down is None for lw in (w.layers[i] for i in spec.moe_layers))


def test_laid_out_weights_are_handed_on_whole_once_and_only_to_their_interleave():
    """LaidOutWeights: the next decode-only engine takes the tensors
    themselves (no copy) where its gate/up interleave is theirs; another
    interleave, a second taker, a cast or a backend other than cuda gets a
    one-line error and the tensors stay where they were."""
    from types import SimpleNamespace

    from megac.runtime.backends import make_backend
    from megac.weights.layout import LAYOUT_TILED, LaidOutWeights, LayoutMismatch

    spec = load_spec("tiny-moe")
    kw = kernel_weights(random_weights(spec, seed=3, dtype=torch.bfloat16), spec, chunk=16, moe_chunk=32)
    donor = SimpleNamespace(kernel_weights=kw, layout=LAYOUT_TILED, interleave=(16, 32))
    laid = LaidOutWeights.take(donor)
    assert donor.kernel_weights is None  # the donor cannot run on them after
    assert (laid.chunk, laid.moe_chunk, laid.layout, laid.dtype) == (16, 32, LAYOUT_TILED, torch.bfloat16)
    assert laid.to(torch.bfloat16, "cuda") is laid
    with pytest.raises(MegacError, match="never cast"):
        laid.to(torch.float32)
    before = {k: v.clone() for k, v in kw.items()}
    with pytest.raises(LayoutMismatch, match="chunks of 16 .experts 32.; these schedules read 16 .8.*16-row groups"):
        laid.adopt(16, 8)  # 8-row chunks split a 16-row group: refused, nothing moved
    assert all(torch.equal(kw[k], before[k]) for k in kw)
    with pytest.raises(MegacError, match="cuda backend only"):
        make_backend("cpu", spec, laid, kv=None, schedules=[])
    got = laid.adopt(16, 32)
    assert all(got[k] is kw[k] for k in kw)  # the very tensors, not copies
    with pytest.raises(MegacError, match="already adopted"):
        laid.adopt(16, 32)


@pytest.mark.parametrize("tiled", [False, True])
def test_laid_out_weights_adopted_by_another_interleave_are_re_interleaved_in_place(tiled):
    """An engine whose expert gate/up chunks differ (a split schedule's 64
    rows beside the default's 128) adopts the laid-out weights re-interleaved
    in place: every field equals what kernel_weights lays out for its
    interleave from the same weights, row-major or tiled, and back again."""
    from types import SimpleNamespace

    from megac.weights.layout import LAYOUT_ROW_MAJOR, LAYOUT_TILED, LaidOutWeights, tile_gemm_weights

    spec = load_spec("tiny-moe")
    lay = LAYOUT_TILED if tiled else LAYOUT_ROW_MAJOR
    width = spec.moe.expert_intermediate_size
    assert width % 16 == 0 and width > 16  # chunks of 16 move rows against whole ones
    w = random_weights(spec, seed=11, dtype=torch.bfloat16)

    def laid_out(chunk, moe_chunk):
        kw = kernel_weights(w, spec, chunk=chunk, moe_chunk=moe_chunk)
        if tiled:  # the gate/up stacks as the tensor-core tile reads them (the tiny router is too narrow to tile)
            for f in ("w_upgate", "w_moe_upgate"):
                if kw[f].numel():
                    kw[f] = tile_gemm_weights(kw[f], 32)
        return kw

    kw = laid_out(16, 32)
    want = laid_out(16, 16)
    assert not torch.equal(want["w_moe_upgate"], kw["w_moe_upgate"])  # the interleaves differ
    ptrs = {k: v.data_ptr() for k, v in kw.items()}
    laid = LaidOutWeights.take(SimpleNamespace(kernel_weights=kw, layout=lay, interleave=(16, 32)))
    got = laid.adopt(16, 16)
    for k in want:
        assert torch.equal(got[k], want[k]), k
        assert got[k].data_ptr() == ptrs[k], k  # in place
    back = LaidOutWeights.take(SimpleNamespace(kernel_weights=got, layout=lay, interleave=(16, 16))).adopt(32, 32)
    want = laid_out(32, 32)
    for k in want:
        assert torch.equal(back[k], want[k]), k

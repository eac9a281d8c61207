"""Hugging Face config.json → ModelSpec, checked against the installed transformers
(its config classes and, for layer flags and math rules, its modeling code)."""

from __future__ import annotations

import json
import math
import re

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from transformers import AutoConfig, Cohere2MoeConfig, LlamaConfig  # noqa: E402

from megac.errors import SpecError  # noqa: E402
from megac.spec import load_spec  # noqa: E402
from megac.spec.hf import (  # noqa: E402
    spec_from_hf,
    spec_from_hf_config,
    to_hf_config,
    to_transformers_config,
    write_hf_config,
)

TINY_C2 = dict(
    vocab_size=256, hidden_size=64, intermediate_size=32, prefix_dense_intermediate_size=96,
    num_hidden_layers=9, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-6, sliding_window=8,
    max_position_embeddings=512, eos_token_id=2, bos_token_id=1, pad_token_id=0,
)
TINY_LLAMA = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=512,
)


def _save(cfg, tmp_path, sub="ckpt"):
    d = tmp_path / sub
    cfg.save_pretrained(d)
    return d


def _model_fields(spec) -> dict:
    d = spec.model_dump()
    d.pop("target")
    d.pop("name")
    return d


def _hf_rope_flags(config) -> list[tuple[bool, bool]]:
    """(sliding, rope) per layer, read off a real Cohere2MoeModel."""
    model = transformers.Cohere2MoeModel(config)
    out = []
    for layer in model.layers:
        a = layer.self_attn
        out.append((a.sliding_window is not None, a.sliding_window is not None or a.force_rope))
    return out


# ------------------------------------------------------------------ cohere2_moe


def test_cohere2_moe_first_k_dense_replace_1(tmp_path):
    cfg = Cohere2MoeConfig(**TINY_C2, first_k_dense_replace=1, expert_selection_fn="sigmoid",
                           norm_topk_prob=False, rope_theta=50000.0, logit_scale=1.0)
    # The installed config puts full attention at 0, 4, 8, ...
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [0, 4, 8]
    assert cfg.mlp_layer_types == ["dense"] + ["sparse"] * 8
    s = spec_from_hf(_save(cfg, tmp_path))
    assert s.name == "ckpt"
    assert (s.family, s.block, s.rope_style) == ("cohere2_moe", "parallel", "interleaved")
    assert s.full_layers == [0, 4, 8]
    assert s.rope_layers == [0, 1, 2, 3, 5, 6, 7]            # NoPE on full layers 4, 8
    assert s.dense_layers == [0] and s.dense_intermediate_size == 96
    assert (s.moe.num_experts, s.moe.top_k, s.moe.expert_intermediate_size) == (8, 2, 32)
    assert (s.moe.router, s.moe.renormalize) == ("sigmoid", False)
    assert s.rope_theta == 50000.0 and s.norm_eps == 1e-6 and s.logit_scale == 1.0
    assert s.eos_token_ids == [2] and s.bos_token_id == 1 and s.max_context == 512
    assert {l.window for l in s.layers if l.attention == "sliding"} == {8}
    assert [(l.attention == "sliding", l.rope) for l in s.layers] == _hf_rope_flags(cfg)


@pytest.mark.parametrize(
    "extra",
    [
        dict(first_k_dense_replace=0),
        dict(first_k_dense_replace=2),
        dict(first_k_dense_replace=3, prefix_dense_sliding_window_pattern=2),
        dict(first_k_dense_replace=2, prefix_dense_sliding_window_pattern=2, sliding_window_pattern=3),
        # dense layers outside the prefix: force_rope applies to every dense layer
        dict(layer_types=["full_attention", "sliding_attention"] * 4 + ["full_attention"],
             mlp_layer_types=["sparse", "sparse", "dense", "sparse", "sparse", "sparse", "dense", "sparse", "sparse"]),
        dict(layer_types=["full_attention", "sliding_attention"] * 4 + ["full_attention"],
             mlp_layer_types=["sparse", "sparse", "dense", "sparse", "sparse", "sparse", "dense", "sparse", "sparse"],
             prefix_dense_sliding_window_pattern=3),
    ],
)
def test_cohere2_moe_layer_flags_match_modeling(tmp_path, extra):
    cfg = Cohere2MoeConfig(**TINY_C2, **extra)
    s = spec_from_hf(_save(cfg, tmp_path))
    assert [l.attention == "sliding" for l in s.layers] == [t == "sliding_attention" for t in cfg.layer_types]
    assert [l.ffn == "dense" for l in s.layers] == [t == "dense" for t in cfg.mlp_layer_types]
    assert [(l.attention == "sliding", l.rope) for l in s.layers] == _hf_rope_flags(cfg)


@pytest.mark.parametrize("first_k, prefix_pat", [(0, 1), (1, 1), (2, 1), (2, 2), (3, 2)])
def test_cohere2_moe_hand_written_config_derivation(tmp_path, first_k, prefix_pat):
    """A config.json without layer_types/mlp_layer_types (like a hand-written
    checkpoint config): we derive them as transformers does on load."""
    raw = {"model_type": "cohere2_moe", **TINY_C2, "first_k_dense_replace": first_k,
           "prefix_dense_sliding_window_pattern": prefix_pat}
    d = tmp_path / "hand"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(raw))
    s = spec_from_hf(d)
    ref = AutoConfig.from_pretrained(d)
    assert [l.attention + "_attention" for l in s.layers] == ref.layer_types
    assert ["dense" if l.ffn == "dense" else "sparse" for l in s.layers] == ref.mlp_layer_types
    assert [(l.attention == "sliding", l.rope) for l in s.layers] == _hf_rope_flags(ref)


def test_cohere2_moe_defaults(tmp_path):
    """Defaults of fields absent from config.json follow Cohere2MoeConfig."""
    d = tmp_path / "min"
    d.mkdir()
    raw = {"model_type": "cohere2_moe", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
           "vocab_size": 256, "intermediate_size": 32, "rms_norm_eps": 1e-6}
    (d / "config.json").write_text(json.dumps(raw))
    s = spec_from_hf(d)
    ref = AutoConfig.from_pretrained(d)
    assert s.head_dim == ref.head_dim == 128          # not hidden/heads
    assert s.num_kv_heads == ref.num_key_value_heads == 4
    assert s.logit_scale == ref.logit_scale == 0.0625
    assert s.rope_theta == ref.rope_parameters["rope_theta"] == 10000.0
    assert s.layers[0].window == ref.sliding_window == 4096
    assert s.max_context == ref.max_position_embeddings == 8192
    assert s.moe.router == "softmax" and s.moe.renormalize is False  # norm_topk_prob unused with softmax
    assert s.moe.top_k == 2 and s.moe.num_experts == 8
    assert s.eos_token_ids == []                       # default 255001 is outside vocab 256
    assert s.tie_embeddings is True


def test_north_mini_code_from_hf_matches_bundled(tmp_path):
    nmc = load_spec("north-mini-code")
    cfg = Cohere2MoeConfig(
        vocab_size=262144, hidden_size=2048, intermediate_size=768, prefix_dense_intermediate_size=3072,
        num_hidden_layers=49, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, expert_selection_fn="sigmoid", norm_topk_prob=False,
        num_shared_experts=0, first_k_dense_replace=1, rope_theta=50000.0, sliding_window=4096,
        rms_norm_eps=1e-6, logit_scale=1.0, tie_word_embeddings=True, eos_token_id=255001,
        max_position_embeddings=262144,
    )
    s = spec_from_hf(_save(cfg, tmp_path))
    assert _model_fields(s) == _model_fields(nmc)
    assert s.target == nmc.target


def test_rope_theta_location(tmp_path):
    """transformers 5 writes rope_parameters['rope_theta'] (and, for cohere2_moe,
    the legacy top-level rope_theta too); rope_parameters wins, legacy-only
    configs still work."""
    cfg = Cohere2MoeConfig(**TINY_C2, rope_theta=50000.0)
    d = _save(cfg, tmp_path)
    raw = json.loads((d / "config.json").read_text())
    assert raw["rope_parameters"] == {"rope_theta": 50000.0, "rope_type": "default"}
    raw["rope_theta"] = 123.0                      # conflicting legacy field
    (d / "config.json").write_text(json.dumps(raw))
    assert spec_from_hf(d).rope_theta == AutoConfig.from_pretrained(d).rope_parameters["rope_theta"] == 50000.0
    del raw["rope_parameters"]
    (d / "config.json").write_text(json.dumps(raw))
    assert spec_from_hf(d).rope_theta == AutoConfig.from_pretrained(d).rope_parameters["rope_theta"] == 123.0

    lcfg = LlamaConfig(**TINY_LLAMA, rope_theta=100000.0)
    ld = _save(lcfg, tmp_path, "llama")
    raw = json.loads((ld / "config.json").read_text())
    assert "rope_theta" not in raw and raw["rope_parameters"]["rope_theta"] == 100000.0
    assert spec_from_hf(ld).rope_theta == 100000.0
    legacy = {k: v for k, v in raw.items() if k != "rope_parameters"} | {"rope_theta": 5000.0}
    (ld / "config.json").write_text(json.dumps(legacy))
    assert spec_from_hf(ld).rope_theta == AutoConfig.from_pretrained(ld).rope_parameters["rope_theta"] == 5000.0


# ------------------------------------------------------------------------ llama


def test_llama_mapping(tmp_path):
    cfg = LlamaConfig(**TINY_LLAMA, rope_theta=100000.0, tie_word_embeddings=True, eos_token_id=[2, 0])
    d = _save(cfg, tmp_path)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    s = load_spec(str(d))
    assert (s.family, s.block, s.rope_style) == ("llama", "sequential", "half")
    assert (s.num_heads, s.num_kv_heads, s.head_dim, s.q_width) == (4, 2, 16, 64)   # head_dim = hidden/heads
    assert s.dense_intermediate_size == 128 and s.moe is None
    assert s.layer_kinds == [("full", "dense", True)]
    assert (s.norm_eps, s.rope_theta, s.logit_scale, s.tie_embeddings) == (1e-5, 100000.0, 1.0, True)
    assert s.eos_token_ids == [2, 0, 7]
    assert s.max_context == 512


def test_smollm2_from_hf_matches_bundled(tmp_path):
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0,
                      max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    s = spec_from_hf(_save(cfg, tmp_path))
    assert _model_fields(s) == _model_fields(load_spec("smollm2-135m"))


def test_load_spec_accepts_config_json_path_and_overrides(tmp_path):
    d = _save(LlamaConfig(**TINY_LLAMA), tmp_path)
    s = load_spec(str(d / "config.json"), target_overrides={"num_sms": 114})
    assert s.target.num_sms == 114 and s.name == "ckpt"


# ------------------------------------------------------------- spec → HF → spec


@pytest.mark.parametrize("name", ["north-mini-code", "smollm2-135m", "tiny-moe", "tiny-llama"])
def test_round_trip_through_transformers(name, tmp_path):
    spec = load_spec(name)
    cfg = to_transformers_config(spec)
    assert type(cfg).__name__ == ("LlamaConfig" if spec.family == "llama" else "Cohere2MoeConfig")
    back = spec_from_hf(_save(cfg, tmp_path), name=name)
    assert _model_fields(back) == _model_fields(spec)
    # And the plain-JSON writer gives the same spec.
    back2 = spec_from_hf(write_hf_config(spec, tmp_path / "json"), name=name)
    assert _model_fields(back2) == _model_fields(spec)


def test_tiny_moe_flags_match_modeling():
    spec = load_spec("tiny-moe")
    cfg = to_transformers_config(spec)
    assert [(l.attention == "sliding", l.rope) for l in spec.layers] == _hf_rope_flags(cfg)


# --------------------------------------------------------------------- refusals


def _c2_raw(tmp_path, **changes) -> str:
    d = _save(Cohere2MoeConfig(**TINY_C2, first_k_dense_replace=1), tmp_path, "c2")
    raw = json.loads((d / "config.json").read_text())
    raw.update(changes)
    (d / "config.json").write_text(json.dumps(raw))
    return str(d)


def _llama_raw(tmp_path, **changes) -> str:
    d = _save(LlamaConfig(**TINY_LLAMA), tmp_path, "ll")
    raw = json.loads((d / "config.json").read_text())
    raw.update(changes)
    (d / "config.json").write_text(json.dumps(raw))
    return str(d)


@pytest.mark.parametrize(
    "family, changes, pattern",
    [
        ("c2", dict(num_shared_experts=1), r"num_shared_experts: shared experts are not supported"),
        ("c2", dict(attention_bias=True), r"attention_bias: an attention bias is not supported"),
        ("ll", dict(attention_bias=True), r"attention_bias: "),
        ("ll", dict(mlp_bias=True), r"mlp_bias: an MLP bias is not supported"),
        ("c2", dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), r"rope_scaling: rope_type 'linear'"),
        ("c2", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), r"rope_parameters: rope_type 'yarn'"),
        ("ll", dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}), r"rope_parameters: rope_type 'llama3'"),
        ("ll", dict(rope_scaling={"type": "dynamic", "factor": 2.0}), r"rope_scaling: rope_type 'dynamic'"),
        ("ll", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
         r"rope_parameters\.partial_rotary_factor"),
        ("c2", dict(rope_parameters={"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}),
         r"rope_parameters: per-layer-type"),
        ("c2", dict(rms_norm_eps=None), r"rms_norm_eps: null selects LayerNorm"),
        ("ll", dict(rms_norm_eps=None), r"rms_norm_eps: must not be null"),
        ("c2", dict(hidden_act="gelu"), r"hidden_act: only silu"),
        ("ll", dict(hidden_act="relu"), r"hidden_act: only silu"),
        ("c2", dict(use_qk_norm=True), r"use_qk_norm: QK-norm"),
        ("c2", dict(expert_selection_fn="topk"), r"expert_selection_fn: must be softmax or sigmoid"),
        ("c2", dict(sliding_window=None), r"sliding_window: null, but layer_types has sliding_attention"),
        ("c2", dict(layer_types=["chunked_attention"] * 9), r"layer_types\[0\]: 'chunked_attention' is not supported"),
        ("c2", dict(mlp_layer_types=["dense"] * 3), r"mlp_layer_types: expected a list of num_hidden_layers \(9\)"),
        ("c2", dict(model_type="mixtral"), r"model_type: 'mixtral' is not supported \(supported: cohere2_moe, llama\)"),
        ("ll", dict(model_type="mistral"), r"model_type: 'mistral' is not supported"),
        ("ll", dict(sliding_window=4096), r"sliding_window: llama has no sliding-window layers"),
        ("c2", dict(num_attention_heads="many"), r"num_attention_heads: expected an integer"),
        ("c2", dict(num_experts_per_tok=9), r"moe\.top_k: top_k \(9\) > num_experts \(8\)"),
        ("c2", dict(head_dim=20), r"head_dim: must be a multiple of 8"),
    ],
)
def test_refusals(tmp_path, family, changes, pattern):
    path = (_c2_raw if family == "c2" else _llama_raw)(tmp_path, **changes)
    with pytest.raises(SpecError) as ei:
        load_spec(path)
    msg = str(ei.value)
    assert "\n" not in msg
    assert msg.startswith(f"{path}/config.json: "), msg
    assert re.search(pattern, msg), msg



def test_missing_model_type_and_bad_json(tmp_path):
    d = tmp_path / "x"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(SpecError, match=r"config\.json: model_type: missing"):
        load_spec(str(d))
    (d / "config.json").write_text('{\n  "model_type": "llama",\n  oops\n}')
    with pytest.raises(SpecError, match=r"config\.json:3: invalid JSON"):
        load_spec(str(d))


def test_missing_config_json(tmp_path):
    with pytest.raises(SpecError, match=r"no config\.json in this directory"):
        load_spec(str(tmp_path))
    with pytest.raises(SpecError, match=r"no config\.json"):
        spec_from_hf(tmp_path)


# ------------------------------------------- the semantics we document, vs torch


def test_rope_styles_match_transformers():
    from transformers.models.cohere2_moe import modeling_cohere2_moe as c2m
    from transformers.models.llama import modeling_llama as llm

    hd, theta, pos = 16, 50000.0, 37
    x = torch.randn(1, 1, 1, hd, dtype=torch.float64)
    inv = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = pos * inv

    # interleaved: pair (2k, 2k+1)
    emb = torch.repeat_interleave(ang, 2)
    ref, _ = c2m.apply_rotary_pos_emb(x, x, emb.cos()[None, None], emb.sin()[None, None])
    a, b = x[..., 0::2], x[..., 1::2]
    ours = torch.stack([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], dim=-1).flatten(-2)
    assert torch.allclose(ref.double(), ours, atol=1e-6)

    # half: pair (k, k + hd/2)
    emb = torch.cat([ang, ang])
    ref, _ = llm.apply_rotary_pos_emb(x, x, emb.cos()[None, None], emb.sin()[None, None])
    a, b = x[..., : hd // 2], x[..., hd // 2:]
    ours = torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], dim=-1)
    assert torch.allclose(ref.double(), ours, atol=1e-6)


@pytest.mark.parametrize("router, renorm", [("sigmoid", False), ("sigmoid", True), ("softmax", False)])
def test_router_rule_matches_transformers(router, renorm):
    from transformers.models.cohere2_moe.modeling_cohere2_moe import Cohere2MoeTopKRouter

    cfg = Cohere2MoeConfig(**TINY_C2, expert_selection_fn=router, norm_topk_prob=renorm)
    r = Cohere2MoeTopKRouter(cfg)
    torch.nn.init.normal_(r.weight)
    h = torch.randn(5, 64)
    _, scores, experts = r(h)

    logits = h @ r.weight.T
    for row in range(5):
        order = sorted(range(8), key=lambda e: (-logits[row, e].item(), e))[:2]
        sel = logits[row, order]
        if router == "sigmoid":
            w = torch.sigmoid(sel)
            if renorm:
                w = w / w.sum()
        else:
            w = torch.softmax(sel, dim=0)
        assert experts[row].tolist() == order
        assert torch.allclose(scores[row], w, atol=1e-6)


def test_sliding_window_counts_own_token():
    from transformers.masking_utils import sliding_window_overlay

    visible = [kv for kv in range(20) if sliding_window_overlay(4)(0, 0, 10, kv) and kv <= 10]
    assert visible == [7, 8, 9, 10]    # window 4 = the query's own token + 3 before it


def test_spec_from_hf_config_dict_directly():
    s = spec_from_hf_config(to_hf_config(load_spec("tiny-moe")), name="t")
    assert _model_fields(s) == _model_fields(load_spec("tiny-moe"))
    assert math.isclose(s.logit_scale, 0.5)

"""Model spec: bundled specs, the YAML format, validation and error messages."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from megac.errors import MegacError, SpecError
from megac.spec import (
    LayerSpec,
    ModelSpec,
    TargetSpec,
    derive_context_buckets,
    list_bundled,
    load_spec,
    spec_from_dict,
    spec_to_yaml,
)
from megac.spec.loader import expand_layers, spec_from_yaml_text

# ----------------------------------------------------------------- bundled specs


def test_bundled_names():
    assert set(list_bundled()) >= {"north-mini-code", "smollm2-135m", "tiny-moe", "tiny-llama"}


@pytest.mark.parametrize("name", ["north-mini-code", "smollm2-135m", "tiny-moe", "tiny-llama"])
def test_bundled_load_from_any_directory(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = load_spec(name)
    assert spec.name == name
    assert len(spec.layers) == spec.num_layers


def test_north_mini_code_geometry():
    s = load_spec("north-mini-code")
    assert (s.family, s.block) == ("cohere2_moe", "parallel")
    assert (s.num_layers, s.hidden_size) == (49, 2048)
    assert (s.num_heads, s.num_kv_heads, s.head_dim, s.q_width) == (32, 4, 128, 4096)
    assert (s.heads_per_kv, s.kv_width, s.qkv_width) == (8, 512, 5120)
    assert s.norm_eps == 1e-6
    assert (s.rope_style, s.rope_theta) == ("interleaved", 50000.0)
    assert s.dense_intermediate_size == 3072
    assert s.moe is not None
    assert (s.moe.num_experts, s.moe.top_k, s.moe.expert_intermediate_size) == (128, 8, 768)
    assert (s.moe.router, s.moe.renormalize) == ("sigmoid", False)
    assert (s.vocab_size, s.tie_embeddings, s.logit_scale) == (262144, True, 1.0)
    assert s.eos_token_ids == [255001]
    assert s.max_context == 262144

    full = list(range(0, 49, 4))
    assert s.full_layers == full and len(full) == 13
    assert s.sliding_layers == [i for i in range(49) if i % 4]
    assert len(s.sliding_layers) == 36
    assert all(s.layers[i].window == 4096 for i in s.sliding_layers)
    assert all(s.layers[i].window is None for i in full)
    # RoPE on sliding layers and the dense layer 0 only; full layers 4..48 are NoPE.
    assert s.rope_layers == sorted([0] + s.sliding_layers)
    assert [i for i in range(49) if not s.layers[i].rope] == list(range(4, 49, 4))
    assert s.dense_layers == [0] and s.moe_layers == list(range(1, 49))
    assert s.dense_prefix_layers == 1
    assert s.layer_kinds == [("full", "dense", True), ("sliding", "moe", True), ("full", "moe", False)]

    assert s.target == TargetSpec()
    assert s.resolved_context_buckets == [1024 * 2**i for i in range(9)]
    assert s.resolved_context_buckets[-1] == 262144

    assert abs(s.num_params - 30.5e9) < 0.1e9
    assert abs(s.num_active_params - 3.3e9) < 0.1e9


def test_smollm2_geometry():
    s = load_spec("smollm2-135m")
    assert (s.family, s.block, s.rope_style) == ("llama", "sequential", "half")
    assert (s.num_layers, s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim) == (30, 576, 9, 3, 64)
    assert s.q_width == 576 and s.dense_intermediate_size == 1536
    assert (s.rope_theta, s.norm_eps, s.vocab_size) == (100000.0, 1e-5, 49152)
    assert s.tie_embeddings and s.logit_scale == 1.0 and s.eos_token_ids == [2]
    assert s.max_context == 8192 and s.moe is None
    assert s.layer_kinds == [("full", "dense", True)]
    assert s.dense_prefix_layers == 0
    assert 134e6 < s.num_params < 135e6  # "135M"
    assert s.resolved_context_buckets == [1024, 2048, 4096, 8192]


def test_tiny_models():
    m = load_spec("tiny-moe")
    assert (m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, m.vocab_size) == (64, 4, 2, 16, 256)
    assert m.moe.num_experts == 8 and m.moe.top_k == 2 and m.moe.expert_intermediate_size == 32
    assert m.dense_intermediate_size == 96 and m.dense_prefix_layers == 1
    # Every NMC layer kind appears.
    assert m.layer_kinds == load_spec("north-mini-code").layer_kinds
    assert {l.window for l in m.layers if l.attention == "sliding"} == {8}
    l = load_spec("tiny-llama")
    assert (l.num_layers, l.hidden_size, l.dense_intermediate_size, l.rope_style) == (2, 64, 128, "half")


@pytest.mark.parametrize("name", ["north-mini-code", "smollm2-135m", "tiny-moe", "tiny-llama"])
def test_yaml_round_trip(name, tmp_path):
    s = load_spec(name)
    p = tmp_path / "m.yaml"
    p.write_text(spec_to_yaml(s))
    assert load_spec(str(p)) == s


def test_spec_is_frozen():
    s = load_spec("tiny-moe")
    with pytest.raises(ValidationError):
        s.hidden_size = 128  # type: ignore[misc]


# ------------------------------------------------------------------ YAML format

BASE = """\
family: cohere2_moe
block: parallel
hidden_size: 64
num_layers: 6
num_heads: 4
num_kv_heads: 2
head_dim: 16
q_width: 64
rope_theta: 50000.0
rope_style: interleaved
norm_eps: 1.0e-6
dense_intermediate_size: 96
moe:
  num_experts: 8
  top_k: 2
  expert_intermediate_size: 32
  router: sigmoid
  renormalize: false
vocab_size: 256
tie_embeddings: true
eos_token_ids: [2]
max_context: 4096
layers:
  attention_pattern: [full, sliding, sliding, sliding]
  sliding_window: 8
  rope: sliding_and_dense_prefix
  dense_prefix: 1
"""


def _write(tmp_path, text, name="model.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _err(tmp_path, text) -> str:
    with pytest.raises(SpecError) as ei:
        load_spec(_write(tmp_path, text))
    msg = str(ei.value)
    assert "\n" not in msg
    return msg


def test_base_yaml_loads_and_name_defaults_to_stem(tmp_path):
    s = load_spec(_write(tmp_path, BASE, "my-model.yaml"))
    assert s.name == "my-model"
    assert s.layer_kinds == [("full", "dense", True), ("sliding", "moe", True), ("full", "moe", False)]


def test_compact_equals_explicit(tmp_path):
    s = load_spec(_write(tmp_path, BASE))
    explicit = BASE.split("layers:\n")[0] + "layers:\n" + "".join(
        f"  - {{attention: {l.attention}, window: {l.window if l.window else 'null'}, "
        f"rope: {str(l.rope).lower()}, ffn: {l.ffn}}}\n"
        for l in s.layers
    )
    assert load_spec(_write(tmp_path, explicit, "explicit.yaml")).layers == s.layers


def test_explicit_layer_window_optional_for_full():
    LayerSpec(attention="full", rope=False, ffn="dense")


@pytest.mark.parametrize(
    "compact, has_moe, expect",
    [
        ({"attention_pattern": "full", "rope": "all"}, False, [("full", None, True, "dense")] * 3),
        ({"attention_pattern": ["sliding", "full"], "sliding_window": 4, "rope": "sliding"}, False,
         [("sliding", 4, True, "dense"), ("full", None, False, "dense"), ("sliding", 4, True, "dense")]),
        ({"attention_pattern": "full", "rope": [1], "dense_prefix": 2}, True,
         [("full", None, False, "dense"), ("full", None, True, "dense"), ("full", None, False, "moe")]),
        ({"attention_pattern": "full", "rope": "none"}, True, [("full", None, False, "moe")] * 3),
        ({"attention_pattern": "full", "rope": "sliding_and_dense_prefix"}, False,
         [("full", None, True, "dense")] * 3),
    ],
)
def test_expand_layers(compact, has_moe, expect):
    got = expand_layers(compact, num_layers=3, has_moe=has_moe)
    assert [(l["attention"], l["window"], l["rope"], l["ffn"]) for l in got] == expect


def test_target_block(tmp_path):
    s = load_spec(_write(tmp_path, BASE + "target:\n  num_sms: 114\n  gpu: h100\n  batch_sizes: [8, 1, 2, 2]\n"))
    assert (s.target.num_sms, s.target.gpu, s.target.batch_sizes) == (114, "h100", [1, 2, 8])
    s = load_spec(_write(tmp_path, BASE + "target:\n  context_buckets: [2048, 1024, 4096]\n"))
    assert s.resolved_context_buckets == [1024, 2048, 4096]


# ---------------------------------------------------------------- error cases


def _sub(old, new):
    assert old in BASE
    return BASE.replace(old, new, 1)


@pytest.mark.parametrize(
    "text, pattern",
    [
        # YAML syntax, with the line number.
        (_sub("num_layers: 6", "num_layers: [6"), r"model\.yaml:5: YAML syntax error"),
        (_sub("max_context: 4096", "max_context: 4096\nmax_context: 5"), r":23: duplicate key 'max_context'"),
        ("- just\n- a list\n", r"expected a mapping"),
        ("", r"expected a mapping"),
        # Unknown fields, with the dotted path.
        (_sub("  top_k: 2", "  top_k: 2\n  foo: 1"), r"unknown field 'moe\.foo'"),
        (_sub("vocab_size: 256", "vocab_size: 256\nvocab: 3"), r"unknown field 'vocab'"),
        (_sub("  router: sigmoid", "  routr: sigmoid"), r"unknown field 'moe\.routr' \(did you mean 'router'\?\)"),
        (_sub("  dense_prefix: 1", "  dense_prefx: 1"), r"unknown field 'layers\.dense_prefx'"),
        (BASE + "target:\n  sms: 3\n", r"unknown field 'target\.sms'"),
        # Missing fields.
        (_sub("  top_k: 2\n", ""), r"missing field 'moe\.top_k'"),
        (_sub("vocab_size: 256\n", ""), r"missing field 'vocab_size'"),
        # Types.
        (_sub("top_k: 2", "top_k: eight"), r"moe\.top_k: .*integer.*'eight'"),
        (_sub("block: parallel", "block: diagonal"), r"block: .*'diagonal'"),
        (_sub("rope: sliding_and_dense_prefix", "rope: sometimes"), r"layers\.rope: .*'sometimes'"),
        # Inconsistent values.
        (_sub("q_width: 64", "q_width: 80"), r":8: q_width: num_heads\*head_dim \(64\) != q_width \(80\)"),
        (_sub("num_kv_heads: 2", "num_kv_heads: 3"), r"num_kv_heads: .*not a multiple"),
        (_sub("top_k: 2", "top_k: 9"), r"moe\.top_k: top_k \(9\) > num_experts \(8\)"),
        (_sub("sliding_window: 8", "sliding_window: 8000"), r"layers\[1\]\.window: window \(8000\) > max_context \(4096\)"),
        (_sub("hidden_size: 64", "hidden_size: 60"), r"hidden_size: must be a multiple of 8"),
        (_sub("head_dim: 16", "head_dim: 12").replace("q_width: 64", "q_width: 48"), r"head_dim: must be a multiple of 8"),
        (_sub("expert_intermediate_size: 32", "expert_intermediate_size: 30"), r"moe\.expert_intermediate_size"),
        (_sub("renormalize: false", "renormalize: true").replace("router: sigmoid", "router: softmax"),
         r"moe\.renormalize: must be false with router softmax"),
        (_sub("eos_token_ids: [2]", "eos_token_ids: [256]"), r"eos_token_ids: id 256 outside"),
        (_sub("dense_prefix: 1", "dense_prefix: 0"), r"dense_intermediate_size: given but no layer"),
        (_sub("dense_intermediate_size: 96\n", ""), r"dense_intermediate_size: required \(layer 0"),
        (_sub("  sliding_window: 8\n", ""), r"layers\.sliding_window: required"),
        (_sub("rope: sliding_and_dense_prefix", "rope: [0, 99]"), r"layers\.rope: layer index 99 out of range"),
        (_sub("rope: sliding_and_dense_prefix", "rope: all"), r"layers\[4\]\.rope: family cohere2_moe"),
        (_sub("block: parallel", "block: sequential"), r"block: family cohere2_moe has a parallel block"),
        (_sub("layers:\n", "layers: 5\nx:\n"), r"layers: expected a list"),
        (BASE + "target:\n  kv_block_size: 48\n", r"target\.kv_block_size: must be a power of two"),
        (BASE + "target:\n  num_sms: 0\n", r"target\.num_sms: .*greater than or equal to 1"),
        (BASE + "target:\n  batch_sizes: [0, 2]\n", r"target\.batch_sizes: each batch size must be in 1\.\.64"),
        (BASE + "target:\n  batch_sizes: [65]\n", r"target\.batch_sizes"),
        (BASE + "target:\n  context_buckets: [1024, 2048]\n", r"target\.context_buckets: the last bucket \(2048\) must equal max_context"),
        (BASE + "target:\n  context_buckets: [1024, 8192]\n", r"target\.context_buckets: bucket 8192 > max_context"),
    ],
)
def test_yaml_errors(tmp_path, text, pattern):
    msg = _err(tmp_path, text)
    assert re.search(pattern, msg), msg
    assert msg.startswith(str(tmp_path / "model.yaml"))


def test_moe_required_without_dense_prefix_coverage(tmp_path):
    no_moe = re.sub(r"moe:\n(  .*\n)+", "", BASE)
    msg = _err(tmp_path, no_moe)
    assert "layers.dense_prefix" in msg and "moe" in msg
    explicit = {**spec_to_dict(load_spec("tiny-moe")), "moe": None}
    with pytest.raises(SpecError, match=r"moe: required \(layer 1 has ffn moe\)"):
        spec_from_dict(explicit)


def spec_to_dict(spec: ModelSpec) -> dict:
    return spec.model_dump()


def test_num_layers_mismatch_in_explicit_list():
    d = spec_to_dict(load_spec("tiny-llama"))
    d["num_layers"] = 3
    with pytest.raises(SpecError, match=r"layers: 2 layers given but num_layers is 3"):
        spec_from_dict(d, source="x.yaml")


def test_layer_window_rules():
    with pytest.raises(ValidationError, match="sliding layer needs a window"):
        LayerSpec(attention="sliding", rope=True, ffn="dense")
    with pytest.raises(ValidationError, match="must be > 0"):
        LayerSpec(attention="sliding", window=0, rope=True, ffn="dense")
    d = spec_to_dict(load_spec("tiny-moe"))
    d["layers"][1]["window"] = None
    with pytest.raises(SpecError, match=r"layers\[1\]\.window: a sliding layer needs a window"):
        spec_from_dict(d)


def test_llama_family_rules():
    d = spec_to_dict(load_spec("tiny-llama"))
    for field, value, pattern in [
        ("rope_style", "interleaved", r"rope_style: family llama"),
        ("block", "parallel", r"block: family llama"),
        ("logit_scale", 0.5, r"logit_scale: family llama"),
    ]:
        with pytest.raises(SpecError, match=pattern):
            spec_from_dict({**d, field: value})
    layers = [dict(l) for l in d["layers"]]
    layers[1]["rope"] = False
    with pytest.raises(SpecError, match=r"layers\[1\]\.rope: family llama"):
        spec_from_dict({**d, "layers": layers})


def test_missing_inputs(tmp_path):
    with pytest.raises(SpecError, match=r"nope\.yaml: no such file or directory"):
        load_spec(str(tmp_path / "nope.yaml"))
    with pytest.raises(SpecError, match=r"no config\.json in this directory"):
        load_spec(str(tmp_path))
    with pytest.raises(SpecError, match=r"unknown model 'no-such-model': not a bundled model \(.*tiny-moe"):
        load_spec("no-such-model")
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(SpecError, match=r"not a model spec"):
        load_spec(str(tmp_path / "weights.bin"))


def test_spec_error_is_megac_error_one_line():
    e = SpecError("a\nb")
    assert isinstance(e, MegacError) and str(e) == "a b"


# ------------------------------------------------------------------- overrides


def test_target_overrides():
    s = load_spec("north-mini-code", target_overrides={"num_sms": 114, "gpu": "h100", "batch_sizes": "8,1",
                                                       "kv_block_size": None})
    assert (s.target.num_sms, s.target.gpu, s.target.batch_sizes, s.target.kv_block_size) == (114, "h100", [1, 8], 64)
    with pytest.raises(SpecError, match=r"unknown field 'target\.num_smz' \(did you mean 'num_sms'\?\)"):
        load_spec("tiny-moe", target_overrides={"num_smz": 3})
    with pytest.raises(SpecError, match=r"^tiny-moe: target\.num_sms"):
        load_spec("tiny-moe", target_overrides={"num_sms": 0})
    with pytest.raises(SpecError, match=r"target\.kv_block_size: must be a power of two"):
        load_spec("tiny-moe", target_overrides={"kv_block_size": 24})


def test_max_context_override_clamps_windows():
    s = load_spec("north-mini-code", max_context=2048)
    assert s.max_context == 2048
    assert {l.window for l in s.layers if l.attention == "sliding"} == {2048}
    assert s.resolved_context_buckets == [1024, 2048]
    s = load_spec("north-mini-code", max_context=16384)
    assert {l.window for l in s.layers if l.attention == "sliding"} == {4096}


# -------------------------------------------------------------- context buckets


@pytest.mark.parametrize(
    "max_context, expect",
    [
        (262144, [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144]),
        (500000, [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144, 500000]),
        (1024, [1024]),
        (1000, [1000]),
        (3000, [1024, 2048, 3000]),
    ],
)
def test_derive_context_buckets(max_context, expect):
    assert derive_context_buckets(max_context) == expect


def test_context_bucket_lookup():
    s = load_spec("smollm2-135m")
    assert s.context_bucket(1) == 1024
    assert s.context_bucket(1025) == 2048
    assert s.context_bucket(8192) == 8192
    with pytest.raises(MegacError, match="exceeds max_context"):
        s.context_bucket(8193)


def test_describe_mentions_layer_kinds():
    text = load_spec("north-mini-code").describe()
    assert "full/moe/nope: layers 4,8,...,48" in text
    assert "30.48B total" in text


def test_yaml_text_source_in_message():
    with pytest.raises(SpecError, match=r"^inline:2: YAML syntax error"):
        spec_from_yaml_text("a: 1\nb: c: d\n", source="inline")

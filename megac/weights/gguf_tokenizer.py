"""The tokenizer (with its chat template) of a GGUF, from metadata already read.

``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` would read the file
again, twice in transformers 5.24 (its legacy reader for the config, about 5 s
for SmolLM2, then its fast one for the vocabulary). The steps after reading
are transformers' own (``convert_gguf_tokenizer`` builds the backend, the
``TokenizersBackend`` class ``AutoTokenizer`` picks for these files wraps
it); only the grouping of the metadata keys is repeated here, from
transformers' ``get_gguf_tokenizer``, and ``tests/weights/test_gguf.py``
checks it against that function.
"""

from __future__ import annotations

from megac.errors import MegacError
from megac.weights.gguf_file import GGUFFile

#: tokenizer config entry -> the GGUF key of the token id it names
_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                   "pad_token": "padding_token_id"}


def tokenizer_inputs(f: GGUFFile) -> tuple[str, dict, dict]:
    """``(architecture, tokenizer_dict, tokenizer_config)`` as transformers'
    ``get_gguf_tokenizer`` gives them for this file."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING

    md = f.metadata
    grouped = {group: {name: md[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in md}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if "tokens" not in tokenizer:
        raise MegacError(f"{f.path}: the GGUF has no tokenizer (tokenizer.ggml.tokens)")
    kind = tokenizer.get("tokenizer_type")
    if kind == "llama":  # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise
        config.setdefault("add_bos_token", True)
    elif kind == "gemma4":  # its chat template writes <bos> itself
        config["add_bos_token"] = False
    for name, key in _SPECIAL_TOKENS.items():
        token_id = md.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    return f.architecture, tokenizer, config


def gguf_tokenizer(f: GGUFFile):
    """A transformers tokenizer equal to ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``'s."""
    try:
        from transformers import TokenizersBackend
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError:  # transformers 4: no such pieces; its own (slower) path reads the file again
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(f.path.parent), gguf_file=f.path.name, local_files_only=True)
    architecture, tokenizer, config = tokenizer_inputs(f)
    try:
        backend, extra = convert_gguf_tokenizer(architecture, tokenizer)
    except Exception as err:  # noqa: BLE001 -- transformers raises many kinds
        raise MegacError(f"{f.path}: cannot build its tokenizer ({type(err).__name__}: {str(err).splitlines()[0]})")
    return TokenizersBackend(tokenizer_object=backend, name_or_path=str(f.path.parent), **config, **extra)


__all__ = ["gguf_tokenizer", "tokenizer_inputs"]

"""Grammar-constrained decoding (structured output) through llguidance.

A request's output can be held to a grammar (a JSON schema, any JSON object,
the tool-call format): before each of its tokens is sampled, the grammar's
matcher says which tokens may come next as a bitmask (one bit per token id,
computed on the CPU), the row's logits outside it become ``-inf`` where the
logits live (CPU or GPU, plain torch ops: no compiled kernel), and the
sampled token is then fed back to the matcher. So every output is a prefix of
a sentence of the grammar, and the request ends as soon as the grammar can
take no further token (:attr:`GrammarMatcher.finished`).

Pieces:

:func:`json_grammar` / :func:`lark_json` / :func:`lark_literal`
    grammar text (llguidance's Lark dialect, where ``%json {schema}`` is a
    rule) from JSON schemas, in one JSON style: no free whitespace, ``", "``
    between items and ``": "`` after keys (what ``json.dumps`` writes and
    what chat models imitate). Free whitespace would let a weak model pad
    forever.
:class:`GrammarTokenizer`
    llguidance's view of a tokenizer's vocabulary (from a transformers fast
    tokenizer, or from per-id bytes for the built-in byte tokenizer) and a
    cache of compiled grammars, keyed by the grammar text: compiling parses
    the grammar and builds its lexer once; each request gets a copy.
:class:`Grammar` / :class:`GrammarMatcher`
    a compiled grammar, and one request's matcher (its state advances with
    every accepted token and lives with the request, so a preempted request
    resumes it: the engine's replay re-runs tokens through the model, never
    through the matcher).
"""

from __future__ import annotations

import collections
import copy
import json
import threading
from typing import Any, Sequence

import torch

from megac.errors import MegacError

#: llguidance's JSON options: one fixed layout (see the module docstring)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

#: compiled grammars kept per tokenizer (least recently used dropped first)
GRAMMAR_CACHE_SIZE = 128


class GrammarError(MegacError):
    """A grammar or JSON schema llguidance cannot compile (the client's)."""


def _llguidance():
    # imported on first use: the CLI's start-up never pays for it
    import llguidance

    return llguidance


# ---------------------------------------------------------------------------- grammar text


def lark_literal(text: str) -> str:
    """``text`` as a Lark string literal (JSON string escapes are Lark's)."""
    return json.dumps(text)


def lark_json(schema: dict[str, Any]) -> str:
    """A Lark rule body matching JSON valid against ``schema`` in :data:`JSON_STYLE`
    (any ``x-guidance`` options of the schema itself are replaced)."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE})


def json_grammar(schema: dict[str, Any]) -> str:
    """The grammar of one JSON value valid against ``schema``."""
    return f"start: {lark_json(schema)}\n"


# ---------------------------------------------------------------------------- tokenizers and compiling


class _BytesVocabulary:
    """What llguidance's ``TokenizerWrapper`` reads: each id's bytes, the
    special ids (matched as tokens, never as text) and an encoder of bytes
    (llguidance tokenizes forced text with it)."""

    def __init__(self, tokens: Sequence[bytes], special_ids: Sequence[int], eos_id: int, bos_id: int | None,
                 encode) -> None:
        self.tokens = list(tokens)
        self.special_token_ids = list(special_ids)
        self.eos_token_id = eos_id
        self.bos_token_id = bos_id
        self._encode = encode

    def __call__(self, s: bytes | str) -> list[int]:
        return self._encode(s if isinstance(s, bytes) else s.encode("utf-8"))


class GrammarTokenizer:
    """A vocabulary as llguidance sees it, plus the compiled-grammar cache.
    ``vocab_size``: the model's (the bitmask covers it; ids the tokenizer does
    not know are never allowed)."""

    def __init__(self, lltok, vocab_size: int) -> None:
        self.lltok = lltok
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._compiled: collections.OrderedDict[str, Grammar] = collections.OrderedDict()

    @classmethod
    def from_hf(cls, hf_tokenizer, vocab_size: int, eos_ids: Sequence[int]) -> "GrammarTokenizer":
        """From a transformers fast tokenizer: llguidance reads the Rust
        tokenizer's JSON (what ``llguidance.hf.from_tokenizer`` does, without
        its check of one transformers class name)."""
        llg = _llguidance()
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise MegacError("structured output needs a fast (Rust-backed) tokenizer")
        backend = copy.copy(backend)  # padding and truncation off on a copy
        backend.no_padding()
        backend.no_truncation()
        n = max(int(vocab_size), len(hf_tokenizer))
        lltok = llg.LLTokenizer(backend.to_str(), n_vocab=n, eos_token=[int(t) for t in eos_ids] or None)
        return cls(lltok, vocab_size)

    @classmethod
    def from_bytes(cls, tokens: Sequence[bytes], vocab_size: int, special_ids: Sequence[int],
                   eos_ids: Sequence[int], bos_id: int | None, encode) -> "GrammarTokenizer":
        """From each id's bytes (``tokens[i]``; ``b""`` for ids that stand for
        no text, which the grammar never allows); ``encode``: bytes -> ids."""
        llg = _llguidance()
        if not eos_ids:
            raise MegacError("structured output needs an EOS token id")
        vocab = _BytesVocabulary(tokens, special_ids, int(eos_ids[0]), bos_id, encode)
        lltok = llg.LLTokenizer(llg.TokenizerWrapper(vocab), n_vocab=len(vocab.tokens),
                                eos_token=[int(t) for t in eos_ids])
        return cls(lltok, vocab_size)

    def compile(self, grammar: str) -> "Grammar":
        """``grammar`` (Lark text) compiled for this vocabulary, from the cache
        when it was compiled before; :class:`GrammarError` when invalid."""
        llg = _llguidance()
        with self._lock:
            hit = self._compiled.get(grammar)
            if hit is not None:
                self._compiled.move_to_end(grammar)
                return hit
        # compile outside the lock (llguidance drops the GIL; a large schema can take ~100 ms)
        proto = llg.LLMatcher(self.lltok, llg.LLMatcher.grammar_from_lark(grammar), log_level=0)
        if proto.is_error():
            raise GrammarError(proto.get_error())
        compiled = Grammar(proto, self.vocab_size)
        with self._lock:
            self._compiled[grammar] = compiled
            while len(self._compiled) > GRAMMAR_CACHE_SIZE:
                self._compiled.popitem(last=False)
        return compiled

    def schema_error(self, schema: dict[str, Any]) -> str | None:
        """Why ``schema`` cannot be compiled, in the JSON-schema compiler's own
        words (without the Lark context :meth:`compile`'s error carries); None
        if it can."""
        llg = _llguidance()
        grammar = llg.LLMatcher.grammar_from_json_schema({**schema, "x-guidance": JSON_STYLE})
        return llg.LLMatcher.validate_grammar(grammar, self.lltok) or None

    @property
    def num_cached(self) -> int:
        return len(self._compiled)


class Grammar:
    """A compiled grammar: hands out fresh matchers."""

    def __init__(self, prototype, vocab_size: int) -> None:
        self._prototype = prototype  # never advanced: only copied
        self._lock = threading.Lock()
        self.vocab_size = vocab_size

    def matcher(self) -> "GrammarMatcher":
        with self._lock:
            return GrammarMatcher(self._prototype.deep_copy(), self.vocab_size)


# ---------------------------------------------------------------------------- per request


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _bit_shifts(device: torch.device) -> torch.Tensor:
    t = _SHIFTS.get(device)
    if t is None:
        t = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return t


def allowed_tokens(bitmask: torch.Tensor, vocab: int, device) -> torch.Tensor:
    """bool ``[vocab]`` on ``device`` from an int32 bitmask (token ``t`` is
    bit ``t % 32`` of word ``t // 32``); ids past the mask are not allowed."""
    words = bitmask.to(device)
    bits = ((words.unsqueeze(-1) >> _bit_shifts(words.device)) & 1).reshape(-1).bool()
    if bits.numel() >= vocab:
        return bits[:vocab]
    return torch.cat([bits, bits.new_zeros(vocab - bits.numel())])


class GrammarMatcher:
    """One request's position in its grammar (see the module docstring)."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self._m = matcher
        self.vocab_size = vocab_size
        self.num_accepted = 0

    def bitmask(self) -> torch.Tensor:
        """int32 ``[ceil(vocab / 32)]`` on the CPU: the tokens allowed next."""
        return torch.frombuffer(bytearray(self._m.compute_bitmask()), dtype=torch.int32)

    def constrain(self, logits: torch.Tensor, unprocessed: torch.Tensor | None = None) -> torch.Tensor:
        """A copy of one row's ``logits`` with every token the grammar forbids
        at ``-inf``, on the logits' device. Where the sampler's own processing
        (``unprocessed``: the logits before it) left no allowed token finite
        (``min_tokens`` masking the EOS a finished grammar needs), the grammar
        wins: the allowed tokens of ``unprocessed`` are used. Decided on the
        device, without a host synchronisation."""
        allowed = allowed_tokens(self.bitmask(), logits.shape[-1], logits.device)
        out = logits.masked_fill(~allowed, float("-inf"))
        if unprocessed is not None and unprocessed is not logits:
            fallback = unprocessed.float().masked_fill(~allowed, float("-inf"))
            out = torch.where(torch.isneginf(out.max()), fallback, out)
        return out

    def accept(self, token: int) -> bool:
        """Advance past the sampled ``token``; False puts the matcher in its
        error state (a token the bitmask did not allow)."""
        self.num_accepted += 1
        return bool(self._m.consume_token(int(token)))

    @property
    def finished(self) -> bool:
        """The grammar takes no further token (complete, or in error)."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str | None:
        """Why the matcher is in its error state; None while it is not."""
        if not self._m.is_error():
            return None
        return self._m.get_error() or "grammar matcher error"

    def allows(self, token: int) -> bool:
        """Whether ``token`` may come next (tests and diagnostics)."""
        return bool(self._m.validate_tokens([int(token)]) == 1)


__all__ = ["GRAMMAR_CACHE_SIZE", "Grammar", "GrammarError", "GrammarMatcher", "GrammarTokenizer", "JSON_STYLE",
           "allowed_tokens", "json_grammar", "lark_json", "lark_literal"]

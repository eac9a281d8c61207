"""The token-count lower bound behind refusing an obviously too-long prompt
(``Tokenizer.max_token_bytes``) holds on a real byte-level BPE tokenizer,
is withheld where a normalizer could shrink the text, and the request
tokenizer is an independent copy."""

from __future__ import annotations

import math
import random

import pytest

from megac.server.chat import ByteTokenizer, Tokenizer
from megac.server.prompt_length import refuse_obviously_too_long

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

CORPUS = ["the quick brown fox jumps over the lazy dog " * 20, "a" * 40 + " " + "b" * 30 + " ",
          "héllo wörld ünïcode ✓ 漢字 emoji 🙂 " * 10]


def _byte_level_bpe(normalizer=None):
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if normalizer is not None:
        tok.normalizer = normalizer
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator(CORPUS, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


def _texts():
    rng = random.Random(0)
    pieces = ["a" * 40, "b" * 30, "the quick brown fox", "<|im_start|>", "<|im_end|>", "漢字", "🙂", " ", "\n",
              "héllo", "ünïcode ✓", "zzz"]
    for _ in range(200):
        yield "".join(rng.choice(pieces) for _ in range(rng.randint(1, 40)))
    yield "a" * 40 * 50  # the longest merge, repeated
    yield "<|im_start|>" * 30  # special tokens, one token each


def test_bound_holds_on_a_byte_level_bpe():
    tok = Tokenizer(_byte_level_bpe())
    per_token = tok.max_token_bytes
    assert per_token is not None and per_token >= len("<|im_start|>")
    tight = 0
    for text in _texts():
        n = len(tok.encode(text))
        bound = math.ceil(len(text.encode()) / per_token)
        assert n >= bound, (text, n, bound)
        tight += n == bound
    assert tight  # the bound is reached (special tokens), so it is not trivially low


def test_no_bound_with_a_normalizer():
    from tokenizers import normalizers

    assert Tokenizer(_byte_level_bpe(normalizers.NFKC())).max_token_bytes is None
    assert Tokenizer(ByteTokenizer(256)).max_token_bytes == 1


def test_refusal_needs_the_bound():
    from megac.server.errors import APIError

    tok = Tokenizer(_byte_level_bpe())
    per_token = tok.max_token_bytes
    refuse_obviously_too_long(tok, "x" * (per_token * 99), 100, "prompt")  # >= 99 tokens: may fit
    with pytest.raises(APIError) as ei:
        refuse_obviously_too_long(tok, "x" * (per_token * 100), 100, "prompt")  # >= 100 tokens: cannot
    assert (ei.value.status, ei.value.code, ei.value.param) == (400, "context_length_exceeded", "prompt")
    normalized = Tokenizer(_byte_level_bpe(tokenizers.normalizers.NFKC()))
    refuse_obviously_too_long(normalized, "x" * 10**6, 100, "prompt")  # no bound: left to the tokenizer


def test_request_tokenizer_is_an_independent_copy():
    tok = Tokenizer(_byte_level_bpe())
    twin = tok.copy()
    assert twin.impl is not tok.impl and twin._lock is not tok._lock
    for text in list(_texts())[:20]:
        assert twin.encode(text) == tok.encode(text)
    assert twin.chat_template == tok.chat_template and twin.eos_token_ids == tok.eos_token_ids

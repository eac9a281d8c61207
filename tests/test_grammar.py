"""Grammar-constrained sampling (megac.grammar through megac.sampling), on
random logits: what the bitmask allows is what llguidance's matcher accepts,
the sampler puts every other token at -inf and advances the matcher once per
token, and the outputs are schema-valid JSON (checked with ``jsonschema``,
an implementation independent of the grammar library)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from megac.grammar import GrammarError, GrammarTokenizer, allowed_tokens, json_grammar
from megac.sampling import RowSampling, SamplingParams, make_stream, needs_logits, sample_row, sample_rows
from megac.server.chat import ByteTokenizer, Tokenizer

VOCAB = 300  # wider than the byte tokenizer's 256 ids: ids past them stand for no text
BOS, EOS = 1, 2
TOK = Tokenizer(ByteTokenizer(VOCAB, BOS, [EOS]), eos_token_ids=[EOS])

SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 10},
                         "days": {"type": "integer", "minimum": 1, "maximum": 14},
                         "unit": {"enum": ["C", "F"]},
                         "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
          "required": ["city", "days", "unit"], "additionalProperties": False}


@pytest.fixture(scope="module")
def vocab() -> GrammarTokenizer:
    return TOK.grammar_tokenizer(VOCAB)


def _decode(ids):
    return TOK.decode([t for t in ids if t != EOS])


def _generate(grammar, params, seed, max_tokens=400):
    """Sample from random logits under ``grammar`` until it finishes."""
    m = grammar.matcher()
    stream = make_stream(params.seed)
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while not m.finished and len(out) < max_tokens:
        out.append(sample_row(torch.randn(VOCAB, generator=gen) * 3, params, stream, out, {EOS}, m))
        assert m.error is None
    return out, m


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_validate_against_the_schema(vocab, temperature):
    g = vocab.compile(json_grammar(SCHEMA))
    texts = set()
    for seed in range(8):
        ids, m = _generate(g, SamplingParams(temperature=temperature, seed=seed), seed)
        assert m.finished and m.num_accepted == len(ids)
        text = _decode(ids)
        jsonschema.validate(json.loads(text), SCHEMA)
        texts.add(text)
    assert len(texts) > 4  # the seeds really gave different outputs


def test_the_bitmask_is_what_the_matcher_accepts(vocab):
    g = vocab.compile(json_grammar(SCHEMA))
    ids, _ = _generate(g, SamplingParams(temperature=1.0, seed=3), 3)
    m = g.matcher()
    for tok in ids:
        allowed = allowed_tokens(m.bitmask(), VOCAB, "cpu")
        # every id checked against the matcher's own verdict, beyond the mask's last word too
        assert [bool(a) for a in allowed] == [m.allows(t) for t in range(VOCAB)]
        assert not allowed[256:].any() and not allowed[BOS]  # no text, no BOS
        assert bool(allowed[EOS]) is False  # the object is not closed yet: no end of sequence
        assert allowed[tok]
        m.accept(tok)
    assert m.finished


def test_constrain_masks_everything_else_and_keeps_allowed_logits(vocab):
    m = vocab.compile(json_grammar({"type": "boolean"})).matcher()
    x = torch.randn(VOCAB)
    y = m.constrain(x)
    finite = torch.isfinite(y).nonzero().flatten().tolist()
    assert finite == [ord("f"), ord("t")]
    assert torch.equal(y[finite], x[finite])


def test_grammar_wins_over_min_tokens(vocab):
    """min_tokens masks the stop tokens; where the grammar allows nothing
    else, its token is taken (not the argmax of an all -inf row)."""
    close = ord("}")
    p = SamplingParams(temperature=0.0, min_tokens=10, stop_token_ids=[close])
    m = vocab.compile(json_grammar({"type": "object", "properties": {}, "additionalProperties": False})).matcher()
    m.accept(ord("{"))
    x = torch.zeros(VOCAB)
    x[7] = 5.0
    assert sample_row(x, SamplingParams(temperature=0.0), None, [], {EOS}, None) == 7
    assert sample_row(x, p, None, [ord("{")], {EOS}, m) == close
    assert m.finished and m.error is None
    # where the grammar leaves a choice, min_tokens still counts
    m = vocab.compile('start: "ab" "c"*\n').matcher()
    m.accept(ord("a"))
    m.accept(ord("b"))
    x = torch.zeros(VOCAB)
    x[EOS] = 5.0
    assert sample_row(x, p, None, [ord("a"), ord("b")], {EOS}, m) == ord("c")


def test_sample_rows_constrains_and_advances_each_grammar_row_once(vocab):
    g = vocab.compile(json_grammar({"type": "integer"}))
    m = g.matcher()
    plain = RowSampling(SamplingParams(temperature=0.0), None)
    held = RowSampling(SamplingParams(temperature=0.0), None, grammar=m)
    assert not needs_logits(plain.params, ()) and needs_logits(held.params, (), held.grammar)
    x = torch.full((3, VOCAB), -1.0)
    x[:, ord("z")] = 9.0  # the plain argmax; not an integer
    x[:, ord("7")] = 1.0
    # the argmax records' shortcut is taken for plain rows only
    got = sample_rows(x, [plain, held, None], greedy=torch.tensor([ord("z"), ord("z"), 0]))
    assert got == [ord("z"), ord("7"), None]
    assert m.num_accepted == 1 and not m.allows(ord("z")) and m.allows(ord("8"))


def test_compiled_grammars_are_cached_per_text_and_tokenizer(vocab):
    text = json_grammar({"type": "array", "items": {"type": "integer"}})
    a, b = vocab.compile(text), vocab.compile(text)
    assert a is b
    assert a.matcher() is not a.matcher()  # one matcher per request
    assert TOK.grammar_tokenizer(VOCAB) is vocab
    other = TOK.copy().grammar_tokenizer(VOCAB)
    assert other is not vocab and other.compile(text) is not a


def test_bad_schema_raises_grammar_error(vocab):
    with pytest.raises(GrammarError, match="frobnicate"):
        vocab.compile(json_grammar({"type": "frobnicate"}))
    with pytest.raises(GrammarError):
        vocab.compile(json_grammar({"properties": {"a": {"$ref": "#/nowhere"}}}))


def _byte_level_bpe():
    """A small transformers fast tokenizer: byte-level BPE, 600 ids, trained here."""
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator(['{"city": "Paris", "days": 3, "unit": "C", "tags": [true, false]}'] * 20 +
                            ["the quick brown fox jumps over the lazy dog " * 20], trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")


def test_hf_byte_level_bpe_vocabulary():
    """A transformers fast tokenizer (a byte-level BPE with multi-byte tokens):
    the sampled ids decode to schema-valid JSON."""
    hf = Tokenizer(_byte_level_bpe(), eos_token_ids=[1])
    n = len(hf.impl)
    g = hf.grammar_tokenizer(n + 8).compile(json_grammar(SCHEMA))
    multi = False
    for seed in range(6):
        m = g.matcher()
        gen = torch.Generator().manual_seed(seed)
        ids: list[int] = []
        while not m.finished:
            x = torch.randn(n + 8, generator=gen) * 3
            ids.append(sample_row(x, SamplingParams(temperature=1.0, seed=seed), make_stream(seed), ids, {1}, m))
            assert ids[-1] < n and len(ids) < 400
        multi |= any(len(hf.decode([t])) > 1 for t in ids)
        jsonschema.validate(json.loads(hf.decode(ids)), SCHEMA)
    assert multi  # merged tokens were used, not only single bytes

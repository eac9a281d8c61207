"""Structured output in the engine: requests held to a grammar (tiny-llama,
untied random weights, byte tokenizer) end when the grammar completes, their
text validates against the schema (``jsonschema``), and a preemption, whose
replay re-runs the generated tokens through the model, leaves each matcher
exactly one step per generated token: the outputs equal those run alone."""

from __future__ import annotations

import json

import jsonschema
import pytest

from megac.grammar import json_grammar
from megac.sampling import SamplingParams
from test_scheduler import PROMPTS, SPEC, TOK, make_engine, submit

SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                      "days": {"type": "integer", "minimum": 1, "maximum": 30}},
     "required": ["city", "days"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "unit": {"enum": ["C", "F", "K"]},
                                      "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 4}},
     "required": ["ok", "unit", "scores"], "additionalProperties": False},
]


def _grammar(i):
    return TOK.grammar_tokenizer(SPEC.vocab_size).compile(json_grammar(SCHEMAS[i % 2]))


def _params(i, **kw):
    return SamplingParams(temperature=1.0, seed=500 + i, max_tokens=kw.pop("max_tokens", 400), **kw)


def _run(eng, indices, *, plain_too=False):
    """Submit constrained requests ``indices`` (and unconstrained ones
    between them) and run to the end: ``{i: (ids, text, finish, matcher,
    preemptions)}``."""
    reqs = {}
    for i in indices:
        req, outs = submit(eng, PROMPTS[i], _params(i), f"g{i}")
        req.grammar = _grammar(i).matcher()
        reqs[i] = (req, outs)
        if plain_too:
            submit(eng, PROMPTS[i], SamplingParams(temperature=1.0, seed=i, max_tokens=60), f"p{i}")
    eng.run_until_idle()
    return {i: (req.output_ids, "".join(o.text for o in outs), outs[-1].finish_reason, req.grammar,
                req.num_preemptions) for i, (req, outs) in reqs.items()}


@pytest.fixture(scope="module")
def alone():
    return {i: _run(make_engine(), [i])[i] for i in range(len(PROMPTS))}


def test_outputs_validate_and_end_with_the_grammar(alone):
    for i, (ids, text, finish, m, _) in alone.items():
        assert finish == "stop" and m.finished and m.error is None, (i, text)
        assert m.num_accepted == len(ids)
        jsonschema.validate(json.loads(text), SCHEMAS[i % 2])
        assert ids[-1] != 2  # the grammar ended the request at its last token, no EOS step
    assert len({v[1] for v in alone.values()}) == len(alone)  # outputs differ between prompts


def test_batched_and_preempted_equal_alone(alone):
    # a 60-block pool cannot hold 12 requests and their unconstrained twins: preemptions happen
    eng = make_engine(num_blocks=60, max_batch=8)
    got = _run(eng, range(len(PROMPTS)), plain_too=True)
    assert sum(v[4] for v in got.values()) > 0  # constrained requests among the preempted
    assert {i: v[:3] for i, v in got.items()} == {i: v[:3] for i, v in alone.items()}
    for ids, _, _, m, _ in got.values():
        assert m.num_accepted == len(ids)  # the replay fed no token to the matcher twice


def test_max_tokens_cuts_a_grammar_short(alone):
    ids, text, *_ = alone[0]
    cut = len(ids) // 2
    eng = make_engine()
    req, outs = submit(eng, PROMPTS[0], _params(0, max_tokens=cut), "cut")
    req.grammar = _grammar(0).matcher()
    eng.run_until_idle()
    assert outs[-1].finish_reason == "length" and req.output_ids == ids[:cut]
    assert not req.grammar.finished


def test_grammar_completing_on_the_last_allowed_token_is_stop(alone):
    ids, text, *_ = alone[1]
    eng = make_engine()
    req, outs = submit(eng, PROMPTS[1], _params(1, max_tokens=len(ids), ignore_eos=True), "exact")
    req.grammar = _grammar(1).matcher()
    eng.run_until_idle()
    assert outs[-1].finish_reason == "stop" and "".join(o.text for o in outs) == text

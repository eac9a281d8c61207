"""Tool-call parsing on canned model outputs: whole, and streamed at every
chunk boundary (the shapes of vLLM's streaming tool-call bugs: nested
objects, arrays of objects, escaped quotes, braces inside strings, several
calls, text before a call, unterminated calls)."""

from __future__ import annotations

import json
import random

import pytest

from megac.server.chat import ByteTokenizer, Tokenizer, render_chat, tool_seed
from megac.server.tools import HermesToolParser, get_tool_parser, object_prefix_ok, parser_for_family, scan_object

P = HermesToolParser()


def call(name, args, pre="<tool_call>\n", post="\n</tool_call>"):
    return pre + json.dumps({"name": name, "arguments": args}) + post


CASES = {
    "plain": ("The capital of France is Paris.", "The capital of France is Paris.", []),
    "lt_not_a_tag": ("a < b and <tools> are <tool_ but not calls", "a < b and <tools> are <tool_ but not calls", []),
    "one_call": (call("get_weather", {"city": "Paris"}), "", [("get_weather", {"city": "Paris"})]),
    "text_before": ("Let me check.\n" + call("get_weather", {"city": "Paris", "unit": "C"}), "Let me check.\n",
                    [("get_weather", {"city": "Paris", "unit": "C"})]),
    "two_calls": (call("a", {"x": 1}) + "\n" + call("b", {"y": [1, 2]}), "", [("a", {"x": 1}), ("b", {"y": [1, 2]})]),
    "nested": (call("f", {"o": {"p": {"q": [1, {"r": None}]}}, "t": True}), "",
               [("f", {"o": {"p": {"q": [1, {"r": None}]}}, "t": True})]),
    "array_of_objects": (call("g", {"items": [{"id": 1, "tags": ["a", "b"]}, {"id": 2, "tags": []}]}), "",
                         [("g", {"items": [{"id": 1, "tags": ["a", "b"]}, {"id": 2, "tags": []}]})]),
    "escapes": (call("h", {"s": 'say "hi" \\ {not a brace} </tool_call> é'}), "",
                [("h", {"s": 'say "hi" \\ {not a brace} </tool_call> é'})]),
    "no_space": ('<tool_call>{"name":"k","arguments":{"a":"}"}}</tool_call>', "", [("k", {"a": "}"})]),
    "args_first": ('<tool_call>\n{"arguments": {"n": 3}, "name": "later"}\n</tool_call>', "", [("later", {"n": 3})]),
    "args_string": ('<tool_call>\n{"name": "s", "arguments": "{\\"q\\": 1}"}\n</tool_call>', "", [("s", {"q": 1})]),
    "parameters_key": ('<tool_call>{"name": "p", "parameters": {"z": 0}}</tool_call>', "", [("p", {"z": 0})]),
    "no_args": ('<tool_call>{"name": "now"}</tool_call>', "", [("now", {})]),
    "unterminated_complete": ('<tool_call>\n{"name": "u", "arguments": {"v": [1, 2]}}', "", [("u", {"v": [1, 2]})]),
    "text_after_dropped": (call("a", {}) + "\nDone!", "", [("a", {})]),
    "no_name": ("<tool_call>\n{\"oops\": 1}\n</tool_call>", "<tool_call>\n{\"oops\": 1}\n</tool_call>", []),
    "garbage_unterminated": ("hi <tool_call> not json", "hi <tool_call> not json", []),
}


def streamed(text: str, cuts: list[int], prefix: str = ""):
    """Feed ``text`` cut at ``cuts``; assemble content and calls from the deltas."""
    p = P.stream(prefix)
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    content = ""
    calls: dict[int, dict] = {}
    deltas = [p.feed(x) for x in pieces] + [p.finish()]
    for d in deltas:
        content += d.content
        for tc in d.tool_calls:
            c = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id is not None:
                assert c["id"] is None, "id sent twice"
                c["id"], c["name"] = tc.id, tc.name
            else:
                assert c["id"] is not None, "arguments before the call header"
            if tc.arguments:
                c["arguments"] += tc.arguments
    return content, [calls[i] for i in sorted(calls)], p


@pytest.mark.parametrize("name", sorted(CASES))
def test_parse_whole(name):
    text, want_content, want_calls = CASES[name]
    content, calls = P.parse(text)
    assert content == want_content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == want_calls
    assert len({c.id for c in calls}) == len(calls)
    assert all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize("name", sorted(CASES))
def test_stream_every_single_cut(name):
    text, want_content, want_calls = CASES[name]
    _, whole = P.parse(text)
    for cut in range(1, len(text)):
        content, calls, _ = streamed(text, [cut])
        assert content == want_content, cut
        assert [c["name"] for c in calls] == [w[0] for w in want_calls], cut
        # the streamed fragments concatenate to exactly the non-streamed arguments
        assert [c["arguments"] for c in calls] == [c.arguments for c in whole], cut


@pytest.mark.parametrize("name", sorted(CASES))
def test_stream_char_by_char_and_random(name):
    text, want_content, want_calls = CASES[name]
    rng = random.Random(name)
    cutsets = [list(range(1, len(text)))]
    for _ in range(20):
        k = rng.randint(1, max(1, len(text) // 3))
        cutsets.append(sorted(rng.sample(range(1, len(text)), min(k, len(text) - 1))))
    for cuts in cutsets:
        content, calls, p = streamed(text, cuts)
        assert content == want_content
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == want_calls
        assert p.content == content
        assert [(c.name, c.arguments) for c in p.tool_calls] == [(c["name"], c["arguments"]) for c in calls]


def test_content_streams_before_the_call_and_holds_partial_tags():
    p = P.stream()
    assert p.feed("Sure, ").content == "Sure, "
    d = p.feed("checking <tool")
    assert d.content == "checking " and not d.tool_calls  # "<tool" may start a tag: held
    d = p.feed('_call>{"name": "f", "argu')
    assert d.content == "" and [(t.index, t.name) for t in d.tool_calls] == [(0, "f")]
    d = p.feed('ments": {"a": [1, 2')
    assert [t.arguments for t in d.tool_calls] == ['{"a": [1, 2']
    d = p.feed("]}}</tool_")
    assert [t.arguments for t in d.tool_calls] == ["]}"]
    assert not p.feed("call>").tool_calls
    assert not p.finish()
    assert p.tool_calls[0].arguments == '{"a": [1, 2]}'


def test_held_partial_tag_is_released_at_the_end():
    p = P.stream()
    assert p.feed("a <tool_ca").content == "a "
    assert p.finish().content == "<tool_ca"
    assert p.content == "a <tool_ca"


def test_unterminated_partial_arguments_are_kept_as_generated():
    content, calls = P.parse('<tool_call>\n{"name": "f", "arguments": {"a": "b')
    assert content == "" and calls[0].name == "f" and calls[0].arguments == '{"a": "b'


def test_complete_tells_finished_arguments_from_cut_off_ones():
    def complete(text, prefix=""):
        return [c.complete for c in P.parse(text, prefix)[1]]

    assert complete(call("f", {"a": [1, 2]})) == [True]
    assert complete('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}') == [True]  # end tag cut off only
    assert complete('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2') == [False]
    assert complete('<tool_call>\n{"name": "f", "argu') == [False]  # gets {} but was never written
    assert complete('<tool_call>{"name": "now"}</tool_call>') == [True]
    assert complete(call("a", {}) + "\n" + '<tool_call>\n{"name": "b", "arguments": {"x"') == [True, False]
    seed = tool_seed({"type": "function", "function": {"name": "g"}})
    assert complete('{"q": "x"}}\n</tool_c', seed) == [True]
    assert complete('{"q": "x', seed) == [False]


def test_named_seed_primes_the_parser():
    seed = tool_seed({"type": "function", "function": {"name": "get_weather"}})
    generated = '{"city": "Oslo"}}\n</tool_call>'
    content, calls = P.parse(generated, prefix=seed)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    for cut in range(1, len(generated)):
        c2, calls2, _ = streamed(generated, [cut], prefix=seed)
        assert c2 == "" and [(c["name"], c["arguments"]) for c in calls2] == [("get_weather", '{"city": "Oslo"}')]


# arguments that are not a JSON object: the call is never complete and its
# arguments are at most the beginning of a JSON object (streamed the same)
NOT_OBJECTS = {
    "unquoted_key": ('{a: 1}', "{"),
    "array": ("[1,2]", "{}"),
    "number": ("5", "{}"),
    "string_of_array": ('"[1, 2]"', "{}"),
    "string_not_json": ('"hello"', "{}"),
    "trailing_comma": ('{"a": 1,}', '{"a": 1,'),
    "bad_literal": ('{"a": tru}', '{"a": tru'),  # the longest beginning of some object
    "bare_word_after_pair": ('{"x": [1, {"y": 2}], b: 3}', '{"x": [1, {"y": 2}], '),
}


@pytest.mark.parametrize("name", sorted(NOT_OBJECTS))
def test_arguments_must_be_a_json_object(name):
    args, sent = NOT_OBJECTS[name]
    text = '<tool_call>\n{"name": "f", "arguments": ' + args + "}\n</tool_call>"
    content, calls = P.parse(text)
    assert content == "" and [(c.name, c.arguments, c.complete) for c in calls] == [("f", sent, False)]
    for cut in range(1, len(text)):
        _, scalls, p = streamed(text, [cut])
        assert [c["arguments"] for c in scalls] == [sent], cut
        assert [c.complete for c in p.tool_calls] == [False], cut


def test_object_prefix_ok_against_json():
    good = [{}, {"a": 1}, {"a": [1, -2.5e-3, {"b": None}], "c": True, "d": False, "e": 'x"}{]['},
            {"n": {"m": []}}]
    for obj in good:
        text = json.dumps(obj)
        assert all(object_prefix_ok(text[:k]) for k in range(len(text) + 1)), text
        assert not object_prefix_ok(text + "}") and not object_prefix_ok(text + ",")
    for bad in ["[", "1", '"a"', "{a", '{"a" 1', '{"a": 01}', '{"a": 1,}', "{,", '{"a": [1,]}', '{"a": nul}',
                "{'a': 1}"]:
        assert not object_prefix_ok(bad), bad
        try:
            assert not isinstance(json.loads(bad), dict), bad  # json agrees: no object
        except ValueError:
            pass


def test_required_seed():
    seed = tool_seed("required")
    content, calls = P.parse('{"name": "a", "arguments": {}}\n</tool_call>', prefix=seed)
    assert content == "" and calls[0].name == "a"


def test_scan_object_partial_and_complete():
    keys, done = scan_object('{"name": "x", "arguments": {"a": [1, {"b": "}"}]}}')
    assert done and set(keys) == {"name", "arguments"} and all(e is not None for _, e in keys.values())
    keys, done = scan_object('{"name": "x", "arguments": {"a": [1, {"b"')
    assert not done and keys["arguments"][1] is None


def test_registry():
    assert get_tool_parser("hermes").name == "hermes"
    assert parser_for_family("llama").name == "hermes"
    with pytest.raises(Exception, match="tool-call-parser nope"):
        get_tool_parser("nope")


# ------------------------------------------------------------------ the tool-aware template


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def _tok(template=None):
    t = Tokenizer(ByteTokenizer(256, 1, [2]), eos_token_ids=[2])
    if template is not None:
        t.chat_template = template
    return t


def test_tool_template_lists_tools_and_history():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]
    r = render_chat(_tok(), msgs, tools=TOOLS, tool_choice="auto")
    assert r.used_tool_template and r.seed == ""
    t = r.text
    assert t.startswith("<|im_start|>system\nBe brief.\n\nYou are a function calling AI model.")
    assert '{"name": "get_weather", "description": "Weather of a city"' in t
    assert "<tool_call>\n{\"name\": <function-name>" in t
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>\n') in t
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>\n" in t
    assert t.endswith("<|im_start|>assistant\n")


def test_tool_choice_variants():
    msgs = [{"role": "user", "content": "hi"}]
    none = render_chat(_tok(), msgs, tools=TOOLS, tool_choice="none")
    assert not none.used_tool_template and "get_weather" not in none.text
    req = render_chat(_tok(), msgs, tools=TOOLS, tool_choice="required")
    assert "You must call at least one" in req.text and req.text.endswith("assistant\n<tool_call>\n")
    named = render_chat(_tok(), msgs, tools=TOOLS,
                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert "You must call the function get_weather." in named.text
    assert named.text.endswith('<tool_call>\n{"name": "get_weather", "arguments": ')
    assert named.seed == '<tool_call>\n{"name": "get_weather", "arguments": '


def test_model_template_that_knows_tools_is_used():
    tpl = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    r = render_chat(_tok(tpl), [{"role": "user", "content": "hi"}], tools=TOOLS, tool_choice="auto")
    assert not r.used_tool_template and r.text == "[get_weather]hi"

"""Tool-call formats: parsing whole completions and streams (any chunking gives the whole
text's result), and the grammars that force valid calls, run through llguidance's matcher on
the default model's tokenizer."""

from __future__ import annotations

import json
import random
import re

import pytest

from eaglesrv.grammar import GrammarError
from eaglesrv.server.tools import (
    ContentDelta,
    ToolCallDelta,
    ToolGrammarError,
    ToolRequestError,
    tool_call_format,
)

QWEN = tool_call_format("qwen25")
LLAMA = tool_call_format("llama3")


def qwen_call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def llama_call(name: str, parameters: str) -> str:
    return f'{{"name": "{name}", "parameters": {parameters}}}'


def calls_of(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def chunkings(text: str):
    """Whole, a character at a time, fixed sizes, every two-piece split, random splits."""
    yield [text]
    yield list(text)
    for size in (2, 3, 5, 8, 13):
        yield [text[i:i + size] for i in range(0, len(text), size)]
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def stream(fmt, chunks: list[str]):
    parser = fmt.stream_parser()
    events = [e for chunk in chunks for e in parser.feed(chunk)] + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    deltas = [e for e in events if isinstance(e, ToolCallDelta)]
    assert [d.index for d in deltas] == list(range(len(deltas)))
    return content, [d.call for d in deltas]


def assert_stream_matches_parse(fmt, text: str) -> None:
    content, calls = fmt.parse(text)
    for chunks in chunkings(text):
        streamed_content, streamed_calls = stream(fmt, chunks)
        assert streamed_content == (content or ""), chunks
        assert calls_of(streamed_calls) == calls_of(calls), chunks


WEATHER = qwen_call("get_weather", '{"city": "Paris", "unit": "c"}')
TIME = qwen_call("get_time", "{}")

QWEN_CASES = [
    # text, expected content, expected calls
    ("Hello there!\n\nHow can I help?", "Hello there!\n\nHow can I help?", []),
    (WEATHER, None, [("get_weather", {"city": "Paris", "unit": "c"})]),
    ("Let me check.\n" + WEATHER, "Let me check.", [("get_weather", {"city": "Paris", "unit": "c"})]),
    ("Checking: " + WEATHER + "\nDone.", "Checking: \nDone.", [("get_weather", {"city": "Paris", "unit": "c"})]),
    (WEATHER + "\n" + TIME + "\n", None, [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {})]),
    # no closing tag (the model stopped right after the JSON)
    ('<tool_call>\n{"name": "get_time", "arguments": {}}', None, [("get_time", {})]),
    ('<tool_call>{"name": "get_time"}</tool_call>', None, [("get_time", {})]),  # no arguments, no newlines
    # malformed JSON, unbalanced JSON, not an object, no name: all content
    ('<tool_call>\n{"name": "f", "arguments": {"x": }}\n</tool_call>',
     '<tool_call>\n{"name": "f", "arguments": {"x": }}\n</tool_call>', []),
    ('<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call> more',
     '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call> more', []),
    ('<tool_call>\n["f"]\n</tool_call>', '<tool_call>\n["f"]\n</tool_call>', []),
    ('<tool_call>\n{"arguments": {}}\n</tool_call>', '<tool_call>\n{"arguments": {}}\n</tool_call>', []),
    ("Wrap calls in <tool_call> tags.", "Wrap calls in <tool_call> tags.", []),
    ("a <toolbox> b <tool_call", "a <toolbox> b <tool_call", []),
    # a marker that is no call, then one that is
    ("<tool_call>" + WEATHER, "<tool_call>", [("get_weather", {"city": "Paris", "unit": "c"})]),
    # braces, brackets, quotes and escapes inside strings; raw newline in a string; non-ASCII
    (qwen_call("echo", r'{"text": "a } { ] [ \" \\ end"}'), None, [("echo", {"text": 'a } { ] [ " \\ end'})]),
    (qwen_call("write", '{"code": "line 1\nline 2"}'), None, [("write", {"code": "line 1\nline 2"})]),
    (qwen_call("get_weather", '{"city": "Zürich"}'), None, [("get_weather", {"city": "Zürich"})]),
    # arguments given as a JSON string, and under llama's key
    ('<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>', None, [("f", {"x": 1})]),
    ('<tool_call>\n{"name": "f", "parameters": {"x": 1}}\n</tool_call>', None, [("f", {"x": 1})]),
]


@pytest.mark.parametrize("text,content,calls", QWEN_CASES)
def test_qwen25_parse(text, content, calls):
    parsed_content, parsed_calls = QWEN.parse(text)
    assert parsed_content == content
    assert calls_of(parsed_calls) == calls


@pytest.mark.parametrize("text", [case[0] for case in QWEN_CASES])
def test_qwen25_stream_matches_parse(text):
    assert_stream_matches_parse(QWEN, text)


LLAMA_CASES = [
    (llama_call("get_weather", '{"city": "Paris"}'), None, [("get_weather", {"city": "Paris"})]),
    ("  \n" + llama_call("get_time", "{}"), None, [("get_time", {})]),
    ("<|python_tag|>" + llama_call("a", '{"x": 1}') + "; " + llama_call("b", "{}"), None,
     [("a", {"x": 1}), ("b", {})]),
    (llama_call("a", "{}") + ";" + llama_call("b", "{}") + "\n" + llama_call("c", "{}"), None,
     [("a", {}), ("b", {}), ("c", {})]),
    ("Let me look that up.<|python_tag|>" + llama_call("a", "{}"), "Let me look that up.", [("a", {})]),
    (llama_call("a", "{}") + " Anything else?", "Anything else?", [("a", {})]),
    ('{"name": "a", "arguments": {"x": 1}}', None, [("a", {"x": 1})]),
    # JSON that is no call, a call not at the start, code for the python tag: all content
    ('{"answer": 42}', '{"answer": 42}', []),
    ("The call is " + llama_call("a", "{}"), "The call is " + llama_call("a", "{}"), []),
    ('<|python_tag|>print("hi")', '<|python_tag|>print("hi")', []),
    ('{"name": "a", "parameters": {"x": }}', '{"name": "a", "parameters": {"x": }}', []),
    # a call, then a separator with no call after it
    (llama_call("a", "{}") + "; and then", "; and then", [("a", {})]),
    (llama_call("a", "{}") + "; " + '{"oops": 1}', '; {"oops": 1}', [("a", {})]),
    ("Use <|python_tag", "Use <|python_tag", []),
]


@pytest.mark.parametrize("text,content,calls", LLAMA_CASES)
def test_llama3_parse(text, content, calls):
    parsed_content, parsed_calls = LLAMA.parse(text)
    assert parsed_content == content
    assert calls_of(parsed_calls) == calls


@pytest.mark.parametrize("text", [case[0] for case in LLAMA_CASES])
def test_llama3_stream_matches_parse(text):
    assert_stream_matches_parse(LLAMA, text)


def test_stream_holds_back_a_partial_marker_and_emits_content_promptly():
    parser = QWEN.stream_parser()
    assert parser.feed("Sure, checking. <tool_") == [ContentDelta("Sure, checking.")]
    assert parser.feed('call>\n{"name": "get_weather", ') == []
    [delta] = parser.feed('"arguments": {"city": "Paris"}}')  # complete before </tool_call>
    assert isinstance(delta, ToolCallDelta) and delta.index == 0
    assert (delta.call.name, delta.call.arguments) == ("get_weather", '{"city": "Paris"}')
    assert parser.feed("\n</tool") == []
    assert parser.feed("_call>\n") == []
    assert parser.finish() == []


def test_stream_gives_back_a_marker_that_was_not_one():
    parser = QWEN.stream_parser()
    assert parser.feed("a <tool") == [ContentDelta("a")]
    assert parser.feed("box> b") == [ContentDelta(" <toolbox> b")]
    assert parser.finish() == []


def test_llama3_stream_waits_for_the_json_at_the_start():
    parser = LLAMA.stream_parser()
    assert parser.feed('{"name": "a", "parameters": {"x"') == []
    [delta] = parser.feed(": 1}}")
    assert (delta.call.name, delta.call.arguments) == ("a", '{"x": 1}')
    parser = LLAMA.stream_parser()
    assert parser.feed("Hi <|py") == [ContentDelta("Hi")]
    assert parser.feed("thon_tag|>") == []


def test_openai_delta_shape():
    [delta] = [e for e in QWEN.stream_parser().feed(WEATHER) if isinstance(e, ToolCallDelta)]
    shaped = delta.to_openai()
    assert re.fullmatch(r"call_[0-9a-f]{24}", shaped["id"])
    assert shaped == {"index": 0, "id": shaped["id"], "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}
    _, [call] = QWEN.parse(WEATHER)
    assert call.to_openai()["function"] == shaped["function"] and call.id != delta.call.id


def test_unknown_format():
    assert tool_call_format("hermes").name == "qwen25"
    with pytest.raises(ValueError, match="llama3"):
        tool_call_format("mistral")


# --- grammars -------------------------------------------------------------------------

def function(name: str, parameters: dict | None = None) -> dict:
    spec = {"name": name, "description": f"the {name} function"}
    if parameters is not None:
        spec["parameters"] = parameters
    return {"type": "function", "function": spec}


TOOLS = [
    function("get_weather", {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}),
    function("get_time"),  # no parameters: any object
    function("convert", {"type": "object", "properties": {"to": {"$ref": "#/$defs/unit"}}, "required": ["to"],
                         "$defs": {"unit": {"enum": ["km", "mi"]}}}),
]
NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def accepts(default_tokenizer, default_lltokenizer):
    """accepts(grammar, text): does llguidance let the default model write exactly `text`?"""
    import llguidance

    tokenizer, ll_tokenizer = default_tokenizer, default_lltokenizer

    def check(grammar: str, text: str) -> bool:
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
        consumed = matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
        return bool(consumed) and not matcher.is_error() and matcher.is_accepting()

    return check


def test_qwen25_required_grammar(accepts):
    grammar = QWEN.grammar(TOOLS, "required")
    weather = qwen_call("get_weather", '{"city": "Paris", "unit": "c"}')
    valid = [weather, qwen_call("get_time", "{}"), qwen_call("get_time", '{"zone": "UTC"}'),
             qwen_call("convert", '{"to": "km"}'), weather + "\n" + qwen_call("get_time", "{}")]
    for text in valid:
        assert accepts(grammar, text), text
        assert QWEN.parse(text)[0] is None and QWEN.parse(text)[1]  # what the grammar allows parses as calls
    invalid = [
        qwen_call("get_wether", '{"city": "Paris"}'),  # no such function
        '<tool_call>\n{"name": "get_weather"}\n</tool_call>',  # arguments missing
        qwen_call("get_weather", '{"unit": "c"}'),  # a required argument missing
        qwen_call("get_weather", '{"city": 3}'),  # wrong type
        qwen_call("get_weather", '{"city": "Paris", "unit": "k"}'),  # not in the enum
        qwen_call("convert", '{"to": "ft"}'),  # not in the $ref'd enum
        "Sure! " + weather,  # text instead of a call
        '<tool_call>\n{"name":"get_time", "arguments": {}}\n</tool_call>',  # not the grammar's spelling
        "",  # no call at all
    ]
    for text in invalid:
        assert not accepts(grammar, text), text


def test_qwen25_one_call_grammars(accepts):
    weather = qwen_call("get_weather", '{"city": "Paris"}')
    named = QWEN.grammar(TOOLS, NAMED_WEATHER)
    assert accepts(named, weather)
    assert not accepts(named, qwen_call("get_time", "{}"))
    assert not accepts(named, weather + "\n" + weather)
    single = QWEN.grammar(TOOLS, "required", parallel=False)
    assert accepts(single, qwen_call("get_time", "{}"))
    assert not accepts(single, weather + "\n" + weather)


def test_llama3_grammar(accepts):
    grammar = LLAMA.grammar(TOOLS, "required")
    two = llama_call("get_weather", '{"city": "Paris"}') + "; " + llama_call("get_time", "{}")
    assert accepts(grammar, two)
    assert calls_of(LLAMA.parse(two)[1]) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert not accepts(grammar, '{"name": "get_weather", "arguments": {"city": "Paris"}}')
    assert not accepts(grammar, llama_call("get_weather", '{"city": true}'))
    named = LLAMA.grammar(TOOLS, NAMED_WEATHER)
    assert accepts(named, llama_call("get_weather", '{"city": "Paris"}'))
    assert not accepts(named, llama_call("get_time", "{}"))


@pytest.mark.parametrize("choice", [None, "auto", "none"])
def test_no_grammar_when_the_model_may_answer_in_text(choice):
    assert QWEN.grammar(TOOLS, choice) is None
    assert LLAMA.grammar(TOOLS, choice) is None


@pytest.mark.parametrize("tools,choice,param", [
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    (TOOLS, "sometimes", "tool_choice"),
    ([], "required", "tool_choice"),
    ([{"type": "code_interpreter"}], "required", "tools[0].type"),
    ([function("")], "required", "tools[0].function.name"),
    ([function("a"), function("a")], "required", "tools[1].function.name"),
    ([function("a", ["not", "a", "schema"])], "required", "tools[0].function.parameters"),
])
def test_bad_tools_or_choice(tools, choice, param):
    with pytest.raises(ToolRequestError) as raised:
        QWEN.grammar(tools, choice)
    assert raised.value.param == param


def test_unenforceable_schema_names_the_tool_and_keyword():
    tools = [TOOLS[0], function("picky", {"type": "object", "properties": {"x": {"not": {"type": "null"}}}})]
    with pytest.raises(ToolGrammarError) as raised:
        QWEN.grammar(tools, "required")
    assert isinstance(raised.value, GrammarError)
    assert (raised.value.tool_index, raised.value.tool_name) == (1, "picky")
    assert "tools[1] (picky)" in str(raised.value) and "not" in str(raised.value)
    assert QWEN.grammar(tools, NAMED_WEATHER)  # the other tool alone is fine

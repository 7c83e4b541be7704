"""Tool calling on /v1/chat/completions through the official `openai` client, against a live
server on the default model (SmolLM2-135M-Instruct). Its template renders no tools, so the
server's Hermes fallback prompt (server/tools/prompting.py) shows them, and the qwen25 parser
reads the calls.

A 135M model's own choice between calling and answering is poor, so the round trips force
the call ("required" or named); "auto" is only checked to give a valid answer either way.
The schemas bound their strings and forbid extra keys, so that a forced call always fits in
max_tokens: a call cut off by the length limit is not a call.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import openai
import pytest
from server_fixtures import API_KEY, LiveServer, live_server  # noqa: F401 (fixture)

from eaglesrv.configs.server import TOOL_CALL_PARSERS
from eaglesrv.server.errors import APIError
from eaglesrv.server.tools import FORMATS
from eaglesrv.server.tools.responses import prepare_chat_tools

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 64


def _function(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


WEATHER = _function("get_weather", "The current weather in a city",
                    {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                    ["city"])
TIME = _function("get_time", "The time now in a timezone", {"timezone": {"type": "string", "maxLength": 20}},
                 ["timezone"])
TOOLS = [WEATHER, TIME]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED_TIME = {"type": "function", "function": {"name": "get_time"}}


def run_tool(name: str, arguments: dict) -> str:
    """The tools themselves: what the client runs when the model calls one."""
    if name == "get_weather":
        return json.dumps({"city": arguments["city"], "temperature": 18, "unit": arguments.get("unit", "celsius")})
    return json.dumps({"timezone": arguments["timezone"], "time": "14:05"})


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=180)


def create(client: openai.OpenAI, **kwargs):
    return client.chat.completions.create(**{"model": MODEL, "messages": QUESTION, "tools": TOOLS,
                                             "max_tokens": MAX_TOKENS, **kwargs})


def streamed(stream) -> dict[int, dict]:
    """Each choice's content, calls (assembled from their deltas) and finish_reason."""
    choices: dict[int, dict] = {}
    for chunk in stream:
        for c in chunk.choices:
            got = choices.setdefault(c.index, {"content": "", "calls": {}, "finish_reason": None})
            got["content"] += c.delta.content or ""
            for delta in c.delta.tool_calls or []:
                call = got["calls"].setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            got["finish_reason"] = c.finish_reason or got["finish_reason"]
    for got in choices.values():
        got["calls"] = [got["calls"][i] for i in sorted(got["calls"])]
    return choices


def whole(response) -> dict[int, dict]:
    """streamed()'s shape for a whole response."""
    return {c.index: {"content": c.message.content or "", "finish_reason": c.finish_reason,
                      "calls": [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
                                for t in c.message.tool_calls or []]}
            for c in response.choices}


def ask(client: openai.OpenAI, stream: bool, **kwargs) -> dict[int, dict]:
    return streamed(create(client, stream=True, **kwargs)) if stream else whole(create(client, **kwargs))


def check_calls(calls: list[dict], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call["id"].startswith("call_")
        assert call["name"] in names
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])


def test_parser_names_are_the_formats():
    assert set(TOOL_CALL_PARSERS) == set(FORMATS)


# ---- the shaping alone, on a stand-in tokenizer (no server) ---------------------------------
PLAIN = SimpleNamespace(chat_template="{% for m in messages %}{{ m.content }}{% endfor %}", all_special_tokens=[])
TWO_CALLS = ('Sure.\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')


def prepare(tool_choice="auto", parallel=True, tokenizer=PLAIN, format_name="qwen25", other_grammar=None):
    return prepare_chat_tools(tokenizer, QUESTION, TOOLS, tool_choice, parallel, format_name, other_grammar)


def test_whole_message_calls_and_finish_reason():
    message, reason = prepare().message(TWO_CALLS, "stop")
    assert reason == "tool_calls" and message["content"] == "Sure."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_time", {"timezone": "UTC"}), ("get_weather", {"city": "Oslo"})]
    assert "index" not in message["tool_calls"][0]
    message, reason = prepare(parallel=False).message(TWO_CALLS, "length")
    assert reason == "length" and [c["function"]["name"] for c in message["tool_calls"]] == ["get_time"]
    assert prepare().message("  no calls here ", "stop") == ({"role": "assistant", "content": "no calls here"},
                                                           "stop")


def test_stream_deltas_join_to_the_whole_message():
    stream = prepare(parallel=False).choice_stream()
    deltas = [stream.delta(TWO_CALLS[i:i + 7], finished=i + 7 >= len(TWO_CALLS)) for i in range(0, len(TWO_CALLS), 7)]
    assert "".join(d.get("content", "") for d in deltas) == "Sure."
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_time")]  # one: parallel off
    assert stream.finish_reason("stop") == "tool_calls" and stream.finish_reason("length") == "length"


def test_a_forced_call_cut_off_by_max_tokens_is_dropped():
    """Under "required" the grammar allows calls only: text that is not a whole call is the
    unfinished last one, never content (whole and streamed alike)."""
    cut = TWO_CALLS.removeprefix("Sure.\n") + '\n<tool_call>\n{"name": "get_ti'
    message, reason = prepare("required").message(cut, "length")
    assert reason == "length" and message["content"] is None and len(message["tool_calls"]) == 2
    stream = prepare("required").choice_stream()
    deltas = [stream.delta(cut[i:i + 5], finished=i + 5 >= len(cut)) for i in range(0, len(cut), 5)]
    assert not any("content" in d for d in deltas) and sum(len(d.get("tool_calls", [])) for d in deltas) == 2


def test_what_tool_choice_changes():
    none = prepare("none")
    assert none.format is None and none.grammar is None and none.template_tools is None
    assert "get_weather" not in json.dumps(none.messages)  # no tools in the prompt
    assert prepare("auto").grammar is None and "get_weather" in json.dumps(prepare("auto").messages)
    assert "get_time" in prepare(NAMED_TIME).grammar
    constrained = prepare("auto", other_grammar="start: /x/")
    assert constrained.format is None and constrained.grammar == "start: /x/"  # all content
    with pytest.raises(APIError) as refused:
        prepare("required", other_grammar="start: /x/")
    assert refused.value.param == "tool_choice"


def test_special_markers_are_kept():
    llama = SimpleNamespace(chat_template="{{ tools }}<|python_tag|>", all_special_tokens=["<|python_tag|>"])
    assert prepare(tokenizer=llama, format_name="llama3").keep_special_tokens
    assert not prepare(tokenizer=llama, format_name="llama3", tool_choice="none").keep_special_tokens
    assert not prepare().keep_special_tokens  # <tool_call> is plain text to SmolLM2's tokenizer


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("tool_choice,names", [("required", {"get_weather", "get_time"}), (NAMED_TIME, {"get_time"})],
                         ids=["required", "named"])
def test_forced_calls_are_valid(client, tool_choice, names, stream):
    kwargs = dict(tool_choice=tool_choice, parallel_tool_calls=False, n=2, temperature=1.0, seed=11)
    choices = ask(client, stream, **kwargs)
    assert sorted(choices) == [0, 1]
    for got in choices.values():
        assert got["finish_reason"] == "tool_calls", got
        assert len(got["calls"]) == 1  # parallel_tool_calls false: one call
        check_calls(got["calls"], names)
        assert got["content"] == ""


@pytest.mark.parametrize("tool_choice", ["required", NAMED_TIME], ids=["required", "named"])
def test_stream_equals_whole_at_temperature_0(client, tool_choice):
    # Parallel calls allowed: under "required" the model writes several, and the last is cut off.
    kwargs = dict(tool_choice=tool_choice, temperature=0, seed=5, max_tokens=48)
    want, got = ask(client, False, **kwargs)[0], ask(client, True, **kwargs)[0]
    check_calls(want["calls"], {"get_weather", "get_time"})
    for call in want["calls"] + got["calls"]:
        del call["id"]  # each call's own
    assert got == want


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_round_trip(client, stream):
    """Call a tool, run it, send the call and its result back, get the answer."""
    first = ask(client, stream, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                temperature=0)[0]
    assert first["finish_reason"] == "tool_calls" and first["content"] == ""
    check_calls(first["calls"], {"get_weather"})
    conversation = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}
        for call in first["calls"]]}]
    conversation += [{"role": "tool", "tool_call_id": call["id"],
                      "content": run_tool(call["name"], json.loads(call["arguments"]))} for call in first["calls"]]
    answer = ask(client, stream, messages=conversation, tool_choice="auto", temperature=0, max_tokens=24)[0]
    assert answer["finish_reason"] in ("stop", "length") and answer["calls"] == []
    assert isinstance(answer["content"], str) and answer["content"]


def test_auto_answers_or_calls_validly(client):
    # Nothing constrains the model under "auto": a call it writes is only parsed, not checked.
    for got in ask(client, False, tool_choice="auto", n=2, temperature=1.0, seed=3, max_tokens=32).values():
        if got["calls"]:
            assert got["finish_reason"] in ("tool_calls", "length")
            assert all(isinstance(json.loads(call["arguments"]), dict) for call in got["calls"])
        else:
            assert got["finish_reason"] in ("stop", "length") and got["content"]

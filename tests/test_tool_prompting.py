"""Rendering conversations with tools: the Hermes fallback on the default model's plain ChatML
template, and a tools-aware template that gets `tools=` and dict arguments."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest

from eaglesrv.server.tools import (
    ToolRequestError,
    default_format,
    render_prompt,
    template_inputs,
    template_renders_tools,
    tool_call_format,
)

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]

# A conversation after one round of two calls.
HISTORY = [
    {"role": "user", "content": "Weather in Paris and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
    {"role": "user", "content": "Thanks! And tomorrow?"},
]

# A small template that renders tools the way Hugging Face's tool templates do (newlines are
# expressions: Hugging Face renders with trim_blocks, which drops a newline after a block tag).
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system{{ '\\n' }}Tools:{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}"
    "{% endfor %}<|im_end|>{{ '\\n' }}{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role + '\\n' }}"
    "{%- if message.tool_calls %}{% for call in message.tool_calls %}{{ '\\n' }}<tool_call>{{ '\\n' }}"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}{{ "\\n" }}</tool_call>'
    "{% endfor %}{% else %}{{ message.content }}{% endif %}<|im_end|>{{ '\\n' }}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(default_tokenizer):
    return default_tokenizer


@pytest.fixture(scope="module")
def tools_tokenizer(tokenizer):
    aware = copy.copy(tokenizer)
    aware.chat_template = TOOLS_TEMPLATE
    assert tokenizer.chat_template != TOOLS_TEMPLATE  # the shared tokenizer is untouched
    return aware


def test_default_model_falls_back_to_hermes(tokenizer):
    assert not template_renders_tools(tokenizer)
    assert default_format(tokenizer) == "qwen25"


@pytest.mark.parametrize("source,renders,fmt", [
    (TOOLS_TEMPLATE, True, "qwen25"),
    ("{% for t in tools %}{{ t | tojson }}{% endfor %}<|python_tag|>", True, "llama3"),
    ('{% for t in tools %}{{ t | tojson }}{% endfor %}{{ \'"parameters": \' }}', True, "llama3"),
    ('{% if tools %}<tool_call>"parameters"{% endif %}', True, "qwen25"),
    ("{% for t in tools %}{{ t | tojson }}{% endfor %}", True, "qwen25"),
    ("{% for m in messages %}{{ m.content }}{% endfor %} <|python_tag|>", False, "qwen25"),
    ({"default": "{{ messages }}", "tool_use": "{{ tools }}"}, True, "qwen25"),
])
def test_template_detection(source, renders, fmt):
    holder = SimpleNamespace(chat_template=source)
    assert template_renders_tools(holder) is renders
    assert default_format(holder) == fmt


def test_fallback_puts_the_tools_in_a_system_prompt(tokenizer):
    prompt = render_prompt(tokenizer, [{"role": "user", "content": "Weather in Paris?"}], TOOLS)
    assert prompt.startswith("<|im_start|>system\n# Tools\n")
    assert "SmolLM" not in prompt  # the template's default system prompt gives way to ours
    assert f"<tools>\n{json.dumps(WEATHER_TOOL)}\n{json.dumps(TIME_TOOL)}\n</tools>" in prompt
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in prompt
    assert prompt.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")


def test_fallback_merges_into_the_system_message(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = render_prompt(tokenizer, messages, TOOLS)
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert prompt.count("<|im_start|>system") == 1


def test_fallback_renders_calls_and_results(tokenizer):
    prompt = render_prompt(tokenizer, HISTORY, TOOLS)
    calls = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert f"<|im_start|>assistant\n{calls}<|im_end|>\n" in prompt
    results = "<tool_response>\n18 C, sunny\n</tool_response>\n<tool_response>\n14:05\n</tool_response>"
    assert f"<|im_start|>user\n{results}<|im_end|>\n<|im_start|>user\nThanks! And tomorrow?" in prompt
    assert "<|im_start|>tool" not in prompt
    # what the prompt shows as a call is what the qwen25 parser reads as one
    content, parsed = tool_call_format("qwen25").parse(calls)
    assert content is None
    assert [(c.name, c.arguments) for c in parsed] == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]


def test_fallback_keeps_an_assistant_message_text_before_its_calls(tokenizer):
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Checking.", "tool_calls": HISTORY[1]["tool_calls"][1:]},
                {"role": "tool", "tool_call_id": "call_2", "content": "14:05"}]
    inputs = template_inputs(tokenizer, messages, TOOLS)
    assert inputs.tools is None and inputs.template_kwargs() == {}
    assert inputs.messages[2] == {"role": "assistant", "content": 'Checking.\n<tool_call>\n'
                                  '{"name": "get_time", "arguments": {}}\n</tool_call>'}


def test_tool_choice_none_leaves_the_tools_out(tokenizer, tools_tokenizer):
    prompt = render_prompt(tokenizer, HISTORY, TOOLS, tool_choice="none")
    assert "<tools>" not in prompt and "# Tools" not in prompt
    assert '"name": "get_weather"' in prompt  # the calls already made are still shown
    assert "Tools:" not in render_prompt(tools_tokenizer, HISTORY, TOOLS, tool_choice="none")


def test_named_tool_choice_shows_only_that_tool(tokenizer):
    choice = {"type": "function", "function": {"name": "get_time"}}
    prompt = render_prompt(tokenizer, [{"role": "user", "content": "Time?"}], TOOLS, tool_choice=choice)
    assert json.dumps(TIME_TOOL) in prompt and "get_weather" not in prompt


def test_tools_aware_template_gets_tools_and_dict_arguments(tools_tokenizer):
    assert template_renders_tools(tools_tokenizer)
    inputs = template_inputs(tools_tokenizer, HISTORY, TOOLS, tool_choice="auto")
    assert inputs.tools == TOOLS and inputs.template_kwargs() == {"tools": TOOLS}
    assistant = inputs.messages[1]
    assert assistant["content"] == ""
    assert assistant["tool_calls"][0] == {"id": "call_1", "type": "function",
                                          "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert inputs.messages[2] == HISTORY[2]  # tool results pass through
    assert HISTORY[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # the input is not changed

    prompt = render_prompt(tools_tokenizer, HISTORY, TOOLS)
    assert prompt.startswith(f"<|im_start|>system\nTools:\n{json.dumps(WEATHER_TOOL)}\n")
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt  # an object, not a JSON string
    assert "<|im_start|>tool\n18 C, sunny<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_template_kwargs_reach_the_template(tools_tokenizer):
    template = "{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}{{ tools | length }}"
    prompt = render_prompt(tools_tokenizer, [{"role": "user", "content": "x"}], TOOLS, chat_template=template,
                           greeting="hello ")
    assert prompt == "hello x2"


@pytest.mark.parametrize("arguments", ["{not json", "[1, 2]", '"text"'])
def test_bad_arguments_in_history_name_the_field(tokenizer, tools_tokenizer, arguments):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": arguments}}]}]
    for tok in (tokenizer, tools_tokenizer):
        with pytest.raises(ToolRequestError) as raised:
            template_inputs(tok, messages, TOOLS)
        assert raised.value.param == "messages[1].tool_calls[0].function.arguments"


def test_content_parts_become_text(tokenizer):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]
    assert template_inputs(tokenizer, messages).messages == [{"role": "user", "content": "Hello there"}]


@pytest.mark.parametrize("tools,choice,param", [
    ([{"type": "function"}], "auto", "tools[0].function"),
    (TOOLS, {"type": "function", "function": {"name": "get_news"}}, "tool_choice"),
])
def test_bad_tools_are_refused_before_rendering(tokenizer, tools, choice, param):
    with pytest.raises(ToolRequestError) as raised:
        template_inputs(tokenizer, [{"role": "user", "content": "Hi"}], tools, choice)
    assert raised.value.param == param

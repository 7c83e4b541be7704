"""Rendering a conversation with tools through the model's own chat template.

A template that renders tools (Qwen2.5, Llama 3.1, Hermes...) gets them as `tools=` and the
messages in Hugging Face's shapes. A template that does not (SmolLM2's plain ChatML loop)
gets the Hermes convention written into the messages instead: the tools in the system
prompt, calls as <tool_call> blocks, results as <tool_response> blocks in a user turn, so the
qwen25 parser reads what the model answers.

With tool_choice "none" the tools are left out of the prompt (as SGLang does, and vLLM with
--exclude-tools-when-tool-choice-none): a model shown tools it may not call tends to write
calls anyway, which would reach the client as text. For a named tool_choice only that
function is shown (SGLang too): the grammar forces it, and the others would only cost prompt.
Calls and results already in the conversation are rendered either way.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from eaglesrv.server.tools.calls import ToolRequestError, forced_functions, function_specs
from eaglesrv.server.tools.formats import HermesFormat, Llama3Format

HERMES_FORMAT = HermesFormat.name  # the format of the fallback prompt


def template_source(tokenizer) -> str:
    """The chat template's text (all of them, for tokenizers that keep several by name)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return "\n".join(template.values()) if isinstance(template, dict) else template


def template_renders_tools(tokenizer) -> bool:
    return re.search(r"\btools\b", template_source(tokenizer)) is not None


def default_format(tokenizer) -> str:
    """The tool-call format the model was trained on, judged from its template: the Hermes
    format when it writes <tool_call> (checked first: Hermes templates for Llama models name
    "parameters" too), llama3 when it knows <|python_tag|> or "parameters", else the Hermes
    format of the fallback prompt."""
    if not template_renders_tools(tokenizer):
        return HERMES_FORMAT
    source = template_source(tokenizer)
    if HermesFormat.OPEN in source:
        return HERMES_FORMAT
    if Llama3Format.PYTHON_TAG in source or '"parameters"' in source:
        return Llama3Format.name
    return HERMES_FORMAT


def tools_for_prompt(tools: list[dict[str, Any]] | None, tool_choice: Any) -> list[dict[str, Any]] | None:
    """The tools to show the model under tool_choice (see the module's docstring); both already checked."""
    if not tools or tool_choice == "none":
        return None
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        return [tool for tool in tools if (tool.get("function") or {}).get("name") == name] or None
    return tools


@dataclass(frozen=True)
class TemplateInputs:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None  # for apply_chat_template(tools=...); None: not passed

    def template_kwargs(self) -> dict[str, Any]:
        return {"tools": self.tools} if self.tools else {}


def template_inputs(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    tool_choice: Any = None) -> TemplateInputs:
    """What to hand apply_chat_template for OpenAI `messages` (roles system, user, assistant
    with optional tool_calls, tool; "developer" already mapped to system) and `tools`.
    ToolRequestError (param: the field) for malformed tools, tool_choice or tool calls."""
    forced_functions(function_specs(tools), tool_choice)  # checks both before they are used
    shown = tools_for_prompt(tools, tool_choice)
    if template_renders_tools(tokenizer):
        return TemplateInputs([_hf_message(m, i) for i, m in enumerate(messages)], shown)
    return TemplateInputs(_hermes_messages(messages, shown), None)


def render_prompt(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                  tool_choice: Any = None, **template_kwargs: Any) -> str:
    """The prompt text, ready for the assistant's answer."""
    inputs = template_inputs(tokenizer, messages, tools, tool_choice)
    return tokenizer.apply_chat_template(inputs.messages, tokenize=False, add_generation_prompt=True,
                                         **inputs.template_kwargs(), **template_kwargs)


def _text(content: Any) -> str:
    """A message's content as text: a string, None, or OpenAI's list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def _arguments(call: Any, where: str) -> tuple[str, dict[str, Any]]:
    """(name, arguments as a dict) of an assistant message's tool_calls entry."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ToolRequestError(f"{where}.function must be an object with a name", param=f"{where}.function")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            arguments = None
    if not isinstance(arguments, dict):
        raise ToolRequestError(f"{where}.function.arguments must be a JSON object's text",
                               param=f"{where}.function.arguments")
    return function["name"], arguments


def _hf_message(message: dict[str, Any], index: int) -> dict[str, Any]:
    """A message as Hugging Face templates read it: content a string, tool-call arguments dicts."""
    converted = {**message, "content": _text(message.get("content"))}
    if message.get("tool_calls"):
        calls = []
        for j, call in enumerate(message["tool_calls"]):
            name, arguments = _arguments(call, f"messages[{index}].tool_calls[{j}]")
            calls.append({**call, "type": "function", "function": {"name": name, "arguments": arguments}})
        converted["tool_calls"] = calls
    return converted


def _tools_section(tools: list[dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return ("# Tools\n\n"
            "You can call functions to help with the user's request. Each function's signature is a JSON "
            "schema; they are listed between <tools> and </tools>:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "To call a function, answer with its name and arguments as a JSON object between <tool_call> and "
            "</tool_call>, one block for each call:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n'
            "The results come back to you between <tool_response> and </tool_response>.")


def _call_block(name: str, arguments: dict[str, Any]) -> str:
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{HermesFormat.OPEN}\n{call}\n{HermesFormat.CLOSE}"


def _hermes_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The conversation in the Hermes convention, with roles and contents a plain template renders."""
    rendered: list[dict[str, Any]] = []
    previous_role = None
    for i, message in enumerate(messages):
        role, content = message.get("role"), _text(message.get("content"))
        if role == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if previous_role == "tool":  # the results of one turn's calls: one user turn
                rendered[-1]["content"] += "\n" + response
            else:
                rendered.append({"role": "user", "content": response})
        elif role == "assistant" and message.get("tool_calls"):
            blocks = [_call_block(*_arguments(call, f"messages[{i}].tool_calls[{j}]"))
                      for j, call in enumerate(message["tool_calls"])]
            rendered.append({"role": role, "content": "\n".join(([content] if content else []) + blocks)})
        else:
            rendered.append({"role": role, "content": content})
        previous_role = role
    if tools:
        section = _tools_section(tools)
        if rendered and rendered[0]["role"] == "system":
            rendered[0]["content"] = f"{rendered[0]['content']}\n\n{section}" if rendered[0]["content"] else section
        else:
            rendered.insert(0, {"role": "system", "content": section})
    return rendered

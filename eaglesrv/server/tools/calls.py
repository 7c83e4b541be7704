"""What tool calling is made of: the functions a request offers, which of them tool_choice
forces, and the calls and stream events parsed from a completion (OpenAI's shapes)."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}  # a function declared without parameters


class ToolRequestError(ValueError):
    """A request's tools, tool_choice or tool messages are malformed; `param` names the field (for a 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def new_call_id() -> str:
    """An id in OpenAI's form: call_ and 24 characters."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        """The call as a message's tool_calls entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """Call `index` of the completion, complete: the parsers emit a call once its JSON has closed,
    so a call is one delta (name and all its arguments), never fragments."""

    index: int
    call: ToolCall

    def to_openai(self) -> dict[str, Any]:
        """The delta's tool_calls entry in a streamed chunk."""
        return {"index": self.index, **self.call.to_openai()}


StreamEvent = ContentDelta | ToolCallDelta


@dataclass(frozen=True)
class FunctionSpec:
    index: int  # its place in the request's tools, for error messages
    name: str
    parameters: dict[str, Any]  # the JSON schema of its arguments


def function_specs(tools: list[Any] | None) -> list[FunctionSpec]:
    """The request's tools (OpenAI's [{"type": "function", "function": {...}}]) checked and read."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolRequestError("tools must be a list", param="tools")
    specs: list[FunctionSpec] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolRequestError(f"{where}: only tools of type 'function' are supported", param=f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ToolRequestError(f"{where}.function must be an object", param=f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ToolRequestError(f"{where}.function.name must be a non-empty string", param=f"{where}.function.name")
        if any(spec.name == name for spec in specs):
            raise ToolRequestError(f"{where}: two functions are named {name!r}", param=f"{where}.function.name")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = EMPTY_PARAMETERS
        if not isinstance(parameters, dict):
            raise ToolRequestError(f"{where}.function.parameters must be a JSON schema object",
                                   param=f"{where}.function.parameters")
        specs.append(FunctionSpec(i, name, parameters))
    return specs


def forced_functions(specs: list[FunctionSpec], tool_choice: Any) -> list[FunctionSpec] | None:
    """The functions tool_choice forces the model to call from, or None when it may answer in
    text ("auto", "none", unset)."""
    if tool_choice in (None, "auto", "none"):
        return None
    if tool_choice == "required":
        if not specs:
            raise ToolRequestError("tool_choice 'required' needs tools", param="tool_choice")
        return specs
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise ToolRequestError("tool_choice.function.name must be a string", param="tool_choice")
        chosen = [spec for spec in specs if spec.name == name]
        if not chosen:
            raise ToolRequestError(f"tool_choice names the function {name!r}, which is not in tools",
                                   param="tool_choice")
        return chosen
    raise ToolRequestError("tool_choice must be 'auto', 'none', 'required' or "
                           '{"type": "function", "function": {"name": ...}}', param="tool_choice")


def call_from_json(value: Any, arguments_keys: tuple[str, ...]) -> ToolCall | None:
    """A call from a decoded {"name": ..., <arguments key>: {...}} object, or None if it is not
    one. Arguments may be missing (no arguments) or an object's JSON text (some models write that)."""
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return None
    key = next((k for k in arguments_keys if k in value), None)
    arguments = {} if key is None else value[key]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))

"""Tool-call formats: how a model writes calls in its text, how to read them back (whole or
streamed), and the grammar that makes it write valid calls when tool_choice forces a call.

Named like SGLang's --tool-call-parser:
  qwen25 (alias hermes)  <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, one block
                         per call, anywhere in the text (Qwen2/2.5, Hermes templates)
  llama3                 {"name": ..., "parameters": {...}} at the start of the text or after
                         <|python_tag|>, several separated by ";" (Llama 3.1-3.3 JSON tool calls)

Text that looks like a call but is not one (JSON that does not parse, no "name") stays
content: no call is ever invented from it.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any

from eaglesrv.grammar import JSON_SEPARATORS, GrammarError, lark_grammar
from eaglesrv.server.tools.calls import (
    ContentDelta,
    FunctionSpec,
    ToolCall,
    ToolCallDelta,
    call_from_json,
    forced_functions,
    function_specs,
)
from eaglesrv.server.tools.scanning import PENDING, JsonObjectReader, ToolCallStreamParser

# As json_schema_grammar: one spelling of each document, no free whitespace to wander into.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": JSON_SEPARATORS[0],
                 "key_separator": JSON_SEPARATORS[1]}


class ToolGrammarError(GrammarError):
    """llguidance cannot enforce one function's parameters schema; the message names the tool."""

    def __init__(self, spec: FunctionSpec, reason: str) -> None:
        super().__init__(f"tools[{spec.index}] ({spec.name}): {reason}")
        self.tool_index = spec.index
        self.tool_name = spec.name


class ToolCallFormat(ABC):
    name: str
    arguments_key: str  # what the format calls the arguments; the parsers accept either name
    call_separator: str  # between two calls, as the grammar writes them

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole completion's content (text outside the calls, stripped; None if empty) and calls."""
        parser = self.stream_parser()
        events = parser.feed(text) + parser.finish()
        content = "".join(e.text for e in events if isinstance(e, ContentDelta)).strip()
        return content or None, [e.call for e in events if isinstance(e, ToolCallDelta)]

    @abstractmethod
    def stream_parser(self) -> ToolCallStreamParser:
        """A parser for one completion's deltas."""

    @abstractmethod
    def _call_text(self, name: str) -> tuple[str, str]:
        """The text a call of `name` has before and after its arguments object."""

    def grammar(self, tools: list[Any] | None, tool_choice: Any, parallel: bool = True) -> str | None:
        """The llguidance grammar of the calls tool_choice forces ("required": one call or, with
        `parallel`, several of any of the tools; a named function: exactly one call of it), or
        None when the model may answer in text. GrammarError (ToolGrammarError naming the tool)
        when a parameters schema cannot be enforced; ToolRequestError for bad tools/tool_choice."""
        forced = forced_functions(function_specs(tools), tool_choice)
        if forced is None:
            return None
        rules = [self._call_rule(spec) for spec in forced]
        several = parallel and tool_choice == "required"
        lines = [f"start: call ({_lark_string(self.call_separator)} call)*" if several else "start: call",
                 "call: " + " | ".join(f"call_{i}" for i in range(len(rules)))]
        lines += [f"call_{i}: {rule}" for i, rule in enumerate(rules)]
        try:
            return lark_grammar("\n".join(lines))
        except GrammarError as exc:
            for spec, rule in zip(forced, rules):
                try:
                    lark_grammar(f"start: {rule}")
                except GrammarError as own:
                    raise ToolGrammarError(spec, str(own)) from None
            raise exc

    def _call_rule(self, spec: FunctionSpec) -> str:
        # The arguments are their own %json root (not a "properties" entry of a call schema) so
        # that the schema's "$ref": "#/$defs/..." resolve against the parameters, as written.
        before, after = self._call_text(spec.name)
        schema = {**spec.parameters, "x-guidance": _JSON_OPTIONS}
        return f"{_lark_string(before)} %json{json.dumps(schema)} {_lark_string(after)}"

    def _call_head(self, name: str) -> str:
        """{"name": <name>, "<arguments key>": , in the grammar's spelling."""
        item, key = JSON_SEPARATORS
        return f'{{"name"{key}{json.dumps(name, ensure_ascii=False)}{item}"{self.arguments_key}"{key}'


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # Lark's string literals take JSON's escapes


class HermesFormat(ToolCallFormat):
    name = "qwen25"
    arguments_key = "arguments"
    call_separator = "\n"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def stream_parser(self) -> ToolCallStreamParser:
        return _HermesStreamParser()

    def _call_text(self, name: str) -> tuple[str, str]:
        return f"{self.OPEN}\n{self._call_head(name)}", f"}}\n{self.CLOSE}"


class _HermesStreamParser(ToolCallStreamParser):
    """States: text (looking for <tool_call>), call (reading the JSON after it), after (an
    optional </tool_call> after the call's JSON)."""

    def __init__(self) -> None:
        super().__init__()
        self._state = "text"
        self._reader = JsonObjectReader()

    def _step(self, final: bool) -> bool:
        open_, close = HermesFormat.OPEN, HermesFormat.CLOSE
        if self._state == "text":
            if not self._content_until(open_, final):
                return False
            self._state, self._reader = "call", JsonObjectReader()
            return True
        if self._state == "call":
            read = self._reader.read(self._buffer, final)
            if read == PENDING:
                return False
            call = call_from_json(read[0], ("arguments", "parameters")) if isinstance(read, tuple) else None
            if call is None:  # not a call: the marker and what follows are content
                self._emit_content(open_)
            else:
                self._emit_call(call)
                self._buffer = self._buffer[read[1]:]
            self._state = "text" if call is None else "after"
            return True
        rest = self._buffer.lstrip()
        if rest.startswith(close):
            self._buffer = rest[len(close):]
        elif close.startswith(rest) and not final:
            return False  # whitespace or part of </tool_call> so far
        self._state = "text"  # anything else after the call (whitespace included) is content
        return True


class Llama3Format(ToolCallFormat):
    name = "llama3"
    arguments_key = "parameters"
    call_separator = "; "
    PYTHON_TAG = "<|python_tag|>"

    def stream_parser(self) -> ToolCallStreamParser:
        return _Llama3StreamParser()

    def _call_text(self, name: str) -> tuple[str, str]:
        return self._call_head(name), "}"


class _Llama3StreamParser(ToolCallStreamParser):
    """States: start (a call may open the text), text (looking for <|python_tag|>), call
    (reading a call's JSON), after (a ";" or another call may follow)."""

    def __init__(self) -> None:
        super().__init__()
        self._state = "start"
        self._reader = JsonObjectReader()
        self._opener = ""  # what led to the call being read: given back as content if it is none

    def _step(self, final: bool) -> bool:
        tag = Llama3Format.PYTHON_TAG
        if self._state == "text":
            if not self._content_until(tag, final):
                return False
            self._expect_call(tag)
            return True
        if self._state == "call":
            read = self._reader.read(self._buffer, final)
            if read == PENDING:
                return False
            call = call_from_json(read[0], ("parameters", "arguments")) if isinstance(read, tuple) else None
            if call is None:
                self._emit_content(self._opener)
                self._state = "text"
            else:
                self._emit_call(call)
                self._buffer = self._buffer[read[1]:]
                self._state = "after"
            return True
        rest = self._buffer.lstrip()
        if not rest and not final:
            return False
        if self._state == "start" and rest.startswith("{"):
            self._expect_call("")
        elif self._state == "after" and rest[:1] in (";", "{"):
            self._buffer = rest[1:] if rest[0] == ";" else rest
            self._expect_call(rest[0] if rest[0] == ";" else "")
        else:
            self._state = "text"
        return True

    def _expect_call(self, opener: str) -> None:
        self._state, self._reader, self._opener = "call", JsonObjectReader(), opener


FORMATS: dict[str, type[ToolCallFormat]] = {"qwen25": HermesFormat, "hermes": HermesFormat, "llama3": Llama3Format}


def tool_call_format(name: str) -> ToolCallFormat:
    """The format named as SGLang's --tool-call-parser names it."""
    try:
        return FORMATS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(FORMATS))}") from None

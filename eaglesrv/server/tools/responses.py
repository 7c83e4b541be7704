"""Tool calling in one /v1/chat/completions request: what it changes before generation (the
prompt, the grammar, the detokenizing) and how it shapes the answer, whole or streamed.

The calls are read out of each choice's text by the format's parser: the whole text for a
whole answer, the deltas one by one for a stream. Both parse the same way (scanning.py), so
a stream's content and calls, joined, equal the whole answer's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from eaglesrv.grammar import GrammarError
from eaglesrv.server.errors import bad_request
from eaglesrv.server.tools.calls import ContentDelta, ToolCall, ToolCallDelta, ToolRequestError
from eaglesrv.server.tools.formats import (
    HermesFormat,
    Llama3Format,
    ToolCallFormat,
    ToolGrammarError,
    tool_call_format,
)
from eaglesrv.server.tools.prompting import template_inputs

# The text each format's parser looks for. A tokenizer may make one a special token (Llama 3's
# <|python_tag|>; <tool_call> in some Hermes fine-tunes), which skip_special_tokens would drop.
_MARKERS: dict[type, tuple[str, ...]] = {HermesFormat: (HermesFormat.OPEN, HermesFormat.CLOSE),
                                         Llama3Format: (Llama3Format.PYTHON_TAG,)}


@dataclass(frozen=True)
class ChatTools:
    messages: list[dict[str, Any]]  # for apply_chat_template
    template_tools: list[dict[str, Any]] | None  # its tools=, for a template that renders them
    grammar: str | None  # the request's grammar: the forced calls', else the request's own constraint
    format: ToolCallFormat | None  # reads calls out of the completion; None: the completion is all content
    parallel: bool  # parallel_tool_calls: false keeps the first call only
    keep_special_tokens: bool  # the format's markers are special tokens: detokenize with them
    # "required" or a named function: the grammar allows calls only, so text outside a whole
    # call is one that max_tokens cut off (the default model, left to write parallel calls
    # under "required", writes them until the limit): it is dropped, not returned as content.
    forced: bool = False

    @property
    def prompt_chars(self) -> int:
        """The characters the template gets (a bound on its work, checked before tokenizing)."""
        chars = sum(len(m.get("content") or "") for m in self.messages)
        chars += sum(len(json.dumps(m["tool_calls"], default=str)) for m in self.messages if m.get("tool_calls"))
        return chars + len(json.dumps(self.template_tools or []))

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole choice's message and finish_reason."""
        if self.format is None:
            return {"role": "assistant", "content": text}, finish_reason
        content, calls = self.format.parse(text)
        calls = calls if self.parallel else calls[:1]
        if self.forced:
            content = None
        if not calls:
            return {"role": "assistant", "content": content or ""}, finish_reason
        return ({"role": "assistant", "content": content, "tool_calls": [call.to_openai() for call in calls]},
                _finish_reason(finish_reason, calls))

    def choice_stream(self) -> ChoiceToolStream:
        return ChoiceToolStream(self)


class ChoiceToolStream:
    """One streamed choice: its text deltas as chunk deltas with content and complete calls."""

    def __init__(self, tools: ChatTools) -> None:
        self._parser = tools.format.stream_parser() if tools.format is not None else None
        self._parallel = tools.parallel
        self._forced = tools.forced
        self._calls: list[ToolCall] = []

    def delta(self, text: str, finished: bool) -> dict[str, Any]:
        """The chunk's delta for `text` (the choice's next piece; `finished`: its last): {} while
        the parser holds the text back (a possible call marker, a call's unfinished JSON)."""
        if self._parser is None:
            return {"content": text} if text else {}
        events = self._parser.feed(text) + (self._parser.finish() if finished else [])
        content = "" if self._forced else "".join(e.text for e in events if isinstance(e, ContentDelta))
        calls = [e for e in events if isinstance(e, ToolCallDelta) and (self._parallel or e.index == 0)]
        self._calls += [e.call for e in calls]
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [e.to_openai() for e in calls]
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        return _finish_reason(reason, self._calls)


def _finish_reason(reason: str | None, calls: list[ToolCall]) -> str | None:
    # OpenAI's "tool_calls" says the model stopped to have its calls run; a cut-off ("length") stays.
    return "tool_calls" if calls and reason == "stop" else reason


def prepare_chat_tools(tokenizer, messages: list[dict[str, Any]], tools: list[Any] | None, tool_choice: Any,
                       parallel: bool, format_name: str, other_grammar: str | None) -> ChatTools:
    """What a request's tools, tool_choice and history make of it; 400 naming the field for bad
    ones. `other_grammar`: the request's own constraint (response_format...), or None."""
    calling = bool(tools) and tool_choice != "none"
    fmt = tool_call_format(format_name) if calling else None
    try:
        inputs = template_inputs(tokenizer, messages, tools, tool_choice)  # checks tools and tool_choice
        grammar = fmt.grammar(tools, tool_choice, parallel) if fmt is not None else None
    except ToolRequestError as exc:
        raise bad_request(str(exc), param=exc.param) from None
    except ToolGrammarError as exc:
        raise bad_request(str(exc), param=f"tools[{exc.tool_index}].function.parameters") from None
    except GrammarError as exc:
        raise bad_request(f"tools: {exc}", param="tools") from None
    if grammar is not None and other_grammar is not None:
        raise bad_request("tool_choice forces a tool call, so the answer cannot also follow response_format or "
                          "another structured output constraint", param="tool_choice")
    if other_grammar is not None:
        fmt = None  # with "auto" the constraint shapes the whole completion: content, never calls
    return ChatTools(messages=inputs.messages, template_tools=inputs.tools, grammar=grammar or other_grammar,
                     format=fmt, parallel=parallel,
                     keep_special_tokens=fmt is not None and _markers_are_special(tokenizer, fmt),
                     forced=grammar is not None)


def _markers_are_special(tokenizer, fmt: ToolCallFormat) -> bool:
    special = set(getattr(tokenizer, "all_special_tokens", ()))
    special |= {token.content for token in getattr(tokenizer, "added_tokens_decoder", {}).values()
                if getattr(token, "special", False)}
    return any(marker in special for marker in _MARKERS.get(type(fmt), ()))

"""The machinery every tool-call format's stream parser shares.

A parser keeps the text it cannot decide on yet (a partial marker, an unfinished JSON object)
and decides each piece only once no later text can change the decision. A whole completion is
parsed by feeding it in one piece, so streamed and whole results agree by construction; the
tests check that any chunking gives the same result.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import Any

from eaglesrv.server.tools.calls import ContentDelta, StreamEvent, ToolCall, ToolCallDelta

PENDING = "pending"  # JsonObjectReader.read: the object is not complete yet
FAILED = "failed"  # ...: the text there is not a JSON object


def partial_marker_length(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `marker`: text
    that must be held back, as the next delta may complete the marker."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


_JSON_SYNTAX = re.compile(r'["\\{}\[\]]')


class JsonObjectReader:
    """Reads one JSON object at the start of a growing text (after whitespace). Each character
    is scanned once, however the text arrives: brackets are counted outside strings until the
    first one closes, and only then is the object decoded."""

    def __init__(self) -> None:
        self._start: int | None = None
        self._pos = 0
        self._depth = 0
        self._in_string = False

    def read(self, text: str, final: bool) -> tuple[Any, int] | str:
        """(the decoded object, where it ends in `text`), PENDING, or FAILED. `text` must
        only have grown since the last call."""
        if self._start is None:
            start = len(text) - len(text.lstrip())
            if start == len(text):
                return FAILED if final else PENDING
            if text[start] != "{":
                return FAILED
            self._start = self._pos = start
        end = self._scan(text)
        if end is None:
            return FAILED if final else PENDING
        try:
            # strict=False: raw newlines and tabs inside strings (code arguments) are taken as written
            return json.loads(text[self._start:end], strict=False), end
        except (ValueError, RecursionError):
            return FAILED

    def _scan(self, text: str) -> int | None:
        pos = self._pos
        while (match := _JSON_SYNTAX.search(text, pos)) is not None:
            char, pos = match.group(), match.end()
            if self._in_string:
                if char == "\\":
                    if pos == len(text):  # the escaped character has not arrived
                        self._pos = match.start()
                        return None
                    pos += 1
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._pos = pos
                    return pos
        self._pos = len(text)
        return None


class ToolCallStreamParser(ABC):
    """Splits a completion, delta by delta, into content and complete tool calls.

    Subclasses implement `_step`, which looks at the undecided text (`self._buffer`) in the
    current state, consumes what it can decide, and says whether to look again. With
    `final` (the completion has ended) it must decide everything.

    Content is emitted without its leading and trailing whitespace: whitespace is held until
    more content follows, so that what a call leaves around it (a newline before
    <tool_call>) is not streamed as content that the whole-text parse strips.
    """

    def __init__(self) -> None:
        self._buffer = ""
        self._events: list[StreamEvent] = []
        self._num_calls = 0
        self._content_started = False
        self._held_space = ""

    def feed(self, text: str) -> list[StreamEvent]:
        self._buffer += text
        while self._step(final=False):
            pass
        return self._take()

    def finish(self) -> list[StreamEvent]:
        while self._step(final=True):
            pass
        assert not self._buffer, "a parser left text undecided at the end"
        self._held_space = ""
        return self._take()

    @abstractmethod
    def _step(self, final: bool) -> bool:
        """Decide what can be decided at the start of the buffer; True to be called again."""

    def _take(self) -> list[StreamEvent]:
        events, self._events = self._events, []
        return events

    def _emit_content(self, text: str) -> None:
        if not self._content_started:
            text = text.lstrip()
        text = self._held_space + text
        shown = text.rstrip()
        self._held_space = text[len(shown):]
        if shown:
            self._content_started = True
            self._events.append(ContentDelta(shown))

    def _content_until(self, marker: str, final: bool) -> bool:
        """Emit the buffer as content up to `marker` and drop the marker: True. Without the
        marker, emit all but a possible beginning of it: False."""
        at = self._buffer.find(marker)
        if at < 0:
            cut = len(self._buffer) - (0 if final else partial_marker_length(self._buffer, marker))
            self._emit_content(self._buffer[:cut])
            self._buffer = self._buffer[cut:]
            return False
        self._emit_content(self._buffer[:at])
        self._buffer = self._buffer[at + len(marker):]
        return True

    def _emit_call(self, call: ToolCall) -> None:
        self._events.append(ToolCallDelta(self._num_calls, call))
        self._num_calls += 1

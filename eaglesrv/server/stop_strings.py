"""Stop strings, applied to text as it streams (the engine only knows stop token ids).

Text that could be the start of a stop string is held back until the next piece shows
whether it is one, so a stop string never leaks into streamed text:

    stop = "\\nUser:"   feed("Hi\\nUs") -> ("Hi", None)        (holds "\\nUs")
                        feed("er: x")   -> ("", "\\nUser:")    (the output ends at "Hi")

Everything released so far is free of stop strings, and a stop string can only begin in
the held-back text or after it, so each feed searches just that part.
"""

from __future__ import annotations

from typing import Sequence


class StopStringFilter:
    def __init__(self, stop_strings: Sequence[str]) -> None:
        self._stops = [s for s in stop_strings if s]
        self._held = ""

    @property
    def active(self) -> bool:
        return bool(self._stops)

    def feed(self, text: str, final: bool = False) -> tuple[str, str | None]:
        """Add text; return (text safe to release, the stop string that matched or None).

        After a match the output ends: the caller finishes the request with reason "stop".
        With final=True (the output ended for another reason) nothing is held back.
        """
        if not self._stops:
            return text, None
        pending = self._held + text
        match = self._first_match(pending)
        if match is not None:
            self._held = ""
            cut, stop = match
            return pending[:cut], stop
        keep = 0 if final else self._partial_match_len(pending)
        self._held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep], None

    def _first_match(self, text: str) -> tuple[int, str] | None:
        """(position, stop string) of the earliest stop string in `text`, if any."""
        found = [(i, s) for s, i in ((s, text.find(s)) for s in self._stops) if i >= 0]
        return min(found) if found else None

    def _partial_match_len(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string.
        Only tails that start with a stop string's first character are tried, leftmost (so
        longest) first: a few comparisons per stop string, not one per length, which keeps
        the per-token cost small even for the longest stop strings allowed."""
        longest = 0
        for stop in self._stops:
            start = text.find(stop[0], max(0, len(text) - len(stop) + 1))
            while start >= 0 and len(text) - start > longest:
                if stop.startswith(text[start:]):
                    longest = len(text) - start
                    break
                start = text.find(stop[0], start + 1)
        return longest

"""Incremental detokenization: token ids in, text deltas out, as tokens arrive.

Two things make this more than `decode(new_tokens)`:
- Byte-level tokenizers split one character over several tokens ("日" is three tokens in
  SmolLM2's vocabulary). Decoding a partial character gives U+FFFD, so a delta is only
  released once the text decodes without a trailing U+FFFD.
- Some tokenizers (SentencePiece) render a token differently depending on what precedes
  it (a leading space is dropped at the start of a decode). So each delta is the
  difference between decoding a short window with and without the new tokens, where the
  window starts a few tokens back: the text of those tokens is already out, and they only
  serve as context.

    window:  [ context tokens | tokens not yet released ]
              ^prefix          ^read
    delta = decode(ids[prefix:]) - decode(ids[prefix:read])

Decoding stays O(window) per step instead of O(output) for long generations.
"""

from __future__ import annotations

from typing import Sequence

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT_TOKENS = 5  # prompt tokens kept as context for the first output tokens


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix = 0  # first token of the decode window (context only)
        self._read = len(self._ids)  # tokens before this one are released as text

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the text that is now complete (may be "")."""
        self._ids.extend(token_ids)
        released = self._decode(self._ids[self._prefix : self._read])
        current = self._decode(self._ids[self._prefix :])
        if len(current) <= len(released) or current.endswith(_REPLACEMENT):
            return ""  # nothing new, or it ends inside a multi-byte character: wait for more
        self._prefix, self._read = self._read, len(self._ids)
        return current[len(released) :]

    def flush(self) -> str:
        """At the end of the output: release whatever is left, incomplete characters included."""
        released = self._decode(self._ids[self._prefix : self._read])
        current = self._decode(self._ids[self._prefix :])
        self._prefix, self._read = self._read, len(self._ids)
        return current[len(released) :] if len(current) > len(released) else ""

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False)

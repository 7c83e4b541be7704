"""Target features the draft has not consumed yet, per request.

With speculation off for a request, its steps skip the draft entirely: the target's
features and the tokens they precede are held here instead. Before the request next
speculates, one draft extend over the backlog brings its draft KV and root state up to
date, exactly as if the draft had run every step. A backlog longer than `limit` tokens is
drained at once, which bounds the memory held per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

DEFAULT_LIMIT = 2048  # tokens per request
GROWTH_ROWS = 64  # rows of room a new buffer leaves past what it must hold


@dataclass
class Backlog:
    start: int  # draft position of the first held entry
    tokens: list[int] = field(default_factory=list)  # token start + 1 + i, for draft position start + i
    # [capacity, 3H], the first len(tokens) rows held: one tensor per request, grown by
    # doubling, rather than one per step. A long-lived server held thousands of small
    # tensors this way, and each full garbage collection walked them all (0.27 s each
    # with 64 requests in flight on a 2-core CPU).
    buffer: torch.Tensor | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def append(self, tokens: list[int], features: torch.Tensor) -> None:
        held, new = len(self.tokens), len(tokens)
        if self.buffer is None or held + new > self.buffer.shape[0]:
            grown = features.new_empty((max(2 * held, held + new + GROWTH_ROWS), features.shape[1]))
            if self.buffer is not None:
                grown[:held] = self.buffer[:held]
            self.buffer = grown
        self.buffer[held : held + new] = features
        self.tokens.extend(tokens)


class FeatureBacklog:
    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self.limit = limit
        self._held: dict[str, Backlog] = {}

    def hold(self, request_id: str, position: int, tokens: list[int], features: torch.Tensor) -> int:
        """Add one step's entries; a backlog that ends elsewhere is dropped first (its
        request was recomputed from an earlier position: preemption). Returns the tokens
        now held."""
        held = self._held.get(request_id)
        if held is None or held.end != position:
            held = self._held[request_id] = Backlog(position)
        held.append(tokens, features)
        return len(held.tokens)

    def end(self, request_id: str) -> int | None:
        held = self._held.get(request_id)
        return held.end if held is not None else None

    def length(self, request_id: str) -> int:
        held = self._held.get(request_id)
        return len(held.tokens) if held is not None else 0

    def take(self, request_id: str) -> tuple[int, list[int], torch.Tensor] | None:
        """(start, tokens, features [n, 3H]) and forget them; None when nothing is held."""
        held = self._held.pop(request_id, None)
        if held is None:
            return None
        return held.start, held.tokens, held.buffer[: len(held.tokens)]

    def forget(self, request_id: str) -> None:
        self._held.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._held)

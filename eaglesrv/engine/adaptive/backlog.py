"""Target features the draft has not consumed yet, per request.

With speculation off for a request, its steps skip the draft entirely: the target's
features and the tokens they precede are held here instead. Before the request next
speculates, one draft extend over the backlog brings its draft KV and root state up to
date, exactly as if the draft had run every step.

The features live in a pool with one row per KV-cache slot, allocated at start-up beside
the KV pools and counted in their memory budget: the features of a request's position p
sit at the slot the page table gives p. Holding a step's features is then one
`index_copy_` for all requests, and a catch-up one gather. (Per-request buffers cost a
copy per request per step, 0.5 ms a step with 64 requests on a 2-core CPU, and memory the
KV budget did not know about: under load every request holds its backlog.) A request owns
its slots while it runs, so nothing else writes them before its catch-up.

A backlog longer than `limit` tokens is drained at once: the catch-up a return to
speculation pays stays bounded, and so does its price in the policy (policy.py), which
would otherwise keep a long request from ever speculating again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from eaglesrv.kernels.attention.base import SequenceSpan, new_token_slots

DEFAULT_LIMIT = 2048  # tokens per request


class HeldStep(NamedTuple):
    """One request's entries of a step: draft positions position .. position + len(tokens) - 1."""

    request_id: str
    page_table: list[int]
    position: int
    tokens: list[int]  # token p + 1, for draft position p


@dataclass
class Backlog:
    start: int  # draft position of the first held entry
    tokens: list[int] = field(default_factory=list)  # token start + 1 + i, for draft position start + i

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


class FeatureBacklog:
    def __init__(self, pool: torch.Tensor, page_size: int, limit: int = DEFAULT_LIMIT) -> None:
        self.pool = pool  # [num_slots, 3 * target hidden]
        self.page_size = page_size
        self.limit = limit
        self._held: dict[str, Backlog] = {}

    @classmethod
    def allocate(cls, num_pages: int, page_size: int, width: int, dtype: torch.dtype,
                 device: torch.device) -> "FeatureBacklog":
        return cls(torch.empty((num_pages * page_size, width), dtype=dtype, device=device), page_size)

    @staticmethod
    def bytes_per_token(width: int, dtype: torch.dtype) -> int:
        return width * torch.empty((), dtype=dtype).element_size()

    def hold(self, steps: list[HeldStep], features: torch.Tensor) -> list[str]:
        """Add one step's entries; `features` holds their rows in order. A backlog that
        ends elsewhere than its step begins is dropped first (its request was recomputed
        from an earlier position: preemption). Returns the requests now over the limit."""
        spans = [SequenceSpan(step.page_table, step.position, len(step.tokens)) for step in steps]
        self.pool.index_copy_(0, new_token_slots(spans, self.page_size).to(self.pool.device), features)
        over = []
        for step in steps:
            held = self._held.get(step.request_id)
            if held is None or held.end != step.position:
                held = self._held[step.request_id] = Backlog(step.position)
            held.tokens.extend(step.tokens)
            if len(held.tokens) > self.limit:
                over.append(step.request_id)
        return over

    def end(self, request_id: str) -> int | None:
        held = self._held.get(request_id)
        return held.end if held is not None else None

    def length(self, request_id: str) -> int:
        held = self._held.get(request_id)
        return len(held.tokens) if held is not None else 0

    def take(self, request_id: str, page_table: list[int]) -> tuple[int, list[int], torch.Tensor] | None:
        """(start, tokens, features [n, 3H]) and forget them; None when nothing is held."""
        held = self._held.pop(request_id, None)
        if held is None:
            return None
        slots = new_token_slots([SequenceSpan(page_table, held.start, len(held.tokens))], self.page_size)
        return held.start, held.tokens, self.pool[slots.to(self.pool.device)]

    def forget(self, request_id: str) -> None:
        self._held.pop(request_id, None)

    def clear(self) -> None:
        self._held.clear()

    def __len__(self) -> int:
        return len(self._held)

"""Target features the draft has not consumed yet.

With speculation off for a request, its steps skip the draft entirely: the target's
features and the tokens they precede are held instead. Before the request next
speculates, one draft extend over its backlog brings its draft KV and root state up to
date, exactly as if the draft had run every step.

The features live in a pool with one row per KV-cache slot (FeaturePool), allocated at
start-up beside the KV pools and counted in their memory budget: the features of a
request's position p sit at the slot the page table gives p. Holding a step's features is
then one `index_copy_` for all requests, and a catch-up one gather. (Per-request buffers
cost a copy per request per step, 0.5 ms a step with 64 requests on a 2-core CPU, and
memory the KV budget did not know about: under load every request holds its backlog.) A
request owns its slots while it runs, so nothing else writes them before its catch-up.
Which positions a request holds (its Backlog) is part of its record in the runner.

A backlog longer than the pool's `limit` tokens is drained at once: the catch-up a return
to speculation pays stays bounded, and so does its price in the policy (policy.py), which
would otherwise keep a long request from ever speculating again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from eaglesrv.kernels.attention.base import SequenceSpan
from eaglesrv.kernels.attention.layout import new_token_slots

DEFAULT_LIMIT = 2048  # tokens per request


class HeldStep(NamedTuple):
    """One request's entries of a step: draft positions position .. position + len(tokens) - 1."""

    page_table: list[int]
    position: int
    tokens: list[int]  # token p + 1, for draft position p


@dataclass
class Backlog:
    """The draft positions one request holds features for."""

    start: int  # draft position of the first held entry
    tokens: list[int] = field(default_factory=list)  # token start + 1 + i, for draft position start + i

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @classmethod
    def grow(cls, held: "Backlog | None", step: HeldStep) -> "Backlog":
        """`held` with the step's entries added. A backlog that ends elsewhere than the step
        begins starts over there: its request was recomputed from an earlier position
        (preemption), and what it held no longer follows."""
        if held is None or held.end != step.position:
            held = cls(step.position)
        held.tokens.extend(step.tokens)
        return held


class FeaturePool:
    def __init__(self, pool: torch.Tensor, page_size: int, limit: int = DEFAULT_LIMIT) -> None:
        self.pool = pool  # [num_slots, 3 * target hidden]
        self.page_size = page_size
        self.limit = limit

    @classmethod
    def allocate(cls, num_pages: int, page_size: int, width: int, dtype: torch.dtype,
                 device: torch.device) -> "FeaturePool":
        return cls(torch.empty((num_pages * page_size, width), dtype=dtype, device=device), page_size)

    @staticmethod
    def bytes_per_token(width: int, dtype: torch.dtype) -> int:
        return width * dtype.itemsize

    def write(self, steps: list[HeldStep], features: torch.Tensor) -> None:
        """Store one step's entries; `features` holds their rows in order."""
        spans = [SequenceSpan(step.page_table, step.position, len(step.tokens)) for step in steps]
        self.pool.index_copy_(0, new_token_slots(spans, self.page_size).to(self.pool.device), features)

    def read(self, held: Backlog, page_table: list[int]) -> torch.Tensor:
        """[len(held.tokens), 3H]: the features of every held position, in order."""
        slots = new_token_slots([SequenceSpan(page_table, held.start, len(held.tokens))], self.page_size)
        return self.pool[slots.to(self.pool.device)]

    def over_limit(self, held: Backlog) -> bool:
        return len(held.tokens) > self.limit

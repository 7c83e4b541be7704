"""What the EAGLE-3 runner keeps for one request between steps, in one record.

The runner owns a record per request (Eagle3Runner.requests) and drops it in one place,
Eagle3Runner.release, when the request finishes or is aborted. A preempted request keeps
its record: the root's position and the backlog's start no longer match the recomputed
sequence, which is exactly how the runner tells that the draft must start over.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eaglesrv.engine.adaptive.acceptance import RequestAcceptance
from eaglesrv.engine.adaptive.backlog import Backlog


@dataclass
class RootState:
    """The draft's output at the last committed position."""

    position: int  # root position n: valid only while the request's num_cached == n
    hidden: torch.Tensor  # [H] pre-norm draft output, the features for the first draft pass
    logprobs: torch.Tensor  # [draft_vocab] draft log-probabilities of the root's children


@dataclass
class SpecRequestState:
    root: RootState | None = None  # where the next tree grows from, once the draft has seen the prompt
    backlog: Backlog | None = None  # adaptive: committed positions whose features wait for the draft
    acceptance: RequestAcceptance = field(default_factory=RequestAcceptance)  # adaptive: this request's record
    # Draft KV is written for positions < draft_end (those after it wait in the backlog).
    # A prefix-cache hit brings the draft KV of the cached positions: it starts at the hit.
    draft_end: int = 0

    def draft_written(self, start: int, count: int) -> None:
        """The draft's KV now holds positions start .. start + count - 1."""
        if start <= self.draft_end:
            self.draft_end = max(self.draft_end, start + count)

    def draft_is_current(self, num_cached: int) -> bool:
        """The draft has seen every committed token: the backlog (adaptive) holds exactly
        the rest, or the root state sits at the root."""
        if self.backlog is not None:
            return self.backlog.end == num_cached
        return self.root is not None and self.root.position == num_cached

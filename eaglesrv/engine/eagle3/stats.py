"""Speculation counters, as SGLang reports them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """accept length = tokens one verification adds, bonus included (SGLang's measure)."""

    num_steps: int
    verifications: int = 0
    accepted_tokens: int = 0  # sum of accept lengths
    draft_passes: int = 0
    accepted_at_depth: list[int] = field(default_factory=list)  # verifications that kept depth d (1-based)

    def __post_init__(self) -> None:
        self.accepted_at_depth = [0] * self.num_steps

    def record(self, path_length: int) -> None:
        self.verifications += 1
        self.accepted_tokens += path_length + 1
        for depth in range(path_length):
            self.accepted_at_depth[depth] += 1

    @property
    def avg_accept_length(self) -> float:
        return self.accepted_tokens / self.verifications if self.verifications else 0.0

    def acceptance_by_depth(self) -> list[float]:
        """P(depth d kept | depth d - 1 kept), d = 1 .. num_steps."""
        rates, reached = [], self.verifications
        for kept in self.accepted_at_depth:
            rates.append(kept / reached if reached else 0.0)
            reached = kept
        return rates

    def snapshot(self) -> dict:
        return {
            "spec_verifications": self.verifications,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_draft_passes": self.draft_passes,
            "avg_spec_accept_length": self.avg_accept_length,
            "spec_acceptance_by_depth": self.acceptance_by_depth(),
        }

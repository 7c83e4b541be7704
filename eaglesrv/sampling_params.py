"""Per-request sampling parameters, shared by the server, scheduler and engine.

Plain Python on purpose: the scheduler must not depend on torch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


class InvalidSamplingParams(ValueError):
    """A sampling parameter is out of range; the message names it."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token of one request, and when to stop.

    temperature 0 means greedy. top_k <= 0 (or -1) disables top-k; top_p 1.0 and
    min_p 0.0 disable theirs. Penalties follow OpenAI: logits -= presence * (count > 0)
    + frequency * count, counted over generated tokens only.
    """

    max_tokens: int | None = 16  # None: until the context is full
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; n >= 0: chosen token plus n alternatives
    min_tokens: int = 0
    # Prompt logprobs (scoring): None: none; n >= 0: each prompt token's logprob given the
    # tokens before it, its rank, and the n most likely tokens there, for prompt tokens
    # logprob_start_len.. (token 0 has no logprob). max_tokens 0 then scores without generating.
    prompt_logprobs: int | None = None
    logprob_start_len: int = 0

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)

    def validate(self) -> None:
        floats = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty")
        for name in floats:
            if not math.isfinite(getattr(self, name)):
                raise InvalidSamplingParams(f"{name} must be a finite number, got {getattr(self, name)!r}")
        checks = [
            (self.max_tokens is None or self.max_tokens >= 0, "max_tokens", "must be at least 0"),
            (self.temperature >= 0.0, "temperature", "must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k == -1 or 0 <= self.top_k < 2**31, "top_k", "must be -1 (disabled) or in [0, 2**31)"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (self.logprobs is None or self.logprobs >= 0, "logprobs", "must be >= 0"),
            (self.min_tokens >= 0, "min_tokens", "must be >= 0"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs", "must be >= 0"),
            (self.logprob_start_len >= 0, "logprob_start_len", "must be >= 0"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be >= 0"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise InvalidSamplingParams(f"{name} {rule}, got {getattr(self, name)!r}")

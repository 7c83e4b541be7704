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
    min_p 0.0 disable theirs. Penalties apply in transformers' order: logit_bias is added
    first (OpenAI's, as transformers' single-token sequence_bias), then repetition_penalty
    as transformers applies it (each distinct token of the prompt and the output: a
    negative logit times it, any other divided by it), then OpenAI's presence and
    frequency penalties, logits -= presence * (count > 0) + frequency * count, counted
    over generated tokens only.
    """

    max_tokens: int | None = 16  # None: until the context is full
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1.0: none
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, each id at most once
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
    # Structured output: the grammar every output token must follow, in llguidance's
    # format (built and checked by eaglesrv/grammar/); None: free text.
    grammar: str | None = None

    def __post_init__(self) -> None:
        # A dict or a list of pairs becomes a tuple of pairs, so the params stay hashable.
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            object.__setattr__(self, "logit_bias", tuple(tuple(pair) for pair in pairs))
        except TypeError:
            raise InvalidSamplingParams(f"logit_bias must be (token id, bias) pairs, got {pairs!r}") from None
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        """Whether apply_penalties changes this request's logits. Such requests decode
        without speculation (Eagle3Runner._may_speculate), which keeps their output exact:
        verifying a draft path would need each node's own token history for the
        repetition and count penalties, and the greedy tree walk reads raw logits."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0 or bool(self.logit_bias))

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)

    def validate(self) -> None:
        floats = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
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
            (0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", "must be in (0, 2]"),
            (self.logprobs is None or self.logprobs >= 0, "logprobs", "must be >= 0"),
            (self.min_tokens >= 0, "min_tokens", "must be >= 0"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs", "must be >= 0"),
            (self.logprob_start_len >= 0, "logprob_start_len", "must be >= 0"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be >= 0"),
            (self.grammar is None or (isinstance(self.grammar, str) and self.grammar), "grammar",
             "must be a non-empty grammar string or None"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise InvalidSamplingParams(f"{name} {rule}, got {getattr(self, name)!r}")
        self._validate_logit_bias()

    def _validate_logit_bias(self) -> None:
        pairs = self.logit_bias
        well_formed = all(
            len(pair) == 2 and isinstance(pair[0], int) and not isinstance(pair[0], bool)
            and isinstance(pair[1], (int, float)) and not isinstance(pair[1], bool)
            for pair in pairs
        )
        if not well_formed:
            raise InvalidSamplingParams(f"logit_bias must be (token id, bias) pairs, got {pairs!r}")
        checks = [
            (all(token >= 0 for token, _ in pairs), "token ids must be >= 0"),
            (all(math.isfinite(bias) and -100.0 <= bias <= 100.0 for _, bias in pairs),
             "biases must be finite and in [-100, 100]"),
            (len({token for token, _ in pairs}) == len(pairs), "must not repeat a token id"),
        ]
        for ok, rule in checks:
            if not ok:
                raise InvalidSamplingParams(f"logit_bias {rule}, got {pairs!r}")

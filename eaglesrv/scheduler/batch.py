"""The typed hand-over between scheduler and engine, one step at a time."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from eaglesrv.sampling_params import SamplingParams


class ForwardMode(enum.Enum):
    """Every kind of forward pass the engine runs."""

    EXTEND = "extend"  # some sequences add several tokens (prefill chunks), maybe with decodes
    DECODE = "decode"  # every sequence adds exactly one token
    IDLE = "idle"  # nothing to run


@dataclass(frozen=True)
class SequenceWork:
    """One request's share of a forward pass."""

    request_id: str
    token_ids: list[int]  # tokens to compute now: a prefill chunk, or the last sampled token
    num_cached: int  # tokens of this sequence already in the KV cache (positions start here)
    page_table: list[int]  # pages for the first num_cached + len(token_ids) tokens, in order
    sample: bool  # this chunk reaches the end of the sequence: sample the next token
    params: SamplingParams
    seed: int
    output_token_ids: list[int]  # generated so far, for penalties (read-only)


@dataclass(frozen=True)
class ScheduledBatch:
    sequences: list[SequenceWork]
    mode: ForwardMode
    preempted_ids: list[str] = field(default_factory=list)  # for logs and metrics

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)

    @property
    def is_empty(self) -> bool:
        return not self.sequences


@dataclass(frozen=True)
class SampledToken:
    """What the engine sampled for one sequence (aligned with the sampling sequences)."""

    token_id: int
    logprobs: object | None = None  # eaglesrv.engine.sampler.TokenLogprobs; opaque here


@dataclass
class RequestOutput:
    """New tokens of one request after a step; the last one for a request has finished=True."""

    request_id: str
    new_token_ids: list[int]
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: "str | None" = None  # FinishReason value once finished
    new_logprobs: list = field(default_factory=list)  # TokenLogprobs per new token, when asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

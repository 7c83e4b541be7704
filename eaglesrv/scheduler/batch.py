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
    page_table: list[int]  # pages for num_cached + len(token_ids) + lookahead tokens, in order
    sample: bool  # this chunk reaches the end of the sequence: sample the next token(s)
    params: SamplingParams
    seed: int
    output_token_ids: list[int]  # generated so far, for penalties (read-only)
    prompt_token_ids: list[int] = field(default_factory=list)  # the prompt, for repetition_penalty (read-only)
    next_token_id: int | None = None  # the known token after this chunk (None when it is to be sampled)
    max_context_len: int = 1 << 30  # positions this sequence may reach
    suppressed_token_ids: tuple[int, ...] = ()  # EOS and stop ids while fewer than min_tokens are out
    lookahead: int = 0  # KV slots reserved past this chunk for a draft tree; 0: decode plainly
    # Prompt tokens [first, end) still to be scored (params.prompt_logprobs): this chunk
    # scores those its rows predict, tokens num_cached + 1 .. num_cached + len(token_ids).
    prompt_logprob_tokens: tuple[int, int] | None = None
    # The request's first chunk since it was admitted (new, or again after a preemption):
    # its state before num_cached is the prefix cache's (complete in every pool), or none.
    admitted: bool = False

    def prompt_tokens_scored(self) -> range:
        """Token indices whose logprobs this chunk's rows give (token t from the row at t - 1)."""
        if self.prompt_logprob_tokens is None:
            return range(0)
        first, end = self.prompt_logprob_tokens
        return range(max(first, self.num_cached + 1), min(end, self.num_cached + len(self.token_ids) + 1))


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
class PromptLogprob:
    """A prompt token's logprob given the tokens before it (the target model's)."""

    token_id: int
    logprob: float
    rank: int  # 1 + how many tokens were more likely there
    top: list[tuple[int, float]]  # the params.prompt_logprobs most likely tokens there, most likely first


@dataclass(frozen=True)
class StepResults:
    """What a runner returns for one step."""

    sampled: list["SequenceResult"]  # one per sequence with sample=True, in order
    prompt_logprobs: dict[int, list[PromptLogprob]] = field(default_factory=dict)  # batch index -> its scored tokens
    # batch index -> leading tokens whose engine state is complete, where it lags the
    # computed tokens (the EAGLE-3 draft's KV): only those may enter the prefix cache
    reusable_tokens: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class SequenceResult:
    """What the engine produced for one sampling sequence (aligned with them, in order).

    Plain decoding: one token, and num_computed = len(work.token_ids). A speculative
    verification: the accepted draft tokens plus the bonus token, and num_computed = the
    root plus the accepted nodes, whose K/V now sit contiguously after work.num_cached.
    """

    token_ids: list[int]
    num_computed: int  # tokens of this sequence now in the KV cache, counted from work.num_cached
    logprobs: list = field(default_factory=list)  # TokenLogprobs per token, when asked
    verified: bool = False  # a speculative verification (for per-request counters)

    @classmethod
    def single(cls, work: "SequenceWork", token_id: int, logprobs=None) -> "SequenceResult":
        return cls([token_id], len(work.token_ids), [logprobs] if logprobs is not None else [])


@dataclass
class RequestOutput:
    """New tokens of one request after a step; the last one for a request has finished=True."""

    request_id: str
    new_token_ids: list[int]
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: "str | None" = None  # FinishReason value once finished
    new_logprobs: list = field(default_factory=list)  # TokenLogprobs per new token, when asked
    # PromptLogprob per prompt token from max(1, logprob_start_len), all in the request's first output
    new_prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    spec_verify_ct: int = 0  # speculative verifications so far (SGLang's meta_info field)
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied (OpenAI's cached_tokens)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

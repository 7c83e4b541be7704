"""One generation request as the scheduler tracks it, in tokens."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from eaglesrv.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV pages; prefilling or decoding
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token (or, in the server, a stop string)
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # cancelled by the client or the server


@dataclass(eq=False)
class Request:
    """A request's tokens and where it stands.

    Speculation-ready bookkeeping: the scheduler only ever compares num_computed_tokens
    (tokens whose K/V are in the cache) with len(all_token_ids). A preempted request
    drops its pages and resets num_computed_tokens to 0; its generated tokens stay, so it
    resumes by recomputing them and continues exactly where it was.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the request's own seed, or one drawn at arrival: sampling never depends on the batch
    eos_token_ids: frozenset[int] = frozenset()
    max_context_len: int = 1 << 30
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    page_table: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    num_verify_passes: int = 0  # speculative verifications (SGLang's spec_verify_ct)
    # Prompt logprobs: the next prompt token to score, and those scored but not yet sent.
    # A preempted request recomputes its chunks but does not score a token twice.
    next_prompt_logprob: int = 0
    pending_prompt_logprobs: list = field(default_factory=list)
    # Prefix cache (scheduler/prefix_cache.py): the deepest cache node this request locks,
    # the leading tokens whose engine state is complete (the EAGLE-3 draft's KV may lag the
    # target's), and the prompt tokens its first admission found cached (usage reports them).
    cache_node: object | None = None
    num_reusable_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    admitted: bool = False  # its first chunk since (re)admission has not run yet

    def __post_init__(self) -> None:
        asked = self.params.prompt_logprobs is not None
        self.next_prompt_logprob = max(1, self.params.logprob_start_len) if asked else len(self.prompt_token_ids)

    def cacheable_limit(self) -> int:
        """The most leading tokens a prefix-cache hit may cover: one token is always
        computed (to sample from), and prompt tokens still to be scored need their rows."""
        pending = self.prompt_logprob_tokens()
        return min(self.num_tokens - 1, pending[0] - 1 if pending else self.num_tokens)

    def prompt_logprob_tokens(self) -> tuple[int, int] | None:
        """Prompt tokens [first, end) still to be scored, or None."""
        end = len(self.prompt_token_ids)
        return (self.next_prompt_logprob, end) if self.next_prompt_logprob < end else None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output, without building the whole list."""
        n_prompt = len(self.prompt_token_ids)
        if stop <= n_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : stop - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n_prompt]

    def suppressed_token_ids(self) -> tuple[int, ...]:
        """Tokens that would end the request, while fewer than min_tokens are generated."""
        if len(self.output_token_ids) >= self.params.min_tokens:
            return ()
        eos = () if self.params.ignore_eos else tuple(sorted(self.eos_token_ids))
        return eos + tuple(self.params.stop_token_ids)

    def stop_reason_after(self, token_id: int) -> FinishReason | None:
        """Why the request ends after appending `token_id`, or None if it goes on."""
        if not self.params.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.STOP
        if token_id in self.params.stop_token_ids:
            return FinishReason.STOP
        if self.params.max_tokens is not None and len(self.output_token_ids) >= self.params.max_tokens:
            return FinishReason.LENGTH
        if self.num_tokens >= self.max_context_len:
            return FinishReason.LENGTH
        return None

"""The messages between the API process and the engine process.

Plain picklable dataclasses with token ids only: the API process tokenizes and
detokenizes, so no text and no torch object crosses the pipe.

    API process                         engine process
    AddRequest / AbortRequest  ------>  Engine.add_request / Engine.abort
    StatsQuery                 ------>  a snapshot taken between two steps (after
                                        emptying the prefix cache, if it asks)
    Shutdown                   ------>  leave the loop, exit 0
                               <------  EngineReady (once) or StartupFailed (then exit 1)
                               <------  StepOutputs (one per step with outputs)
                               <------  AddRequestFailed (add_request raised ValueError)
                               <------  StatsReply
                               <------  EngineFailed (the loop crashed; exit 1)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eaglesrv.sampling_params import SamplingParams
from eaglesrv.scheduler.batch import PromptLogprob

# (token_id, logprob, [(alternative_id, logprob), ...] most likely first)
WireLogprob = tuple[int, float, list[tuple[int, float]]]


# ---- API process -> engine process --------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class StatsQuery:
    query_id: int
    flush_cache: bool = False  # POST /flush_cache: evict every unused cached page first


@dataclass(frozen=True)
class Shutdown:
    pass


# ---- engine process -> API process --------------------------------------------------
@dataclass(frozen=True)
class EngineInfo:
    """Fixed facts about the loaded engine, sent once when it is ready."""

    model_name: str  # --served-model-name, else --model-path, else the default model's name
    model_path: str | None
    tokenizer_path: str | None
    max_context_len: int  # prompt + output, already capped by the KV pool's size
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    page_size: int
    num_pages: int
    max_running_requests: int
    dtype: str
    device: str


@dataclass(frozen=True)
class EngineReady:
    info: EngineInfo
    tokenizer_pickle: bytes | None  # the engine's tokenizer, pickled; None without one


@dataclass(frozen=True)
class StartupFailed:
    message: str


@dataclass(frozen=True)
class EngineOutput:
    """What one step produced for one request (mirrors scheduler.RequestOutput)."""

    request_id: str
    new_token_ids: list[int]
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    new_logprobs: list[WireLogprob] = field(default_factory=list)
    new_prompt_logprobs: list[PromptLogprob] = field(default_factory=list)  # all in a request's first output
    spec_verify_ct: int = 0  # speculative verifications so far
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class StepOutputs:
    outputs: list[EngineOutput]


@dataclass(frozen=True)
class AddRequestFailed:
    request_id: str
    message: str


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the scheduler, taken between two steps."""

    num_running: int
    num_waiting: int
    kv_pages_total: int
    kv_pages_free: int
    kv_pages_used: int
    page_size: int
    num_steps: int
    # Engine.spec_stats: None without speculation, else SGLang's counters, e.g.
    # {"avg_spec_accept_length": 2.8, "spec_verifications": 120, "spec_accepted_tokens": 336,
    #  "spec_draft_passes": 600, "spec_acceptance_by_depth": [0.8, 0.6, ...]}.
    speculation: dict | None = None
    # Engine._prefix_cache_stats: {"prefix_cache_enabled", "prefix_cache_pages",
    # "prefix_cache_evictable_pages", "prefix_cache_evicted_pages", "prefix_cache_queried_tokens",
    # "prefix_cache_hit_tokens", "prefix_cache_hit_rate"}
    prefix_cache: dict = field(default_factory=dict)

    @property
    def kv_pages_available(self) -> int:
        """Pages a request could get now: the free ones and the cached ones nobody uses."""
        return self.kv_pages_free + self.prefix_cache.get("prefix_cache_evictable_pages", 0)

    @property
    def token_usage(self) -> float:
        """The fraction of the pool requests hold (SGLang's token_usage)."""
        return 1.0 - self.kv_pages_available / max(self.kv_pages_total, 1)


@dataclass(frozen=True)
class StatsReply:
    query_id: int
    stats: EngineStats


@dataclass(frozen=True)
class EngineFailed:
    message: str

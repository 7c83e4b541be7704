"""The in-process engine: load a model, then step() = schedule, run, update.

    engine = Engine(EngineConfig(model=ModelConfig(dtype="float32")))
    results = engine.generate(["The capital of France is"], SamplingParams(temperature=0))

With tensor parallelism (config.parallel.tp_size > 1) this is rank 0: it schedules, and
every step it runs is sent to the other ranks first (parallel/followers.py). Created
alone, it starts them itself; close() stops them.
"""

from __future__ import annotations

import logging
import random
import threading
import uuid
from dataclasses import dataclass, field
from typing import Sequence

import torch

from eaglesrv.configs import EngineConfig
from eaglesrv.engine.builder import build_engine
from eaglesrv.engine.follower_process import start_followers, stop_followers
from eaglesrv.engine.parallel.followers import Followers
from eaglesrv.engine.parallel.ranks import RankPlacement, node_placements
from eaglesrv.engine.stats_logger import StepStatsLogger
from eaglesrv.sampling_params import SamplingParams
from eaglesrv.scheduler import Request, RequestOutput, RequestRejected

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]


@dataclass
class GenerationResult:
    """A finished request, as Engine.generate returns it."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)  # TokenLogprobs per output token, when asked
    prompt_logprobs: list = field(default_factory=list)  # PromptLogprob per scored prompt token, when asked
    text: str | None = None  # decoded output, when the engine has a tokenizer


class Engine:
    def __init__(self, config: EngineConfig | None = None, placement: RankPlacement | None = None) -> None:
        """placement: rank 0's, when whoever made this process started the other ranks too
        (EngineClient.spawn); None: this engine starts them (with more than one rank)."""
        self.config = config or EngineConfig()
        started = []
        if placement is None:
            placement, *others = node_placements(self.config.parallel)
            if not placement.is_leader:
                raise ValueError("an Engine is rank 0: on other nodes, ranks start with launch.py --node-rank")
            started = start_followers(self.config, others, logging.getLevelName(logging.getLogger().level))
        try:
            parts = build_engine(self.config, placement)
        except BaseException:
            stop_followers(started, timeout_s=0)
            raise
        self.followers = Followers(parts.tp)
        self._started_followers = started  # joined at close()
        self.device, self.dtype, self.arch = parts.device, parts.dtype, parts.arch
        self.model, self.tokenizer, self.eos_token_ids = parts.model, parts.tokenizer, parts.eos_token_ids
        self.max_context_len = parts.max_context_len
        self.runner, self.scheduler = parts.runner, parts.scheduler
        self._seed_source = random.Random(self.config.model.random_seed)
        self._stats_logger = StepStatsLogger()
        self._inbox_lock = threading.Lock()  # guards the three fields below
        self._pending_adds: list[Request] = []
        self._pending_aborts: list[str] = []
        self._known_ids: set[str] = set()  # queued or running: the one place duplicate ids are refused

    # ---- requests -------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a prompt (text or token ids); returns its request id. Raises ValueError if it can never run."""
        params = params or SamplingParams()
        token_ids = self.encode(prompt)
        if params.grammar is not None:
            if self.runner.grammars is None:
                raise ValueError("this engine has no tokenizer, so it cannot enforce a grammar")
            self.runner.grammars.check(params.grammar)
        request = Request(
            request_id=request_id or uuid.uuid4().hex,
            prompt_token_ids=token_ids,
            params=params,
            seed=params.seed if params.seed is not None else self._seed_source.getrandbits(63),
            eos_token_ids=self.eos_token_ids,
            max_context_len=self.max_context_len,
        )
        self.scheduler.validate(request)
        with self._inbox_lock:
            if request.request_id in self._known_ids:
                raise RequestRejected(f"request id {request.request_id!r} is already in use")
            self._known_ids.add(request.request_id)
            self._pending_adds.append(request)
        return request.request_id

    def abort(self, request_id: str) -> None:
        """Cancel a request; takes effect at the next step boundary (safe from any thread)."""
        with self._inbox_lock:
            self._pending_aborts.append(request_id)

    def step(self) -> list[RequestOutput]:
        """One engine step: take in new requests and aborts, schedule, run, update."""
        outputs = self._drain_inbox()
        batch = self.scheduler.schedule()
        if not batch.is_empty:
            self.followers.step(batch)
            step = self.runner.run(batch)
            self.followers.stepped(step)
            outputs += self.scheduler.update(batch, step.sampled, step.prompt_logprobs, step.reusable_tokens)
        self._forget_finished(outputs)
        self._stats_logger.record(
            sum(len(out.new_token_ids) for out in outputs), len(self.scheduler.running),
            len(self.scheduler.waiting), self.scheduler.pages.num_used, self.scheduler.pages.num_pages,
            self.spec_stats,
        )
        return outputs

    def stats(self) -> dict:
        """A snapshot for /metrics and /get_server_info (read from the loop's thread)."""
        snapshot = {
            "num_running_reqs": len(self.scheduler.running),
            "num_waiting_reqs": len(self.scheduler.waiting),
            "kv_pages_used": self.scheduler.pages.num_used,
            "kv_pages_free": self.scheduler.pages.num_free,
            "kv_pages_total": self.scheduler.pages.num_pages,
            **self._prefix_cache_stats(),
            "page_size": self.scheduler.page_size,
            "max_total_num_tokens": self.scheduler.pool_capacity_tokens,
        }
        snapshot.update(self.spec_stats or {})
        return snapshot

    def _prefix_cache_stats(self) -> dict:
        cache = self.scheduler.cache
        return {
            "prefix_cache_enabled": cache is not None,
            "prefix_cache_pages": cache.num_pages if cache else 0,
            "prefix_cache_evictable_pages": cache.num_evictable if cache else 0,
            "prefix_cache_evicted_pages": cache.evicted_pages if cache else 0,
            "prefix_cache_queried_tokens": cache.queried_tokens if cache else 0,
            "prefix_cache_hit_tokens": cache.hit_tokens if cache else 0,
            "prefix_cache_hit_rate": cache.hit_rate if cache else 0.0,
        }

    def flush_cache(self) -> int:
        """Empty the prefix cache of every page no running request uses; returns how many
        pages it freed. Safe while serving (call it from the loop's thread)."""
        return self.scheduler.flush_cache()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or bool(self._pending_adds or self._pending_aborts)

    # ---- batch API ------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[GenerationResult]:
        """Run prompts to completion (alongside anything already queued); results in prompt order."""
        per_prompt = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        results: dict[str, GenerationResult] = {}
        order = []
        for prompt, p in zip(prompts, per_prompt, strict=True):
            token_ids = self.encode(prompt)
            request_id = self.add_request(token_ids, p)
            results[request_id] = GenerationResult(request_id, token_ids)
            order.append(request_id)
        pending = set(order)
        while pending:
            for out in self.step():
                result = results.get(out.request_id)
                if result is None:
                    continue
                result.output_token_ids.extend(out.new_token_ids)
                result.logprobs.extend(out.new_logprobs)
                result.prompt_logprobs.extend(out.new_prompt_logprobs)
                if out.finished:
                    result.finish_reason = out.finish_reason
                    pending.discard(out.request_id)
        for result in results.values():
            result.text = self.decode(result.output_token_ids) if self.tokenizer else None
        return [results[r] for r in order]

    def warmup(self) -> None:
        """One short generation, so the first real request does not pay for kernel set-up."""
        self.generate([[0] * 4], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        self.followers.after_warmup()
        self.runner.after_warmup()

    def close(self) -> None:
        """Stop the other tensor-parallel ranks and leave the group (nothing with one rank)."""
        self.followers.stop()
        stop_followers(self._started_followers, timeout_s=30.0)

    # ---- text -----------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer; pass token ids")
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        return [int(t) for t in prompt]

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    # ---- the inbox: add/abort may be called from other threads, step() owns the scheduler
    def _drain_inbox(self) -> list[RequestOutput]:
        with self._inbox_lock:
            adds, self._pending_adds = self._pending_adds, []
            aborts, self._pending_aborts = self._pending_aborts, []
        for request in adds:
            self.scheduler.add(request)
        return [out for out in (self.scheduler.abort(rid) for rid in aborts) if out is not None]

    def _forget_finished(self, outputs: list[RequestOutput]) -> None:
        finished = [out.request_id for out in outputs if out.finished]
        if finished:
            with self._inbox_lock:
                self._known_ids.difference_update(finished)
            self.followers.release(finished)
            self.runner.release(finished)

    @property
    def spec_stats(self) -> dict | None:
        """Speculation counters (accept length, per-depth acceptance), or None without it."""
        return self.runner.spec_stats()

    @torch.inference_mode()
    def forward_sequences(
        self, sequences: Sequence[Sequence[int]], capture_layers: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's hidden states [sum of lengths, H] (and captured features) of whole
        sequences packed in one pass, outside serving: for scoring and training. Their pages
        are borrowed from the scheduler for the call; refused while requests are in flight."""
        if self.has_unfinished:
            raise RuntimeError("forward_sequences needs an idle engine: requests are in flight")
        if self.followers.tp.size > 1:
            raise RuntimeError("forward_sequences runs on one rank: not under tensor parallelism")
        sizes = [-(-len(tokens) // self.scheduler.page_size) for tokens in sequences]
        self.scheduler.reclaim(sum(sizes))
        with self.scheduler.pages.borrowed(sizes) as page_tables:
            return self.runner.forward_sequences(sequences, page_tables, capture_layers)

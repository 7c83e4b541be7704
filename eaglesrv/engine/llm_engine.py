"""The in-process engine: load a model, then step() = schedule, run, update.

    engine = Engine(EngineConfig(model=ModelConfig(dtype="float32")))
    results = engine.generate(["The capital of France is"], SamplingParams(temperature=0))
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from eaglesrv.configs import EngineConfig
from eaglesrv.engine.kv_cache import KVPool
from eaglesrv.engine.loader import resolve_model
from eaglesrv.engine.model.arch import ModelArch
from eaglesrv.engine.model.cpu_layout import wants_input_major
from eaglesrv.engine.model.llama import LlamaForCausalLM
from eaglesrv.engine.model_runner import ModelRunner
from eaglesrv.engine.adaptive.backlog import FeatureBacklog
from eaglesrv.engine.adaptive.calibrate import load_or_measure
from eaglesrv.engine.adaptive.controller import AdaptiveSpeculation
from eaglesrv.engine.eagle3.head_io import load_draft_head
from eaglesrv.engine.eagle3.runner import Eagle3Runner
from eaglesrv.engine.eagle3.stats import SpecStats
from eaglesrv.engine.stats_logger import StepStatsLogger
from eaglesrv.heads import DEFAULT_MODEL_HEAD, default_model_head
from eaglesrv.engine.setup import EngineSetupError, kv_pool_pages, resolve_device, resolve_dtype
from eaglesrv.kernels.attention import create_attention_backend
from eaglesrv.sampling_params import SamplingParams
from eaglesrv.scheduler import Request, RequestOutput, Scheduler
from eaglesrv.utils.malloc import keep_freed_memory

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
    text: str | None = None  # decoded output, when the engine has a tokenizer


class Engine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        if config.runtime.num_threads:
            torch.set_num_threads(config.runtime.num_threads)
        self.device = resolve_device(config.runtime)
        if self.device.type == "cpu":
            keep_freed_memory()
        self.draft_path = _draft_path(config) if config.speculative.enabled else None  # before loading, not after
        source = resolve_model(
            config.model.model_path, config.model.load_format, config.model.tokenizer_path,
            config.model.download_dir, config.model.revision,
        )
        logger.info("Loading %s", source.description)
        self.arch = ModelArch.from_hf_config(source.hf_config)
        self.dtype = resolve_dtype(config.model, source.hf_config, self.device)
        self.model = _build_model(self.arch, self.dtype, self.device, source.iter_weights, config.model.random_seed)
        self.tokenizer = None
        if source.load_tokenizer is not None and not config.model.skip_tokenizer_init:
            self.tokenizer = source.load_tokenizer()
        self.eos_token_ids = _eos_ids(self.arch, source.generation_config, self.tokenizer)
        self.max_context_len = min(config.model.context_length or self.arch.max_context_len, self.arch.max_context_len)

        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.draft = self._load_draft() if config.speculative.enabled else None
        if self.draft is not None:  # every position a request may reach must be in both rotary tables
            self.max_context_len = min(self.max_context_len, self.draft.config.arch.max_position_embeddings)
        draft_bytes_per_token = KVPool.bytes_per_token(self.draft.config.arch, self.dtype) if self.draft else 0
        if self.draft is not None:
            weight_bytes += sum(p.numel() * p.element_size() for p in self.draft.parameters())
        adaptive = config.speculative.enabled and config.speculative.adaptive
        feature_width = self.draft.fc.in_features if adaptive else 0  # a row of the backlog's pool
        num_pages = kv_pool_pages(
            config.cache, self.arch, self.dtype, self.device, weight_bytes,
            extra_bytes_per_token=draft_bytes_per_token + FeatureBacklog.bytes_per_token(feature_width, self.dtype),
        )
        self.kv = KVPool(self.arch, num_pages, config.cache.page_size, self.dtype, self.device)
        attention = create_attention_backend(config.runtime.attention_backend, config.cache.page_size, self.device)
        if self.draft is None:
            self.runner = ModelRunner(self.model, self.kv, attention, self.device)
            self.scheduler = Scheduler(config.scheduler, num_pages, config.cache.page_size)
        else:
            draft_kv = KVPool(self.draft.config.arch, num_pages, config.cache.page_size, self.dtype, self.device)
            self.runner = Eagle3Runner(self.model, self.draft, self.kv, draft_kv, attention, self.device, config.speculative)
            self.scheduler = Scheduler(
                config.scheduler, num_pages, config.cache.page_size,
                decode_lookahead=self.runner.lookahead, decode_cost=self.runner.num_nodes,
            )
            logger.info(
                "EAGLE-3: steps %d, topk %d, %d tree nodes; features from target layers %s%s",
                config.speculative.num_steps, config.speculative.eagle_topk, self.runner.num_nodes,
                self.runner.capture_layers, "; adaptive (these are the largest)" if config.speculative.adaptive else "",
            )
            if adaptive:
                costs = load_or_measure(self.runner, self.scheduler.pages, config.scheduler.max_running_requests)
                backlog = FeatureBacklog.allocate(num_pages, config.cache.page_size, feature_width, self.dtype,
                                                  self.device)
                self.runner.adaptive = AdaptiveSpeculation(self.runner.largest, costs, backlog)
        self._seed_source = random.Random(config.model.random_seed)
        self._stats_logger = StepStatsLogger()
        self._inbox_lock = threading.Lock()  # guards the three fields below
        self._pending_adds: list[Request] = []
        self._pending_aborts: list[str] = []
        self._known_ids: set[str] = set()  # queued or running, for duplicate-id checks
        logger.info(
            "Engine ready: %s, %d layers, %s on %s, context %d, attention %s",
            self.arch.family, self.arch.num_layers, self.dtype, self.device, self.max_context_len, attention.name,
        )

    # ---- requests -------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a prompt (text or token ids); returns its request id. Raises ValueError if it can never run."""
        params = params or SamplingParams()
        token_ids = self.encode(prompt)
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
                raise ValueError(f"request id {request.request_id!r} is already in use")
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
        if isinstance(self.runner, Eagle3Runner):
            self.scheduler.decode_cost = self.runner.planned_decode_cost
        batch = self.scheduler.schedule()
        if not batch.is_empty:
            outputs += self.scheduler.update(batch, self.runner.run(batch))
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
            "page_size": self.kv.page_size,
            "max_total_num_tokens": self.kv.num_tokens,
        }
        snapshot.update(self.spec_stats or {})
        return snapshot

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
                if out.finished:
                    result.finish_reason = out.finish_reason
                    pending.discard(out.request_id)
        for result in results.values():
            result.text = self.decode(result.output_token_ids) if self.tokenizer else None
        return [results[r] for r in order]

    def warmup(self) -> None:
        """One short generation, so the first real request does not pay for kernel set-up."""
        self.generate([[0] * 4], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        if isinstance(self.runner, Eagle3Runner):
            self.runner.stats = SpecStats(self.config.speculative.num_steps)  # count real traffic only
            if self.runner.adaptive is not None:
                self.runner.adaptive = self.runner.adaptive.restart()

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
            if isinstance(self.runner, Eagle3Runner):
                self.runner.forget(finished)

    def _load_draft(self):
        model = self.config.model
        path = self.draft_path
        return load_draft_head(
            path, self.arch, self.model.model.embed_tokens.weight.detach(), self.dtype, self.device,
            random_seed=model.random_seed if path is None else None,
        )

    @property
    def spec_stats(self) -> dict | None:
        """Speculation counters (accept length, per-depth acceptance), or None without it."""
        if not isinstance(self.runner, Eagle3Runner):
            return None
        snapshot = self.runner.stats.snapshot()
        if self.runner.adaptive is not None:
            snapshot.update(self.runner.adaptive.snapshot())
        return snapshot


def _build_model(arch: ModelArch, dtype: torch.dtype, device: torch.device, iter_weights, seed: int):
    started = time.monotonic()
    with torch.device("meta"):
        model = LlamaForCausalLM(arch)
    model = model.to_empty(device=device).to(dtype)
    model.model.rotary_emb.reset_tables()  # to_empty left the non-persistent tables blank
    if iter_weights is None:
        model.init_dummy_weights(seed)
    else:
        model.load_weights(iter_weights())
    if wants_input_major(dtype, device):
        model.use_input_major_weights()
    logger.info("Weights ready in %.1f s", time.monotonic() - started)
    return model.eval()


def _draft_path(config: EngineConfig) -> str | None:
    """The head to load: the one named, the shipped one for the default model, or None
    (a random head) for dummy speed runs."""
    if config.speculative.draft_model_path is not None or config.model.load_format == "dummy":
        return config.speculative.draft_model_path
    if config.model.model_path is None:
        head = default_model_head()
        if head is None:
            raise EngineSetupError(
                f"the default model's EAGLE-3 head is missing from this install ({DEFAULT_MODEL_HEAD}); "
                "reinstall eaglesrv or pass --speculative-draft-model-path"
            )
        logger.info("EAGLE-3 head: the shipped one for the default model, %s", head)
        return str(head)
    raise EngineSetupError("--speculative-algorithm EAGLE3 needs --speculative-draft-model-path")


def _eos_ids(arch: ModelArch, generation_config: dict[str, Any], tokenizer) -> frozenset[int]:
    ids = set(arch.eos_token_ids)
    gen_eos = generation_config.get("eos_token_id")
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)

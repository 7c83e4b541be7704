"""Continuous batching over a paged KV cache.

Each step, in three passes:
  1. running requests, oldest first: one token each when decoding, or their next prefill
     chunk. When one needs a page and none is free, the newest running request is
     preempted: its pages are freed and it goes back to the front of the queue, to be
     recomputed later (prompt + tokens generated so far).
  2. lookahead: decoding requests that may speculate get KV slots for a draft tree past
     their next token, from available pages only (free, or cached for nobody).
     Speculation is optional work: a request that gets none decodes plainly (same
     output), and nobody is preempted for a draft.
  3. waiting requests are admitted while the token budget, the running-request cap and
     the free pages allow, in the order --schedule-policy sets (lpm: longest cached prefix
     first; fcfs: arrival); an admitted request gets pages for its whole prefill at once,
     so that its later chunks never preempt anyone.

With the prefix cache (prefix_cache.py, on unless --disable-radix-cache), an admitted
request starts from its longest cached prefix and computes only the rest; pages that
requests have completed enter the cache after every step, and when they finish, are
preempted or aborted. Unused cached pages count as free: they are evicted, least recently
used first, whenever pages are needed, before anyone is preempted. A waiting request whose
prefix another running request is computing right now waits for it, rather than compute
the same pages alongside it.

Progress is checked every step (NoProgress): with work to do, the batch holds the oldest
running request, or with none running, the first one admission tries. The oldest running
request always fits alone (a request's context is capped at the pool's size), so a step
without it is a bug, not a state to wait out.
"""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from eaglesrv.configs.scheduler import SchedulerConfig
from eaglesrv.scheduler.batch import (
    ForwardMode,
    PromptLogprob,
    RequestOutput,
    ScheduledBatch,
    SequenceResult,
    SequenceWork,
)
from eaglesrv.scheduler.page_allocator import PageAllocator
from eaglesrv.scheduler.prefix_cache import PrefixCache, page_keys
from eaglesrv.scheduler.request import FinishReason, Request, RequestStatus

LPM_MAX_WAITING = 128


class RequestRejected(ValueError):
    """The request can never run (e.g. its prompt does not fit); the message says why."""


class NoProgress(RuntimeError):
    """A step would leave the oldest request behind: a scheduler bug, raised rather than stall."""


class DecodeDemand(Protocol):
    """What a decoding request takes from a step. The step runner answers; the scheduler
    reads it at every step, since an adaptive runner's answer changes with the load."""

    @property
    def decode_lookahead(self) -> int:
        """KV slots past its next token for a draft tree and the draft's scratch (0: none)."""

    @property
    def decode_cost(self) -> int:
        """Rows of the per-step token budget it counts for."""


@dataclass(frozen=True)
class FixedDemand:
    decode_lookahead: int = 0
    decode_cost: int = 1


PLAIN_DECODING = FixedDemand()


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, num_pages: int, page_size: int, demand: DecodeDemand = PLAIN_DECODING,
        prefix_cache: bool = False,
    ) -> None:
        self.config = config
        self.page_size = page_size
        self.demand = demand
        self.pages = PageAllocator(num_pages)
        self.cache = PrefixCache(self.pages, page_size) if prefix_cache else None
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._watermark_pages = int(config.admission_watermark * num_pages)
        self.pool_capacity_tokens = num_pages * page_size

    # ---- requests in and out -------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request; its id must be new (Engine.add_request checks that)."""
        self.validate(request)
        self._requests[request.request_id] = request
        self.waiting.append(request)

    def validate(self, request: Request) -> None:
        """Refuse a request that could never run; reads only fixed state, so safe from any thread."""
        # A single sequence can never hold more tokens than the whole pool.
        request.max_context_len = min(request.max_context_len, self.pool_capacity_tokens)
        if not request.prompt_token_ids:
            raise RequestRejected("the prompt is empty")
        if len(request.prompt_token_ids) >= request.max_context_len:
            raise RequestRejected(
                f"the prompt has {len(request.prompt_token_ids)} tokens; the limit is "
                f"{request.max_context_len - 1} (context length {request.max_context_len}, one token left to generate)"
            )

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request wherever it is; returns its final output, or None if unknown."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        else:
            self.running.remove(request)
        self._finish(request, FinishReason.ABORT)
        return _output(request, [], [])

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_available_pages(self) -> int:
        """Pages a request can get now: the free ones and the cached ones nobody uses."""
        return self.pages.num_free + (self.cache.num_evictable if self.cache else 0)

    def reclaim(self, count: int) -> None:
        """Evict cached pages until `count` are free (or nothing more can be evicted)."""
        if self.cache is not None:
            self.cache.evict(count - self.pages.num_free)

    def flush_cache(self) -> int:
        """Drop every cached page no running request uses; returns how many."""
        return self.cache.flush() if self.cache is not None else 0

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # ---- one step ------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        budget = self.config.token_budget or math.inf
        decode_cost, decode_lookahead = self.demand.decode_cost, self.demand.decode_lookahead
        oldest = self.running[0] if self.running else None
        planned: list[tuple[Request, int]] = []  # (request, tokens to compute), in batch order
        drafting: list[Request] = []  # decoding requests whose tree the budget can take
        preempted: list[str] = []

        # 1. running requests
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            remaining = request.num_tokens - request.num_computed_tokens
            decoding = remaining == 1
            may_draft = decoding and budget >= decode_cost
            if decoding and not may_draft and planned:
                break  # the rest wait for the next step; a first one always runs, plainly if need be
            count = 1 if decoding else int(min(remaining, budget))
            if not self._reserve_or_preempt(request, request.num_computed_tokens + count, preempted):
                continue  # `request` itself was preempted; the list shifted under `index`
            planned.append((request, count))
            if may_draft:
                drafting.append(request)
            budget -= decode_cost if may_draft else count
            index += 1

        # 2. draft-tree slots, never at anyone's expense
        lookahead = {request.request_id: self._grant_lookahead(request, decode_lookahead) for request in drafting}

        # 3. admission; admitting right after a preemption would only thrash the pool
        def room() -> bool:
            return budget > 0 and len(self.running) < self.config.max_running_requests

        candidates = self._admission_order() if room() and not preempted else []
        if oldest is None and candidates:
            oldest = candidates[0]  # with nothing running, the first candidate always fits
        for request in candidates:
            if not room():
                break
            if self._shares_prefix_in_flight(request):
                continue  # the pages it would share are being computed: take them next step
            hit = self._lock_cached_prefix(request)
            needed = self._pages_for(request.num_tokens) - len(hit)
            available = self.num_available_pages
            if (available - needed < self._watermark_pages and self.running) or needed > available:
                self._release_cache_lock(request)
                break
            self.waiting.remove(request)
            self._admit(request, hit, needed)
            count = int(min(request.num_tokens - request.num_computed_tokens, budget))
            planned.append((request, count))
            budget -= count

        work = [self._work(request, count, lookahead.get(request.request_id, 0)) for request, count in planned]
        if oldest is not None and oldest.request_id not in {w.request_id for w in work}:
            raise NoProgress(
                f"request {oldest.request_id!r} ({oldest.num_computed_tokens} of {oldest.num_tokens} tokens "
                f"computed, {len(oldest.page_table)} pages) got nothing this step; "
                f"{self.pages.num_free} of {self.pages.num_pages} pages free, {len(self.running)} running"
            )
        mode = ForwardMode.IDLE
        if work:
            mode = ForwardMode.DECODE if all(len(w.token_ids) == 1 and w.sample for w in work) else ForwardMode.EXTEND
        return ScheduledBatch(sequences=work, mode=mode, preempted_ids=preempted)

    def update(self, batch: ScheduledBatch, results: list[SequenceResult],
               prompt_logprobs: Mapping[int, list[PromptLogprob]] | None = None,
               reusable_tokens: Mapping[int, int] | None = None) -> list[RequestOutput]:
        """Apply a step's results: advance computed tokens, append new ones, finish.
        `prompt_logprobs`: the prompt tokens each sequence (by batch index) scored;
        `reusable_tokens`: where a sequence's engine state lags its computed tokens (StepResults).

        Tokens are appended one at a time so that a stop rule met inside a speculative run
        cuts it exactly there.
        """
        outputs: list[RequestOutput] = []
        result_iter = iter(results)
        for index, work in enumerate(batch.sequences):
            result = next(result_iter) if work.sample else None
            request = self._requests.get(work.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted after scheduling: its result is void
            request.admitted = False
            scored = (prompt_logprobs or {}).get(index)
            if scored:
                request.pending_prompt_logprobs += scored
                request.next_prompt_logprob += len(scored)
            request.num_computed_tokens = (request.num_computed_tokens + len(work.token_ids) if result is None
                                           else work.num_cached + result.num_computed)
            request.num_reusable_tokens = min(request.num_computed_tokens,
                                              (reusable_tokens or {}).get(index, request.num_computed_tokens))
            if result is None:
                self._cache_completed_pages(request)
                continue
            request.num_verify_passes += int(result.verified)
            appended, reason = [], None
            if request.params.max_tokens == 0:  # scoring only: the prompt is computed, nothing is generated
                reason = FinishReason.LENGTH
            for token_id in result.token_ids if reason is None else ():
                request.output_token_ids.append(token_id)
                appended.append(token_id)
                reason = request.stop_reason_after(token_id)
                if reason is not None:
                    break
            if reason is not None:
                self.running.remove(request)
                self._finish(request, reason)
            else:
                self._trim_pages(request)
                self._cache_completed_pages(request)
            outputs.append(_output(request, appended, result.logprobs[: len(appended)]))
        return outputs

    # ---- internals -----------------------------------------------------------------
    def _admission_order(self) -> list[Request]:
        """Waiting requests in the order admission tries them: arrival order (preempted ones
        first), or under lpm with the prefix cache on, longest cached prefix first, ties in
        arrival order. Past LPM_MAX_WAITING requests, matching every one each step would
        cost more than the order saves, and arrival order holds (as in SGLang). Admission
        matches each request again: admitting one can evict cached pages another matched here."""
        waiting = list(self.waiting)
        if self.config.schedule_policy != "lpm" or self.cache is None or not 1 < len(waiting) <= LPM_MAX_WAITING:
            return waiting
        cached = {id(r): len(self.cache.match(r.all_token_ids, r.cacheable_limit())) for r in waiting}
        return sorted(waiting, key=lambda r: -cached[id(r)])  # sorted() is stable

    def _work(self, request: Request, count: int, lookahead: int) -> SequenceWork:
        start = request.num_computed_tokens
        return SequenceWork(
            request_id=request.request_id,
            token_ids=request.token_slice(start, start + count),
            num_cached=start,
            page_table=list(request.page_table),
            sample=start + count == request.num_tokens,
            params=request.params,
            seed=request.seed,
            output_token_ids=request.output_token_ids,
            prompt_token_ids=request.prompt_token_ids,  # by reference: the prompt never changes
            next_token_id=request.token_slice(start + count, start + count + 1)[0]
            if start + count < request.num_tokens else None,
            max_context_len=request.max_context_len,
            suppressed_token_ids=request.suppressed_token_ids(),
            lookahead=lookahead,
            prompt_logprob_tokens=request.prompt_logprob_tokens(),
            admitted=request.admitted,
        )

    def _grant_lookahead(self, request: Request, lookahead: int) -> int:
        """`lookahead` slots past the next token, if the context and the free pages allow
        it whole; else 0 (the request decodes plainly this step)."""
        end = request.num_computed_tokens + 1 + lookahead
        if not lookahead or end > request.max_context_len:
            return 0
        needed = self._pages_for(end) - len(request.page_table)
        if needed > self.num_available_pages:
            return 0
        if needed > 0:
            request.page_table.extend(self._allocate(needed))
        return lookahead

    def _trim_pages(self, request: Request) -> None:
        """Give back pages past the computed tokens (rejected draft nodes, draft scratch)."""
        keep = self._pages_for(request.num_computed_tokens)
        if len(request.page_table) > keep:
            self.pages.free(request.page_table[keep:])
            del request.page_table[keep:]

    def _allocate(self, count: int) -> list[int]:
        """`count` pages, evicting unused cached ones if the free list is short."""
        self.reclaim(count)
        return self.pages.allocate(count)

    def _release_pages(self, request: Request) -> None:
        """The request lets go of its pages (leaving what it completed in the cache)."""
        self._cache_completed_pages(request)
        self._release_cache_lock(request)
        if request.page_table:
            self.pages.free(request.page_table)
            request.page_table = []

    # ---- the prefix cache --------------------------------------------------------------
    def _lock_cached_prefix(self, request: Request) -> list[int]:
        """Pages of the request's longest cached prefix, locked for it (none without a cache)."""
        if self.cache is None:
            return []
        nodes = self.cache.match(request.all_token_ids, request.cacheable_limit())
        if nodes:
            request.cache_node = nodes[-1]
            self.cache.lock(nodes[-1])
        return [node.page for node in nodes]

    def _release_cache_lock(self, request: Request) -> None:
        if request.cache_node is not None:
            self.cache.unlock(request.cache_node)
            request.cache_node = None

    def _admit(self, request: Request, hit: list[int], needed: int) -> None:
        """Running, with the cached pages `hit` and `needed` new ones for the rest of its tokens."""
        self.pages.share(hit)
        request.page_table = hit + self._allocate(needed)
        request.num_computed_tokens = request.num_reusable_tokens = len(hit) * self.page_size
        if self.cache is not None:
            self.cache.record_lookup(request.num_tokens, request.num_computed_tokens)
        if request.num_preemptions == 0:
            request.num_cached_prompt_tokens = request.num_computed_tokens
        request.admitted = True
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _cache_completed_pages(self, request: Request) -> None:
        """Put the request's completed full pages in the cache and lock its path to them."""
        if self.cache is None or not request.page_table:
            return
        complete = min(request.num_reusable_tokens, request.num_tokens - 1)  # a page's key takes the next token
        start = request.cache_node
        if complete // self.page_size <= (start.depth if start is not None else 0):
            return  # no page completed since the last time
        node = self.cache.insert(request.all_token_ids, request.page_table, complete, start)  # a deeper node
        self.cache.lock(node)
        self._release_cache_lock(request)
        request.cache_node = node

    def _shares_prefix_in_flight(self, request: Request) -> bool:
        """Whether a running request is computing pages `request` would find cached once
        they are done (more than the cache holds for it now)."""
        if self.cache is None:
            return False
        tokens, size, limit = request.all_token_ids, self.page_size, request.cacheable_limit()
        for other in self.running:
            if other.num_reusable_tokens >= len(other.prompt_token_ids):
                continue  # past its prefill: what it completed is cached already
            shared = _shared_pages(tokens, other.prompt_token_ids, size, limit)
            if shared * size > other.num_reusable_tokens and shared > len(self.cache.match(tokens, shared * size)):
                return True
        return False

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _reserve_or_preempt(self, request: Request, total_tokens: int, preempted: list[str]) -> bool:
        """Give `request` pages for `total_tokens`, preempting the newest requests if needed.

        Returns False when `request` itself had to be preempted.
        """
        while True:
            needed = self._pages_for(total_tokens) - len(request.page_table)
            if needed <= self.num_available_pages:
                if needed > 0:
                    request.page_table.extend(self._allocate(needed))
                return True
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release_pages(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        self._release_pages(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self._requests[request.request_id]


def _shared_pages(tokens: list[int], other: list[int], size: int, limit: int) -> int:
    """Leading full pages `tokens` shares with `other` (their cache keys equal), within `limit` tokens."""
    pairs = zip(page_keys(tokens, size, limit), page_keys(other, size, len(other)))
    return sum(1 for _ in itertools.takewhile(lambda pair: pair[0] == pair[1], pairs))


def _output(request: Request, new_tokens: list[int], logprobs: list) -> RequestOutput:
    scored, request.pending_prompt_logprobs = request.pending_prompt_logprobs, []
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=new_tokens,
        num_prompt_tokens=len(request.prompt_token_ids),
        num_output_tokens=len(request.output_token_ids),
        finish_reason=request.finish_reason.value if request.finish_reason else None,
        new_logprobs=logprobs,
        new_prompt_logprobs=scored,
        spec_verify_ct=request.num_verify_passes,
        num_cached_tokens=request.num_cached_prompt_tokens,
    )

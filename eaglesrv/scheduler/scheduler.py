"""Continuous batching over a paged KV cache.

Each step, in three passes:
  1. running requests, oldest first: one token each when decoding, or their next prefill
     chunk. When one needs a page and none is free, the newest running request is
     preempted: its pages are freed and it goes back to the front of the queue, to be
     recomputed later (prompt + tokens generated so far).
  2. lookahead: decoding requests that may speculate get KV slots for a draft tree past
     their next token, from free pages only. Speculation is optional work: a request that
     gets none decodes plainly (same output), and nobody is preempted for a draft.
  3. waiting requests are admitted while the token budget, the running-request cap and
     the free pages allow; an admitted request gets pages for its whole prefill at once,
     so that its later chunks never preempt anyone.

Progress is checked every step (NoProgress): with work to do, the batch holds the oldest
running request, or with none running, the first waiting one. The oldest running request
always fits alone (a request's context is capped at the pool's size), so a step without it
is a bug, not a state to wait out.
"""

from __future__ import annotations

import collections
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
from eaglesrv.scheduler.request import FinishReason, Request, RequestStatus


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
        self, config: SchedulerConfig, num_pages: int, page_size: int, demand: DecodeDemand = PLAIN_DECODING
    ) -> None:
        self.config = config
        self.page_size = page_size
        self.demand = demand
        self.pages = PageAllocator(num_pages)
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
    def num_requests(self) -> int:
        return len(self._requests)

    # ---- one step ------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        budget = self.config.token_budget or math.inf
        decode_cost, decode_lookahead = self.demand.decode_cost, self.demand.decode_lookahead
        oldest = self.running[0] if self.running else (self.waiting[0] if self.waiting else None)
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
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_running_requests:
            request = self.waiting[0]
            count = int(min(request.num_tokens, budget))
            needed = self._pages_for(request.num_tokens)
            if self.pages.num_free - needed < self._watermark_pages and self.running:
                break
            if needed > self.pages.num_free:
                break
            self.waiting.popleft()
            request.page_table = self.pages.allocate(needed)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
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
               prompt_logprobs: Mapping[int, list[PromptLogprob]] | None = None) -> list[RequestOutput]:
        """Apply a step's results: advance computed tokens, append new ones, finish.
        `prompt_logprobs`: the prompt tokens each sequence (by batch index) scored.

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
            scored = (prompt_logprobs or {}).get(index)
            if scored:
                request.pending_prompt_logprobs += scored
                request.next_prompt_logprob += len(scored)
            if result is None:
                request.num_computed_tokens += len(work.token_ids)
                continue
            request.num_computed_tokens = work.num_cached + result.num_computed
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
            outputs.append(_output(request, appended, result.logprobs[: len(appended)]))
        return outputs

    # ---- internals -----------------------------------------------------------------
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
            next_token_id=request.token_slice(start + count, start + count + 1)[0]
            if start + count < request.num_tokens else None,
            max_context_len=request.max_context_len,
            suppressed_token_ids=request.suppressed_token_ids(),
            lookahead=lookahead,
            prompt_logprob_tokens=request.prompt_logprob_tokens(),
        )

    def _grant_lookahead(self, request: Request, lookahead: int) -> int:
        """`lookahead` slots past the next token, if the context and the free pages allow
        it whole; else 0 (the request decodes plainly this step)."""
        end = request.num_computed_tokens + 1 + lookahead
        if not lookahead or end > request.max_context_len:
            return 0
        needed = self._pages_for(end) - len(request.page_table)
        if needed > self.pages.num_free:
            return 0
        if needed > 0:
            request.page_table.extend(self.pages.allocate(needed))
        return lookahead

    def _trim_pages(self, request: Request) -> None:
        """Give back pages past the computed tokens (rejected draft nodes, draft scratch)."""
        keep = self._pages_for(request.num_computed_tokens)
        if len(request.page_table) > keep:
            self.pages.free(request.page_table[keep:])
            del request.page_table[keep:]

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _reserve_or_preempt(self, request: Request, total_tokens: int, preempted: list[str]) -> bool:
        """Give `request` pages for `total_tokens`, preempting the newest requests if needed.

        Returns False when `request` itself had to be preempted.
        """
        while True:
            needed = self._pages_for(total_tokens) - len(request.page_table)
            if needed <= self.pages.num_free:
                if needed > 0:
                    request.page_table.extend(self.pages.allocate(needed))
                return True
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.pages.free(request.page_table)
        request.page_table = []
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.page_table:
            self.pages.free(request.page_table)
            request.page_table = []
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self._requests[request.request_id]


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
    )

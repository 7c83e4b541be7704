"""One generation ("choice") as text pieces, and several of them run side by side.

run_choice drives one engine request: it detokenizes incrementally, applies stop strings
(aborting the engine request when one matches), records latency metrics, and yields a
ChoiceDelta per engine step. Every endpoint (chat, completions, /generate) builds on it,
so streamed and non-streamed text come from the same code and cannot differ.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence

from eaglesrv.engine.client import EngineDeadError
from eaglesrv.engine.protocol import EngineOutput, WireLogprob
from eaglesrv.sampling_params import SamplingParams
from eaglesrv.scheduler import RequestRejected
from eaglesrv.scheduler.batch import PromptLogprob
from eaglesrv.server.detokenizer import IncrementalDetokenizer
from eaglesrv.server.errors import error_body
from eaglesrv.server.formatting import sse
from eaglesrv.server.state import ServerState
from eaglesrv.server.stop_strings import StopStringFilter


@dataclass
class ChoiceDelta:
    """What one engine step added to one choice."""

    index: int
    text: str  # newly released text (may be "" while a character or stop string is pending)
    token_ids: list[int]
    logprobs: list[WireLogprob]
    num_prompt_tokens: int
    num_output_tokens: int  # so far, including the token that finished it
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last delta
    matched_stop: str | int | None = None  # the stop string or stop token id that ended it
    spec_verify_ct: int = 0  # speculative verifications so far
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)  # the scored prompt, in the first delta
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied


@dataclass
class ChoiceResult:
    """A whole choice, accumulated from its deltas."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[WireLogprob] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    spec_verify_ct: int = 0
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    num_cached_tokens: int = 0

    def add(self, delta: ChoiceDelta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.prompt_logprobs += delta.prompt_logprobs
        self.num_prompt_tokens = delta.num_prompt_tokens
        self.num_output_tokens = delta.num_output_tokens
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.matched_stop = delta.matched_stop if delta.matched_stop is not None else self.matched_stop
        self.spec_verify_ct = delta.spec_verify_ct
        self.num_cached_tokens = delta.num_cached_tokens


async def run_choice(
    state: ServerState,
    index: int,
    prompt_ids: list[int],
    params: SamplingParams,
    stop_strings: Sequence[str] = (),
    skip_special_tokens: bool = True,
) -> AsyncIterator[ChoiceDelta]:
    """Yield one ChoiceDelta per engine step until the choice finishes."""
    text = _ChoiceText(state, prompt_ids, params, stop_strings, skip_special_tokens)
    started = last_token_at = time.monotonic()
    num_prompt = len(prompt_ids)
    reason: str | None = None
    try:
        async with aclosing(state.client.stream(prompt_ids, params)) as outputs:
            async for out in outputs:
                now = time.monotonic()
                first = out.num_output_tokens == len(out.new_token_ids)
                _record_latency(state, first, len(out.new_token_ids), now - (started if first else last_token_at))
                last_token_at = now
                num_prompt = out.num_prompt_tokens
                piece, reason, matched = text.add(out)
                if reason is not None:
                    state.metrics.request_finished(reason, num_prompt, now - started)
                yield ChoiceDelta(index, piece, list(out.new_token_ids), list(out.new_logprobs), num_prompt,
                                  out.num_output_tokens, reason, matched, out.spec_verify_ct,
                                  list(out.new_prompt_logprobs), out.num_cached_tokens)
                if reason is not None:
                    return  # after a stop string, leaving the stream aborts the engine request
    finally:
        if reason is None:  # the client left, or the engine failed
            state.metrics.request_finished("abort", num_prompt, time.monotonic() - started)


class _ChoiceText:
    """Engine outputs -> released text, finish reason and matched stop, for one choice."""

    def __init__(self, state: ServerState, prompt_ids: list[int], params: SamplingParams,
                 stop_strings: Sequence[str], skip_special_tokens: bool) -> None:
        self._detok = None
        if state.tokenizer is not None:
            self._detok = IncrementalDetokenizer(state.tokenizer, prompt_ids, skip_special_tokens)
        self._stops = StopStringFilter(stop_strings)
        self._stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos and state.info is not None:
            self._stop_ids.update(state.info.eos_token_ids)

    def add(self, out: EngineOutput) -> tuple[str, str | None, str | int | None]:
        matched: str | int | None = None
        text_ids = out.new_token_ids
        if out.finish_reason == "stop" and text_ids and text_ids[-1] in self._stop_ids:
            matched = text_ids[-1]
            text_ids = text_ids[:-1]  # EOS / stop token: it ends the text, it is not part of it
        text = ""
        if self._detok is not None:
            text = self._detok.add(text_ids) + (self._detok.flush() if out.finished else "")
        text, hit = self._stops.feed(text, final=out.finished)
        if hit is not None:
            return text, "stop", hit
        return text, out.finish_reason, matched


def _record_latency(state: ServerState, first: bool, new_tokens: int, elapsed_s: float) -> None:
    if new_tokens <= 0:
        return
    state.metrics.generation_tokens.inc(new_tokens)
    if first:
        state.metrics.ttft.observe(elapsed_s)
        return
    # Several tokens in one step (speculation): spread the gap over them, as bench_serving does.
    for _ in range(new_tokens):
        state.metrics.itl.observe(elapsed_s / new_tokens)


async def merge_choices(runs: list[AsyncIterator[ChoiceDelta]]) -> AsyncIterator[ChoiceDelta]:
    """Interleave several choices' deltas as they arrive (n > 1, or several prompts).

    Each run is pumped by its own task; leaving early (client gone) cancels the tasks,
    which closes every run and so aborts every engine request.
    """
    if len(runs) == 1:
        async with aclosing(runs[0]) as only:
            async for delta in only:
                yield delta
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(run: AsyncIterator[ChoiceDelta]) -> None:
        try:
            async with aclosing(run) as deltas:
                async for delta in deltas:
                    queue.put_nowait(delta)
            queue.put_nowait(done)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
            queue.put_nowait(exc)

    tasks = [asyncio.create_task(pump(run)) for run in runs]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect_choices(runs: list[AsyncIterator[ChoiceDelta]]) -> list[ChoiceResult]:
    """Run choices to the end; results in index order."""
    results: dict[int, ChoiceResult] = {}
    async with aclosing(merge_choices(runs)) as deltas:
        async for delta in deltas:
            results.setdefault(delta.index, ChoiceResult(delta.index)).add(delta)
    return [results[i] for i in sorted(results)]


STREAM_FAILURES = (EngineDeadError, RequestRejected)  # what ends a stream with an error event


def stream_error(exc: Exception) -> str:
    """The SSE error event for a stream that cannot go on (503 engine gone, 400 rejected)."""
    return sse(error_body(503 if isinstance(exc, EngineDeadError) else 400, str(exc)))

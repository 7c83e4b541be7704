"""POST /v1/completions."""

from __future__ import annotations

from contextlib import aclosing
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from eaglesrv.server.formatting import (
    SSE_DONE,
    SSEResponse,
    TokenText,
    cached_prompt_tokens,
    completion_logprobs,
    echoed_prompt_logprobs,
    joined_logprobs,
    new_id,
    now_s,
    parse_body,
    sse,
    until_disconnected,
    usage,
    vllm_prompt_logprobs,
)
from eaglesrv.server.generation import (
    STREAM_FAILURES,
    ChoiceDelta,
    collect_choices,
    merge_choices,
    run_choice,
    stream_error,
)
from eaglesrv.server.openai_protocol import CompletionRequest
from eaglesrv.server.request_prep import (
    check_choices,
    check_logprob_counts,
    check_prompt,
    check_stop_rules,
    completion_prompts,
    openai_sampling_params,
    prompt_list,
    with_choice_seed,
)
from eaglesrv.server.state import ServerState
from eaglesrv.server.structured import openai_grammar


def completions_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        handler = await state.prepare(CompletionHandler, state, body)  # tokenizes: off the event loop
        return await handler.respond(request)

    return router


class CompletionHandler:
    """One completions request: n choices for each of its prompts.

    Choice index = prompt_index * n + i, as in OpenAI's API.
    """

    def __init__(self, state: ServerState, body: CompletionRequest) -> None:
        body.refuse_unsupported()
        info = state.require_serving()
        state.check_model(body.model)
        prompts = prompt_list(body.prompt)
        check_choices(state.server_config, len(prompts), body.n)
        check_stop_rules(state.server_config, info, body.stop_strings, body.stop_token_ids)
        check_logprob_counts(state.server_config, logprobs=body.logprobs, prompt_logprobs=body.prompt_logprobs)
        self.prompts = completion_prompts(prompts, state)
        for prompt_ids in self.prompts:
            check_prompt(prompt_ids, info, body.output_limit, param="prompt")
        self.params = openai_sampling_params(info, body, body.logprobs, openai_grammar(body, state))
        self.echo_logprobs = body.echo and body.logprobs is not None  # the echoed prompt's logprobs too
        self.state = state
        self.body = body
        self.id = new_id("cmpl")
        self.created = now_s()
        self.model = info.model_name
        self.token_text = TokenText(state.tokenizer)
        self.num_choices = len(self.prompts) * body.n

    def _prompt_text(self, index: int) -> str:
        """What echo puts before choice `index`'s text: its prompt, as text."""
        if not self.body.echo:
            return ""
        prompt = self.body.prompt
        prompt_index = index // self.body.n
        if isinstance(prompt, str):
            return prompt
        if all(isinstance(p, str) for p in prompt):
            return prompt[prompt_index]
        if self.state.tokenizer is None:
            return ""
        skip = self.body.skip_special_tokens
        return self.state.tokenizer.decode(self.prompts[prompt_index], skip_special_tokens=skip)

    def _unechoed_ids(self) -> frozenset[int]:
        """Special tokens that _prompt_text leaves out of a token-id prompt's echo."""
        decoded = not isinstance(self.body.prompt, str) and not all(isinstance(p, str) for p in self.body.prompt)
        if not (decoded and self.body.skip_special_tokens and self.state.tokenizer is not None):
            return frozenset()
        return frozenset(self.state.tokenizer.all_special_ids)

    def _runs(self) -> list[AsyncIterator[ChoiceDelta]]:
        n = self.body.n
        return [
            run_choice(self.state, p * n + i, prompt_ids, with_choice_seed(self.params, i),
                       self.body.stop_strings, self.body.skip_special_tokens)
            for p, prompt_ids in enumerate(self.prompts)
            for i in range(n)
        ]

    def _logprobs(self, delta_logprobs, text_offset: int):
        if self.body.logprobs is None:
            return None
        return completion_logprobs(delta_logprobs, self.token_text, self.body.logprobs, text_offset)

    def _prompt_fields(self, index: int, scored) -> dict:
        """The scored prompt of choice `index`: the echo's logprobs, and vLLM's prompt_logprobs when asked."""
        prompt_ids = self.prompts[index // self.body.n]
        fields = {}
        if self.echo_logprobs:
            fields["logprobs"] = echoed_prompt_logprobs(prompt_ids, scored, self.token_text, self.body.logprobs,
                                                        self._unechoed_ids())
        if self.body.prompt_logprobs is not None:
            fields["prompt_logprobs"] = vllm_prompt_logprobs(prompt_ids, scored, self.token_text)
        return fields

    @property
    def _prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    async def respond(self, request: Request) -> Response:
        release = self.state.admit(self.num_choices)
        if self.body.stream:
            return SSEResponse(self._stream(), release)
        try:
            results = await until_disconnected(request, collect_choices(self._runs()))
        finally:
            release()
        choices = []
        for r in results:
            prefix = self._prompt_text(r.index)
            choice = {
                "index": r.index, "text": prefix + r.text,
                "logprobs": self._logprobs(r.logprobs, len(prefix)),
                "finish_reason": r.finish_reason, "matched_stop": r.matched_stop,
            }
            prompt = self._prompt_fields(r.index, r.prompt_logprobs)
            if "logprobs" in prompt:
                choice["logprobs"] = joined_logprobs(prompt.pop("logprobs"), choice["logprobs"])
            choices.append({**choice, **prompt})
        return JSONResponse({
            "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
            "choices": choices,
            "usage": usage(self._prompt_tokens, sum(r.num_output_tokens for r in results),
                           cached_prompt_tokens({r.index: r.num_cached_tokens for r in results}, self.body.n)),
        })

    async def _stream(self) -> AsyncIterator[str]:
        completion_tokens: dict[int, int] = {}
        cached_tokens: dict[int, int] = {}
        offsets = {i: len(self._prompt_text(i)) for i in range(self.num_choices)}
        scores_prompt = self.body.prompt_scores is not None
        try:
            if self.body.echo and not scores_prompt:
                for i in range(self.num_choices):
                    echo = {"index": i, "text": self._prompt_text(i), "logprobs": None, "finish_reason": None}
                    yield self._chunk(echo)
            async with aclosing(merge_choices(self._runs())) as deltas:
                async for d in deltas:
                    if scores_prompt and d.index not in completion_tokens:  # its first delta: the scored prompt
                        yield self._chunk({"index": d.index, "text": self._prompt_text(d.index), "logprobs": None,
                                           "finish_reason": None, **self._prompt_fields(d.index, d.prompt_logprobs)})
                    completion_tokens[d.index] = d.num_output_tokens
                    cached_tokens[d.index] = d.num_cached_tokens
                    has_logprobs = self.body.logprobs is not None and d.logprobs
                    if not (d.text or has_logprobs or d.finish_reason):
                        continue  # text held back (partial character or possible stop string)
                    yield self._chunk({
                        "index": d.index, "text": d.text,
                        "logprobs": self._logprobs(d.logprobs, offsets[d.index]) if has_logprobs else None,
                        "finish_reason": d.finish_reason,
                    })
                    offsets[d.index] += len(d.text)
            if self.body.include_usage:
                yield sse({**self._envelope(), "choices": [],
                           "usage": usage(self._prompt_tokens, sum(completion_tokens.values()),
                                          cached_prompt_tokens(cached_tokens, self.body.n))})
        except STREAM_FAILURES as exc:
            yield stream_error(exc)
        yield SSE_DONE

    def _envelope(self) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model}

    def _chunk(self, choice: dict) -> str:
        payload = {**self._envelope(), "choices": [choice]}
        if self.body.include_usage:
            payload["usage"] = None
        return sse(payload)

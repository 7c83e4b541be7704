"""POST /v1/chat/completions."""

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
    chat_logprobs,
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
from eaglesrv.server.openai_protocol import ChatCompletionRequest
from eaglesrv.server.request_prep import (
    chat_prompt_ids,
    check_choices,
    check_logprob_counts,
    check_prompt,
    check_stop_rules,
    openai_sampling_params,
    with_choice_seed,
)
from eaglesrv.server.state import ServerState
from eaglesrv.server.structured import openai_grammar
from eaglesrv.server.tools.prompting import default_format
from eaglesrv.server.tools.responses import prepare_chat_tools


def chat_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        handler = await state.prepare(ChatHandler, state, body)  # tokenizes: off the event loop
        return await handler.respond(request)

    return router


class ChatHandler:
    """One chat request: prepare it, then answer it whole or as a stream."""

    def __init__(self, state: ServerState, body: ChatCompletionRequest) -> None:
        body.refuse_unsupported()
        info = state.require_serving()
        state.check_model(body.model)
        tokenizer = state.require_tokenizer("chat")
        check_choices(state.server_config, 1, body.n)
        check_stop_rules(state.server_config, info, body.stop_strings, body.stop_token_ids)
        self.tools = prepare_chat_tools(tokenizer, [m.for_template() for m in body.messages], body.tools,
                                        body.tool_choice, body.parallel_tool_calls,
                                        state.server_config.tool_call_parser or default_format(tokenizer),
                                        openai_grammar(body, state))
        state.check_prompt_chars(self.tools.prompt_chars, "messages")
        self.prompt_ids = chat_prompt_ids(tokenizer, self.tools.messages, body.chat_template_kwargs,
                                          self.tools.template_tools)
        check_prompt(self.prompt_ids, info, body.output_limit, param="messages")
        check_logprob_counts(state.server_config, top_logprobs=body.top_logprobs, prompt_logprobs=body.prompt_logprobs)
        self.top_n = (body.top_logprobs or 0) if body.logprobs else None
        self.params = openai_sampling_params(info, body, self.top_n, self.tools.grammar)
        self.skip_special_tokens = body.skip_special_tokens and not self.tools.keep_special_tokens
        self.state = state
        self.body = body
        self.id = new_id("chatcmpl")
        self.created = now_s()
        self.model = info.model_name
        self.token_text = TokenText(tokenizer)

    def _runs(self) -> list[AsyncIterator[ChoiceDelta]]:
        # the prompt is the same for every choice: the first scores it (vLLM's prompt_logprobs)
        return [
            run_choice(self.state, i, self.prompt_ids,
                       with_choice_seed(self.params if i == 0 else self.params.replace(prompt_logprobs=None), i),
                       self.body.stop_strings, self.skip_special_tokens)
            for i in range(self.body.n)
        ]

    def _prompt_logprobs(self, scored) -> dict:
        if self.body.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": vllm_prompt_logprobs(self.prompt_ids, scored, self.token_text)}

    async def respond(self, request: Request) -> Response:
        release = self.state.admit(self.body.n)
        if self.body.stream:
            return SSEResponse(self._stream(), release)
        try:
            results = await until_disconnected(request, collect_choices(self._runs()))
        finally:
            release()
        choices = []
        for r in results:
            message, finish_reason = self.tools.message(r.text, r.finish_reason)
            choices.append({
                "index": r.index,
                "message": message,
                "logprobs": chat_logprobs(r.logprobs, self.token_text, self.top_n) if self.top_n is not None else None,
                "finish_reason": finish_reason,
                "matched_stop": r.matched_stop,
            })
        return JSONResponse({
            "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
            "choices": choices,
            "usage": usage(len(self.prompt_ids), sum(r.num_output_tokens for r in results),
                           cached_prompt_tokens({r.index: r.num_cached_tokens for r in results}, self.body.n)),
            **self._prompt_logprobs(results[0].prompt_logprobs),
        })

    async def _stream(self) -> AsyncIterator[str]:
        include_usage = self.body.include_usage
        completion_tokens: dict[int, int] = {}
        cached_tokens: dict[int, int] = {}
        streams = [self.tools.choice_stream() for _ in range(self.body.n)]  # each choice's calls are its own
        try:
            for i in range(self.body.n):
                yield self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None})
            async with aclosing(merge_choices(self._runs())) as deltas:
                async for d in deltas:
                    if d.prompt_logprobs and self.body.prompt_logprobs is not None:  # choice 0's first delta
                        yield self._chunk({"index": d.index, "delta": {}, "logprobs": None, "finish_reason": None},
                                          self._prompt_logprobs(d.prompt_logprobs))
                    completion_tokens[d.index] = d.num_output_tokens
                    cached_tokens[d.index] = d.num_cached_tokens
                    has_logprobs = self.top_n is not None and d.logprobs
                    delta = streams[d.index].delta(d.text, finished=d.finish_reason is not None)
                    if not (delta or has_logprobs or d.finish_reason):
                        continue  # text held back (partial character, possible stop string or tool call)
                    yield self._chunk({
                        "index": d.index,
                        "delta": delta,
                        "logprobs": chat_logprobs(d.logprobs, self.token_text, self.top_n) if has_logprobs else None,
                        "finish_reason": streams[d.index].finish_reason(d.finish_reason),
                    })
            if include_usage:
                yield sse({**self._envelope(), "choices": [],
                           "usage": usage(len(self.prompt_ids), sum(completion_tokens.values()),
                                          cached_prompt_tokens(cached_tokens, self.body.n))})
        except STREAM_FAILURES as exc:
            yield stream_error(exc)
        yield SSE_DONE

    def _envelope(self) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model}

    def _chunk(self, choice: dict, extra: dict | None = None) -> str:
        payload = {**self._envelope(), "choices": [choice], **(extra or {})}
        if self.body.include_usage:
            payload["usage"] = None
        return sse(payload)

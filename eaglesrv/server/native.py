"""SGLang's native API: POST /generate, GET /get_server_info, GET /get_model_info,
POST /flush_cache; enough for SGLang's bench_serving with --backend sglang.

/generate streams events whose "text" is all the text so far (SGLang's convention), with
meta_info.completion_tokens, then `data: [DONE]`.
"""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

import eaglesrv
from eaglesrv.configs.cli import ENGINE_FLAGS
from eaglesrv.server.errors import bad_request
from eaglesrv.server.formatting import (
    SSE_DONE,
    SSEResponse,
    TokenText,
    new_id,
    parse_body,
    sse,
    until_disconnected,
)
from eaglesrv.server.generation import (
    STREAM_FAILURES,
    ChoiceDelta,
    ChoiceResult,
    collect_choices,
    merge_choices,
    run_choice,
    stream_error,
)
from eaglesrv.server.request_prep import (
    build_sampling_params,
    check_choices,
    check_logprob_counts,
    check_prompt,
    check_stop_rules,
    completion_prompts,
    prompt_list,
)
from eaglesrv.server.state import ServerState
from eaglesrv.server.structured import native_grammar
from eaglesrv.server.unsupported import NATIVE_BODY_FIELDS, NATIVE_SAMPLING_FIELDS, refuse_known_unsupported


class NativeSamplingParams(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # kept for refuse_known_unsupported

    max_new_tokens: int | None = 128  # SGLang's default
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    min_new_tokens: int = Field(0, ge=0)
    sampling_seed: int | None = None
    n: int = Field(1, ge=1, le=1)


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept for refuse_known_unsupported; others are ignored

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0)
    # With return_logprob: the first prompt position whose logprob is returned; -1 (SGLang's
    # default): the last prompt token only.
    logprob_start_len: int = Field(-1, ge=-1)
    return_text_in_logprobs: bool = False


def native_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.post("/generate")
    async def generate(request: Request) -> Response:
        body = await parse_body(request, GenerateRequest)
        handler = await state.prepare(GenerateHandler, state, body)  # tokenizes: off the event loop
        return await handler.respond(request)

    @router.get("/get_server_info")
    async def get_server_info() -> Response:
        info = state.require_serving()
        stats = await state.client.stats()
        internal = {
            # bench_serving prints "Accept length" from this; None when speculation is off.
            "avg_spec_accept_length": None,
            **(stats.speculation or {}),
            "num_running_reqs": stats.num_running,
            "num_waiting_reqs": stats.num_waiting,
            "kv_pages_used": stats.kv_pages_used,
            "kv_pages_free": stats.kv_pages_free,
            "kv_pages_total": stats.kv_pages_total,
            "page_size": stats.page_size,
            "token_usage": stats.token_usage,
            **stats.prefix_cache,
        }
        return JSONResponse({
            **_flag_values(state), "served_model_name": info.model_name, "context_length": info.max_context_len,
            "max_total_num_tokens": info.num_pages * info.page_size, "dtype": info.dtype, "device": info.device,
            "version": eaglesrv.__version__, "internal_states": [internal],
        })

    @router.get("/get_model_info")
    async def get_model_info() -> Response:
        info = state.require_serving()
        return JSONResponse({"model_path": info.model_path or info.model_name, "tokenizer_path": info.tokenizer_path,
                             "is_generation": True, "context_length": info.max_context_len})

    @router.post("/flush_cache")
    async def flush_cache() -> Response:
        # Pages running requests use stay; every other cached page is freed (SGLang refuses
        # the whole flush while requests run, which bench_serving's warm-up never meets).
        state.require_serving()
        stats = await state.client.stats(flush_cache=True)
        kept = stats.prefix_cache.get("prefix_cache_pages", 0)
        note = f" {kept} pages kept for running requests." if kept else ""
        return Response(f"Cache flushed.{note}\n", media_type="text/plain")

    return router


def _flag_values(state: ServerState) -> dict:
    """The effective settings under SGLang's server-arg names (no secrets)."""
    values = {}
    for flag in ENGINE_FLAGS:
        group = getattr(state.engine_config, flag.group)
        values[flag.names[0].removeprefix("--").replace("-", "_")] = getattr(group, flag.field)
    server = state.server_config
    values.update(host=server.host, port=server.port, log_level=server.log_level,
                  enable_metrics=server.enable_metrics, max_queued_requests=server.max_queued_requests,
                  max_stop_strings=server.max_stop_strings, max_stop_string_length=server.max_stop_string_length,
                  max_stop_token_ids=server.max_stop_token_ids,
                  max_choices_per_request=server.max_choices_per_request, max_logprobs=server.max_logprobs)
    return values


class GenerateHandler:
    def __init__(self, state: ServerState, body: GenerateRequest) -> None:
        info = state.require_serving()
        if (body.text is None) == (body.input_ids is None):
            raise bad_request("give exactly one of text and input_ids", param="text")
        self.batched = isinstance(body.text, list) or bool(body.input_ids and isinstance(body.input_ids[0], list))
        prompts = prompt_list(body.text if body.text is not None else body.input_ids)
        param = "text" if body.text is not None else "input_ids"
        check_choices(state.server_config, len(prompts), 1, param=param)
        sp = body.sampling_params
        refuse_known_unsupported(body, NATIVE_BODY_FIELDS)
        refuse_known_unsupported(sp, NATIVE_SAMPLING_FIELDS, prefix="sampling_params.")
        self.stop_strings = [] if sp.stop is None else [sp.stop] if isinstance(sp.stop, str) else list(sp.stop)
        check_stop_rules(state.server_config, info, self.stop_strings, sp.stop_token_ids, prefix="sampling_params.")
        check_logprob_counts(state.server_config, top_logprobs_num=body.top_logprobs_num)
        self.prompts = completion_prompts(prompts, state, param)
        for prompt_ids in self.prompts:
            check_prompt(prompt_ids, info, sp.max_new_tokens, param=param)
        start = body.logprob_start_len
        starts = [start if start >= 0 else len(ids) - 1 for ids in self.prompts]
        if body.return_logprob and any(start >= len(ids) for start, ids in zip(starts, self.prompts)):
            raise bad_request(f"logprob_start_len {body.logprob_start_len} is not inside the prompt",
                              param="logprob_start_len")
        self.params = build_sampling_params(
            info, max_tokens=sp.max_new_tokens, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
            min_p=sp.min_p, presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
            repetition_penalty=sp.repetition_penalty, logit_bias=sp.logit_bias, seed=sp.sampling_seed,
            stop_token_ids=sp.stop_token_ids, ignore_eos=sp.ignore_eos,
            min_tokens=sp.min_new_tokens,
            logprobs=body.top_logprobs_num if body.return_logprob else None,
            prompt_logprobs=body.top_logprobs_num if body.return_logprob else None,
            grammar=native_grammar(sp, state),
        )
        self.starts = starts
        self.token_text = TokenText(state.tokenizer)
        self.state = state
        self.body = body
        self.id = new_id("gen")
        self.started = time.monotonic()

    def _runs(self) -> list[AsyncIterator[ChoiceDelta]]:
        skip = self.body.sampling_params.skip_special_tokens
        return [run_choice(self.state, i, ids, self.params.replace(logprob_start_len=start), self.stop_strings, skip)
                for i, (ids, start) in enumerate(zip(self.prompts, self.starts))]

    def _entry(self, logprob: float | None, token_id: int) -> list:
        """SGLang's [logprob, token id, text or None]."""
        return [logprob, token_id, self.token_text(token_id) if self.body.return_text_in_logprobs else None]

    def _input_logprobs(self, r: ChoiceResult) -> dict:
        """input_token_logprobs and input_top_logprobs from logprob_start_len; position 0 has none."""
        prompt_ids = self.prompts[r.index]
        start = self.starts[r.index]
        unscored = [self._entry(None, token) for token in prompt_ids[start : len(prompt_ids) - len(r.prompt_logprobs)]]
        return {
            "input_token_logprobs": unscored + [self._entry(e.logprob, e.token_id) for e in r.prompt_logprobs],
            "input_top_logprobs": [None] * len(unscored)
            + [[self._entry(lp, t) for t, lp in e.top] for e in r.prompt_logprobs],
        }

    async def respond(self, request: Request) -> Response:
        release = self.state.admit(len(self.prompts))
        if self.body.stream:
            return SSEResponse(self._stream(), release)
        try:
            results = await until_disconnected(request, collect_choices(self._runs()))
        finally:
            release()
        items = [self._item(r) for r in results]
        return JSONResponse(items if self.batched else items[0])

    async def _stream(self) -> AsyncIterator[str]:
        results: dict[int, ChoiceResult] = {}
        try:
            async with aclosing(merge_choices(self._runs())) as deltas:
                async for d in deltas:
                    result = results.setdefault(d.index, ChoiceResult(d.index))
                    result.add(d)
                    if d.text or d.finish_reason or (self.body.return_logprob and d.logprobs):
                        yield sse(self._item(result, streaming=True))
        except STREAM_FAILURES as exc:
            yield stream_error(exc)
        yield SSE_DONE

    def _item(self, r: ChoiceResult, streaming: bool = False) -> dict:
        meta = {
            "id": f"{self.id}-{r.index}",
            "finish_reason": _finish_reason(r),
            "prompt_tokens": r.num_prompt_tokens,
            "completion_tokens": r.num_output_tokens,
            "cached_tokens": r.num_cached_tokens,
            "e2e_latency": time.monotonic() - self.started,
            "spec_verify_ct": r.spec_verify_ct,
        }
        if self.body.return_logprob:
            meta["output_token_logprobs"] = [self._entry(lp, tok) for tok, lp, _ in r.logprobs]
            meta["output_top_logprobs"] = [[self._entry(lp, tok) for tok, lp in top] for _, _, top in r.logprobs]
            meta.update(self._input_logprobs(r))
        item = {"text": r.text, "meta_info": meta}
        if not streaming:  # streamed events would repeat every id so far
            item["output_ids"] = r.token_ids
        if self.batched:
            item["index"] = r.index
        return item


def _finish_reason(r: ChoiceResult) -> dict | None:
    """SGLang's shape: {"type": "stop", "matched": ...} or {"type": "length", "length": n}."""
    if r.finish_reason is None:
        return None
    if r.finish_reason == "length":
        return {"type": "length", "length": r.num_output_tokens}
    if r.finish_reason == "stop":
        return {"type": "stop", "matched": r.matched_stop}
    return {"type": r.finish_reason}

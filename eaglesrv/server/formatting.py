"""HTTP plumbing shared by the endpoints: body parsing, ids, usage, logprobs in OpenAI's
two shapes, server-sent events, and running a handler until the client goes away."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from eaglesrv.engine.protocol import WireLogprob
from eaglesrv.scheduler.batch import PromptLogprob
from eaglesrv.server.errors import APIError, bad_request, from_validation_error

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class SSEResponse(StreamingResponse):
    """A server-sent-event stream that gives back its admission slots however it ends.

    The release lives here, not in the generator: a client gone before the first byte
    means the generator never starts, and its own `finally` would never run.
    """

    def __init__(self, events: AsyncIterator[str], release: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; cached_tokens: prompt tokens the prefix cache supplied."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def cached_prompt_tokens(cached_by_choice: dict[int, int], n: int) -> int:
    """Cached prompt tokens over the prompts of a request with `n` choices per prompt
    (choice p * n + i samples prompt p), counted once per prompt, as its tokens are: each
    prompt's first choice."""
    return sum(cached for index, cached in cached_by_choice.items() if index % n == 0)


class TokenText:
    """Token id -> the text OpenAI shows for it in logprobs (a lone token's decoding)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def __call__(self, token_id: int) -> str:
        if self._tokenizer is None:
            return f"token_id:{token_id}"
        return self._tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(logprobs: Sequence[WireLogprob], token_text: TokenText, top_n: int) -> dict[str, Any]:
    """Chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    content = []
    for token_id, logprob, top in logprobs:
        item = token_text.entry(token_id, logprob)
        item["top_logprobs"] = [token_text.entry(t, lp) for t, lp in top[:top_n]]
        content.append(item)
    return {"content": content}


def completion_logprobs(
    logprobs: Sequence[WireLogprob], token_text: TokenText, top_n: int, text_offset: int = 0
) -> dict[str, Any]:
    """Completions shape: parallel lists tokens / token_logprobs / top_logprobs / text_offset."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token_id, logprob, top in logprobs:
        text = token_text(token_id)
        tokens.append(text)
        token_logprobs.append(logprob)
        tops.append({token_text(t): lp for t, lp in top[:top_n]})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def echoed_prompt_logprobs(
    prompt_ids: Sequence[int], scored: Sequence[PromptLogprob], token_text: TokenText, top_n: int,
    unechoed_ids: frozenset[int] = frozenset(),
) -> dict[str, Any]:
    """Completions shape for an echoed prompt: every prompt token, the first with a null
    logprob (nothing precedes it), text offsets into the echoed text, in which the tokens in
    `unechoed_ids` (special tokens a token-id prompt's echo leaves out) take no room."""
    tokens = [token_text(t) for t in prompt_ids]
    widths = (0 if t in unechoed_ids else len(text) for t, text in zip(prompt_ids, tokens))
    offsets = [0, *itertools.accumulate(widths)][:-1]
    tops = [None] + [{token_text(t): lp for t, lp in entry.top[:top_n]} for entry in scored]
    return {"tokens": tokens, "token_logprobs": [None] + [entry.logprob for entry in scored],
            "top_logprobs": tops, "text_offset": offsets}


def joined_logprobs(first: dict[str, Any], second: dict[str, Any] | None) -> dict[str, Any]:
    """Two completions-shape logprobs one after the other (an echoed prompt, then the output)."""
    return first if second is None else {key: first[key] + second[key] for key in first}


def vllm_prompt_logprobs(prompt_ids: Sequence[int], scored: Sequence[PromptLogprob],
                         token_text: TokenText) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's shape: per prompt token, None for the first, else {token id: {logprob, rank,
    decoded_token}} for the token and the top alternatives."""
    out: list[dict[str, dict[str, Any]] | None] = [None] * (len(prompt_ids) - len(scored))
    for entry in scored:
        item = {str(t): {"logprob": lp, "rank": rank, "decoded_token": token_text(t)}
                for rank, (t, lp) in enumerate(entry.top, start=1)}
        item[str(entry.token_id)] = {"logprob": entry.logprob, "rank": entry.rank,
                                     "decoded_token": token_text(entry.token_id)}
        out.append(item)
    return out


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first (non-streamed requests).

    Cancelling closes the choices' engine streams, which aborts their engine requests.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            # Nobody will read this answer; 499 is what proxies log for "client closed".
            raise APIError(499, "the client disconnected")
        return task.result()
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(data: Any) -> tuple | None:
    """The path to a key or string that holds a lone surrogate, or None. JSON may
    escape one (`"\\ud800"`); Python decodes it into a str that no tokenizer or encoder
    accepts. Walked without recursion: the body may nest as deep as json.loads allows."""
    stack: list[tuple[tuple, Any]] = [((), data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path
        elif isinstance(value, dict):
            for key, item in value.items():
                if _SURROGATE.search(key):
                    return path + (key,)
                stack.append((path + (key,), item))
        elif isinstance(value, list):
            stack.extend((path + (index,), item) for index, item in enumerate(value))
    return None


async def parse_body(request: Request, model: type[M]) -> M:
    """The JSON body validated as `model`; 400 (not FastAPI's 422) for anything wrong with it."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except RecursionError:
        raise bad_request("the request body is not valid JSON: it is nested too deeply") from None
    except ValueError as exc:  # bad syntax or encoding, or an integer too long to convert
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    where = _lone_surrogate(data)
    if where is not None:
        # A key may be the culprit: shown escaped, since the answer cannot carry it either.
        param = ".".join(str(part).encode("utf-8", "backslashreplace").decode() for part in where) or None
        raise bad_request(f"{param}: a string holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
                          "which is not text", param=param)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None

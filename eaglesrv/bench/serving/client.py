"""One benchmark request per backend, timed as SGLang's bench_serving times it.

Backends: SGLang's native /generate ("sglang", "eaglesrv"), OpenAI completions
("sglang-oai", "vllm") and OpenAI chat completions ("sglang-oai-chat", "vllm-chat").
Greedy, max tokens = the row's output length, EOS ignored unless --disable-ignore-eos.

Timing: TTFT is the time to the first event that carries text; each later event with
text adds one inter-token latency (ITL). /generate reports how many tokens it has sent,
so an event that carries several (speculation accepts several per step) adds that many
ITLs of an equal share, as SGLang does; the OpenAI streams do not say, so there it is one
ITL per event. Output tokens: the server's count (meta_info or usage) when it gives one,
else the requested length.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import httpx

NATIVE_BACKENDS = ("sglang", "eaglesrv")
COMPLETION_BACKENDS = ("sglang-oai", "vllm")
CHAT_BACKENDS = ("sglang-oai-chat", "vllm-chat")
BACKENDS = NATIVE_BACKENDS + COMPLETION_BACKENDS + CHAT_BACKENDS
DEFAULT_PORTS = {"vllm": 8000, "vllm-chat": 8000}  # every other backend: 30000, SGLang's


@dataclass(frozen=True)
class RequestInput:
    prompt: str
    prompt_len: int
    output_len: int
    model: str
    api_url: str
    stream: bool = True
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    # The chat backends send these instead of `prompt` as one user message (a multi-turn conversation so far).
    messages: tuple[dict[str, str], ...] | None = None


@dataclass
class RequestRecord:
    """One request as the load generator saw it: its timings, text and lengths (or its error)."""

    success: bool = False
    generated_text: str = ""
    latency: float = 0.0  # seconds, request sent -> last event
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0
    output_len: int = 0
    error: str = ""


RequestFunc = Callable[[httpx.AsyncClient, RequestInput], Awaitable[RequestRecord]]


def api_path(backend: str) -> str:
    if backend in NATIVE_BACKENDS:
        return "/generate"
    if backend in COMPLETION_BACKENDS:
        return "/v1/completions"
    if backend in CHAT_BACKENDS:
        return "/v1/chat/completions"
    raise ValueError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")


class _Timer:
    """TTFT and ITLs from the arrival times of the events that carry new tokens."""

    def __init__(self, out: RequestRecord) -> None:
        self.out = out
        self.start = time.perf_counter()
        self.last = self.start

    def tokens_arrived(self, count: int = 1) -> None:
        now = time.perf_counter()
        if not self.out.ttft:
            self.out.ttft = now - self.start
        elif count > 0:
            self.out.itl.extend([(now - self.last) / count] * count)
        self.last = now

    def finish(self) -> None:
        self.out.latency = time.perf_counter() - self.start
        self.out.success = True


async def _sse_events(response: httpx.Response) -> AsyncIterator[dict]:
    """The JSON events of an SSE stream; an error event raises."""
    async for line in response.aiter_lines():
        line = line.strip()
        if not line.startswith("data:"):
            continue
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            raise RuntimeError(f"error event in the stream: {event['error']}")
        yield event


async def _post(client: httpx.AsyncClient, inp: RequestInput, payload: dict,
                read: Callable[[httpx.Response, RequestRecord, _Timer], Awaitable[None]]) -> RequestRecord:
    out = RequestRecord(prompt_len=inp.prompt_len, output_len=inp.output_len)
    timer = _Timer(out)
    try:
        async with client.stream("POST", inp.api_url, json={**payload, **inp.extra_body}) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                out.error = f"HTTP {response.status_code}: {body[:300]}"
                return out
            await read(response, out, timer)
        timer.finish()
    except Exception:  # any failure is this request's result, counted and shown, not a crash
        out.success = False
        out.error = traceback.format_exc(limit=3)
    return out


async def native_generate(client: httpx.AsyncClient, inp: RequestInput) -> RequestRecord:
    payload = {
        "text": inp.prompt, "stream": inp.stream,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": inp.output_len, "ignore_eos": inp.ignore_eos},
    }

    async def read(response: httpx.Response, out: RequestRecord, timer: _Timer) -> None:
        if not inp.stream:
            body = json.loads(await response.aread())
            timer.tokens_arrived()
            out.generated_text, out.output_len = body["text"], body["meta_info"]["completion_tokens"]
            return
        sent = 0
        async for event in _sse_events(response):
            count = event.get("meta_info", {}).get("completion_tokens", sent)
            if event.get("text") and count > sent:
                timer.tokens_arrived(count - sent)
                out.generated_text, sent = event["text"], count  # "text" is all the text so far
        out.output_len = sent

    return await _post(client, inp, payload, read)


def _openai_payload(inp: RequestInput) -> dict:
    payload = {"model": inp.model, "temperature": 0.0, "max_tokens": inp.output_len, "stream": inp.stream,
               "ignore_eos": inp.ignore_eos}
    if inp.stream:  # the last event then carries usage.completion_tokens: an exact output count
        payload["stream_options"] = {"include_usage": True}
    return payload


async def _read_openai(response: httpx.Response, out: RequestRecord, timer: _Timer, stream: bool,
                       text_of: Callable[[dict], str | None]) -> None:
    if not stream:
        body = json.loads(await response.aread())
        timer.tokens_arrived()
        out.generated_text = text_of(body["choices"][0]) or ""
        out.output_len = (body.get("usage") or {}).get("completion_tokens", out.output_len)
        return
    async for event in _sse_events(response):
        for choice in event.get("choices") or ():
            text = text_of(choice)
            if text:
                timer.tokens_arrived()
                out.generated_text += text
        out.output_len = (event.get("usage") or {}).get("completion_tokens", out.output_len)


async def openai_completions(client: httpx.AsyncClient, inp: RequestInput) -> RequestRecord:
    payload = {**_openai_payload(inp), "prompt": inp.prompt}

    async def read(response: httpx.Response, out: RequestRecord, timer: _Timer) -> None:
        await _read_openai(response, out, timer, inp.stream, lambda choice: choice.get("text"))

    return await _post(client, inp, payload, read)


async def openai_chat(client: httpx.AsyncClient, inp: RequestInput) -> RequestRecord:
    messages = list(inp.messages) if inp.messages else [{"role": "user", "content": inp.prompt}]
    payload = {**_openai_payload(inp), "messages": messages}

    def text_of(choice: dict) -> str | None:
        return (choice.get("delta") or choice.get("message") or {}).get("content")

    async def read(response: httpx.Response, out: RequestRecord, timer: _Timer) -> None:
        await _read_openai(response, out, timer, inp.stream, text_of)

    return await _post(client, inp, payload, read)


def request_func(backend: str) -> RequestFunc:
    api_path(backend)  # refuses unknown backends
    if backend in NATIVE_BACKENDS:
        return native_generate
    return openai_completions if backend in COMPLETION_BACKENDS else openai_chat


async def start_spaced(items: list, start: Callable[[Any], Awaitable[Any]], request_rate: float,
                       arrivals: random.Random) -> list:
    """Run `start(item)` for every item, started at Poisson arrivals of `request_rate` per
    second (all at once when it is infinite); their results in item order."""
    tasks = []
    for item in items:
        tasks.append(asyncio.create_task(start(item)))
        if math.isfinite(request_rate):
            await asyncio.sleep(arrivals.expovariate(request_rate))
    return list(await asyncio.gather(*tasks))

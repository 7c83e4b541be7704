"""The prefix cache as clients see it, on the shared live server (default model, page 16):
cached tokens in usage and meta_info, /flush_cache, and the cache in /metrics and
/get_server_info."""

from __future__ import annotations

import json
import random

import httpx
import pytest
from server_fixtures import http, live_server  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow


def _prompt(seed: int, length: int = 40) -> list[int]:
    """Token ids no other test sends (so nothing is cached for them yet)."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(length)]


def _completion(http: httpx.Client, prompt, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _cached(payload: dict) -> int:
    return payload["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_completions_report_cached_prompt_tokens_and_flush_empties_the_cache(http: httpx.Client):
    prompt = _prompt(1)
    first = _completion(http, prompt)
    second = _completion(http, prompt)
    assert _cached(first) == 0
    assert _cached(second) == 32  # 2 of the prompt's 40 tokens' pages; the last token is always computed
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert _cached(_completion(http, prompt[:20] + _prompt(2, 20))) == 16  # a shared first page

    flushed = http.post("/flush_cache")
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed.")
    assert _cached(_completion(http, prompt)) == 0


def test_completions_with_several_prompts_count_each_prompt_once(http: httpx.Client):
    prompts = [_prompt(3), _prompt(4)]
    _completion(http, prompts)
    again = _completion(http, prompts, n=2)
    assert again["usage"]["prompt_tokens"] == 80 and _cached(again) == 64


def test_chat_and_streamed_usage(http: httpx.Client):
    messages = [{"role": "system", "content": "You answer in one word. " * 12},
                {"role": "user", "content": "Name a colour."}]
    body = {"messages": messages, "max_tokens": 2, "temperature": 0}
    http.post("/v1/chat/completions", json=body).raise_for_status()
    again = http.post("/v1/chat/completions", json=body).json()
    assert _cached(again) >= 64 and _cached(again) < again["usage"]["prompt_tokens"]

    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=streamed) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert _cached(events[-1]) == _cached(again)


def test_generate_meta_info_and_server_state(http: httpx.Client):
    prompt = _prompt(5)
    body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 2}}
    assert http.post("/generate", json=body).json()["meta_info"]["cached_tokens"] == 0
    assert http.post("/generate", json=body).json()["meta_info"]["cached_tokens"] == 32

    info = http.get("/get_server_info").json()
    state = info["internal_states"][0]
    assert info["disable_radix_cache"] is False
    assert state["prefix_cache_enabled"] and state["prefix_cache_pages"] >= 2
    assert 0 < state["prefix_cache_hit_rate"] < 1 and state["prefix_cache_hit_tokens"] >= 32

    metrics = http.get("/metrics").text
    rate = next(line for line in metrics.splitlines() if line.startswith("eaglesrv:cache_hit_rate{"))
    assert 0 < float(rate.split()[-1]) < 1
    assert "eaglesrv:prefix_cache_pages{" in metrics and "eaglesrv:prefix_cache_evicted_pages{" in metrics

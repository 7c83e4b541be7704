"""SGLang's native API (/generate, /get_server_info) and stream cancellation, against a
live server on the default model."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from server_fixtures import LiveServer, http, live_server  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def _events(response: httpx.Response) -> list:
    """The SSE events of a streamed response: parsed JSON, and the final "[DONE]"."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_generate_non_stream_and_stream(http: httpx.Client):
    body = {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 6}}
    whole = http.post("/generate", json=body).json()
    assert whole["text"].startswith(" Paris.")
    meta = whole["meta_info"]
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == 6
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert len(whole["output_ids"]) == 6

    with http.stream("POST", "/generate", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _events(response)
    assert events[-1] == "[DONE]"
    texts = [e["text"] for e in events[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), "each event carries all text so far"
    assert texts[-1] == whole["text"]
    counts = [e["meta_info"]["completion_tokens"] for e in events[:-1]]
    assert counts == sorted(counts) and counts[-1] == 6
    assert events[-2]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-2])


def test_generate_batch_ids_stop_and_bench_serving_fields(http: httpx.Client):
    # The payload SGLang's bench_serving sends with --backend sglang (extra fields included).
    body = {"input_ids": [[504, 3575, 282, 4649, 314], [504, 3575, 282, 4649, 314]],
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True, "stop": "."},
            "stream": False, "lora_path": None, "return_logprob": False, "logprob_start_len": -1}
    items = http.post("/generate", json=body).json()
    assert [item["index"] for item in items] == [0, 1]
    for item in items:
        assert item["text"] == " Paris"
        assert item["meta_info"]["finish_reason"] == {"type": "stop", "matched": "."}


def test_get_server_info_and_model_info(http: httpx.Client):
    info = http.get("/get_server_info").json()
    internal = info["internal_states"][0]
    assert "avg_spec_accept_length" in internal and internal["avg_spec_accept_length"] is None  # no speculation yet
    assert internal["kv_pages_total"] == internal["kv_pages_free"] + internal["kv_pages_used"]
    assert info["context_length"] == 1024 and info["served_model_name"] == "SmolLM2-135M-Instruct"
    assert "api_key" not in info
    assert http.get("/get_model_info").json()["is_generation"] is True
    assert http.post("/flush_cache").status_code == 200


async def _cut_stream(client: httpx.AsyncClient, i: int) -> int:
    """Open a long stream on one of the three streaming endpoints, read 2 events, hang up."""
    common = {"max_tokens": 200, "ignore_eos": True, "temperature": 0.7, "stream": True}
    path, body = [
        ("/v1/completions", {"prompt": f"Story number {i}:", **common}),
        ("/v1/chat/completions", {"messages": [{"role": "system", "content": "Be brief."},  # a short prompt
                                               {"role": "user", "content": f"Count to {i}"}], **common}),
        ("/generate", {"text": f"List {i}:", "stream": True,
                       "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}),
    ][i % 3]
    seen = 0
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen == 2:
                    break  # leaving the block closes the connection mid-stream
    return seen


def test_fifty_cut_streams_free_every_kv_page(live_server: LiveServer):
    total = live_server.server_info()["internal_states"][0]["kv_pages_total"]
    free_before, _, _ = live_server.wait_idle(total)

    async def main() -> list[int]:
        limits = httpx.Limits(max_connections=60)
        async with httpx.AsyncClient(base_url=live_server.base_url, headers=live_server.headers, timeout=180,
                                     limits=limits) as client:
            return await asyncio.gather(*(_cut_stream(client, i) for i in range(50)))

    assert asyncio.run(main()) == [2] * 50
    assert live_server.wait_idle(free_before, timeout_s=120) == (free_before, 0, 0)
    assert httpx.get(f"{live_server.base_url}/health").status_code == 200


def test_non_streamed_request_is_aborted_when_the_client_leaves(live_server: LiveServer):
    total = live_server.server_info()["internal_states"][0]["kv_pages_total"]
    free_before, _, _ = live_server.wait_idle(total)
    body = {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live_server.base_url}/v1/completions", json=body, headers=live_server.headers, timeout=3)
    assert live_server.wait_idle(free_before, timeout_s=60) == (free_before, 0, 0)

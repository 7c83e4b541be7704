"""logit_bias, repetition_penalty and chat_template_kwargs through the APIs, on the shared
live server (default model): each changes the output as it should, nothing is dropped."""

from __future__ import annotations

import httpx
import pytest
from server_fixtures import http, live_server  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def _completion_ids(http: httpx.Client, **fields) -> list[int]:
    body = {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True, **fields}}
    response = http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()["output_ids"]


def test_logit_bias_forces_and_forbids_tokens(http: httpx.Client):
    plain = _completion_ids(http)
    forced = _completion_ids(http, logit_bias={"42": 100})
    assert forced == [42] * 6
    forbidden = _completion_ids(http, logit_bias={str(plain[0]): -100})
    assert forbidden[0] != plain[0]

    chat = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 3, "temperature": 0,
            "logit_bias": {"42": 100}, "logprobs": True}
    response = http.post("/v1/chat/completions", json=chat)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["message"]["content"] == http.post("/v1/completions", json={
        "prompt": [42, 42, 42], "max_tokens": 0, "echo": True, "logprobs": 0}).json()["choices"][0]["text"]


def test_repetition_penalty_is_applied(http: httpx.Client):
    body = {"prompt": "one one one one one one", "max_tokens": 8, "temperature": 0}
    plain = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    penalized = http.post("/v1/completions", json={**body, "repetition_penalty": 1.8}).json()["choices"][0]["text"]
    assert penalized != plain


def test_chat_template_kwargs_and_empty_known_fields_are_accepted(http: httpx.Client):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
    plain = http.post("/v1/chat/completions", json=body).json()
    with_kwargs = http.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"enable_thinking": False},
                                                          "lora_path": None, "guided_json": None}).json()
    assert with_kwargs["choices"][0]["message"] == plain["choices"][0]["message"]

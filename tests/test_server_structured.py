"""Structured output through the APIs, on the shared live server (default model): OpenAI's
response_format on chat and completions (whole, streamed, n > 1), vLLM's guided_* and
structured_outputs, SGLang's json_schema / regex / ebnf in /generate. Every answer follows
its constraint; the official openai client takes the same fields."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from jsonschema import Draft202012Validator
from server_fixtures import API_KEY, LiveServer, http, live_server  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "country": {"enum": ["France", "Italy", "Spain", "Germany"]},
        "population_millions": {"type": "number", "minimum": 0, "maximum": 40},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
    },
    "required": ["city", "country", "landmarks"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Tell me about Paris as JSON."}]


def _valid(text: str, schema: dict) -> bool:
    return not list(Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
                    .iter_errors(json.loads(text)))


def _chat(http: httpx.Client, **fields) -> dict:
    response = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 200} | fields)
    assert response.status_code == 200, response.text
    return response.json()


def test_chat_json_schema_whole_streamed_and_sampled(http: httpx.Client):
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    whole = _chat(http, temperature=0, response_format=response_format)["choices"][0]
    assert whole["finish_reason"] == "stop" and _valid(whole["message"]["content"], CITY)

    text = ""
    body = {"messages": ASK, "max_tokens": 200, "temperature": 0, "response_format": response_format, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line.removeprefix("data: "))["choices"][0]["delta"].get("content") or ""
    assert text == whole["message"]["content"]

    sampled = _chat(http, temperature=1.0, seed=7, n=3, response_format=response_format)["choices"]
    assert all(c["finish_reason"] == "stop" and _valid(c["message"]["content"], CITY) for c in sampled)


def test_json_mode_and_completions(http: httpx.Client):
    short = [{"role": "user", "content": "Give the capital of France as JSON, with the key capital."}]
    choice = _chat(http, messages=short, temperature=0, response_format={"type": "json_object"})["choices"][0]
    assert choice["finish_reason"] == "stop" and isinstance(json.loads(choice["message"]["content"]), dict)
    response = http.post("/v1/completions", json={
        "prompt": "A city, as JSON:", "max_tokens": 200, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}})
    assert response.status_code == 200, response.text
    assert _valid(response.json()["choices"][0]["text"], CITY)


def test_vllm_fields(http: httpx.Client):
    choice = _chat(http, temperature=0, guided_choice=["yes", "no", "maybe"])["choices"][0]["message"]["content"]
    assert choice in {"yes", "no", "maybe"}
    phone = _chat(http, temperature=1.0, seed=3, guided_regex=r"\d{3}-\d{4}")["choices"][0]["message"]["content"]
    assert re.fullmatch(r"\d{3}-\d{4}", phone)
    structured = _chat(http, temperature=0, structured_outputs={"json": CITY})["choices"][0]["message"]["content"]
    assert _valid(structured, CITY)


def test_generate_with_sglang_fields(http: httpx.Client):
    def text(**constraint) -> str:
        response = http.post("/generate", json={
            "text": "Is Paris in France? Answer:", "sampling_params": {"temperature": 0, "max_new_tokens": 100,
                                                                       **constraint}})
        assert response.status_code == 200, response.text
        assert response.json()["meta_info"]["finish_reason"]["type"] == "stop"
        return response.json()["text"]

    assert text(regex=" (Yes|No)\\.") in {" Yes.", " No."}
    assert re.fullmatch(r"(yes|no), [a-z]+", text(ebnf='root ::= ("yes" | "no") ", " [a-z]+'))
    assert _valid(text(json_schema=json.dumps(CITY)), CITY)


def test_the_openai_client(live_server: LiveServer):
    client = openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=ASK, temperature=0, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}})
    assert _valid(reply.choices[0].message.content, CITY)

"""Bad requests against a live server: each gets the right status and OpenAI's error
envelope, and afterwards the server is healthy, still answers, and has leaked no KV pages."""

from __future__ import annotations

import json

import httpx
import pytest
from server_fixtures import CONTEXT_LENGTH, LiveServer, http, live_server  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]
LONG_PROMPT = "hello " * (CONTEXT_LENGTH + 50)
TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
NOT_TOOL = {"type": "function", "function": {"name": "no_strings", "parameters": {  # llguidance has no "not"
    "type": "object", "properties": {"x": {"not": {"type": "string"}}}}}}


def chat(**fields) -> dict:
    return {"model": "SmolLM2-135M-Instruct", "messages": MESSAGES, "max_tokens": 4, **fields}


# (name, method, path, body (dict, or raw str/bytes), headers, status, error param or None)
BAD_REQUESTS = [
    ("malformed json", "POST", CHAT, '{"messages": [', None, 400, None),
    ("body not an object", "POST", CHAT, "[1, 2]", None, 400, None),
    ("messages missing", "POST", CHAT, {"model": "SmolLM2-135M-Instruct"}, None, 400, "messages"),
    ("messages empty", "POST", CHAT, chat(messages=[]), None, 400, "messages"),
    ("messages wrong type", "POST", CHAT, chat(messages="hello"), None, 400, "messages"),
    ("unknown role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), None, 400, None),
    ("temperature wrong type", "POST", CHAT, chat(temperature="hot"), None, 400, "temperature"),
    ("temperature negative", "POST", CHAT, chat(temperature=-1), None, 400, "temperature"),
    ("temperature NaN", "POST", CHAT, '{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}', None,
     400, "temperature"),
    ("top_p out of range", "POST", CHAT, chat(top_p=1.5), None, 400, "top_p"),
    ("n zero", "POST", CHAT, chat(n=0), None, 400, "n"),
    ("max_tokens zero", "POST", CHAT, chat(max_tokens=0), None, 400, "max_tokens"),
    ("max_tokens beyond context", "POST", CHAT, chat(max_tokens=CONTEXT_LENGTH), None, 400, "max_tokens"),
    ("top_logprobs too many", "POST", CHAT, chat(logprobs=True, top_logprobs=50), None, 400, "top_logprobs"),
    ("presence_penalty out of range", "POST", CHAT, chat(presence_penalty=3), None, 400, "presence_penalty"),
    ("empty stop string", "POST", CHAT, chat(stop=[""]), None, 400, "stop"),
    ("tool without a function", "POST", CHAT, chat(tools=[{"type": "function"}]), None, 400, "tools[0].function"),
    ("unknown model", "POST", CHAT, chat(model="gpt-4o"), None, 404, "model"),
    ("over-long prompt", "POST", COMPLETIONS, {"prompt": LONG_PROMPT, "max_tokens": 4}, None, 400, "prompt"),
    ("over-long chat", "POST", CHAT, chat(messages=[{"role": "user", "content": LONG_PROMPT}]), None, 400, "messages"),
    ("token id outside vocab", "POST", COMPLETIONS, {"prompt": [1, 2, 10**9], "max_tokens": 4}, None, 400, "prompt"),
    ("negative token id", "POST", COMPLETIONS, {"prompt": [-5], "max_tokens": 4}, None, 400, "prompt"),
    ("empty prompt", "POST", COMPLETIONS, {"prompt": "", "max_tokens": 4}, None, 400, "prompt"),
    ("empty prompt list", "POST", COMPLETIONS, {"prompt": [], "max_tokens": 4}, None, 400, "prompt"),
    ("prompt wrong type", "POST", COMPLETIONS, {"prompt": {"a": 1}}, None, 400, "prompt"),
    ("logprobs too many", "POST", COMPLETIONS, {"prompt": "x", "logprobs": 21}, None, 400, "logprobs"),
    ("prompt_logprobs too many", "POST", COMPLETIONS, {"prompt": "x", "prompt_logprobs": 21}, None, 400,
     "prompt_logprobs"),
    ("chat prompt_logprobs too many", "POST", CHAT, chat(prompt_logprobs=21), None, 400, "prompt_logprobs"),
    ("max_tokens zero without scoring", "POST", COMPLETIONS, {"prompt": "x", "max_tokens": 0, "echo": True}, None,
     400, "max_tokens"),
    ("top_logprobs_num too many", "POST", "/generate", {"text": "x", "return_logprob": True, "top_logprobs_num": 21},
     None, 400, "top_logprobs_num"),
    ("logprob_start_len past the prompt", "POST", "/generate",
     {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2}, None, 400, "logprob_start_len"),
    ("generate without input", "POST", "/generate", {"sampling_params": {}}, None, 400, None),
    ("generate bad params", "POST", "/generate", {"text": "x", "sampling_params": {"temperature": -2}}, None, 400,
     "temperature"),
    ("missing api key", "POST", CHAT, chat(), {"Authorization": ""}, 401, None),
    ("wrong api key", "POST", CHAT, chat(), {"Authorization": "Bearer nope"}, 401, None),
    ("oversized body", "POST", COMPLETIONS, {"prompt": "x" * (2 << 20)}, None, 413, None),
    ("json nested too deeply", "POST", CHAT, "[" * 100_000 + "]" * 100_000, None, 400, None),
    ("integer of 5000 digits", "POST", CHAT, '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": '
     + "9" * 5000 + "}", None, 400, None),
    ("lone surrogate in a prompt", "POST", COMPLETIONS, r'{"prompt": "a\ud800b", "max_tokens": 4}', None, 400,
     "prompt"),
    ("lone surrogate in chat content", "POST", CHAT,
     r'{"messages": [{"role": "user", "content": "\udfff"}], "max_tokens": 4}', None, 400, "messages.0.content"),
    ("lone surrogate in the model name", "POST", CHAT,
     r'{"model": "\ud800", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}', None, 400, "model"),
    ("lone surrogate in a key", "POST", CHAT,
     r'{"messages": [{"role": "user", "content": "Hi"}], "\ud800": 1}', None, 400, None),
    ("lone surrogate in generate text", "POST", "/generate", r'{"text": "\ud83d", "sampling_params": {}}', None,
     400, "text"),
    ("50,000 stop strings", "POST", CHAT, chat(stop=["x"] * 50_000), None, 400, "stop"),
    ("stop string of 2,000 characters", "POST", COMPLETIONS, {"prompt": "x", "stop": "y" * 2000}, None, 400, "stop"),
    ("300 stop token ids", "POST", COMPLETIONS, {"prompt": "x", "stop_token_ids": [1] * 300}, None, 400,
     "stop_token_ids"),
    ("stop token id outside vocab", "POST", CHAT, chat(stop_token_ids=[10**9]), None, 400, "stop_token_ids"),
    ("prompts x n of 8,000", "POST", COMPLETIONS, {"prompt": ["Hi"] * 1000, "n": 8, "max_tokens": 1}, None, 400,
     "n"),
    ("generate batch of 2,000", "POST", "/generate", {"text": ["a"] * 2000, "sampling_params": {}}, None, 400,
     "text"),
    ("generate with 100 stop strings", "POST", "/generate",
     {"text": "x", "sampling_params": {"stop": ["a"] * 100}}, None, 400, "sampling_params.stop"),
    ("generate with an empty stop string", "POST", "/generate", {"text": "x", "sampling_params": {"stop": [""]}},
     None, 400, "sampling_params.stop"),
    ("cross-site text/plain POST", "POST", CHAT, json.dumps(chat()),
     {"Origin": "https://evil.example", "Content-Type": "text/plain"}, 403, None),
    ("cross-site preflight", "OPTIONS", CHAT, None,
     {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}, 403, None),
    ("n far above the cap", "POST", CHAT, chat(n=10**6), None, 400, "n"),
    ("max_tokens negative", "POST", CHAT, chat(max_tokens=-5), None, 400, "max_tokens"),
    ("logprobs negative", "POST", COMPLETIONS, {"prompt": "x", "logprobs": -1}, None, 400, "logprobs"),
    ("min_p above 1", "POST", CHAT, chat(min_p=2), None, 400, "min_p"),
    ("top_k below -1", "POST", CHAT, chat(top_k=-5), None, 400, "top_k"),
    ("chat content a number", "POST", CHAT, chat(messages=[{"role": "user", "content": 5}]), None, 400,
     "messages"),
    ("token ids mixed with text", "POST", COMPLETIONS, {"prompt": [[1, "a"]]}, None, 400, "prompt"),
    ("generate with text and input_ids", "POST", "/generate", {"text": "x", "input_ids": [1]}, None, 400, "text"),
    ("GET on generate", "GET", "/generate", None, None, 405, None),
    ("tool_choice required without tools", "POST", CHAT, chat(tool_choice="required"), None, 400, "tool_choice"),
    ("tool_choice naming an unknown function", "POST", CHAT,
     chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}), None, 400, "tool_choice"),
    ("tool_choice of an unknown kind", "POST", CHAT, chat(tools=[TOOL], tool_choice="always"), None, 400,
     "tool_choice"),
    ("tool parameters not enforceable", "POST", CHAT, chat(tools=[TOOL, NOT_TOOL], tool_choice="required"), None,
     400, "tools[1]"),
    ("forced tool call with response_format", "POST", CHAT,
     chat(tools=[TOOL], tool_choice="required", response_format={"type": "json_object"}), None, 400, "tool_choice"),
    ("tool call arguments not JSON", "POST", CHAT, chat(messages=[*MESSAGES, {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{oops"}}]}]), None, 400,
     "messages[1].tool_calls[0].function.arguments"),
    ("response_format json_schema without a schema", "POST", CHAT, chat(response_format={"type": "json_schema"}),
     None, 400, "response_format"),
    ("response_format unknown type", "POST", CHAT, chat(response_format={"type": "yaml"}), None, 400,
     "response_format"),
    ("response_format schema keyword not enforced", "POST", CHAT,
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
         "type": "array", "uniqueItems": True}}}), None, 400, "response_format.json_schema.schema"),
    ("two constraints", "POST", CHAT, chat(response_format={"type": "json_object"}, regex="a+"), None, 400, "regex"),
    ("logit_bias key not a token id", "POST", CHAT, chat(logit_bias={"hello": 5}), None, 400, "logit_bias"),
    ("logit_bias token outside vocab", "POST", CHAT, chat(logit_bias={"999999999": 5}), None, 400, "logit_bias"),
    ("logit_bias above 100", "POST", COMPLETIONS, {"prompt": "x", "logit_bias": {"5": 101}}, None, 400,
     "logit_bias"),
    ("repetition_penalty 0", "POST", CHAT, chat(repetition_penalty=0), None, 400, "repetition_penalty"),
    ("vLLM guided_json not a schema", "POST", CHAT, chat(guided_json=[1]), None, 400, "guided_json"),
    ("vLLM guided_choice not strings", "POST", CHAT, chat(guided_choice=["a", 5]), None, 400, "guided_choice"),
    ("SGLang regex invalid on completions", "POST", COMPLETIONS, {"prompt": "x", "regex": "[a-"}, None, 400, "regex"),
    ("structural_tag", "POST", CHAT, chat(structural_tag={"type": "x"}), None, 400, "structural_tag"),
    ("functions", "POST", CHAT, chat(functions=[{"name": "f"}]), None, 400, "functions"),
    ("generate json_schema not JSON", "POST", "/generate", {"text": "x", "sampling_params": {"json_schema": "{"}},
     None, 400, "sampling_params.json_schema"),
    ("generate ebnf undefined rule", "POST", "/generate", {"text": "x", "sampling_params": {"ebnf": "root ::= foo"}},
     None, 400, "sampling_params.ebnf"),
    ("generate image_data", "POST", "/generate", {"text": "x", "image_data": "abc"}, None, 400, "image_data"),
    ("chat_template_kwargs overriding the call", "POST", CHAT, chat(chat_template_kwargs={"tokenize": True}), None,
     400, "chat_template_kwargs"),
    ("suffix unsupported", "POST", COMPLETIONS, {"prompt": "x", "suffix": "y"}, None, 400, "suffix"),
    ("best_of other than n", "POST", COMPLETIONS, {"prompt": "x", "best_of": 3}, None, 400, "best_of"),
    ("unknown route", "GET", "/v1/nothing", None, None, 404, None),
    ("wrong method", "GET", CHAT, None, None, 405, None),
]


@pytest.fixture(scope="module")
def kv_before(live_server: LiveServer) -> int:
    free, running, waiting = live_server.wait_idle(live_server.server_info()["internal_states"][0]["kv_pages_total"])
    assert (running, waiting) == (0, 0)
    return free


@pytest.mark.parametrize("name,method,path,body,headers,status,param", BAD_REQUESTS, ids=[r[0] for r in BAD_REQUESTS])
def test_bad_request(http: httpx.Client, kv_before, name, method, path, body, headers, status, param):
    kwargs = {}
    if isinstance(body, dict):
        kwargs["content"] = json.dumps(body)
        kwargs["headers"] = {"Content-Type": "application/json"}
    elif body is not None:
        kwargs["content"] = body
    if headers:
        kwargs["headers"] = {**kwargs.get("headers", {}), **headers}
    response = http.request(method, path, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"]
    if param is not None:
        assert error["param"] is not None and param in error["param"], error


def test_server_is_healthy_after_bad_requests(http: httpx.Client, live_server: LiveServer, kv_before):
    assert http.get("/health").status_code == 200
    answer = http.post(COMPLETIONS, json={"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0,
                                          "top_k": 10**30})  # larger than the vocabulary: no restriction
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"].startswith(" Paris.")
    assert live_server.wait_idle(kv_before) == (kv_before, 0, 0)


def test_health_and_metrics_need_no_key(live_server: LiveServer):
    assert httpx.get(f"{live_server.base_url}/health").status_code == 200
    metrics = httpx.get(f"{live_server.base_url}/metrics")
    assert metrics.status_code == 200
    for name in ("eaglesrv:num_requests_total", "eaglesrv:prompt_tokens_total", "eaglesrv:generation_tokens_total",
                 "eaglesrv:num_running_reqs", "eaglesrv:num_queue_reqs", "eaglesrv:kv_pages_used",
                 "eaglesrv:kv_pages_free", "eaglesrv:time_to_first_token_seconds_bucket",
                 "eaglesrv:inter_token_latency_seconds_bucket"):
        assert name in metrics.text, name
    assert httpx.get(f"{live_server.base_url}/v1/models").status_code == 401

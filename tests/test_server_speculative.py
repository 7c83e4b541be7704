"""The server with EAGLE-3 on (tiny random Llama, random head): greedy output over HTTP
equals the plain engine's, several tokens per step stream correctly, and the speculation
counters reach /get_server_info (bench_serving's "Accept length") and /metrics."""

from __future__ import annotations

import json

import pytest
from conftest import engine_config
from eagle3_helpers import save_random_head
from engine_helpers import random_prompts
from server_fixtures import LiveServer

from eaglesrv.engine.llm_engine import Engine
from eaglesrv.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def spec_server(tiny_llama_dir, tmp_path_factory):
    head = save_random_head(tiny_llama_dir, tmp_path_factory.mktemp("head"))
    server = LiveServer(
        "--model-path", tiny_llama_dir, "--dtype", "float32", "--device", "cpu", "--max-total-tokens", "4096",
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", head, "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6", "--enable-metrics",
        "--disable-speculative-adaptive",
    )
    try:
        yield server.wait_healthy()
    finally:
        server.stop()


def test_greedy_over_http_with_eagle3_equals_the_plain_engine(spec_server, tiny_llama_dir):
    prompts = random_prompts((7, 23), 256, seed=5)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = [r.output_token_ids for r in Engine(engine_config(tiny_llama_dir)).generate(prompts, params)]
    with spec_server.client() as http:
        items = http.post("/generate", json={
            "input_ids": prompts, "sampling_params": {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True},
        }).json()
        assert [item["output_ids"] for item in items] == expected
        assert all(0 < item["meta_info"]["spec_verify_ct"] < 20 for item in items)  # the first token is the prefill's

        # Streamed, tokens come several per step; without a tokenizer, logprob entries name the ids.
        body = {"prompt": prompts[1], "max_tokens": 20, "temperature": 0, "ignore_eos": True, "logprobs": 0,
                "stream": True}
        streamed = []
        with http.stream("POST", "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    logprobs = json.loads(line.removeprefix("data: "))["choices"][0]["logprobs"]
                    streamed += [int(t.removeprefix("token_id:")) for t in (logprobs or {}).get("tokens", [])]
        assert streamed == expected[1]

        info = http.get("/get_server_info").json()["internal_states"][0]
        assert info["avg_spec_accept_length"] >= 1.0 and info["spec_verifications"] > 0
        assert info["spec_adaptive"] is False  # --disable-speculative-adaptive: the mode is reported
        assert spec_server.wait_idle(info["kv_pages_total"]) == (info["kv_pages_total"], 0, 0)
        metrics = http.get("/metrics").text
    for name in ("eaglesrv:spec_accept_length", "eaglesrv:spec_verifications_total", "eaglesrv:spec_acceptance_rate"):
        assert name in metrics


def test_adaptive_server_reports_its_mode(tiny_llama_dir, tmp_path_factory):
    head = save_random_head(tiny_llama_dir, tmp_path_factory.mktemp("adaptive-head"))
    cache = tmp_path_factory.mktemp("cost-cache")
    server = LiveServer(
        "--model-path", tiny_llama_dir, "--dtype", "float32", "--device", "cpu", "--max-total-tokens", "4096",
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", head, "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6",
        "--enable-metrics", env={"EAGLESRV_CACHE": str(cache)},
    )
    prompts = random_prompts((7, 23), 256, seed=5)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = [r.output_token_ids for r in Engine(engine_config(tiny_llama_dir)).generate(prompts, params)]
    try:
        with server.wait_healthy().client() as http:
            items = http.post("/generate", json={
                "input_ids": prompts, "sampling_params": {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True},
            }).json()
            assert [item["output_ids"] for item in items] == expected
            info = http.get("/get_server_info").json()["internal_states"][0]
            metrics = http.get("/metrics").text
    finally:
        server.stop()
    assert info["spec_adaptive"] is True and info["spec_steps_plain"] + info["spec_steps_speculative"] > 0
    assert 'eaglesrv:spec_mode{knob="num_steps"' in metrics and "eaglesrv:spec_adaptive_steps_total" in metrics
    assert list(cache.glob("cost_models/*.json")), "the measured cost model is cached"


def test_advertised_context_is_what_speculation_serves(tiny_llama_dir, tmp_path_factory):
    """With the pool smaller than the model's context, every endpoint advertises the pool's
    size, a prompt one token short of it is served (the tree does not fit there: that
    request decodes plainly), and one token more is a 400 at admission."""
    head = save_random_head(tiny_llama_dir, tmp_path_factory.mktemp("edge-head"))
    server = LiveServer(
        "--model-path", tiny_llama_dir, "--dtype", "float32", "--device", "cpu", "--max-total-tokens", "256",
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", head, "--speculative-num-steps", "5",
        "--speculative-eagle-topk", "8", "--speculative-num-draft-tokens", "32", "--disable-speculative-adaptive",
    )
    prompts = [random_prompts((250,), 256, seed=9)[0], random_prompts((256,), 256, seed=9)[0]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = Engine(engine_config(tiny_llama_dir)).generate(prompts[:1], params)[0].output_token_ids
    try:
        with server.wait_healthy().client() as http:
            assert http.get("/v1/models").json()["data"][0]["max_model_len"] == 256
            assert http.get("/get_server_info").json()["context_length"] == 256
            assert http.get("/get_model_info").json()["context_length"] == 256
            served = http.post("/generate", json={"input_ids": prompts[0], "sampling_params": {
                "temperature": 0, "max_new_tokens": 6, "ignore_eos": True}}).json()
            assert served["output_ids"] == expected and served["meta_info"]["finish_reason"]["type"] == "length"
            refused = http.post("/v1/completions", json={"prompt": prompts[1], "max_tokens": 1})
            assert refused.status_code == 400 and "maximum context length is 256" in refused.text
            assert http.get("/health").status_code == 200
    finally:
        server.stop()

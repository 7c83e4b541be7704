"""Prompt logprobs over HTTP, against transformers on the default model's fp32 weights:
completions with echo (what lm-eval's local-completions sends and slices), vLLM's
prompt_logprobs on chat, SGLang's input logprobs on /generate; plain (the shared server) and
EAGLE-3 with prefill chunks of 16 tokens, so that prompts cross chunk boundaries.
"""

from __future__ import annotations

import json

import pytest
import torch
from server_fixtures import LiveServer, live_server  # noqa: F401 (fixture)
from transformers import AutoModelForCausalLM

from eaglesrv.engine.loader import default_model_path
from eaglesrv.engine.loader.gguf_file import gguf_tokenizer_loader
from eaglesrv.server.request_prep import chat_prompt_ids

pytestmark = pytest.mark.slow
TEXT = "The quick brown fox jumps over the lazy dog, and then it naps in the warm afternoon sun by the river."
QUESTION = [{"role": "user", "content": "Name three rivers in Europe."}]


@pytest.fixture(scope="module")
def tokenizer():
    return gguf_tokenizer_loader(default_model_path())()


@pytest.fixture(scope="module")
def hf_model():
    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def eagle3_server():
    server = LiveServer("--speculative-algorithm", "EAGLE3", "--chunked-prefill-size", "16", "--context-length", "512",
                        "--max-total-tokens", "4096")
    try:
        yield server.wait_healthy()
    finally:
        server.stop()


@pytest.fixture(params=["plain", "eagle3"])
def server(request, live_server, eagle3_server):  # noqa: F811
    return live_server if request.param == "plain" else eagle3_server


def hf_scores(hf_model, ids: list[int], top: int):
    """Per token 1..: (logprob, rank, [(top id, top logprob)]) under transformers."""
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)[:-1]
    chosen = logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    values, indices = logprobs.topk(top, dim=-1)
    return [(float(chosen[i]), int((logprobs[i] > chosen[i]).sum()) + 1,
             list(zip(indices[i].tolist(), values[i].tolist()))) for i in range(len(ids) - 1)]


def test_the_request_lm_eval_sends_gets_what_it_slices(server, tokenizer, hf_model):
    """lm-eval's loglikelihood: token-id prompts, echo, logprobs 1, max_tokens 1, then
    token_logprobs[ctxlen:-1] summed, and each compared with the best of top_logprobs."""
    context, continuation = tokenizer.encode(TEXT[:40]), tokenizer.encode(TEXT[40:])
    prompts = [context + continuation, continuation]
    body = {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    with server.client() as http:
        response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    for ids, choice in zip(prompts, choices):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        expected = hf_scores(hf_model, ids, 1)
        assert lp["token_logprobs"][1 : len(ids)] == pytest.approx([e[0] for e in expected], abs=1e-4)
        is_greedy = [tok == max(top.values()) for tok, top in zip(lp["token_logprobs"][1:-1], lp["top_logprobs"][1:-1])]
        assert is_greedy == [e[1] == 1 for e in expected]
        assert choice["text"].startswith(tokenizer.decode(ids))
    ctxlen = len(context)
    total = sum(choices[0]["logprobs"]["token_logprobs"][ctxlen:-1])
    assert total == pytest.approx(sum(e[0] for e in hf_scores(hf_model, prompts[0], 1)[ctxlen - 1 :]), abs=1e-3)


def test_echo_with_no_output_scores_the_prompt_and_streams_the_same(live_server, tokenizer, hf_model):  # noqa: F811
    ids = tokenizer.encode(TEXT)
    body = {"prompt": TEXT, "echo": True, "logprobs": 2, "max_tokens": 0}
    with live_server.client() as http:
        whole = http.post("/v1/completions", json=body).json()
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    choice = whole["choices"][0]
    assert choice["text"] == TEXT and choice["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 0 and whole["usage"]["prompt_tokens"] == len(ids)
    lp = choice["logprobs"]
    assert lp["tokens"] == [tokenizer.decode([t]) for t in ids] and len(lp["token_logprobs"]) == len(ids)
    assert lp["text_offset"][0] == 0 and "".join(lp["tokens"]) == TEXT
    assert all(len(top) == 2 for top in lp["top_logprobs"][1:])
    assert lp["token_logprobs"][1:] == pytest.approx([e[0] for e in hf_scores(hf_model, ids, 2)], abs=1e-4)
    streamed = [event["choices"][0]["logprobs"] for event in events if event["choices"][0]["logprobs"]]
    assert streamed == [lp]


def test_chat_prompt_logprobs_in_vllm_shape(server, tokenizer, hf_model):
    ids = chat_prompt_ids(tokenizer, QUESTION)  # as the server renders it
    body = {"messages": QUESTION, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 2}
    with server.client() as http:
        got = http.post("/v1/chat/completions", json=body).json()
    scores = got["prompt_logprobs"]
    assert len(scores) == len(ids) == got["usage"]["prompt_tokens"] and scores[0] is None
    for token, entry, (logprob, rank, top) in zip(ids[1:], scores[1:], hf_scores(hf_model, ids, 2)):
        assert entry[str(token)]["logprob"] == pytest.approx(logprob, abs=1e-4)
        assert entry[str(token)]["rank"] == rank
        assert entry[str(token)]["decoded_token"] == tokenizer.decode([token])
        for position, (alternative, value) in enumerate(top, start=1):
            if alternative != token:
                assert entry[str(alternative)] == {"logprob": pytest.approx(value, abs=1e-4), "rank": position,
                                                   "decoded_token": tokenizer.decode([alternative])}
    assert got["choices"][0]["message"]["content"]


def test_generate_input_logprobs_in_sglang_shape(server, tokenizer, hf_model):
    ids = tokenizer.encode(TEXT)
    expected = hf_scores(hf_model, ids, 2)
    body = {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 2, "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    with server.client() as http:
        from_start = http.post("/generate", json={**body, "logprob_start_len": 0}).json()["meta_info"]
        from_ten = http.post("/generate", json={**body, "logprob_start_len": 10}).json()["meta_info"]
        default = http.post("/generate", json=body).json()["meta_info"]
    assert from_start["input_token_logprobs"][0] == [None, ids[0], tokenizer.decode([ids[0]])]
    assert from_start["input_top_logprobs"][0] is None
    for entry, tops, (logprob, _, top), token in zip(from_start["input_token_logprobs"][1:],
                                                     from_start["input_top_logprobs"][1:], expected, ids[1:]):
        assert entry[0] == pytest.approx(logprob, abs=1e-4) and entry[1:] == [token, tokenizer.decode([token])]
        assert [t[1] for t in tops] == [t for t, _ in top]
    assert from_ten["input_token_logprobs"] == from_start["input_token_logprobs"][10:]
    assert len(default["input_token_logprobs"]) == 1 and default["input_token_logprobs"][0][1] == ids[-1]
    assert len(from_start["output_token_logprobs"]) == 2


def test_text_offsets_index_the_echoed_text_of_a_token_id_prompt(live_server, tokenizer):  # noqa: F811
    """A token-id prompt's echo leaves special tokens out of its text: they take no room."""
    ids = [tokenizer.convert_tokens_to_ids("<|im_start|>")] + tokenizer.encode("The capital of France is")
    body = {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 2, "temperature": 0}
    with live_server.client() as http:
        choice = http.post("/v1/completions", json=body).json()["choices"][0]
    lp, text = choice["logprobs"], choice["text"]
    assert text.startswith("The capital of France is") and lp["tokens"][0] == "<|im_start|>"
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][:2] == [0, 0]
    for token, offset in list(zip(lp["tokens"], lp["text_offset"]))[1:]:
        assert text[offset : offset + len(token)] == token

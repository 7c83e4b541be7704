"""Tensor parallelism through the server, with the official openai client, on the CPU (gloo,
one thread per rank): a model split over ranks answers what one rank answers (greedy, fp32;
plain, static and adaptive EAGLE-3), on a tiny random model whose heads are grouped and
on the default model; a rank that dies or hangs takes the server down with a non-zero exit
and leaves no process behind; ranks on a second "node" (a second launch, --node-rank 1)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import openai
import pytest
from conftest import engine_config
from eagle3_helpers import save_random_head
from server_fixtures import LiveServer, free_port, live_server  # noqa: F401 - a fixture
from test_tensor_parallel import GQA_WITH_BIASES, _save_model

from eaglesrv.engine.llm_engine import Engine
from eaglesrv.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [[1, 5, 9, 33, 70], [1, 200, 3, 17, 17, 4], list(range(1, 30))]
MAX_TOKENS = 24
SPECULATIVE = ("--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3", "--speculative-eagle-topk", "2",
               "--speculative-num-draft-tokens", "4")
MODES = {"plain": (), "static": (*SPECULATIVE, "--disable-speculative-adaptive"), "adaptive": SPECULATIVE}


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory) -> tuple[str, str]:
    """The tiny model with grouped-query heads and biases, and a random head for it."""
    model = _save_model(tmp_path_factory.mktemp("tp_server_model"), **GQA_WITH_BIASES)
    return model, save_random_head(model, tmp_path_factory.mktemp("tp_server_head"))


@pytest.fixture(scope="module")
def one_rank_outputs(gqa_model) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [r.output_token_ids for r in Engine(engine_config(gqa_model[0])).generate(PROMPTS, params)]


def _tiny_server(gqa_model, *args: str, cache_dir=None) -> LiveServer:
    model, head = gqa_model
    head_args = ("--speculative-draft-model-path", head) if "EAGLE3" in args else ()
    return LiveServer("--model-path", model, "--device", "cpu", "--max-total-tokens", "4096", *head_args, *args,
                      env={"EAGLESRV_CACHE": str(cache_dir)} if cache_dir else None)


def _openai(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key or "none", max_retries=0,
                         timeout=120)


def _served_tokens(client: openai.OpenAI, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy completions of token-id prompts; without a tokenizer, logprob entries name the ids."""
    model = client.models.list().data[0].id
    response = client.completions.create(model=model, prompt=prompts, max_tokens=MAX_TOKENS, temperature=0,
                                         logprobs=0, extra_body={"ignore_eos": True})
    choices = sorted(response.choices, key=lambda choice: choice.index)
    return [[int(token.removeprefix("token_id:")) for token in choice.logprobs.tokens] for choice in choices]


def _rank_pids(server: LiveServer) -> dict[int, int]:
    """rank -> pid, from the start-up log lines that name each rank's backend."""
    pattern = r"Tensor parallelism: rank (\d+) of \d+ \(pid (\d+)\), backend gloo"
    found = re.findall(pattern, server.log_path.read_text())
    return {int(rank): int(pid) for rank, pid in found}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("mode", list(MODES))
def test_tiny_model_split_over_two_ranks_serves_what_one_rank_does(gqa_model, one_rank_outputs, mode,
                                                                     tmp_path):
    server = _tiny_server(gqa_model, "--tp-size", "2", *MODES[mode], cache_dir=tmp_path)
    try:
        server.wait_healthy()
        client = _openai(server)
        assert _served_tokens(client, PROMPTS) == one_rank_outputs
        # Streamed too, one request at a time beside nothing else.
        model = client.models.list().data[0].id
        stream = client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0,
                                           logprobs=0, stream=True, extra_body={"ignore_eos": True})
        streamed = [int(token.removeprefix("token_id:")) for chunk in stream if chunk.choices[0].logprobs
                    for token in chunk.choices[0].logprobs.tokens]
        assert streamed == one_rank_outputs[2]
        info = server.server_info()
    finally:
        assert server.stop() == 0
    assert info["tp_size"] == 2
    assert sorted(_rank_pids(server)) == [0, 1]  # the start-up log names the backend of each rank
    state = info["internal_states"][0]
    if mode == "static":
        assert state["spec_verifications"] > 0
    if mode == "adaptive":
        assert state["spec_adaptive"] and state["spec_steps_plain"] + state["spec_steps_speculative"] > 0


@pytest.fixture(scope="module")
def default_model_answers(live_server) -> list[str]:
    """The shared one-rank server's greedy chat answers (default model, fp32)."""
    return [_chat(_openai(live_server), question) for question in QUESTIONS]


QUESTIONS = ["What is the capital of France?", "Write a haiku about rivers.", "Describe Paris as JSON."]
# The last question is asked under a JSON schema, in one mode (its first grammar makes every
# other rank load a tokenizer, seconds on this machine): every rank masks its logits and
# verifies its trees with the grammar, and their masks must agree.
STRUCTURED_MODE = "static"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "is_capital": {"type": "boolean"}},
          "required": ["city", "is_capital"], "additionalProperties": False}


def _chat(client: openai.OpenAI, question: str) -> str:
    model = client.models.list().data[0].id
    structured = {"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}}
    response = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                              temperature=0, max_tokens=32,
                                              **(structured if "JSON" in question else {}))
    return response.choices[0].message.content


@pytest.mark.parametrize("mode", list(MODES))
def test_default_model_split_over_three_ranks_answers_as_one_rank(default_model_answers, mode):
    """SmolLM2-135M has 9 query and 3 KV heads: 3 ranks (3 and 1 each), not 2, divide them."""
    server = LiveServer("--tp-size", "3", "--max-total-tokens", "4096", "--max-running-requests", "4", *MODES[mode])
    try:
        client = _openai(server.wait_healthy())
        asked = QUESTIONS if mode == STRUCTURED_MODE else QUESTIONS[:-1]
        answers = [_chat(client, question) for question in asked]
        info = server.server_info()
    finally:
        assert server.stop() == 0
    assert answers == default_model_answers[:len(asked)]
    if mode == STRUCTURED_MODE:
        assert json.loads(answers[-1]).keys() == {"city", "is_capital"}
    if mode != "plain":
        # The shipped head accepts several tokens a step here, so trees really are verified across ranks.
        assert info["internal_states"][0]["avg_spec_accept_length"] > 1.5


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_rank_that_dies_or_hangs_takes_the_server_down(gqa_model, how):
    server = _tiny_server(gqa_model, "--tp-size", "2", "--dist-timeout", "5")
    server.wait_healthy()
    pids = _rank_pids(server)
    client = _openai(server)
    model = client.models.list().data[0].id
    # logprobs: a model without a tokenizer streams a chunk per step only with them (its text is empty)
    stream = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=480, temperature=0, stream=True,
                                       logprobs=0, extra_body={"ignore_eos": True})
    next(iter(stream))  # the request is running
    os.kill(pids[1], signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    stopped_at = time.monotonic()
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass
    try:
        server.process.wait(timeout=60)
    finally:
        server.stop()
    # Killed: the API process sees the rank end at once. Hung: rank 0's next collective times out (5 s).
    assert time.monotonic() - stopped_at < (10 if how == "killed" else 30)
    assert server.process.returncode == 1
    log = server.log()
    if how == "killed":
        assert "the tensor-parallel process eaglesrv-rank-1 exited (exit code -9)" in log
    else:
        assert "lost the other ranks (one exited, or hung past --dist-timeout)" in log
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids.values()), "a rank outlived the server"


def test_ranks_on_a_second_node_follow_the_first(gqa_model, one_rank_outputs):
    """Two "nodes" on this machine: node 0 serves with rank 0, a second launch with
    --node-rank 1 runs rank 1 and no HTTP; stopping node 0 ends node 1 with exit code 0."""
    address = f"127.0.0.1:{free_port()}"
    nodes = ("--tp-size", "2", "--nnodes", "2", "--dist-init-addr", address)
    server = _tiny_server(gqa_model, *nodes, "--node-rank", "0")
    second = subprocess.Popen(
        [sys.executable, "-m", "eaglesrv.launch", "--model-path", gqa_model[0], "--device", "cpu", "--dtype",
         "float32", "--num-threads", "1", "--max-total-tokens", "4096", *nodes, "--node-rank", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert _served_tokens(_openai(server.wait_healthy()), PROMPTS) == one_rank_outputs
    finally:
        assert server.stop() == 0
        try:
            output, _ = second.communicate(timeout=60)
        finally:
            second.kill()
    assert second.returncode == 0, output[-3000:]
    assert "rank 1 of 2" in output and "Uvicorn" not in output


def test_a_split_that_does_not_divide_the_heads_stops_the_server(gqa_model):
    server = _tiny_server(gqa_model, "--tp-size", "3")
    assert server.process.wait(timeout=120) == 1
    log = server.log()
    server.stop()
    assert "--tp-size 3 does not divide this model's attention heads 8, KV heads 4" in log
    assert "tensor-parallel sizes that do: 1, 2, 4" in log

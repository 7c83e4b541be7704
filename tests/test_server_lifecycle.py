"""`python -m eaglesrv.launch`: flags, start-up failure, and SIGTERM while streaming."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from conftest import save_tiny_llama
from server_fixtures import LiveServer, free_port

from eaglesrv.configs.cli import engine_config_from_args
from eaglesrv.configs.server import server_config_from_args
from eaglesrv.launch import build_parser
from eaglesrv.server.not_landed import report_ignored_flags

SEED_COMMAND = (
    "--model meta-llama/Llama-3.1-8B-Instruct --speculative-algorithm EAGLE3 "
    "--speculative-draft-model-path jamesliu1/sglang-EAGLE3-Llama-3.1-Instruct-8B "
    "--speculative-num-steps 5 --speculative-eagle-topk 8 --speculative-num-draft-tokens 32 "
    "--mem-fraction 0.6 --cuda-graph-max-bs 2 --dtype float16"
).split()


def test_no_flags_serve_the_default_model_on_127_0_0_1_30000():
    args = build_parser().parse_args([])
    server, engine = server_config_from_args(args), engine_config_from_args(args)
    assert (server.host, server.port, server.api_key) == ("127.0.0.1", 30000, None)
    assert engine.model.model_path is None  # the default model, SmolLM2-135M-Instruct


def test_seed_command_parses_and_ignored_flags_are_named(caplog):
    args = build_parser().parse_args(SEED_COMMAND)
    engine = engine_config_from_args(args)
    assert engine.model.model_path == "meta-llama/Llama-3.1-8B-Instruct"
    assert engine.cache.mem_fraction_static == 0.6  # --mem-fraction abbreviates --mem-fraction-static
    assert (engine.speculative.algorithm, engine.speculative.num_draft_tokens) == ("EAGLE3", 32)
    assert engine.runtime.cuda_graph_max_bs == 2 and engine.model.dtype == "float16"
    assert report_ignored_flags(engine) == []  # EAGLE-3's steps run in CUDA graphs too: --cuda-graph-max-bs counts
    plain = engine_config_from_args(build_parser().parse_args(["--cuda-graph-max-bs", "8"]))
    assert report_ignored_flags(plain) == []  # plain decoding captures its graphs
    alone = engine_config_from_args(build_parser().parse_args(["--dist-init-addr", "10.0.0.1:5000"]))
    with caplog.at_level(logging.WARNING):
        assert report_ignored_flags(alone) == ["--dist-init-addr and --dist-timeout are ignored without --tp-size "
                                               "above 1"]
    assert "--dist-init-addr and --dist-timeout are ignored" in caplog.text
    spec_flags_alone = engine_config_from_args(build_parser().parse_args(["--speculative-num-steps", "3"]))
    assert report_ignored_flags(spec_flags_alone) == [
        "--speculative-* flags are ignored without --speculative-algorithm"
    ]


def test_help_is_readable():
    out = subprocess.run([sys.executable, "-m", "eaglesrv.launch", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0
    for flag in ("--model-path", "--port", "--api-key", "--enable-metrics", "--mem-fraction-static",
                 "--speculative-algorithm", "--cuda-graph-max-bs", "--log-level", "--served-model-name"):
        assert flag in out.stdout
    assert "__" not in out.stdout  # no internal dest names as metavars


def test_bad_flag_value_exits_2():
    out = subprocess.run([sys.executable, "-m", "eaglesrv.launch", "--port", "99999"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "--port" in out.stderr


@pytest.mark.slow
def test_engine_start_up_failure_is_an_error_exit_not_a_hang():
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "eaglesrv.launch", "--model-path", "/nonexistent/model", "--port", str(free_port())],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 1
    assert "the engine failed to start" in out.stderr and "/nonexistent/model" in out.stderr
    assert time.monotonic() - started < 120


STREAM_TOKENS = 3000  # long enough to still be streaming when SIGTERM comes, even on a fast machine


def _stream_completion(base_url: str, results: list, first_token: threading.Event) -> None:
    # The tiny model has no tokenizer, so its chunks carry no text: logprobs make every
    # step send one (naming the token ids), so the first chunk comes with the first token.
    body = {"prompt": [1, 5, 9, 13, 17], "max_tokens": STREAM_TOKENS, "ignore_eos": True, "temperature": 0,
            "stream": True, "logprobs": 0, "stream_options": {"include_usage": True}}
    reason, usage, done = None, None, False
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line.removeprefix("data: "))
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    reason = choice["finish_reason"] or reason
                first_token.set()
    results.append((reason, usage and usage["completion_tokens"], done, time.monotonic()))


@pytest.mark.slow
def test_sigterm_lets_streams_finish_then_exits_zero(tmp_path):
    # A tiny model starts in seconds (what is tested here is the server, not the model);
    # this one has a long context so that its streams outlast the signal.
    model = save_tiny_llama(tmp_path, max_position_embeddings=4096)
    server = LiveServer("--model-path", model, "--dtype", "float32", "--device", "cpu",
                        "--max-total-tokens", "16384")
    try:
        server.wait_healthy()
        assert server.health_codes[-1] == 200
        assert 503 in server.health_codes  # HTTP was up, answering 503, while the model loaded
        results: list = []
        first_tokens = [threading.Event() for _ in range(3)]
        threads = [threading.Thread(target=_stream_completion, args=(server.base_url, results, event))
                   for event in first_tokens]
        for thread in threads:
            thread.start()
        for event in first_tokens:
            assert event.wait(120)
        server.process.send_signal(signal.SIGTERM)
        signalled_at = time.monotonic()
        for thread in threads:
            thread.join(120)
        assert server.process.wait(120) == 0, server.log()
    finally:
        server.stop()
    assert len(results) == 3
    for reason, completion_tokens, done, finished_at in results:
        assert (reason, completion_tokens, done) == ("length", STREAM_TOKENS, True)
    assert max(r[3] for r in results) > signalled_at  # they were still streaming when the signal came
    assert "shutting down: finishing in-flight requests" in server.log()

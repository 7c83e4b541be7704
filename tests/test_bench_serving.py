"""bench_serving: ShareGPT and random sampling, the three API clients, the run and its report.

The fast tests answer requests with httpx.MockTransport (no server, no model); the slow
one is the smoke run of the real CLI against the shared live server (default model).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from server_fixtures import API_KEY, live_server  # noqa: F401 (fixture)

from eaglesrv.bench.serving.client import RequestInput, native_generate, openai_chat, openai_completions
from eaglesrv.bench.serving.dataset import DatasetRow, sample_random_requests, sample_sharegpt_requests
from eaglesrv.bench.serving.metrics import (
    OPTIONAL_LABELS,
    REPORT_LABELS,
    compute_metrics,
    missing_report_lines,
    parse_report,
)
from eaglesrv.bench.serving.run import BenchSettings, accept_length_between, benchmark
from eaglesrv.bench.serving.tokenizer import pick_tokenizer_spec
from eaglesrv.bench_serving import parse_args
from eaglesrv.data import TRAINING_CONVERSATIONS


class WordTokenizer:
    """One token per whitespace-separated word: lengths that are easy to reason about."""

    bos_token = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(word) for word in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join("w" * max(i, 1) for i in ids)


def words(n: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def write_sharegpt(path, pairs: list[tuple[str, str]]) -> str:
    records = [{"id": str(i), "conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": r}]}
               for i, (p, r) in enumerate(pairs)]
    path.write_text(json.dumps(records))
    return str(path)


# ---- datasets ---------------------------------------------------------------------------
def test_sharegpt_sampling_filters_short_and_long_pairs_like_sglang(tmp_path) -> None:
    pairs = [(words(10), words(20)), (words(3), words(20)), (words(10), words(3)), (words(1100), words(5)),
             (words(1000), words(1100)), (words(12), words(30))]
    path = write_sharegpt(tmp_path / "sg.json", pairs)
    rows = sample_sharegpt_requests(WordTokenizer(), 2, dataset_path=path, split="all", seed=0)
    assert sorted((r.prompt_len, r.output_len) for r in rows) == [(10, 20), (12, 30)]
    with pytest.raises(ValueError, match="only 2"):
        sample_sharegpt_requests(WordTokenizer(), 3, dataset_path=path, split="all")

    fixed = sample_sharegpt_requests(WordTokenizer(), 3, dataset_path=path, split="all", fixed_output_len=8)
    assert sorted(r.output_len for r in fixed) == [8, 8, 8]  # the 3-token reply no longer matters
    capped = sample_sharegpt_requests(WordTokenizer(), 2, dataset_path=path, split="all", max_output_len=25)
    assert sorted(r.output_len for r in capped) == [20, 25]
    # A context length drops pairs whose prompt plus output exceed it.
    short_ctx = sample_sharegpt_requests(WordTokenizer(), 1, dataset_path=path, split="all", context_len=35)
    assert [(r.prompt_len, r.output_len) for r in short_ctx] == [(10, 20)]


def test_sharegpt_sampling_is_seeded_and_uses_held_out_conversations_by_default(tmp_path) -> None:
    # The training split is the first 8,000 usable conversations; only the rest may be drawn.
    pairs = [(words(5, "train"), words(5))] * TRAINING_CONVERSATIONS + [(words(5, f"eval{i}x"), words(5))
                                                                        for i in range(6)]
    path = write_sharegpt(tmp_path / "sg.json", pairs)
    rows = sample_sharegpt_requests(WordTokenizer(), 6, dataset_path=path, seed=3)
    assert all(r.prompt.startswith("eval") for r in rows)
    again = sample_sharegpt_requests(WordTokenizer(), 6, dataset_path=path, seed=3)
    other = sample_sharegpt_requests(WordTokenizer(), 6, dataset_path=path, seed=4)
    assert [r.prompt for r in rows] == [r.prompt for r in again] != [r.prompt for r in other]


def test_random_requests_have_the_drawn_lengths(tmp_path) -> None:
    path = write_sharegpt(tmp_path / "sg.json", [(words(7), words(5)), (words(3), words(4)), (words(30), words(4))])
    rows = sample_random_requests(WordTokenizer(), 3, 20, 10, 0.5, dataset_path=path, split="all", seed=1)
    assert all(10 <= r.prompt_len <= 20 and 5 <= r.output_len <= 10 for r in rows)
    assert [len(WordTokenizer().encode(r.prompt)) for r in rows] == [r.prompt_len for r in rows]
    with pytest.raises(ValueError, match="only 3"):
        sample_random_requests(WordTokenizer(), 4, 20, 10, 0.5, dataset_path=path, split="all")


# ---- a fake server ----------------------------------------------------------------------
class FakeServer:
    """Streams canned answers for the three APIs through httpx.MockTransport.

    /generate sends `chunks` tokens per event (several, as when speculation accepts a run);
    the OpenAI APIs one per event then a usage event. Keeps speculation counters that
    already hold an earlier run's history, and the most requests ever in flight.
    """

    def __init__(self, chunks: tuple[int, ...] = (1, 3), fail_status: int | None = None) -> None:
        self.chunks = chunks
        self.fail_status = fail_status
        self.verifications, self.accepted = 100, 500  # an average of 5 from before the run
        self.in_flight = self.max_in_flight = 0
        self.bodies: list[dict] = []

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/get_server_info":
            return httpx.Response(200, json={"internal_states": [{
                "avg_spec_accept_length": self.accepted / self.verifications,
                "spec_verifications": self.verifications, "spec_accepted_tokens": self.accepted}]})
        body = json.loads(request.content)
        self.bodies.append(body)
        if self.fail_status:
            return httpx.Response(self.fail_status, json={"error": {"message": "no such luck"}})
        return httpx.Response(200, content=self._events(request.url.path, body),
                              headers={"content-type": "text/event-stream"})

    async def _events(self, path: str, body: dict):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        sent = 0
        for count in self.chunks:
            await asyncio.sleep(0.01)
            sent += count
            if path == "/generate":
                event = {"text": "t " * sent, "meta_info": {"completion_tokens": sent}}
            elif path == "/v1/completions":
                event = {"choices": [{"index": 0, "text": "t " * count}]}
            else:
                event = {"choices": [{"index": 0, "delta": {"content": "t " * count}}]}
            yield f"data: {json.dumps(event)}\n\n".encode()
        self.verifications += len(self.chunks) - 1  # the first token is the prefill's
        self.accepted += sent - self.chunks[0]
        # Done before the last event: the client stops reading at [DONE], so code after it may never run.
        self.in_flight -= 1
        if path != "/generate":
            yield f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': sent}})}\n\n".encode()
        yield b"data: [DONE]\n\n"


def request(path: str, stream: bool = True) -> RequestInput:
    return RequestInput(prompt="hello there", prompt_len=2, output_len=4, model="m", api_url=f"http://fake{path}",
                        stream=stream)


async def _send(func, server: FakeServer, inp: RequestInput):
    async with httpx.AsyncClient(transport=server.transport) as client:
        return await func(client, inp)


# ---- the clients ------------------------------------------------------------------------
def test_native_client_spreads_an_events_gap_over_its_tokens() -> None:
    server = FakeServer(chunks=(1, 3))
    out = asyncio.run(_send(native_generate, server, request("/generate")))
    assert out.success and out.output_len == 4 and out.generated_text == "t t t t "
    assert len(out.itl) == 3 and len(set(out.itl)) == 1  # one gap, shared by the 3 tokens it brought
    assert 0 < out.ttft < out.latency
    assert server.bodies[0]["sampling_params"] == {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}


@pytest.mark.parametrize("func, path", [(openai_completions, "/v1/completions"), (openai_chat, "/v1/chat/completions")])
def test_openai_clients_take_the_output_count_from_usage(func, path) -> None:
    server = FakeServer(chunks=(1, 2, 2))
    out = asyncio.run(_send(func, server, request(path)))
    assert out.success and out.output_len == 5 and out.generated_text == "t " * 5
    assert len(out.itl) == 2  # one per event: the stream does not say how many tokens each held
    body = server.bodies[0]
    assert body["ignore_eos"] is True and body["max_tokens"] == 4 and body["stream_options"] == {"include_usage": True}
    assert ("messages" in body) == (path == "/v1/chat/completions")


def test_failed_requests_are_results_with_their_error() -> None:
    out = asyncio.run(_send(native_generate, FakeServer(fail_status=400), request("/generate")))
    assert not out.success and out.error.startswith("HTTP 400") and "no such luck" in out.error

    class ErrorEvent(FakeServer):
        async def _events(self, path, body):
            yield b'data: {"error": {"message": "engine gone"}}\n\n'

    out = asyncio.run(_send(openai_chat, ErrorEvent(), request("/v1/chat/completions")))
    assert not out.success and "engine gone" in out.error


# ---- a run and its report ---------------------------------------------------------------
def run_fake(server: FakeServer, rows: int = 6, **settings) -> object:
    bench = BenchSettings(backend=settings.pop("backend", "sglang"), base_url="http://fake", model="m",
                          show_progress=False, **settings)
    dataset = [DatasetRow(f"prompt {i}", 2, 4) for i in range(rows)]
    return asyncio.run(benchmark(bench, dataset, WordTokenizer(), transport=server.transport))


def test_a_run_keeps_to_its_concurrency_and_reports_every_line() -> None:
    server = FakeServer(chunks=(1, 3))
    result = run_fake(server, max_concurrency=2)
    assert server.max_in_flight == 2
    assert len(server.bodies) == 7  # one warm-up request, then the six
    report = result.report()
    assert missing_report_lines(report) == []
    values = parse_report(report)
    assert set(values) == set(REPORT_LABELS) | {"Accept length:"}
    assert values["Successful requests:"] == 6 and values["Max request concurrency:"] == 2
    assert values["Total generated tokens:"] == 24 and values["Total input tokens:"] == 12
    # This run's own accept length (3 tokens from 1 verification per request), not the lifetime average.
    assert values["Accept length:"] == 3.0 and result.accept_length == 3.0
    assert values["Output token throughput (tok/s):"] == pytest.approx(24 / result.duration_s, rel=0.01)


def test_a_run_counts_failures_and_shows_the_first_errors() -> None:
    result = run_fake(FakeServer(fail_status=503), rows=3, warmup_requests=0, backend="vllm-chat")
    report = result.report()
    assert parse_report(report)["Successful requests:"] == 0 and parse_report(report)["Failed requests:"] == 3
    assert "First errors of the 3 failed requests" in report and "HTTP 503" in report
    assert missing_report_lines(report) == []  # zeros, as SGLang prints them
    assert OPTIONAL_LABELS[0] in report
    with pytest.raises(RuntimeError, match="warm-up failed"):
        run_fake(FakeServer(fail_status=503), rows=1)


def test_poisson_arrivals_spread_the_requests() -> None:
    started = time.perf_counter()
    result = run_fake(FakeServer(chunks=(1,)), rows=4, request_rate=50.0, warmup_requests=0)
    assert result.metrics.completed == 4 and time.perf_counter() - started > 0.02


def test_metrics_follow_sglangs_definitions() -> None:
    from eaglesrv.bench.serving.client import RequestRecord

    outs = [RequestRecord(True, "a b c", latency=1.0, ttft=0.2, itl=[0.4, 0.4], prompt_len=10, output_len=3),
            RequestRecord(True, "a", latency=0.5, ttft=0.5, itl=[], prompt_len=6, output_len=1),
            RequestRecord(False, error="boom", prompt_len=99)]
    m = compute_metrics(outs, 2.0, WordTokenizer())
    assert (m.completed, m.failed, m.total_input, m.total_output, m.total_output_retokenized) == (2, 1, 16, 4, 4)
    assert m.output_throughput == 2.0 and m.request_throughput == 1.0 and m.total_throughput == 10.0
    assert m.mean_ttft_ms == pytest.approx(350) and m.median_itl_ms == pytest.approx(400)
    assert m.mean_tpot_ms == pytest.approx(400)  # (1.0 - 0.2) / 2; one-token outputs have no TPOT
    assert m.concurrency == pytest.approx(0.75)  # 1.5 s of requests over 2 s


def test_accept_length_from_counters_or_the_servers_average() -> None:
    before = {"spec_verifications": 10, "spec_accepted_tokens": 30}
    assert accept_length_between(before, {"spec_verifications": 20, "spec_accepted_tokens": 55}) == 2.5
    assert accept_length_between(None, {"avg_spec_accept_length": 2.8}) == 2.8  # SGLang keeps only this
    assert accept_length_between(None, {"avg_spec_accept_length": None}) is None  # speculation off
    assert accept_length_between(None, None) is None  # no /get_server_info (vLLM)


def test_tokenizer_choice_and_cli_defaults() -> None:
    assert pick_tokenizer_spec("tok-dir", "m", None) == "tok-dir"
    assert pick_tokenizer_spec(None, "meta-llama/Llama-3.1-8B-Instruct", None) == "meta-llama/Llama-3.1-8B-Instruct"
    assert pick_tokenizer_spec(None, "SmolLM2-135M-Instruct", {"tokenizer_path": None}) is None  # the default model
    with pytest.raises(ValueError, match="--tokenizer"):
        pick_tokenizer_spec(None, "my-served-name", {"model_path": "my-served-name"})
    smoke, full = parse_args(["--smoke", "--num-prompts", "3"]), parse_args([])
    assert (smoke.num_prompts, smoke.sharegpt_output_len) == (3, 16)
    assert (full.num_prompts, full.sharegpt_output_len, full.request_rate, full.sharegpt_split) == (
        1000, None, float("inf"), "heldout")


# ---- the smoke run against a live server ------------------------------------------------
@pytest.mark.slow
def test_smoke_run_against_the_live_server_prints_a_complete_report(live_server, tmp_path, capsys,
                                                                    monkeypatch) -> None:
    from eaglesrv.bench_serving import main

    out = tmp_path / "runs.jsonl"
    # 1000 tokens at most: the shared server's context is 1024 (SGLang's filter alone allows 2048).
    common = ["--base-url", live_server.base_url, "--smoke", "--num-prompts", "3", "--sharegpt-output-len", "8",
              "--sharegpt-context-len", "1000", "--disable-tqdm", "--output-file", str(out)]
    proc = subprocess.run([sys.executable, "-m", "eaglesrv.bench_serving", *common], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OPENAI_API_KEY": API_KEY})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Smoke check: the report is complete" in proc.stdout
    values = parse_report(proc.stdout)
    assert missing_report_lines(proc.stdout) == []
    assert values["Backend:"] == "sglang" and values["Successful requests:"] == 3
    assert values["Total generated tokens:"] == 3 * 8  # EOS ignored: every request runs to its length
    assert values["Output token throughput (tok/s):"] > 0 and values["Mean ITL (ms):"] > 0
    assert "Accept length:" not in values  # speculation is off on the shared server

    # The chat API too, in-process (the tokenizer is cached by now), appending to the same file.
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    assert main([*common, "--backend", "sglang-oai-chat", "--num-prompts", "2"]) == 0
    chat = parse_report(capsys.readouterr().out)
    assert chat["Backend:"] == "sglang-oai-chat" and chat["Successful requests:"] == 2
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["backend"], r["completed"], r["failed"]) for r in records] == [
        ("sglang", 3, 0), ("sglang-oai-chat", 2, 0)]
    assert records[0]["total_output_tokens"] == 24 and records[0]["sharegpt_split"] == "heldout"

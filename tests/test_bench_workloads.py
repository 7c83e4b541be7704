"""The prefix-cache workloads of bench_serving and bench_compare: SGLang's generated-shared-prefix
requests, ShareGPT conversations replayed turn by turn, and a comparison with only --config servers.

No server, no model: requests are answered through httpx.MockTransport and tokens are words.
"""

from __future__ import annotations

import asyncio
import json
import re
from contextlib import contextmanager

import httpx
import pytest

from eaglesrv.bench.compare.configs import build_configs
from eaglesrv.bench.compare.report import MARKDOWN_NAME, write_outputs
from eaglesrv.bench.serving.dataset import render_chat
from eaglesrv.bench.serving.metrics import missing_report_lines, parse_report
from eaglesrv.bench.serving.multiturn import ConversationRow, exchanges, sample_sharegpt_conversations
from eaglesrv.bench.serving.run import BenchSettings, benchmark
from eaglesrv.bench.serving.shared_prefix import sample_generated_shared_prefix_requests
from eaglesrv.bench_compare import build_variants
from eaglesrv.bench_compare import main as compare_main
from eaglesrv.bench_compare import parse_args as compare_args
from eaglesrv.bench_serving import dataset_fields, parse_args, requests_from_args
from eaglesrv.data import Conversation, Turn

SPECIAL = 0  # the one special token id of the test vocabulary


class ChatWordTokenizer:
    """One token per word; id i decodes to a word of i letters; a chat template of "<role> text" words."""

    bos_token = None
    all_special_ids = [SPECIAL]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(word) for word in text.split()]

    def decode(self, ids: list[int]) -> str:
        assert SPECIAL not in ids, "special tokens must stay out of generated text"
        return " ".join("w" * i for i in ids)

    def get_vocab(self) -> dict[str, int]:
        return {"<eos>": SPECIAL, **{"w" * i: i for i in range(1, 9)}}

    def apply_chat_template(self, messages, add_generation_prompt: bool = False, tokenize: bool = False) -> str:
        text = " ".join(f"<{m['role']}> {m['content']}" for m in messages)
        return text + (" <assistant>" if add_generation_prompt else "")


TOKENIZER = ChatWordTokenizer()


def words(n: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


# ---- generated-shared-prefix ------------------------------------------------------------
def test_shared_prefix_requests_are_groups_sharing_a_system_prompt_shuffled_with_the_seed() -> None:
    rows = sample_generated_shared_prefix_requests(TOKENIZER, 3, 4, 20, 5, 7, seed=2)
    assert len(rows) == 12 and {(r.prompt_len, r.output_len) for r in rows} == {(25, 7)}
    systems = [r.prompt.split("\n\n")[0] for r in rows]
    assert sorted(systems.count(s) for s in set(systems)) == [4, 4, 4]  # three groups of four
    assert len({r.prompt.split("\n\n")[1] for r in rows}) > 1  # each request asks its own question
    # Shuffled, as SGLang sends them: a group's requests do not all come one after another.
    assert systems != sorted(systems, key=systems.index)
    again = sample_generated_shared_prefix_requests(TOKENIZER, 3, 4, 20, 5, 7, seed=2)
    other = sample_generated_shared_prefix_requests(TOKENIZER, 3, 4, 20, 5, 7, seed=3)
    assert [r.prompt for r in rows] == [r.prompt for r in again] != [r.prompt for r in other]


def test_shared_prefix_lengths_follow_the_range_ratio_and_bad_flags_are_refused() -> None:
    rows = sample_generated_shared_prefix_requests(TOKENIZER, 4, 8, 40, 10, 16, range_ratio=0.5, seed=1)
    system_lens = {len(r.prompt.split("\n\n")[0].split()) for r in rows}
    assert len(system_lens) <= 4 and all(20 <= n <= 40 for n in system_lens)  # one length per group
    assert all(5 <= len(r.prompt.split("\n\n")[1].split()) <= 10 and 8 <= r.output_len <= 16 for r in rows)
    assert len({r.output_len for r in rows}) > 1
    templated = sample_generated_shared_prefix_requests(TOKENIZER, 1, 2, 4, 2, 4, chat_template=True)
    assert all(r.prompt.startswith("<user> ") and r.prompt_len == 4 + 2 + 2 for r in templated)
    for bad in ({"num_groups": 0}, {"output_len": 0}, {"range_ratio": 1.5}):
        kwargs = {"num_groups": 1, "prompts_per_group": 1, "system_prompt_len": 4, "question_len": 2,
                  "output_len": 4, **bad}
        with pytest.raises(ValueError, match="--gsp-"):
            sample_generated_shared_prefix_requests(TOKENIZER, **kwargs)


def test_cli_takes_sglangs_gsp_flags_with_sglangs_defaults() -> None:
    full = parse_args(["--dataset-name", "generated-shared-prefix"])
    assert (full.gsp_num_groups, full.gsp_prompts_per_group, full.gsp_system_prompt_len, full.gsp_question_len,
            full.gsp_output_len, full.gsp_range_ratio) == (64, 16, 2048, 128, 256, 1.0)
    args = parse_args(["--dataset-name", "generated-shared-prefix", "--smoke", "--gsp-num-groups", "3"])
    assert (args.gsp_num_groups, args.gsp_prompts_per_group, args.gsp_system_prompt_len) == (3, 2, 64)
    rows = requests_from_args(args, TOKENIZER)
    assert len(rows) == 6 and all(r.output_len == 16 for r in rows)  # --num-prompts does not apply
    fields = dataset_fields(args)
    assert fields["gsp_num_groups"] == 3 and fields["dataset_name"] == "generated-shared-prefix"
    assert "gsp_num_groups" not in dataset_fields(parse_args([]))


# ---- multi-turn ShareGPT ----------------------------------------------------------------
def conversation(*texts: str, roles: str = "") -> dict:
    roles = roles or "hg" * len(texts)
    names = {"h": "human", "g": "gpt", "s": "system"}
    return {"id": "c", "conversations": [{"from": names[r], "value": t} for r, t in zip(roles, texts)]}


def write_conversations(path, records: list[dict]) -> str:
    path.write_text(json.dumps(records))
    return str(path)


def test_exchanges_stop_at_the_first_turn_out_of_order() -> None:
    def conv(*roles_texts):
        return Conversation("c", tuple(Turn(role, text) for role, text in roles_texts))

    assert exchanges(conv(("human", "a"), ("gpt", "b"), ("human", "c"), ("gpt", "d"))) == [("a", "b"), ("c", "d")]
    assert exchanges(conv(("human", "a"), ("gpt", "b"), ("human", "c"), ("human", "d"), ("gpt", "e"))) == [
        ("a", "b")]
    assert exchanges(conv(("human", "a"), ("gpt", "b"), ("human", "c"))) == [("a", "b")]  # no reply: no turn


def test_conversations_keep_the_turns_that_fit_and_skip_single_turn_ones(tmp_path) -> None:
    records = [
        conversation(words(5), words(6), words(3), words(8), words(4), words(9)),  # 3 turns
        conversation(words(5), words(6)),  # one turn: not a multi-turn conversation
        conversation(words(5), words(6), "", words(8)),  # an empty second turn ends it at one turn
        conversation(words(5), words(30), words(2), words(40), words(2), words(50)),  # long replies
    ]
    path = write_conversations(tmp_path / "sg.json", records)
    rows = sample_sharegpt_conversations(TOKENIZER, 2, dataset_path=path, split="all", seed=0)
    assert sorted(r.output_lens for r in rows) == [(6, 8, 9), (30, 40, 50)]
    short_replies = next(r for r in rows if r.output_lens == (6, 8, 9))
    assert short_replies.user_lens == (5, 3, 4) and (short_replies.prompt_len, short_replies.output_len) == (12, 23)
    with pytest.raises(ValueError, match="only 2"):
        sample_sharegpt_conversations(TOKENIZER, 3, dataset_path=path, split="all")

    capped = sample_sharegpt_conversations(TOKENIZER, 2, dataset_path=path, split="all", max_turns=2,
                                           fixed_output_len=10, max_output_len=7)
    assert sorted(r.output_lens for r in capped) == [(7, 7), (7, 7)]
    # A turn's prompt is the conversation so far in the template: turn 3 of the long-reply one is
    # 6 role words + 5 + 30 + 2 + 40 + 2 = 85 tokens, and with its 50 output tokens passes 100.
    short = sample_sharegpt_conversations(TOKENIZER, 2, dataset_path=path, split="all", context_len=100)
    assert sorted(r.num_turns for r in short) == [2, 3]
    one = sample_sharegpt_conversations(TOKENIZER, 4, dataset_path=path, split="all", max_turns=1)
    assert sorted(r.num_turns for r in one) == [1, 1, 1, 1]  # asked for single turns: single turns it is


def test_cli_multiturn_defaults() -> None:
    args = parse_args(["--dataset-name", "sharegpt-multiturn", "--smoke"])
    assert (args.num_prompts, args.multiturn_max_turns, args.sharegpt_output_len) == (4, 3, 16)
    assert parse_args(["--dataset-name", "sharegpt-multiturn"]).multiturn_max_turns is None
    assert dataset_fields(args)["multiturn_max_turns"] == 3


class ChatServer:
    """Answers every API with a text that names the turn it answers ("answer-3" for the third user
    message), in two events; records every request body in arrival order and the most in flight."""

    def __init__(self, fail_turn: int | None = None) -> None:
        self.fail_turn = fail_turn
        self.requests: list[tuple[str, dict]] = []  # (path, body)
        self.in_flight = self.max_in_flight = 0

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/get_server_info", "/flush_cache"):
            self.requests.append((request.url.path, {}))
            return httpx.Response(200, json={})
        body = json.loads(request.content)
        self.requests.append((request.url.path, body))
        turn = self.turn_of(body)
        if turn == self.fail_turn:
            return httpx.Response(500, text="boom")
        return httpx.Response(200, content=self._events(request.url.path, f"answer-{turn}"),
                              headers={"content-type": "text/event-stream"})

    @staticmethod
    def turn_of(body: dict) -> int:
        if "messages" in body:
            return sum(m["role"] == "user" for m in body["messages"])
        return (body.get("text") or body.get("prompt")).count("<user>")

    async def _events(self, path: str, text: str):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        for sent, piece in enumerate((text[:3], text[3:]), 1):
            await asyncio.sleep(0.005)
            if path == "/generate":
                event = {"text": text[:3] if sent == 1 else text, "meta_info": {"completion_tokens": sent}}
            elif path == "/v1/completions":
                event = {"choices": [{"index": 0, "text": piece}]}
            else:
                event = {"choices": [{"index": 0, "delta": {"content": piece}}]}
            yield f"data: {json.dumps(event)}\n\n".encode()
        self.in_flight -= 1
        if path != "/generate":
            yield f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': 2}})}\n\n".encode()
        yield b"data: [DONE]\n\n"


CONVERSATIONS = [ConversationRow((f"a{i} one", f"a{i} two", f"a{i} three")[:turns], (4,) * turns, (2,) * turns)
                 for i, turns in enumerate((3, 2, 3))]


def replay(server: ChatServer, backend: str, rows=CONVERSATIONS, **settings):
    bench = BenchSettings(backend=backend, base_url="http://fake", model="m", show_progress=False, **settings)
    return asyncio.run(benchmark(bench, rows, TOKENIZER, transport=server.transport))


@pytest.mark.parametrize("backend", ["sglang", "sglang-oai", "vllm-chat"])
def test_each_turn_carries_the_conversation_so_far_with_the_models_own_answers(backend) -> None:
    server = ChatServer()
    result = replay(server, backend, warmup_requests=0)
    bodies = [body for path, body in server.requests if path not in ("/get_server_info", "/flush_cache")]
    assert len(bodies) == 8 and result.metrics.completed == 8
    last = next(b for b in bodies if "a2 three" in json.dumps(b))
    expected = [{"role": "user", "content": "a2 one"}, {"role": "assistant", "content": "answer-1"},
                {"role": "user", "content": "a2 two"}, {"role": "assistant", "content": "answer-2"},
                {"role": "user", "content": "a2 three"}]
    if backend == "vllm-chat":
        assert last["messages"] == expected
    else:  # the text backends send the conversation in the chat template
        assert (last.get("text") or last.get("prompt")) == render_chat(TOKENIZER, expected)
    # Prompt lengths: the conversation so far in the template, counted after the run.
    assert [o.prompt_len for o, t in zip(result.outputs, result.turns) if t == 3] == [14, 14]
    assert result.turns == [1, 2, 3, 1, 2, 1, 2, 3]


def test_conversations_hold_their_slot_from_first_turn_to_last() -> None:
    server = ChatServer()
    replay(server, "sglang-oai-chat", warmup_requests=0, max_concurrency=2)
    assert server.max_in_flight == 2
    order = [(body["messages"][-1]["content"].split()[0], ChatServer.turn_of(body))
             for path, body in server.requests if path == "/v1/chat/completions"]
    # The third conversation starts only once one of the first two has sent its last turn.
    assert order.index(("a2", 1)) > min(order.index(("a0", 3)), order.index(("a1", 2)))


def test_multiturn_report_has_ttft_by_turn_and_a_failed_turn_ends_its_conversation() -> None:
    server = ChatServer(fail_turn=2)
    result = replay(server, "sglang", warmup_requests=0)
    assert (result.metrics.completed, result.metrics.failed) == (3, 3)  # the third turns are never sent
    assert result.turns == [1, 2, 1, 2, 1, 2]
    report = result.report()
    assert missing_report_lines(report) == [] and parse_report(report)["Successful requests:"] == 3
    assert "TTFT by Turn" in report and re.search(r"\nConversations: +3\n", report)
    record = result.to_json(details=True)
    assert record["conversations"] == 3 and record["turns"] == result.turns
    assert [(s["turn"], s["completed"]) for s in record["ttft_by_turn"]] == [(1, 3)]
    assert record["ttft_by_turn"][0]["mean_input_tokens"] == 4.0  # "<user> aN one <assistant>"


def test_warm_up_then_flush_then_the_run() -> None:
    server = ChatServer()
    replay(server, "sglang-oai-chat", rows=CONVERSATIONS[:1], flush_cache=True)
    paths = [path for path, _ in server.requests]
    assert paths[:3] == ["/v1/chat/completions", "/flush_cache", "/get_server_info"]  # warm-up, flush, run
    assert server.requests[0][1]["messages"] == [{"role": "user", "content": "a0 one"}]
    assert paths.count("/v1/chat/completions") == 4


# ---- bench_compare with only --config servers -------------------------------------------
RADIX_ARGS = ["--config", "radix=", "--config", "no-radix=--disable-radix-cache", "--baseline", "radix"]


def test_a_config_can_be_the_baseline_and_plain_then_does_not_run(tmp_path) -> None:
    configs = build_variants(compare_args(RADIX_ARGS))
    assert [(c.name, c.server_args) for c in configs] == [("radix", ()), ("no-radix", ("--disable-radix-cache",))]
    assert [c.name for c in build_variants(compare_args(RADIX_ARGS[:4]))] == ["plain", "radix", "no-radix"]
    named_last = build_configs(None, [], ["a=--x", "b=--y"], baseline="b")
    assert [c.name for c in named_last] == ["b", "a"]  # the baseline runs first
    with pytest.raises(SystemExit, match="--baseline nobody: no configuration"):
        build_variants(compare_args([*RADIX_ARGS[:4], "--baseline", "nobody"]))

    runs = [{"config": name, "max_concurrency": 4, "round": 1, "completed": 4, "failed": 0,
             "total_output_tokens": 100, "duration": 100 / tput, "output_throughput": tput, "accept_length": None,
             "mean_ttft_ms": 1.0, "median_ttft_ms": 1.0, "mean_itl_ms": 1.0, "median_itl_ms": 1.0}
            for name, tput in (("radix", 20.0), ("no-radix", 10.0))]
    write_outputs(tmp_path, runs, {"title": "t"}, [], baseline="radix")
    table = (tmp_path / MARKDOWN_NAME).read_text()
    assert "| vs radix |" in table and "| 4 | no-radix | 10.0 | 0.50x |" in table


def test_bench_compare_runs_the_shared_prefix_workload_on_config_servers_alone(tmp_path, monkeypatch) -> None:
    started: list[tuple[str, ...]] = []
    server = ChatServer()

    @contextmanager
    def fake_server(server_args, log_path, startup_timeout_s, source_dir=None):
        started.append(tuple(server_args))
        yield type("Server", (), {"base_url": "http://fake"})()

    def fake_run(settings, rows, tokenizer):
        return asyncio.run(benchmark(settings, rows, tokenizer, transport=server.transport))

    monkeypatch.setattr("eaglesrv.bench_compare.load_tokenizer", lambda spec: TOKENIZER)
    monkeypatch.setattr("eaglesrv.bench.compare.run.ManagedServer", fake_server)
    monkeypatch.setattr("eaglesrv.bench.compare.run.served_model_name", lambda url: "m")
    monkeypatch.setattr("eaglesrv.bench.compare.run.run_benchmark", fake_run)
    monkeypatch.setattr("eaglesrv.bench.machine.machine_info", lambda: {
        "cpu": "cpu", "cores": 2, "torch": "t", "load_average_1m": 0.0})
    argv = [*RADIX_ARGS, "--dataset-name", "generated-shared-prefix", "--smoke", "--disable-tqdm",
            "--output-dir", str(tmp_path)]
    assert compare_main(argv) == 0
    assert started == [(), ("--disable-radix-cache",)]
    # Two servers, two concurrencies each: every run flushes the cache after its warm-up.
    assert [path for path, _ in server.requests].count("/flush_cache") == 4
    table = (tmp_path / MARKDOWN_NAME).read_text()
    assert "4 generated shared-prefix prompts (2 groups of 2" in table and "| vs radix |" in table
    assert table.count("| radix |") == 2 and table.count("| no-radix |") == 2

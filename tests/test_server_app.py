"""The HTTP layer in-process, on a scripted fake engine: phases (loading, draining, dead
engine), overload, body limits, and that leaving a request aborts its engine request.

No model and no subprocess, so these run in about a second."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from server_fixtures import byte_level_tokenizer

from eaglesrv.configs import EngineConfig, ServerConfig
from eaglesrv.engine.client import EngineDeadError
from eaglesrv.engine.protocol import EngineInfo, EngineOutput, EngineStats
from eaglesrv.server.app import build_app
from eaglesrv.server.state import ServerState

INFO = EngineInfo(model_name="fake", model_path=None, tokenizer_path=None, max_context_len=64, vocab_size=300,
                  eos_token_ids=(0,), page_size=16, num_pages=8, max_running_requests=1, dtype="float32", device="cpu")


class FakeEngineClient:
    """Answers every request with `script` (token ids, one per step), after `gate` opens."""

    def __init__(self, script: list[int]) -> None:
        self.script = script
        self.gate = asyncio.Event()
        self.gate.set()
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.dead_reason: str | None = None
        self.stall_reason: str | None = None

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None

    async def stream(self, prompt_ids, params):
        if not self.is_alive:
            raise EngineDeadError(self.dead_reason)
        request_id = f"r{len(self.added)}"
        self.added.append(request_id)
        finished = False
        try:
            await self.gate.wait()
            limit = min(len(self.script), params.max_tokens or len(self.script))
            for k in range(limit):
                finished = k == limit - 1
                yield EngineOutput(request_id, [self.script[k]], len(prompt_ids), k + 1, "length" if finished else None)
                await asyncio.sleep(0)
        finally:
            if not finished:
                self.aborted.append(request_id)

    async def stats(self) -> EngineStats:
        return EngineStats(0, 0, 8, 8, 0, 16, 0)


def make_app(script: list[int], ready: bool = True, **server_fields):
    tokenizer = byte_level_tokenizer()
    client = FakeEngineClient(script)
    state = ServerState(ServerConfig(**server_fields), EngineConfig(), client)
    if ready:
        state.set_ready(INFO, tokenizer)
    return build_app(state), state, client, tokenizer


def run(coro):
    return asyncio.run(coro)


def http_client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def test_phases_answer_503_with_the_reason():
    async def main():
        app, state, client, _ = make_app([5], ready=False)
        async with http_client(app) as http:
            loading = await http.get("/health")
            state.set_ready(INFO, None)
            serving = await http.get("/health")
            state.draining = True
            draining = await http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
            state.draining = False
            client.dead_reason = "exit code 1"
            dead = await http.get("/health")
        return loading, serving, draining, dead

    loading, serving, draining, dead = run(main())
    assert loading.status_code == 503 and "loading" in loading.json()["error"]["message"]
    assert serving.status_code == 200
    assert draining.status_code == 503 and "shutting down" in draining.json()["error"]["message"]
    assert dead.status_code == 503 and "exit code 1" in dead.json()["error"]["message"]


def test_overload_is_503_and_slots_come_back():
    async def main():
        app, state, client, tokenizer = make_app([5, 6], max_queued_requests=0)  # 1 running + 0 queued
        client.gate.clear()
        async with http_client(app) as http:
            first = asyncio.create_task(http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}))
            while not client.added:
                await asyncio.sleep(0.01)
            refused = await http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
            client.gate.set()
            accepted = await first
            again = await http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        return refused, accepted, again

    refused, accepted, again = run(main())
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "overloaded"
    assert refused.headers["Retry-After"] == "1"
    assert accepted.status_code == 200 and again.status_code == 200


LIMITS = dict(max_queued_requests=2, max_stop_strings=2, max_stop_string_length=5, max_stop_token_ids=2,
              max_choices_per_request=4)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c"]}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": "abcdef"}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [1, 2, 3]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": ["x", "y", "z"], "n": 2}, "n"),  # 6 generations, 4 allowed
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 3}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 5}, "n"),
    ("/generate", {"text": ["a"] * 5, "sampling_params": {}}, "text"),
    ("/generate", {"input_ids": [[1]] * 5, "sampling_params": {}}, "input_ids"),
    ("/generate", {"text": "x", "sampling_params": {"stop": "abcdef"}}, "sampling_params.stop"),
    ("/generate", {"text": "x", "sampling_params": {"stop_token_ids": [1, 2, 3]}}, "sampling_params.stop_token_ids"),
    ("/v1/completions", {"prompt": ["x", "y"], "n": 2}, "n"),  # 4 generations: allowed, but more than 1 + 2 fit
], ids=["stops", "stop-length", "stop-ids", "prompts-x-n", "chat-stops", "chat-n", "generate-batch",
        "generate-id-batch", "generate-stop-length", "generate-stop-ids", "beyond-capacity"])
def test_limits_are_400s_naming_the_field_before_anything_runs(path, body, param):
    async def main():
        app, state, client, tokenizer = make_app([5, 6], **LIMITS)
        async with http_client(app) as http:
            return await http.post(path, json={"max_tokens": 2, **body} if path != "/generate" else body), client

    response, client = run(main())
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param and not client.added


def test_stop_string_match_aborts_the_engine_request():
    async def main():
        app, state, client, tokenizer = make_app([])
        client.script = tokenizer.encode("hello world, hello there")
        async with http_client(app) as http:
            response = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 50, "stop": [", h"]})
        return response, client

    response, client = run(main())
    choice = response.json()["choices"][0]
    assert choice["text"] == "hello world" and choice["finish_reason"] == "stop"
    assert client.aborted == client.added  # the engine was told to stop at once


def test_chunked_body_over_the_limit_is_413():
    async def main():
        app, *_ = make_app([5], max_request_bytes=2048)

        async def body():
            for _ in range(10):
                yield b" " * 512  # no Content-Length: the limit is enforced while reading

        async with http_client(app) as http:
            return await http.post("/v1/completions", content=body(), headers={"Content-Type": "application/json"})

    response = run(main())
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


def test_dead_engine_mid_stream_ends_the_stream_with_an_error_event():
    async def main():
        app, state, client, _ = make_app([5, 6, 7])

        async def dying_stream(prompt_ids, params):
            yield EngineOutput("r0", [5], len(prompt_ids), 1, None)
            raise EngineDeadError("the engine has stopped: boom")

        client.stream = dying_stream
        async with http_client(app) as http:
            return await http.post("/v1/completions", json={"prompt": [1], "max_tokens": 3, "stream": True})

    response = run(main())
    assert response.status_code == 200
    assert '"error"' in response.text and "boom" in response.text and response.text.endswith("data: [DONE]\n\n")
    assert '"code": "service_unavailable"' in response.text  # as the 503 a request gets outside a stream


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/generate"])
def test_api_key_is_checked_in_constant_time_and_health_is_open(path):
    async def main():
        app, *_ = make_app([5], api_key="sekrit")
        async with http_client(app) as http:
            return (await http.post(path, json={}), await http.get("/health"),
                    await http.post(path, json={}, headers={"Authorization": "Bearer sekrit"}))

    denied, health, admitted = run(main())
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    assert health.status_code == 200
    assert admitted.status_code == 400  # past the key check: the empty body is the problem now


class _SlowTokenizer:
    """The byte-level tokenizer, with every encode taking `seconds` (outside the GIL, as a
    fast tokenizer's does) and counted."""

    def __init__(self, tokenizer, seconds: float) -> None:
        self._tokenizer, self.seconds, self.encodes = tokenizer, seconds, 0

    def encode(self, text, **kwargs):
        self.encodes += 1
        time.sleep(self.seconds)
        return self._tokenizer.encode(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


async def probe_health(http: httpx.AsyncClient, until: asyncio.Task, every: float = 0.02) -> float:
    """The longest time between two /health answers while `until` runs, a pause of `every`
    included (so a loop blocked between probes counts too)."""
    longest, last = 0.0, time.monotonic()
    while not until.done():
        assert (await http.get("/health")).status_code == 200
        now = time.monotonic()
        longest, last = max(longest, now - last), now
        await asyncio.sleep(every)
    return longest


@pytest.mark.parametrize("body,status", [
    ({"prompt": "hello " * 5}, 200),
    ({"prompt": "x" * 10_000_000}, 400),  # too long for the context whatever it tokenizes to: never tokenized
    ({"prompt": "hi", "stop": ["x"] * 50_000}, 400),  # over --max-stop-strings: refused before tokenizing
], ids=["slow-encode", "10MB-prompt", "50k-stop-strings"])
def test_the_event_loop_stays_free_while_a_request_is_prepared(body, status):
    async def main():
        app, state, client, tokenizer = make_app([5, 6])
        slow = _SlowTokenizer(tokenizer, seconds=0.6)
        state.set_ready(INFO, slow)
        async with http_client(app) as http:
            request = asyncio.create_task(http.post("/v1/completions", json={**body, "max_tokens": 2}))
            longest = await probe_health(http, request)
            return await request, longest, slow.encodes

    response, longest, encodes = run(main())
    assert response.status_code == status, response.text
    assert longest < 0.2  # without the preparation worker a probe waits out the whole encode
    assert encodes == (1 if status == 200 else 0)


def test_health_generate_runs_one_token_and_says_503_for_a_dead_engine():
    async def main():
        app, state, client, _ = make_app([5, 6])
        async with http_client(app) as http:
            alive = await http.get("/health_generate")
            client.dead_reason = "exit code 1"
            dead = await http.get("/health_generate")
        return alive, dead, client

    alive, dead, client = run(main())
    assert alive.status_code == 200 and len(client.added) == 1
    assert dead.status_code == 503 and dead.json()["error"]["code"] == "service_unavailable"


@pytest.mark.parametrize("allowed,origin,host,status", [
    ((), None, "127.0.0.1:30000", 200),  # curl, SDKs: no Origin header
    ((), "https://evil.example", "127.0.0.1:30000", 403),  # a page elsewhere, through a browser
    ((), "http://evil.example:30000", "evil.example:30000", 403),  # DNS rebinding: same origin, not loopback
    ((), "http://127.0.0.1:30000", "127.0.0.1:30000", 200),  # the server's own /docs page
    (("https://app.example",), "https://app.example", "127.0.0.1:30000", 200),
    (("https://app.example",), "https://other.example", "127.0.0.1:30000", 403),
    (("*",), "https://anything.example", "127.0.0.1:30000", 200),
], ids=["no-origin", "cross-site", "rebinding", "own-page", "allowed", "not-listed", "any"])
def test_browser_requests_need_an_allowed_origin(allowed, origin, host, status):
    async def main():
        app, state, client, _ = make_app([5, 6], allowed_origins=allowed)
        headers = {"Content-Type": "text/plain", "Host": host, **({"Origin": origin} if origin else {})}
        async with http_client(app) as http:  # text/plain: a browser sends it without a preflight
            response = await http.post("/v1/completions", content='{"prompt": [1, 2], "max_tokens": 2}',
                                       headers=headers)
        return response, client

    response, client = run(main())
    assert response.status_code == status, response.text
    if status == 403:
        assert response.json()["error"]["code"] == "origin_not_allowed" and not client.added
    elif origin:
        assert response.headers["access-control-allow-origin"] == origin


def test_an_allowed_origin_gets_its_preflight_answered_without_a_key():
    async def main():
        app, _, _, _ = make_app([5], allowed_origins=("https://app.example",), api_key="secret")
        async with http_client(app) as http:
            return await http.options("/v1/chat/completions", headers={
                "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type"})

    response = run(main())
    assert response.status_code == 204
    assert response.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in response.headers["access-control-allow-methods"]
    assert response.headers["access-control-allow-headers"] == "authorization, content-type"


def test_a_bug_is_a_500_in_the_envelope_logged_once(caplog):
    async def main():
        app, _, client, _ = make_app([5])

        async def broken_stream(prompt_ids, params):
            raise ValueError("a bug")
            yield

        client.stream = broken_stream
        async with http_client(app) as http:  # the transport re-raises what escapes the app
            return await http.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})

    response = run(main())
    assert response.status_code == 500 and response.json()["error"]["message"] == "internal error: ValueError"
    assert [r.exc_info is not None for r in caplog.records if "unhandled error" in r.getMessage()] == [True]


def test_an_unreadable_message_from_the_engine_ends_the_engine_not_one_stream():
    import pickle

    from eaglesrv.engine.client import EngineClient

    class Pipe:
        def recv(self):
            raise pickle.UnpicklingError("truncated")

        def send(self, message):
            pass

        def close(self):
            pass

    class Process:
        exitcode = None

        def join(self, timeout=None):
            pass

    async def main():
        client = EngineClient(Process(), Pipe(), Pipe(), asyncio.get_running_loop())
        for _ in range(100):
            if not client.is_alive:
                break
            await asyncio.sleep(0.01)
        return client

    client = run(main())
    assert not client.is_alive and "unreadable message" in client.dead_reason and "truncated" in client.dead_reason

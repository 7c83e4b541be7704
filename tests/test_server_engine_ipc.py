"""The engine process and its client, on the tiny random Llama: same tokens as the
in-process engine, abort frees pages, start-up failures and engine death are reported."""

from __future__ import annotations

import asyncio
import os
import signal
from contextlib import aclosing

import pytest
from conftest import engine_config
from engine_helpers import random_prompts

from eaglesrv.engine.client import EngineClient, EngineDeadError, EngineStartupError
from eaglesrv.engine.llm_engine import Engine
from eaglesrv.sampling_params import SamplingParams
from eaglesrv.scheduler import RequestRejected

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)


async def _collect(client: EngineClient, prompt, params) -> list:
    async with aclosing(client.stream(prompt, params)) as outputs:
        return [out async for out in outputs]


def test_streams_match_the_in_process_engine_and_abort_frees_pages(tiny_llama_dir):
    prompts = random_prompts((5, 17, 30), 256, seed=3)
    expected = Engine(engine_config(tiny_llama_dir)).generate(prompts, GREEDY)

    async def main():
        client = EngineClient.spawn(engine_config(tiny_llama_dir), "warning")
        try:
            info, tokenizer = await client.wait_ready()
            assert tokenizer is None and info.vocab_size == 256 and info.max_context_len == 512
            runs = await asyncio.gather(*(_collect(client, p, GREEDY) for p in prompts))
            before = await client.stats()
            long_params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            async with aclosing(client.stream(prompts[0], long_params)) as outputs:
                async for out in outputs:
                    if out.num_output_tokens >= 3:
                        break  # leaving aborts the request
            after = before
            for _ in range(100):
                after = await client.stats()
                if after.num_running == 0 and after.kv_pages_available == before.kv_pages_available:
                    break
                await asyncio.sleep(0.05)
            with pytest.raises(RequestRejected, match="limit is"):
                await _collect(client, [5] * 600, GREEDY)
            return runs, before, after
        finally:
            assert client.shutdown() == 0

    runs, before, after = asyncio.run(main())
    for outputs, want in zip(runs, expected):
        assert [t for out in outputs for t in out.new_token_ids] == want.output_token_ids
        assert outputs[-1].finish_reason == "length" and not any(o.finished for o in outputs[:-1])
        logprobs = [lp for out in outputs for lp in out.new_logprobs]
        assert [lp[0] for lp in logprobs] == want.output_token_ids and all(len(lp[2]) == 2 for lp in logprobs)
    assert before.kv_pages_available == before.kv_pages_total and before.num_running == 0
    assert (after.kv_pages_available, after.num_running, after.num_waiting) == (before.kv_pages_available, 0, 0)


def test_start_up_failure_is_reported_not_hung(tmp_path):
    async def main():
        client = EngineClient.spawn(engine_config(str(tmp_path / "missing")), "critical")
        try:
            with pytest.raises(EngineStartupError, match="does not exist"):
                await asyncio.wait_for(client.wait_ready(), 120)
        finally:
            assert client.shutdown() == 1

    asyncio.run(main())


def test_engine_death_fails_open_streams_and_calls_on_death(tiny_llama_dir):
    async def main():
        client = EngineClient.spawn(engine_config(tiny_llama_dir), "critical")
        deaths: list[str] = []
        client.on_death = deaths.append
        try:
            await client.wait_ready()
            params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            with pytest.raises(EngineDeadError):
                async with aclosing(client.stream([1, 2, 3], params)) as outputs:
                    async for _ in outputs:
                        os.kill(client._process.pid, signal.SIGKILL)  # the test's own child
            for _ in range(100):
                if deaths:
                    break
                await asyncio.sleep(0.05)
            assert not client.is_alive and deaths and "exit code -9" in deaths[0]
            with pytest.raises(EngineDeadError):
                await client.stats()
        finally:
            client.shutdown()

    asyncio.run(main())


def test_a_stopped_engine_is_reported_stalled_and_serves_again_when_continued(tiny_llama_dir):
    import httpx

    from eaglesrv.configs import ServerConfig
    from eaglesrv.server.app import build_app
    from eaglesrv.server.state import ServerState

    timeout_s = 1.5
    config = engine_config(tiny_llama_dir)

    async def wait_for_health(http, status: int, within_s: float) -> float:
        started = asyncio.get_running_loop().time()
        while (await http.get("/health")).status_code != status:
            assert asyncio.get_running_loop().time() - started < within_s, f"/health never said {status}"
            await asyncio.sleep(0.1)
        return asyncio.get_running_loop().time() - started

    async def main():
        client = EngineClient.spawn(config, "critical")
        state = ServerState(ServerConfig(watchdog_timeout_s=timeout_s), config, client)
        transport = httpx.ASGITransport(app=build_app(state))
        long = {"prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True}
        try:
            info, tokenizer = await client.wait_ready()
            state.set_ready(info, tokenizer)
            watchdog = asyncio.create_task(client.watchdog(timeout_s))
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as http:
                assert (await http.get("/health_generate")).status_code == 200
                in_flight = asyncio.create_task(http.post("/v1/completions", json=long))
                await asyncio.sleep(0.3)
                os.kill(client._process.pid, signal.SIGSTOP)
                stalled_after = await wait_for_health(http, 503, within_s=timeout_s + 3)
                refused = await http.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
                failed = await in_flight
                os.kill(client._process.pid, signal.SIGCONT)
                await wait_for_health(http, 200, within_s=timeout_s + 3)
                served = await http.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
                checked = await http.get("/health_generate")
            for _ in range(100):  # the failed request was aborted: the engine lets it go
                stats = await client.stats()
                if stats.num_running == 0 and stats.kv_pages_available == stats.kv_pages_total:
                    break
                await asyncio.sleep(0.05)
            watchdog.cancel()
            return stalled_after, refused, failed, served, checked, stats
        finally:
            os.kill(client._process.pid, signal.SIGCONT)
            assert client.shutdown() == 0

    stalled_after, refused, failed, served, checked, stats = asyncio.run(main())
    assert stalled_after <= timeout_s + 2
    for response in (refused, failed):
        assert response.status_code == 503 and "no progress" in response.json()["error"]["message"]
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 2
    assert checked.status_code == 200
    assert stats.num_running == 0 and stats.kv_pages_available == stats.kv_pages_total

"""Streaming through AsyncEngine: same tokens as the batch API, and cancellation frees pages."""

from __future__ import annotations

import asyncio

import pytest

from conftest import engine_config
from engine_helpers import random_prompts
from eaglesrv.engine.async_engine import AsyncEngine
from eaglesrv.engine.llm_engine import Engine
from eaglesrv.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def async_engine(tiny_llama_dir):
    engine = AsyncEngine(Engine(engine_config(tiny_llama_dir)))
    yield engine
    engine.shutdown()


def test_concurrent_streams_equal_batch_generation(async_engine, tiny_llama_dir):
    prompts = random_prompts((4, 19, 33, 8), 256)
    # A separate engine: the async one's loop thread owns its engine's steps.
    expected = [r.output_token_ids for r in Engine(engine_config(tiny_llama_dir)).generate(prompts, GREEDY)]

    async def collect(prompt):
        chunks = [out async for out in async_engine.stream(prompt, GREEDY)]
        assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
        return [t for c in chunks for t in c.new_token_ids]

    async def main():
        return await asyncio.gather(*(collect(p) for p in prompts))

    assert asyncio.run(main()) == expected


def test_leaving_a_stream_early_aborts_and_frees_pages(async_engine):
    pages = async_engine.engine.scheduler.pages

    async def main():
        for prompt in random_prompts([10] * 5, 256, seed=9):
            params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            async for out in async_engine.stream(prompt, params):
                if out.num_output_tokens >= 3:
                    break
        for _ in range(100):
            if pages.num_free == pages.num_pages and not async_engine.engine.has_unfinished:
                return
            await asyncio.sleep(0.02)

    asyncio.run(main())
    assert pages.num_free == pages.num_pages


def test_bad_request_raises_and_engine_keeps_serving(async_engine):
    async def main():
        with pytest.raises(ValueError, match="limit is"):
            async for _ in async_engine.stream([5] * 600, GREEDY):
                pass
        return await async_engine.generate([5, 6, 7], GREEDY)

    assert len(asyncio.run(main())) == GREEDY.max_tokens

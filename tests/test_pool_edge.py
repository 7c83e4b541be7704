"""EAGLE-3 near a full KV pool: a request at the pool's edge decodes (plainly where no tree
fits) instead of preempting itself for its own draft, requests beside it are not held up
beyond what plain decoding does, and a random mix on a tiny pool completes with plain
greedy's output and every page back. Steps are counted, not seconds."""

from __future__ import annotations

import dataclasses
import random

import pytest
from conftest import engine_config
from eagle3_helpers import spec_config
from engine_helpers import assert_pages_returned, random_prompts

from eaglesrv.engine.llm_engine import Engine
from eaglesrv.sampling_params import SamplingParams

POOL = 256  # tokens: 16 pages of 16; the tiny model's own context is 512, so the pool binds
TREE = (5, 8, 32)
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
BASE = random_prompts([POOL], 256, seed=21)[0]


@pytest.fixture(scope="module", autouse=True)
def private_cost_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EAGLESRV_CACHE", str(tmp_path_factory.getbasetemp() / "eaglesrv-cache"))
        yield


def build(mode: str, model_dir: str, head_dir: str, pool: int = POOL, **kwargs) -> Engine:
    # Arrival order: the tests place the edge request before or after the short ones, and
    # under lpm an edge request with a cached prefix would be admitted ahead of them.
    kwargs.setdefault("schedule_policy", "fcfs")
    if mode == "plain":
        return Engine(engine_config(model_dir, max_total_tokens=pool, **kwargs))
    config = spec_config(model_dir, head_dir, *TREE, max_total_tokens=pool, **kwargs)
    if mode == "adaptive":
        config = dataclasses.replace(config, speculative=dataclasses.replace(config.speculative, adaptive=True))
    return Engine(config)


@pytest.fixture(scope="module")
def engines(tiny_llama_dir, head_dir):
    return {mode: build(mode, tiny_llama_dir, head_dir) for mode in ("plain", "static", "adaptive")}


def run(engine: Engine, arrivals: list[tuple[int, list[int], SamplingParams]], max_steps: int = 2000,
        preempted: list[str] | None = None):
    """Submit (step, prompt, params) as the steps come; returns per request its output,
    finish reason and the step it finished on (None for one refused at admission).
    `preempted` collects the ids of requests preempted on the way."""
    pending = sorted(enumerate(arrivals), key=lambda item: item[1][0])
    ids, results = {}, {}
    step = 0
    schedule = engine.scheduler.schedule
    if preempted is not None:
        engine.scheduler.schedule = lambda: (
            lambda batch: (preempted.extend(batch.preempted_ids), batch)[1])(schedule())
    while pending or engine.has_unfinished:
        while pending and pending[0][1][0] <= step:
            index, (_, prompt, params) = pending.pop(0)
            try:
                ids[engine.add_request(prompt, params)] = index
                results[index] = [[], None, None]
            except ValueError:
                results[index] = None
        for out in engine.step():
            result = results[ids[out.request_id]]
            result[0].extend(out.new_token_ids)
            if out.finished:
                result[1], result[2] = out.finish_reason, step
        step += 1
        assert step < max_steps, "the engine stopped making progress"
    engine.scheduler.schedule = schedule
    assert_pages_returned(engine)
    return [results[i] for i in range(len(arrivals))]


@pytest.mark.parametrize("mode", ["static", "adaptive"])
def test_prompts_at_the_pool_edge_finish_in_plain_steps(engines, mode):
    """No tree fits within 31 slots of the pool's end: there the request decodes plainly,
    never preempting itself to make room for its own draft (which re-prefilled it for
    every token it gained)."""
    for k in range(0, TREE[2] + 2):
        prompt = BASE[: POOL - k]
        preempted = []
        [plain] = run(engines["plain"], [(0, prompt, GREEDY)])
        [spec] = run(engines[mode], [(0, prompt, GREEDY)], preempted=preempted)
        if k == 0:
            assert plain is None and spec is None, "a prompt as long as the pool is refused at admission"
            continue
        assert spec[0] == plain[0] and spec[1] == plain[1] == "length", k
        assert len(plain[0]) == min(k, GREEDY.max_tokens)
        assert spec[2] <= plain[2] and not preempted, (k, spec[2], plain[2], preempted)


@pytest.mark.parametrize("mode", ["static", "adaptive"])
def test_short_requests_beside_a_pool_edge_request(engines, mode):
    edge = (0, BASE[: POOL - 12], GREEDY)
    shorts = [(0, p, GREEDY.replace(max_tokens=8)) for p in random_prompts((8, 5, 11), 256, seed=3)]
    alone = run(engines[mode], shorts)
    # Short ones first: the edge request waits for pages; they run as if alone.
    first = run(engines[mode], shorts + [edge])
    assert [r[0] for r in first[:3]] == [r[0] for r in alone]
    assert max(r[2] for r in first[:3]) <= max(r[2] for r in alone) + 1
    # The edge request first: the short ones wait for its pages, no longer than on a plain engine.
    plain = run(engines["plain"], [edge] + shorts)
    spec = run(engines[mode], [edge] + shorts)
    assert [r[0] for r in spec] == [r[0] for r in plain] and spec[0][0] == first[3][0]
    assert max(r[2] for r in spec[1:]) <= max(r[2] for r in plain[1:]) + 1


@pytest.mark.parametrize("mode", ["plain", "static", "adaptive"])
def test_random_mix_on_a_tiny_pool(tiny_llama_dir, head_dir, mode):
    rng = random.Random(7)
    pool = 96  # 12 pages of 8
    arrivals = []
    for _ in range(24):
        length = rng.choice([1, 3, 8, 12, 20, 33, 40, 55, 70, 90, 95, 96, 130])
        params = GREEDY.replace(max_tokens=rng.randint(1, 40))
        if rng.random() < 0.2:
            params = params.replace(presence_penalty=0.5)  # decodes without speculation, beside trees
        arrivals.append((rng.randint(0, 30), random_prompts([length], 256, seed=rng.randint(0, 10**6))[0], params))
    reference_engine = build("plain", tiny_llama_dir, head_dir, pool=pool, page_size=8)
    reference = [run(reference_engine, [(0, prompt, params)])[0] for _, prompt, params in arrivals]
    engine = build(mode, tiny_llama_dir, head_dir, pool=pool, page_size=8, admission_watermark=0.0)
    results = run(engine, arrivals)  # NoProgress would raise from engine.step()
    for got, want in zip(results, reference):
        assert (got is None) == (want is None)
        if got is not None:
            assert got[:2] == want[:2]
    assert sum(r is None for r in results) >= 2 and sum(r is not None for r in results) >= 15

"""The prefix cache in the engine: greedy output (fp32) with it equals output without it,
plain and EAGLE-3, and every KV page comes back, under a pool too small for everything."""

from __future__ import annotations

import pytest
import torch
from conftest import engine_config
from eagle3_helpers import spec_config
from engine_helpers import assert_pages_returned, random_prompts, spy_on_preemptions

from eaglesrv.engine.llm_engine import Engine
from eaglesrv.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SYSTEM = random_prompts([70], 256, seed=1)[0]  # 4 pages and 6 tokens: the shared prefix ends mid-page
QUESTIONS = random_prompts([5, 17, 1, 30, 9, 16, 2, 40], 256, seed=2)
FOLLOW_UPS = random_prompts([7, 3, 16], 256, seed=3)

MODES = {
    "plain": lambda d, h, **kw: engine_config(d, **kw),
    "eagle3-static": lambda d, h, **kw: spec_config(d, h, 5, 8, 32, **kw),
    "eagle3-chain": lambda d, h, **kw: spec_config(d, h, 3, 1, 4, page_size=4, **kw),
    "eagle3-adaptive": lambda d, h, **kw: spec_config(d, h, 5, 8, 32, adaptive=True, **kw),
}


def _conversation(engine: Engine) -> list[list[int]]:
    """Three turns, each resending the whole conversation with the model's answers."""
    conversation, answers = SYSTEM + QUESTIONS[0], []
    for follow_up in FOLLOW_UPS:
        answer = engine.generate([conversation], GREEDY)[0].output_token_ids
        answers.append(answer)
        conversation = conversation + answer + follow_up
    return answers


def _workload(engine: Engine) -> dict:
    together = [r.output_token_ids for r in engine.generate([SYSTEM + q for q in QUESTIONS], GREEDY)]
    again = engine.generate([SYSTEM + QUESTIONS[3]], GREEDY)[0].output_token_ids  # a whole prompt seen before
    return {"together": together, "conversation": _conversation(engine), "again": again}


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_output_with_the_cache_equals_output_without_it(tiny_llama_dir, head_dir, mode):
    cached = Engine(MODES[mode](tiny_llama_dir, head_dir))
    uncached = Engine(MODES[mode](tiny_llama_dir, head_dir, disable_radix_cache=True))
    assert _workload(cached) == _workload(uncached)
    cache = cached.scheduler.cache
    # 7 of the 8 requests arriving together reuse the first one's prefix; each turn reuses the last
    page = cached.scheduler.page_size
    assert cache.hit_tokens >= 7 * (len(SYSTEM) // page * page) + 2 * len(SYSTEM)
    assert uncached.scheduler.cache is None
    if mode in ("eagle3-static", "eagle3-chain"):
        # the draft runs from the cached positions' KV exactly as from its own: same drafts, same acceptance
        for key in ("spec_verifications", "spec_accepted_tokens", "spec_acceptance_by_depth"):
            assert cached.spec_stats[key] == uncached.spec_stats[key]
    assert_pages_returned(cached)
    assert_pages_returned(uncached)


@pytest.mark.parametrize("mode", ["plain", "eagle3-static"])
def test_longest_prefix_first_admits_warm_prompts_first_with_the_same_output(tiny_llama_dir, head_dir, mode):
    """Under --schedule-policy lpm, prompts that hit the cache are admitted ahead of cold
    ones queued before them; the output is what an engine without the cache gives."""
    lpm = Engine(MODES[mode](tiny_llama_dir, head_dir, schedule_policy="lpm", chunked_prefill_size=32))
    uncached = Engine(MODES[mode](tiny_llama_dir, head_dir, disable_radix_cache=True))
    cold = random_prompts([40, 33], 256, seed=4)
    warm = [SYSTEM + q for q in QUESTIONS[:3]]
    admitted = []
    admit = lpm.scheduler._admit
    lpm.scheduler._admit = lambda request, *args: (admitted.append(request.prompt_token_ids), admit(request, *args))
    outputs = {}
    for name, engine in (("lpm", lpm), ("uncached", uncached)):
        engine.generate([SYSTEM + QUESTIONS[4]], GREEDY)  # the system prompt enters lpm's cache
        outputs[name] = [r.output_token_ids for r in engine.generate(cold + warm, GREEDY)]
    assert outputs["lpm"] == outputs["uncached"]
    assert admitted[1:4] == warm and sorted(map(tuple, admitted[4:])) == sorted(map(tuple, cold))
    assert_pages_returned(lpm)


def _draft_root_after_prefill(engine: Engine, prompt: list[int]) -> torch.Tensor:
    """The draft's log-probabilities at the end of the prompt (what the first tree grows from)."""
    request_id = engine.add_request(prompt, GREEDY)
    while not any(out.request_id == request_id for out in engine.step()):
        pass
    root = engine.runner.requests[request_id].root.logprobs.clone()
    while engine.has_unfinished:
        engine.step()
    return root


@pytest.mark.parametrize("shared", [70, 64], ids=["mid-page", "page-end"])
@pytest.mark.parametrize("wipe", [False, True], ids=["cached", "wiped"])
def test_a_hit_drafts_as_if_it_had_prefilled_everything(tiny_llama_dir, head_dir, wipe, shared):
    """The draft's state after a hit equals its state after a whole prefill; with the
    cached pages' draft KV wiped it does not (so the cache is what carries it). Prompts
    that part right after a page share one page less: the draft's KV at the page's last
    position read the first prompt's next token."""
    engine = Engine(MODES["eagle3-static"](tiny_llama_dir, head_dir))
    reference = Engine(MODES["eagle3-static"](tiny_llama_dir, head_dir, disable_radix_cache=True))
    engine.generate([SYSTEM[:shared] + QUESTIONS[1]], GREEDY)
    if wipe:
        size = engine.scheduler.page_size
        for node in engine.scheduler.cache._nodes():
            engine.runner.draft_kv.k[:, node.page * size : (node.page + 1) * size] = 0
            engine.runner.draft_kv.v[:, node.page * size : (node.page + 1) * size] = 0
    prompt = SYSTEM[:shared] + QUESTIONS[3]
    got = _draft_root_after_prefill(engine, prompt)
    assert engine.scheduler.cache.hit_tokens == (shared - 1) // 16 * 16
    want = _draft_root_after_prefill(reference, prompt)
    assert torch.allclose(got, want, atol=1e-5) != wipe


def _run_with_aborts(engine: Engine, prompts, params, abort_at: dict[int, int]) -> dict[int, list[int]]:
    """Submit one prompt per step; abort prompt i after abort_at[i] steps. Outputs of the rest."""
    ids, outputs, step = [], {}, 0
    while len(ids) < len(prompts) or engine.has_unfinished:
        if len(ids) < len(prompts):
            ids.append(engine.add_request(prompts[len(ids)], params))
        for index, after in abort_at.items():
            if index < len(ids) and step == index + after:
                engine.abort(ids[index])
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    return {i: outputs[rid] for i, rid in enumerate(ids) if i not in abort_at}


@pytest.mark.parametrize("mode", ["plain", "eagle3-static", "eagle3-adaptive"])
def test_a_small_pool_evicts_preempts_and_accounts_for_every_page(tiny_llama_dir, head_dir, mode):
    systems = random_prompts([40, 70, 23], 256, seed=5)
    tails = random_prompts([3, 9, 1, 20, 5, 12, 7, 2, 15, 4, 30, 6], 256, seed=6)
    prompts = [systems[i % 3] + tail for i, tail in enumerate(tails)]
    params = GREEDY.replace(max_tokens=40)
    abort_at = {2: 3, 7: 1, 9: 6}
    small = Engine(MODES[mode](tiny_llama_dir, head_dir, max_total_tokens=288, admission_watermark=0.0))
    preempted = spy_on_preemptions(small)
    got = _run_with_aborts(small, prompts, params, abort_at)
    reference = Engine(MODES[mode](tiny_llama_dir, head_dir, disable_radix_cache=True))
    want = _run_with_aborts(reference, prompts, params, abort_at)
    assert got == want
    cache = small.scheduler.cache
    assert preempted and cache.evicted_pages > 0 and cache.hit_tokens > 0
    assert_pages_returned(small)
    cached_pages = cache.num_pages
    assert cached_pages and small.flush_cache() == cached_pages
    assert cache.num_pages == 0 and small.scheduler.pages.num_free == small.scheduler.pages.num_pages

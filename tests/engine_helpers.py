"""Helpers for engine tests: the transformers oracle and staggered submission."""

from __future__ import annotations

import torch

from eaglesrv.engine.llm_engine import Engine
from eaglesrv.sampling_params import SamplingParams


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation, exactly max_new_tokens long (EOS ignored)."""
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=0, eos_token_id=None,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return out[0, len(prompt):].tolist()


def random_prompts(lengths, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def run_staggered(
    engine: Engine, prompts, params: SamplingParams | list[SamplingParams], every: int = 3
) -> list[list[int]]:
    """Submit one prompt every `every` steps while earlier ones decode; outputs in prompt order."""
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    ids: list[str] = []
    outputs: dict[str, list[int]] = {}
    step = 0
    while len(ids) < len(prompts) or engine.has_unfinished:
        if len(ids) < len(prompts) and step % every == 0:
            ids.append(engine.add_request(prompts[len(ids)], per_prompt[len(ids)]))
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    return [outputs[i] for i in ids]


def spy_on_preemptions(engine: Engine) -> list[str]:
    """The ids of every request the engine's scheduler preempts from now on (filled as it runs)."""
    preempted: list[str] = []
    original_schedule = engine.scheduler.schedule

    def spying_schedule():
        batch = original_schedule()
        preempted.extend(batch.preempted_ids)
        return batch

    engine.scheduler.schedule = spying_schedule
    return preempted


def assert_pages_returned(engine: Engine) -> None:
    """With no request left, every KV page is free or kept by the prefix cache for nobody:
    free + cached = total, no cached page locked, and each cached page has the cache as
    its only holder."""
    scheduler = engine.scheduler
    assert not scheduler.has_work
    cache, pages = scheduler.cache, scheduler.pages
    cached = cache.num_pages if cache is not None else 0
    assert pages.num_free + cached == pages.num_pages
    if cache is not None:
        assert cache.num_evictable == cache.num_pages
        assert all(pages.holders(node.page) == 1 for node in cache._nodes())

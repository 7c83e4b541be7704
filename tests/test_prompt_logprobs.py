"""Prompt logprobs (scoring a prompt) in the engine, against transformers on the same fp32 weights.

Token t's logprob is read from the row at position t - 1, so a chunk's last row scores the
next chunk's first token; chunked prefill, EAGLE-3, preemption and a batch in which only
some requests ask must all give transformers' values, each prompt token once.
"""

from __future__ import annotations

import pytest
import torch
from conftest import engine_config
from eagle3_helpers import spec_config
from engine_helpers import assert_pages_returned, random_prompts, run_staggered, spy_on_preemptions
from transformers import AutoModelForCausalLM

from eaglesrv.engine.llm_engine import Engine
from eaglesrv.sampling_params import InvalidSamplingParams, SamplingParams

LENGTHS = (5, 40, 2, 70, 17)  # chunks of 16 split the long ones; 2: a single scored token
TOP = 3
SCORE = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=TOP)


@pytest.fixture(scope="module")
def hf_scores(tiny_llama_dir):
    """Per prompt: (logprob, rank, top ids, top logprobs) of tokens 1.. under transformers."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    scores = []
    for prompt in random_prompts(LENGTHS, 256):
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)[:-1]
        chosen = logprobs.gather(1, torch.tensor(prompt[1:])[:, None])
        top = logprobs.topk(TOP, dim=-1)
        scores.append([(float(chosen[i]), int((logprobs[i] > chosen[i]).sum()) + 1, top.indices[i].tolist(),
                        top.values[i].tolist()) for i in range(len(prompt) - 1)])
    return scores


def assert_scores_equal(got, expected):
    assert len(got) == len(expected)
    for entry, (logprob, rank, top_ids, top_values) in zip(got, expected):
        assert entry.logprob == pytest.approx(logprob, abs=1e-4)
        assert entry.rank == rank
        assert [t for t, _ in entry.top] == top_ids
        assert [v for _, v in entry.top] == pytest.approx(top_values, abs=1e-4)


def test_prompt_logprobs_equal_transformers_across_chunks(tiny_llama_dir, hf_scores):
    engine = Engine(engine_config(tiny_llama_dir, chunked_prefill_size=16, page_size=4))
    prompts = random_prompts(LENGTHS, 256)
    results = engine.generate(prompts, SCORE)
    for prompt, result, expected in zip(prompts, results, hf_scores):
        assert [entry.token_id for entry in result.prompt_logprobs] == prompt[1:]
        assert_scores_equal(result.prompt_logprobs, expected)


@pytest.mark.parametrize("adaptive", [False, True], ids=["static", "adaptive"])
def test_prompt_logprobs_under_eagle3_equal_transformers_and_leave_the_output_alone(tiny_llama_dir, head_dir,
                                                                                     hf_scores, adaptive):
    config = spec_config(tiny_llama_dir, head_dir, 3, 2, 6, adaptive=adaptive, chunked_prefill_size=16,
                         page_size=4)
    prompts = random_prompts(LENGTHS, 256)
    plain = [r.output_token_ids for r in Engine(engine_config(tiny_llama_dir)).generate(prompts, SCORE)]
    results = Engine(config).generate(prompts, SCORE)
    assert [r.output_token_ids for r in results] == plain
    for result, expected in zip(results, hf_scores):
        assert_scores_equal(result.prompt_logprobs, expected)


def test_only_the_requests_that_ask_are_scored_and_the_others_are_unchanged(tiny_llama_dir, hf_scores):
    prompts = random_prompts(LENGTHS, 256)
    plain = SCORE.replace(prompt_logprobs=None)
    expected = [r.output_token_ids for r in Engine(engine_config(tiny_llama_dir)).generate(prompts, plain)]
    engine = Engine(engine_config(tiny_llama_dir, chunked_prefill_size=16, page_size=4))
    scored_rows = []
    original = engine.runner._prompt_logprobs

    def counting(hidden, targets, top_n):
        scored_rows.append(hidden.shape[0])
        return original(hidden, targets, top_n)

    engine.runner._prompt_logprobs = counting
    mixed = [SCORE if i % 2 else plain for i in range(len(prompts))]
    results = run_staggered(engine, prompts, mixed, every=1)
    assert results == expected
    assert sum(scored_rows) == sum(n - 1 for i, n in enumerate(LENGTHS) if i % 2)  # nobody else's rows


def test_scoring_from_a_start_position_with_no_output(tiny_llama_dir, hf_scores):
    engine = Engine(engine_config(tiny_llama_dir, chunked_prefill_size=16, page_size=4))
    prompts = random_prompts(LENGTHS, 256)
    results = engine.generate(prompts, SCORE.replace(max_tokens=0, logprob_start_len=12, prompt_logprobs=0))
    for prompt, result, expected in zip(prompts, results, hf_scores):
        assert result.output_token_ids == [] and result.finish_reason == "length"
        assert [entry.token_id for entry in result.prompt_logprobs] == prompt[12:]
        assert [entry.logprob for entry in result.prompt_logprobs] == pytest.approx([e[0] for e in expected[11:]],
                                                                                    abs=1e-4)
        assert all(entry.top == [] for entry in result.prompt_logprobs)
    assert_pages_returned(engine)


def test_preempted_requests_score_each_prompt_token_once(tiny_llama_dir, hf_scores):
    engine = Engine(engine_config(tiny_llama_dir, max_total_tokens=96, page_size=8, admission_watermark=0.0,
                                  chunked_prefill_size=16))
    preempted = spy_on_preemptions(engine)
    prompts = random_prompts(LENGTHS, 256)
    ids = [engine.add_request(prompt, SCORE.replace(max_tokens=12)) for prompt in prompts]
    scored = {request_id: [] for request_id in ids}
    while engine.has_unfinished:
        for out in engine.step():
            scored[out.request_id] += out.new_prompt_logprobs
    assert preempted, "the pool was meant to be too small"
    for request_id, expected in zip(ids, hf_scores):
        assert_scores_equal(scored[request_id], expected)


def test_out_of_range_values_are_refused():
    with pytest.raises(InvalidSamplingParams, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(InvalidSamplingParams, match="logprob_start_len"):
        SamplingParams(prompt_logprobs=1, logprob_start_len=-1)
    with pytest.raises(InvalidSamplingParams, match="max_tokens"):
        SamplingParams(max_tokens=-1)


def test_a_cached_prefix_is_scored_all_the_same(tiny_llama_dir, hf_scores):
    """A prompt seen before is scored in full (the cache serves only what is not scored)."""
    engine = Engine(engine_config(tiny_llama_dir, page_size=4))
    prompts = random_prompts(LENGTHS, 256)
    engine.generate(prompts, SCORE.replace(prompt_logprobs=None))
    results = engine.generate(prompts, SCORE.replace(logprob_start_len=9))
    for prompt, result, expected in zip(prompts, results, hf_scores):
        assert [entry.token_id for entry in result.prompt_logprobs] == prompt[9:]
        assert [entry.logprob for entry in result.prompt_logprobs] == pytest.approx([e[0] for e in expected[8:]],
                                                                                    abs=1e-4)
    assert engine.scheduler.cache.hit_tokens >= sum(8 for n in LENGTHS if n > 9)
    assert_pages_returned(engine)

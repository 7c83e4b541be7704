"""EAGLE-3 inside continuous batching: exactly the plain engine's greedy output, on the CPU."""

from __future__ import annotations

import pytest
import torch
from conftest import engine_config
from eagle3_helpers import save_random_head, spec_config, use_oracle
from engine_helpers import assert_pages_returned, random_prompts, run_staggered

from eaglesrv.engine.eagle3.draft_model import DraftHeadError
from eaglesrv.engine.llm_engine import Engine
from eaglesrv.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
LENGTHS = (3, 40, 9, 1, 25, 64, 12, 5, 30, 17, 2, 50, 8, 21, 6, 33)  # 16 mixed-length prompts
TREES = [(5, 8, 32), (3, 1, 4), (6, 10, 60)]


@pytest.fixture(scope="module")
def plain_outputs(tiny_llama_dir):
    engine = Engine(engine_config(tiny_llama_dir))
    return [r.output_token_ids for r in engine.generate(random_prompts(LENGTHS, 256), GREEDY)]


@pytest.mark.parametrize("tree", TREES, ids=lambda t: "x".join(map(str, t)))
def test_greedy_equals_plain_single_and_staggered_batch(tiny_llama_dir, head_dir, plain_outputs, tree):
    engine = Engine(spec_config(tiny_llama_dir, head_dir, *tree))
    prompts = random_prompts(LENGTHS, 256)
    assert engine.generate([prompts[1]], GREEDY)[0].output_token_ids == plain_outputs[1]
    assert run_staggered(engine, prompts, GREEDY, every=2) == plain_outputs
    stats = engine.spec_stats
    assert stats["spec_verifications"] > 0 and stats["avg_spec_accept_length"] >= 1.0
    assert_pages_returned(engine)


@pytest.mark.parametrize("tree", [(3, 1, 4), (5, 1, 6), (4, 3, 10)], ids=lambda t: "x".join(map(str, t)))
def test_oracle_draft_reaches_the_maximum_accept_length(tiny_llama_dir, head_dir, tree):
    prompt = random_prompts([11], 256, seed=4)[0]
    continuation = Engine(engine_config(tiny_llama_dir)).generate(
        [prompt], GREEDY.replace(max_tokens=GREEDY.max_tokens + 10))[0].output_token_ids
    engine = Engine(spec_config(tiny_llama_dir, head_dir, *tree))
    use_oracle(engine, prompt + continuation)
    result = engine.generate([prompt], GREEDY)[0]
    assert result.output_token_ids == continuation[: GREEDY.max_tokens]
    assert engine.spec_stats["avg_spec_accept_length"] == tree[0] + 1
    assert engine.spec_stats["spec_acceptance_by_depth"] == [1.0] * tree[0]


def test_stop_rules_cut_inside_an_accepted_run(tiny_llama_dir, head_dir):
    prompt = random_prompts([11], 256, seed=4)[0]
    plain = Engine(engine_config(tiny_llama_dir))
    continuation = plain.generate([prompt], GREEDY)[0].output_token_ids
    engine = Engine(spec_config(tiny_llama_dir, head_dir, 5, 1, 6))
    use_oracle(engine, prompt + continuation + [0] * 10)
    stop_token = continuation[7]
    first = continuation.index(stop_token)
    stopped = engine.generate([prompt], GREEDY.replace(stop_token_ids=(stop_token,)))[0]
    assert stopped.output_token_ids == continuation[: first + 1] and stopped.finish_reason == "stop"
    short = engine.generate([prompt], GREEDY.replace(max_tokens=9))[0]
    assert short.output_token_ids == continuation[:9] and short.finish_reason == "length"
    assert_pages_returned(engine)


def test_logprobs_with_speculation_equal_plain(tiny_llama_dir, head_dir):
    prompt = random_prompts([11], 256, seed=4)[0]
    params = GREEDY.replace(logprobs=2, max_tokens=8)
    plain = Engine(engine_config(tiny_llama_dir)).generate([prompt], params)[0]
    engine = Engine(spec_config(tiny_llama_dir, head_dir, 3, 1, 4))
    use_oracle(engine, prompt + plain.output_token_ids + [0] * 10)
    spec = engine.generate([prompt], params)[0]
    assert [lp.token_id for lp in spec.logprobs] == plain.output_token_ids
    for a, b in zip(spec.logprobs, plain.logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_pages_all_free_after_aborts_and_forced_preemption(tiny_llama_dir, head_dir, plain_outputs):
    # 20 pages of 8 tokens: 16 requests with 31-token lookaheads cannot all run at once.
    engine = Engine(spec_config(tiny_llama_dir, head_dir, 5, 8, 32, max_total_tokens=160, page_size=8,
                                admission_watermark=0.0))
    preempted = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: (lambda b: (preempted.extend(b.preempted_ids), b)[1])(schedule())
    prompts = random_prompts(LENGTHS, 256)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    outputs: dict[str, list[int]] = {i: [] for i in ids}
    for step in range(10_000):
        if step == 3:
            engine.abort(ids[0])
        if step == 9:
            engine.abort(ids[5])
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
        if not engine.has_unfinished:
            break
    assert preempted, "the pool was meant to be too small"
    kept = [i for n, i in enumerate(ids) if n not in (0, 5)]
    assert [outputs[i] for i in kept] == [plain_outputs[n] for n in range(len(ids)) if n not in (0, 5)]
    assert_pages_returned(engine)
    assert not engine.runner.requests, "the runner's request records must be dropped with their requests"


def test_malformed_heads_are_refused_with_the_reason(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    head = save_random_head(tiny_llama_dir, tmp_path / "ok")
    tensors = load_file(f"{head}/model.safetensors")
    del tensors["fc.weight"]
    save_file(tensors, f"{head}/model.safetensors")
    with pytest.raises(DraftHeadError, match="fc.weight"):
        Engine(spec_config(tiny_llama_dir, head, 3, 1, 4))
    tensors["fc.weight"] = torch.zeros(64, 10)
    save_file(tensors, f"{head}/model.safetensors")
    with pytest.raises(DraftHeadError, match="fc.weight.*shape"):
        Engine(spec_config(tiny_llama_dir, head, 3, 1, 4))


def test_a_missing_head_is_refused_before_loading(tiny_llama_dir, monkeypatch):
    import eaglesrv.engine.builder as builder
    from eaglesrv.engine.placement import EngineSetupError

    with pytest.raises(EngineSetupError, match="needs --speculative-draft-model-path"):
        Engine(spec_config(tiny_llama_dir, None, 3, 1, 4))
    monkeypatch.setattr(builder, "default_model_head", lambda: None)  # an install without the shipped head
    with pytest.raises(EngineSetupError, match="head is missing from this install"):
        Engine(spec_config(None, None, 3, 1, 4))

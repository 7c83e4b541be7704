"""The engine on a tiny random Llama, against Hugging Face transformers in fp32."""

from __future__ import annotations

import pytest
import torch
from conftest import engine_config, save_tiny_llama
from engine_helpers import assert_pages_returned, hf_greedy, random_prompts, run_staggered, spy_on_preemptions
from transformers import AutoModelForCausalLM

from eaglesrv.engine.llm_engine import Engine
from eaglesrv.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
LENGTHS = (1, 5, 17, 40, 64, 3, 29)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def expected(hf_model):
    return [hf_greedy(hf_model, p, GREEDY.max_tokens) for p in random_prompts(LENGTHS, 256)]


def test_single_prompts_match_transformers(tiny_llama_dir, expected):
    engine = Engine(engine_config(tiny_llama_dir))
    for prompt, want in zip(random_prompts(LENGTHS, 256), expected):
        assert engine.generate([prompt], GREEDY)[0].output_token_ids == want


def test_batch_together_and_staggered_match_transformers(tiny_llama_dir, expected):
    engine = Engine(engine_config(tiny_llama_dir))
    prompts = random_prompts(LENGTHS, 256)
    assert [r.output_token_ids for r in engine.generate(prompts, GREEDY)] == expected
    assert run_staggered(engine, prompts, GREEDY, every=2) == expected
    assert_pages_returned(engine)


def test_preemption_gives_the_same_outputs_and_frees_every_page(tiny_llama_dir, expected):
    # 14 pages of 8 tokens cannot hold 7 sequences of up to 88 tokens at once.
    engine = Engine(engine_config(tiny_llama_dir, max_total_tokens=112, page_size=8, admission_watermark=0.0))
    prompts = random_prompts(LENGTHS, 256)
    preempted = spy_on_preemptions(engine)
    assert run_staggered(engine, prompts, GREEDY, every=1) == expected
    assert preempted, "the pool was meant to be too small"
    assert_pages_returned(engine)


def test_chunked_prefill_matches_unchunked(tiny_llama_dir, expected):
    engine = Engine(engine_config(tiny_llama_dir, chunked_prefill_size=7))
    assert [r.output_token_ids for r in engine.generate(random_prompts(LENGTHS, 256), GREEDY)] == expected


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(tiny_llama_dir):
    engine = Engine(engine_config(tiny_llama_dir))
    prompt = random_prompts([12], 256, seed=5)[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=1234, ignore_eos=True)
    alone = engine.generate([prompt], seeded)[0].output_token_ids
    others = random_prompts([3, 30, 7], 256, seed=6)
    noise = SamplingParams(temperature=0.8, max_tokens=25, ignore_eos=True)
    batched = engine.generate(others[:2] + [prompt] + others[2:], [noise, noise, seeded, noise])[2].output_token_ids
    staggered = run_staggered(engine, [others[0], prompt, others[1]], [noise, seeded, noise], every=2)[1]
    assert alone == batched == staggered
    other_seed = engine.generate([prompt], seeded.replace(seed=99))[0].output_token_ids
    assert other_seed != alone


def test_abort_at_any_point_frees_pages(tiny_llama_dir):
    engine = Engine(engine_config(tiny_llama_dir, chunked_prefill_size=8))
    prompts = random_prompts((5, 40, 20, 6), 256)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    finished = {}

    def step():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.finish_reason

    engine.abort(ids[3])  # still waiting
    step()
    step()
    assert engine.scheduler.running[1].num_computed_tokens < 40
    engine.abort(ids[1])  # mid-prefill
    step()
    engine.abort(ids[0])  # mid-decode
    while engine.has_unfinished:
        step()
    assert finished == {ids[0]: "abort", ids[1]: "abort", ids[2]: "length", ids[3]: "abort"}
    assert_pages_returned(engine)


def test_logprobs_match_transformers(tiny_llama_dir, hf_model):
    engine = Engine(engine_config(tiny_llama_dir))
    prompt = random_prompts([9], 256)[0]
    result = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True))[0]
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + result.output_token_ids])).logits[0].float()
    reference = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    for position, entry in enumerate(result.logprobs):
        assert entry.token_id == result.output_token_ids[position]
        assert entry.logprob == pytest.approx(reference[position, entry.token_id].item(), abs=1e-4)
        assert [t for t, _ in entry.top] == reference[position].topk(3).indices.tolist()


@pytest.mark.parametrize(
    "variant",
    [
        dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"]),
        dict(model_type="mistral", architectures=["MistralForCausalLM"], head_dim=24, sliding_window=None),
        dict(tie_word_embeddings=True, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}),
        dict(attention_bias=True, mlp_bias=True, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    ],
    ids=["qwen2-qkv-bias", "mistral-head-dim", "llama3.1-rope-tied", "llama2-linear-rope-bias"],
)
def test_architecture_variants_match_transformers(tmp_path, variant):
    path = save_variant(tmp_path, variant)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = Engine(engine_config(path))
    prompts = random_prompts((6, 33), 256, seed=3)
    got = [r.output_token_ids for r in engine.generate(prompts, GREEDY)]
    assert got == [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]


def save_variant(tmp_path, variant: dict) -> str:
    """Save a tiny model of another family (transformers' own config class for it)."""
    from transformers import AutoConfig

    variant = dict(variant)
    model_type = variant.pop("model_type", "llama")
    architectures = variant.pop("architectures", ["LlamaForCausalLM"])
    if model_type == "llama":
        return save_tiny_llama(tmp_path, seed=1, **variant)
    from conftest import TINY_LLAMA

    torch.manual_seed(1)
    config = AutoConfig.for_model(model_type, **{**TINY_LLAMA, "initializer_range": 0.2, **variant})
    config.architectures = architectures
    model = AutoModelForCausalLM.from_config(config).float()
    if model_type == "qwen2":  # make the q/k/v biases matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return str(tmp_path)


def test_min_tokens_holds_back_eos_and_stop_ids(tiny_llama_dir):
    engine = Engine(engine_config(tiny_llama_dir))
    prompt = random_prompts([9], 256, seed=2)[0]
    free_run = engine.generate([prompt], GREEDY)[0].output_token_ids
    stop = free_run[2]
    stopped = engine.generate([prompt], GREEDY.replace(stop_token_ids=(stop,)))[0]
    assert stopped.output_token_ids == free_run[:3] and stopped.finish_reason == "stop"
    held = engine.generate([prompt], GREEDY.replace(stop_token_ids=(stop,), min_tokens=6))[0].output_token_ids
    assert stop not in held[:6] and len(held) >= 6


def test_duplicate_request_ids_are_refused_until_the_first_finishes(tiny_llama_dir):
    from eaglesrv.scheduler import RequestRejected

    engine = Engine(engine_config(tiny_llama_dir))
    engine.add_request([5, 6, 7], GREEDY.replace(max_tokens=2), request_id="same")
    with pytest.raises(RequestRejected, match="'same' is already in use"):
        engine.add_request([8, 9], GREEDY, request_id="same")
    while engine.has_unfinished:
        engine.step()
    engine.add_request([8, 9], GREEDY.replace(max_tokens=1), request_id="same")  # free again


def test_forward_sequences_scores_on_borrowed_pages_and_only_when_idle(tiny_llama_dir, hf_model):
    engine = Engine(engine_config(tiny_llama_dir))
    prompts = random_prompts((9, 4), 256, seed=2)
    hidden, _ = engine.forward_sequences(prompts)
    logits = engine.model.compute_logits(hidden)
    with torch.no_grad():
        expected = torch.cat([hf_model(torch.tensor([p])).logits[0] for p in prompts])
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert_pages_returned(engine)
    engine.add_request(prompts[0], GREEDY)
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.forward_sequences(prompts)

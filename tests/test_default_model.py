"""End to end on the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import engine_config
from engine_helpers import hf_greedy, run_staggered
from transformers import AutoModelForCausalLM

from eaglesrv.configs import SpeculativeConfig
from eaglesrv.engine.llm_engine import Engine
from eaglesrv.engine.loader import default_model_path
from eaglesrv.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
    "List three prime numbers.",
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def engine():
    return Engine(engine_config(None))


@pytest.fixture(scope="module")
def hf_model():
    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(engine):
    return [
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in QUESTIONS
    ]


def test_answers_sensibly(engine, prompts):
    result = engine.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=32))[0]
    assert "Paris" in result.text and result.finish_reason == "stop"


def test_greedy_matches_transformers_single_batched_and_staggered(engine, hf_model, prompts):
    token_prompts = [engine.encode(p) for p in prompts]
    expected = [hf_greedy(hf_model, p, MAX_NEW) for p in token_prompts]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    assert engine.generate([token_prompts[1]], greedy)[0].output_token_ids == expected[1]
    assert [r.output_token_ids for r in engine.generate(token_prompts, greedy)] == expected
    assert run_staggered(engine, token_prompts, greedy, every=3) == expected


def test_hf_directory_and_gguf_give_the_same_logits(engine, hf_model, tmp_path):
    # transformers dequantizes the GGUF independently of us; we load its HF export.
    # transformers refuses save_pretrained on a GGUF-loaded model, so write the layout by hand.
    from safetensors.torch import save_file

    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp_path / "config.json").write_text(__import__("json").dumps(config))
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    from_dir = Engine(engine_config(str(tmp_path), max_total_tokens=1024))
    tokens = engine.encode("The quick brown fox jumps over the lazy dog because")
    logits = []
    for eng in (engine, from_dir):
        hidden, _ = eng.forward_sequences([tokens])
        logits.append(eng.model.compute_logits(hidden))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-4)
    with torch.no_grad():
        reference = hf_model(torch.tensor([tokens])).logits[0].float()
    torch.testing.assert_close(logits[0], reference, rtol=1e-4, atol=1e-3)


def test_shipped_head_speculates_and_leaves_greedy_output_unchanged(engine, prompts):
    """--speculative-algorithm EAGLE3 on the default model loads the shipped head by itself."""
    config = dataclasses.replace(engine_config(None), speculative=SpeculativeConfig(algorithm="EAGLE3", adaptive=False))
    speculative = Engine(config)
    token_prompts = [engine.encode(p) for p in prompts]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    expected = [r.output_token_ids for r in engine.generate(token_prompts, greedy)]
    assert [r.output_token_ids for r in speculative.generate(token_prompts, greedy)] == expected
    # A random head of this vocabulary accepts next to nothing (about 1.0); the trained one about 2.
    assert speculative.spec_stats["avg_spec_accept_length"] > 1.4

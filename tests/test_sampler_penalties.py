"""repetition_penalty and logit_bias against transformers' logits processors, their
validation, and the engine's greedy output against transformers' generate (plain and
under EAGLE-3, where such requests decode without speculation)."""

from __future__ import annotations

import pytest
import torch
from conftest import engine_config
from eagle3_helpers import spec_config
from engine_helpers import hf_greedy, random_prompts, run_staggered, spy_on_preemptions
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

from eaglesrv.engine.llm_engine import Engine
from eaglesrv.engine.sampler import SamplingBatch, apply_penalties
from eaglesrv.sampling_params import InvalidSamplingParams, SamplingParams

V = 64


def hf_processed(logits_row: torch.Tensor, params: SamplingParams, history: list[int]) -> torch.Tensor:
    """One row through transformers' processors, in generate's order (bias, then repetition)."""
    scores = logits_row.unsqueeze(0).clone()
    input_ids = torch.tensor([history])
    if params.logit_bias:
        scores = SequenceBiasLogitsProcessor({(t,): float(b) for t, b in params.logit_bias})(input_ids, scores)
    if params.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty))(input_ids, scores)
    return scores[0]


def random_history(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, V, (n,), generator=g).tolist()


def test_repetition_penalty_and_logit_bias_equal_transformers_processors():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, V, generator=g) * 4  # both signs, so both branches of the penalty run
    original = logits.clone()
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(),  # nothing: bit-identical
        SamplingParams(repetition_penalty=0.7, logit_bias=((5, -100.0), (9, 2.5), (63, 100.0))),
        SamplingParams(logit_bias=((0, -3.25), (40, 7.0))),
        SamplingParams(temperature=0.0, top_k=3),  # filters do not touch the penalized logits
        SamplingParams(repetition_penalty=2.0, logit_bias={17: -1.5}),
        SamplingParams(repetition_penalty=1.1, logit_bias=((70, 5.0),)),  # an id past the logits' width
    ]
    prompts = [random_history(g, n) for n in (12, 5, 30, 8, 3, 1, 6)]
    outputs = [random_history(g, n) for n in (4, 7, 0, 2, 9, 15, 3)]
    batch = SamplingBatch(params=params, output_token_ids=outputs, seeds=list(range(7)),
                          step_indices=[len(o) for o in outputs], prompt_token_ids=prompts)
    got = apply_penalties(logits, batch)
    assert torch.equal(logits, original)  # input not modified
    for row, p in enumerate(params):
        if not p.uses_penalties:
            assert torch.equal(got[row], original[row]), row
        elif row == 6:  # transformers refuses an id past the vocabulary; the sampler ignores it
            want = hf_processed(original[row], p.replace(logit_bias=()), prompts[row] + outputs[row])
            assert torch.equal(got[row], want)
        else:
            assert torch.equal(got[row], hf_processed(original[row], p, prompts[row] + outputs[row])), row


def test_repetition_penalty_counts_the_prompt_and_each_token_once():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0]])
    params = [SamplingParams(repetition_penalty=2.0)]
    batch = SamplingBatch(params=params, output_token_ids=[[2, 2, 2]], seeds=[0], step_indices=[3],
                          prompt_token_ids=[[1, 1, 0]])
    assert apply_penalties(logits, batch).tolist() == [[1.0, -4.0, 1.0, -2.0, 1.0]]


def test_penalties_compose_with_presence_and_frequency_after_them():
    logits = torch.tensor([[1.0, -1.0, 3.0, 0.5]])
    params = [SamplingParams(repetition_penalty=2.0, logit_bias=((3, 1.5),), presence_penalty=0.5,
                             frequency_penalty=0.25)]
    batch = SamplingBatch(params=params, output_token_ids=[[2, 2, 3]], seeds=[0], step_indices=[3],
                          prompt_token_ids=[[1]])
    # token 1: prompt only, -1 * 2; token 2: output twice, 3 / 2 - 0.5 - 0.5; token 3: (0.5 + 1.5) / 2 - 0.75
    assert apply_penalties(logits, batch).tolist() == [[1.0, -2.0, 0.5, 0.25]]


def test_uses_penalties_for_the_new_parameters():
    assert not SamplingParams().uses_penalties
    assert SamplingParams(repetition_penalty=1.2).uses_penalties
    assert SamplingParams(logit_bias=((3, 0.0),)).uses_penalties  # given, even if zero: no speculation
    assert hash(SamplingParams(logit_bias=[[3, 1.0]])) == hash(SamplingParams(logit_bias=((3, 1.0),)))


@pytest.mark.parametrize("changes, message", [
    (dict(repetition_penalty=0.0), "repetition_penalty must be in (0, 2]"),
    (dict(repetition_penalty=-1.0), "repetition_penalty must be in (0, 2]"),
    (dict(repetition_penalty=2.01), "repetition_penalty must be in (0, 2]"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty must be a finite number"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be a finite number"),
    (dict(logit_bias=((-1, 1.0),)), "logit_bias token ids must be >= 0"),
    (dict(logit_bias=((3, 100.5),)), "logit_bias biases must be finite and in [-100, 100]"),
    (dict(logit_bias=((3, -101.0),)), "logit_bias biases must be finite and in [-100, 100]"),
    (dict(logit_bias=((3, float("nan")),)), "logit_bias biases must be finite and in [-100, 100]"),
    (dict(logit_bias=((3, 1.0), (3, 2.0))), "logit_bias must not repeat a token id"),
    (dict(logit_bias=((3,),)), "logit_bias must be (token id, bias) pairs"),
    (dict(logit_bias=(("3", 1.0),)), "logit_bias must be (token id, bias) pairs"),
    (dict(logit_bias=5), "logit_bias must be (token id, bias) pairs"),
])
def test_validation_names_the_field(changes, message):
    with pytest.raises(InvalidSamplingParams) as error:
        SamplingParams(**changes)
    assert str(error.value).startswith(message)


def test_boundaries_are_accepted():
    SamplingParams(repetition_penalty=2.0, logit_bias=((0, -100.0), (1, 100.0)))
    SamplingParams(repetition_penalty=1e-3)


# ---------------------------------------------------------------------------- engine

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = random_prompts((1, 6, 23), 256, seed=4)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def hf_generate(hf_model, prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=0, eos_token_id=None,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long), **kwargs,
        )
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def cases(hf_model):
    """(params, transformers' output) per prompt: a repetition penalty, and a bias forbidding
    the token transformers would pick first."""
    penalty = GREEDY.replace(repetition_penalty=1.3)
    cases = []
    for prompt in PROMPTS:
        want = hf_generate(hf_model, prompt, GREEDY.max_tokens, repetition_penalty=1.3)
        assert want != hf_greedy(hf_model, prompt, GREEDY.max_tokens)  # the penalty matters here
        cases.append((prompt, penalty, want))
    for prompt in PROMPTS:
        first = hf_greedy(hf_model, prompt, 1)[0]
        biased = GREEDY.replace(logit_bias=((first, -100.0),))
        want = hf_generate(hf_model, prompt, GREEDY.max_tokens, sequence_bias={(first,): -100.0})
        assert want[0] != first
        cases.append((prompt, biased, want))
    return cases


def test_engine_greedy_equals_transformers_generate(tiny_llama_dir, cases):
    engine = Engine(engine_config(tiny_llama_dir))
    results = engine.generate([c[0] for c in cases], [c[1] for c in cases])
    assert [r.output_token_ids for r in results] == [c[2] for c in cases]


def test_preempted_requests_still_count_their_prompt(tiny_llama_dir, cases):
    # 8 pages of 8 tokens cannot hold six sequences of up to 39 tokens at once.
    engine = Engine(engine_config(tiny_llama_dir, max_total_tokens=64, page_size=8, admission_watermark=0.0))
    preempted = spy_on_preemptions(engine)
    outputs = run_staggered(engine, [c[0] for c in cases], [c[1] for c in cases], every=1)
    assert preempted, "the pool was meant to be too small"
    assert outputs == [c[2] for c in cases]


def test_under_eagle3_equal_to_plain_decoding(tiny_llama_dir, head_dir, cases):
    engine = Engine(spec_config(tiny_llama_dir, head_dir, 3, 2, 6))
    plain = GREEDY.replace(max_tokens=12)  # beside them, requests that do speculate
    prompts = [c[0] for c in cases] + PROMPTS
    params = [c[1] for c in cases] + [plain] * len(PROMPTS)
    results = engine.generate(prompts, params)
    assert [r.output_token_ids for r in results[: len(cases)]] == [c[2] for c in cases]
    assert engine.spec_stats["spec_verifications"] > 0

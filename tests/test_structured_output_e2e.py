"""Structured output on the default model (SmolLM2-135M-Instruct, fp32), over the corpus of
real-world-style schemas (tests/data/json_schemas/, the bounded ones): every output is
JSON that validates against its schema (jsonschema, formats checked), at temperature 0 and
1, without speculation and with EAGLE-3; greedy output is the same with EAGLE-3 as without."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import engine_config
from jsonschema import Draft202012Validator

from eaglesrv.configs import SpeculativeConfig
from eaglesrv.engine.llm_engine import Engine
from eaglesrv.grammar import json_schema_grammar
from eaglesrv.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

CORPUS = sorted(Path(__file__).parent.glob("data/json_schemas/*.json"))
MAX_TOKENS = 400  # the bounded schemas' documents (strings <= 40 characters, arrays <= 4 items) end well before


def _bounded_schemas() -> list[dict]:
    entries = [json.loads(path.read_text()) | {"name": path.stem} for path in CORPUS]
    return [entry for entry in entries if entry.get("bounded") and entry.get("refused") is None]


@pytest.fixture(scope="module")
def requests(engines) -> list[tuple[dict, list[int], str]]:
    tokenizer = engines["plain"].tokenizer
    out = []
    for entry in _bounded_schemas():
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Write a JSON document describing {entry['description']}."}],
            add_generation_prompt=True, tokenize=False)
        out.append((entry, tokenizer.encode(prompt), json_schema_grammar(entry["schema"])))
    return out


@pytest.fixture(scope="module")
def engines():
    # Both cores for the 252 generations (the suite's other processes are idle meanwhile).
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    config = engine_config(None, max_total_tokens=40960, max_running_requests=128)
    spec = SpeculativeConfig(algorithm="EAGLE3", num_steps=3, eagle_topk=2, num_draft_tokens=4, adaptive=False)
    yield {"plain": Engine(config), "eagle3": Engine(dataclasses.replace(config, speculative=spec))}
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def outputs(engines, requests) -> dict[tuple[str, float], list]:
    """Each engine runs the greedy and the sampled requests in one batch: a step's cost here
    is mostly reading the weights, so twice the rows cost far less than twice the steps."""
    temperatures = (0.0, 1.0)
    prompts = [ids for _ in temperatures for _, ids, _ in requests]
    params = [SamplingParams(temperature=t, seed=i, max_tokens=MAX_TOKENS, grammar=grammar)
              for t in temperatures for i, (_, _, grammar) in enumerate(requests)]
    results = {}
    for name, engine in engines.items():
        generated = engine.generate(prompts, params)
        for k, t in enumerate(temperatures):
            results[name, t] = generated[k * len(requests): (k + 1) * len(requests)]
    return results


def test_the_corpus_has_enough_bounded_schemas():
    assert len(_bounded_schemas()) >= 50


@pytest.mark.parametrize("engine", ["plain", "eagle3"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_validates_against_its_schema(outputs, requests, engine, temperature):
    failures = []
    for (entry, _, _), result in zip(requests, outputs[engine, temperature]):
        try:
            document = json.loads(result.text)
            errors = [e.message for e in Draft202012Validator(
                entry["schema"], format_checker=Draft202012Validator.FORMAT_CHECKER).iter_errors(document)]
        except json.JSONDecodeError as exc:
            errors = [f"not JSON: {exc}"]
        if errors or result.finish_reason != "stop":
            failures.append((entry["name"], result.finish_reason, result.text, errors))
    assert not failures, failures


def test_greedy_output_is_the_same_with_eagle3(outputs, engines):
    plain = [r.output_token_ids for r in outputs["plain", 0.0]]
    assert [r.output_token_ids for r in outputs["eagle3", 0.0]] == plain
    stats = engines["eagle3"].spec_stats
    assert stats["avg_spec_accept_length"] > 1.5, stats  # the grammar-masked draft is accepted

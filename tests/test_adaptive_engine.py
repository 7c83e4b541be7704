"""Adaptive speculation inside the engine: outputs equal plain decoding whatever the policy
chooses from step to step, and the draft's KV after a spell without speculation is what it
would have been had the draft run every step."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging

import pytest
import torch
from conftest import engine_config
from eagle3_helpers import spec_config
from engine_helpers import assert_pages_returned, random_prompts, run_staggered

from eaglesrv.engine.adaptive import calibrate
from eaglesrv.engine.adaptive.policy import Decision
from eaglesrv.engine.llm_engine import Engine
from eaglesrv.engine.tree_shape import TreeShape
from eaglesrv.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
LENGTHS = (3, 40, 9, 1, 25, 64, 12, 5, 30, 17, 2, 50)


@pytest.fixture(autouse=True)
def private_cost_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("EAGLESRV_CACHE", str(tmp_path_factory.getbasetemp() / "eaglesrv-cache"))


def adaptive_engine(model_dir, head_dir, tree=(5, 8, 32), **kwargs) -> Engine:
    config = spec_config(model_dir, head_dir, *tree, **kwargs)
    return Engine(dataclasses.replace(config, speculative=dataclasses.replace(config.speculative, adaptive=True)))


class ScriptedPolicy:
    """Cycles through fixed choices: (shape or None, fraction of the eligible that speculate)."""

    def __init__(self, script):
        self.script = itertools.cycle(script)

    def decide(self, load):
        shape, fraction = next(self.script)
        count = round(len(load.multipliers) * fraction) if shape is not None else 0
        return Decision(shape if count else None, tuple(range(count)), 0.0, 0.0)


def use_script(engine, script) -> None:
    """The script decides every step: plain decisions are not repeated without it."""
    engine.runner.adaptive.policy = ScriptedPolicy(script)
    engine.runner.adaptive.repeat_plain = lambda decoding, other_rows, eligible_ids: None


SWITCHING = [(None, 1), (TreeShape.of(3, 1, 4), 1), (TreeShape.of(5, 8, 32), 0.5), (None, 1), (None, 1),
             (TreeShape.of(2, 2, 4), 1), (TreeShape.of(5, 8, 32), 1), (TreeShape.of(4, 4, 16), 0.34)]


def test_greedy_equals_plain_while_the_mode_switches_every_step(tiny_llama_dir, head_dir):
    prompts = random_prompts(LENGTHS, 256)
    plain = Engine(engine_config(tiny_llama_dir))
    expected = run_staggered(plain, prompts, GREEDY, every=2)
    engine = adaptive_engine(tiny_llama_dir, head_dir)
    use_script(engine, SWITCHING)
    assert run_staggered(engine, prompts, GREEDY, every=2) == expected
    stats = engine.spec_stats
    assert stats["spec_verifications"] > 0 and stats["spec_steps_plain"] > 0 and stats["spec_steps_speculative"] > 0
    assert_pages_returned(engine)
    assert not engine.runner.requests  # every request's record released on finish
    pool = engine.runner.adaptive.features.pool  # a row per KV slot a request can hold, of the draft's input width
    assert pool.shape == (engine.runner.kv.num_tokens, engine.runner.draft.fc.in_features)


def test_greedy_equals_plain_with_the_measured_policy(tiny_llama_dir, head_dir, monkeypatch):
    prompts = random_prompts(LENGTHS, 256, seed=1)
    expected = run_staggered(Engine(engine_config(tiny_llama_dir)), prompts, GREEDY, every=3)
    engine = adaptive_engine(tiny_llama_dir, head_dir)
    assert run_staggered(engine, prompts, GREEDY, every=3) == expected
    costs = engine.runner.adaptive.costs
    assert costs.target.rows[0] == 1 and all(s > 0 for s in costs.target.seconds)
    # A second engine reads the cached measurement instead of measuring again (the tiny
    # model's sub-millisecond passes are too noisy on a shared CI machine for the spot check).
    monkeypatch.setattr(calibrate, "STALE_TOLERANCE", float("inf"))
    again = adaptive_engine(tiny_llama_dir, head_dir)
    assert again.runner.adaptive.costs.target.seconds == costs.target.seconds


def test_a_cached_cost_model_far_from_its_spot_check_is_measured_again(tiny_llama_dir, head_dir, tmp_path,
                                                                       monkeypatch, caplog):
    """A model cached while the machine was busy (here: every price tripled) is measured
    again at the next start and the cache rewritten; one that holds is kept."""
    monkeypatch.setenv("EAGLESRV_CACHE", str(tmp_path))
    adaptive_engine(tiny_llama_dir, head_dir)
    [path] = tmp_path.glob("cost_models/*.json")
    stale = json.loads(path.read_text())
    for curve in ("target", "draft"):
        stale[curve]["seconds"] = [3 * seconds for seconds in stale[curve]["seconds"]]
    path.write_text(json.dumps(stale))
    with caplog.at_level(logging.WARNING):
        engine = adaptive_engine(tiny_llama_dir, head_dir)
    assert "measuring it again" in caplog.text
    remeasured = json.loads(path.read_text())
    for curve in ("target", "draft"):
        assert all(fresh < old for fresh, old in zip(remeasured[curve]["seconds"], stale[curve]["seconds"]))
    assert engine.runner.adaptive.costs.target.seconds == remeasured["target"]["seconds"]
    # A spot check that agrees keeps the cached model without measuring it again.
    monkeypatch.setattr(calibrate, "_overpricing", lambda *args: 0.0)
    monkeypatch.setattr(calibrate, "measure", lambda *args: pytest.fail("measured a model that held"))
    kept = adaptive_engine(tiny_llama_dir, head_dir).runner.adaptive.costs
    assert kept.target.seconds == remeasured["target"]["seconds"]


@pytest.mark.parametrize("limit", [2048, 5])  # 5: the prompt and the spell drain in pieces
def test_draft_kv_after_a_plain_spell_equals_always_drafting(tiny_llama_dir, head_dir, limit):
    """Decode 12 tokens plainly, then one speculative step (which catches the draft up);
    the draft's K/V for every position before the root must equal those of an engine that
    prefilled the same tokens with the draft running."""
    prompt = random_prompts([20], 256, seed=7)[0]
    engine = adaptive_engine(tiny_llama_dir, head_dir, (3, 2, 6))
    engine.runner.adaptive.features.limit = limit
    use_script(engine, [(None, 1)] * 13 + [(TreeShape.of(3, 2, 6), 1)])
    request_id = engine.add_request(prompt, GREEDY.replace(max_tokens=40))
    outputs = []
    for _ in range(14):
        for out in engine.step():
            outputs.extend(out.new_token_ids)
    request = engine.scheduler._requests[request_id]
    root = len(prompt) + 12  # position of the root the speculative step drafted from

    reference = Engine(spec_config(tiny_llama_dir, head_dir, 3, 2, 6))
    reference_id = reference.add_request((prompt + outputs)[: root + 1], GREEDY.replace(max_tokens=1))
    reference_pages = []
    original_update = reference.scheduler.update

    def keep_pages(batch, *results):  # the request finishes in this step and frees its pages
        reference_pages.extend(reference.scheduler._requests[reference_id].page_table)
        return original_update(batch, *results)

    reference.scheduler.update = keep_pages
    reference.step()  # prefill: the draft extends over every prompt position

    def draft_kv(eng, page_table):
        kv, page = eng.runner.draft_kv, eng.runner.draft_kv.page_size
        slots = torch.tensor([page_table[p // page] * page + p % page for p in range(root)])
        return kv.k[:, slots], kv.v[:, slots]

    k, v = draft_kv(engine, request.page_table)
    k_ref, v_ref = draft_kv(reference, reference_pages)
    torch.testing.assert_close(k, k_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(v, v_ref, rtol=1e-4, atol=1e-4)


def test_metrics_snapshot_names_the_mode(tiny_llama_dir, head_dir):
    engine = adaptive_engine(tiny_llama_dir, head_dir, (3, 1, 4))
    engine.generate(random_prompts([8], 256), GREEDY)
    stats = engine.stats()
    assert stats["spec_adaptive"] is True
    assert stats["spec_steps_plain"] + stats["spec_steps_speculative"] > 0
    assert stats["spec_mode"] == "plain" or stats["spec_mode"].startswith("(")

"""Speculative sampling keeps the target distribution (total variation against exact
probabilities from transformers), and a broken acceptance rule is caught by the same bound."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import save_tiny_llama
from eagle3_helpers import save_random_head, spec_config
from transformers import AutoModelForCausalLM

from eaglesrv.engine.eagle3 import verify
from eaglesrv.engine.llm_engine import Engine
from eaglesrv.sampling_params import SamplingParams

VOCAB = 12
PROMPT = [3, 7, 1, 9]
SAMPLES = 3000
BOUND = 0.06  # total variation; sampling noise with 3000 draws over 12 outcomes is ~0.03


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    path = save_tiny_llama(tmp_path_factory.mktemp("vocab12"), seed=5, vocab_size=VOCAB, initializer_range=0.15)
    head = save_random_head(path, tmp_path_factory.mktemp("vocab12_head"), seed=2)
    return path, head


@pytest.fixture(scope="module")
def exact_marginals(small_vocab_model):
    """P(token 2 = t) and P(token 3 = t) after PROMPT at temperature 0.8, top_p 0.95, by enumeration."""
    model = AutoModelForCausalLM.from_pretrained(small_vocab_model[0], dtype=torch.float64).eval()
    params = PARAMS

    def dist(prefixes):
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + list(p) for p in prefixes])).logits[:, -1]
        probs = torch.softmax(logits / params.temperature, dim=-1)
        return torch.stack([_top_p(row, params.top_p) for row in probs])

    p1 = dist([()])[0]
    p2_given = dist([(a,) for a in range(VOCAB)])  # [a, b]
    p3_given = dist(list(itertools.product(range(VOCAB), repeat=2))).view(VOCAB, VOCAB, VOCAB)
    joint12 = p1[:, None] * p2_given
    return joint12.sum(0), (joint12[:, :, None] * p3_given).sum((0, 1))


PARAMS = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=3, ignore_eos=True)


def _top_p(probs, top_p):
    order = probs.argsort(descending=True)
    above = probs[order].cumsum(0) - probs[order]
    kept = torch.zeros_like(probs, dtype=torch.bool)
    kept[order[above < top_p - 1e-6]] = True
    filtered = torch.where(kept, probs, 0.0)
    return filtered / filtered.sum()


def sampled_marginals(model_dir, head_dir):
    engine = Engine(spec_config(model_dir, head_dir, 3, 3, 8, max_total_tokens=1 << 16, max_running_requests=1024,
                                chunked_prefill_size=-1))
    results = engine.generate([PROMPT] * SAMPLES, [PARAMS.replace(seed=s) for s in range(SAMPLES)])
    counts = torch.zeros(2, VOCAB, dtype=torch.float64)
    for r in results:
        counts[0, r.output_token_ids[1]] += 1
        counts[1, r.output_token_ids[2]] += 1
    stats = engine.spec_stats
    assert stats["spec_verifications"] > 0 and stats["avg_spec_accept_length"] > 1.05, stats  # drafts get accepted
    return counts / SAMPLES


def total_variation(p, q) -> float:
    return 0.5 * (p - q).abs().sum().item()


def test_speculative_sampling_matches_the_target_distribution(small_vocab_model, exact_marginals):
    observed = sampled_marginals(*small_vocab_model)
    for position in range(2):
        assert total_variation(observed[position], exact_marginals[position]) < BOUND


def test_a_broken_acceptance_rule_fails_the_same_bound(small_vocab_model, exact_marginals, monkeypatch):
    def without_residual(node_tokens, children, target_probs, uniforms_for_step):
        # The classic bug: after refusing a child, draw the bonus from the full target
        # distribution instead of the residual, so refused tokens come back too often.
        node, path = 0, []
        while True:
            uniforms = uniforms_for_step(len(path)).tolist()
            accepted = None
            for draw, child in enumerate(children[node]):
                if uniforms[draw] < target_probs[node, node_tokens[child]].item():
                    accepted = child
                    break
            if accepted is None:
                cumulative = target_probs[node].double().cumsum(0)
                bonus = int(torch.searchsorted(cumulative, torch.tensor([uniforms[-1]], dtype=torch.float64)))
                return verify.Acceptance(path, min(bonus, VOCAB - 1))
            path.append(accepted)
            node = accepted

    monkeypatch.setattr("eaglesrv.engine.eagle3.eagle3_runner.accept_sampling", without_residual)
    observed = sampled_marginals(*small_vocab_model)
    assert max(total_variation(observed[i], exact_marginals[i]) for i in range(2)) > BOUND

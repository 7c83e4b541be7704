"""Grammars in the engine, on a tiny random model with a 12-token tokenizer of one character
per token: every output follows its grammar; greedy output under a grammar is the same with
EAGLE-3 as without; sampling with EAGLE-3 keeps the exactly masked distribution (total
variation against enumeration with transformers); and verification without the grammar's
masks is caught by both."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from conftest import engine_config, save_tiny_llama
from eagle3_helpers import save_random_head, spec_config
from engine_helpers import assert_pages_returned, run_staggered
from test_eagle3_sampling import total_variation
from transformers import AutoModelForCausalLM

from eaglesrv.engine.llm_engine import Engine
from eaglesrv.grammar import ebnf_grammar, regex_grammar
from eaglesrv.sampling_params import SamplingParams

CHARS = ["a", "b", "</s>", "c", "d", "0", "1", "2", "3", "{", "}", ","]  # token id = index; 2 is EOS
VOCAB = len(CHARS)
PROMPTS = [[3, 7, 1, 9], [0, 4, 4], [11, 5, 6, 7, 8, 10], [1]]
TRIPLES = r"([ab][cd01][0-3a]){1,6}"
SAMPLES = 3000
BOUND = 0.06  # as tests/test_eagle3_sampling.py: noise with 3000 draws over 12 outcomes is ~0.03


def save_char_tokenizer(path) -> None:
    """A fast tokenizer with one printable character per token (byte-level, so llguidance
    reads each token's bytes) and </s> as EOS, beside the model's weights."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(CHARS)}, merges=[]))
    tokenizer.add_special_tokens(["</s>"])
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>").save_pretrained(path)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = save_tiny_llama(tmp_path_factory.mktemp("chars12"), seed=5, vocab_size=VOCAB, initializer_range=0.15)
    save_char_tokenizer(path)
    return path, save_random_head(path, tmp_path_factory.mktemp("chars12_head"), seed=2)


def _text(engine: Engine, ids: list[int]) -> str:
    return "".join(CHARS[t] for t in ids if t != 2)


GREEDY = SamplingParams(temperature=0, max_tokens=24, grammar=None)


PAIRS_EBNF = 'root ::= "{" pair ("," pair)? ("," pair)? "}"\npair ::= [ab] [0-3]'
PAIRS = r"\{[ab][0-3](,[ab][0-3]){0,2}\}"


@pytest.mark.parametrize("grammar,pattern", [(regex_grammar(TRIPLES), TRIPLES), (ebnf_grammar(PAIRS_EBNF), PAIRS)],
                         ids=["regex", "ebnf"])
def test_greedy_output_follows_the_grammar_and_equals_plain_under_eagle3(model, grammar, pattern):
    params = GREEDY.replace(grammar=grammar)
    plain = Engine(engine_config(model[0]))
    results = plain.generate(PROMPTS, params)
    expected = [r.output_token_ids for r in results]
    for result in results:
        assert result.finish_reason == "stop", result  # the grammar ended it, with EOS
        assert re.fullmatch(pattern, _text(plain, result.output_token_ids)), result.output_token_ids
    for adaptive in (False, True):
        spec = Engine(spec_config(model[0], model[1], 3, 3, 8, adaptive=adaptive))
        assert [r.output_token_ids for r in spec.generate(PROMPTS, params)] == expected
        assert run_staggered(spec, PROMPTS, params, every=2) == expected
        if not adaptive:
            assert spec.spec_stats["avg_spec_accept_length"] > 1.0
        assert_pages_returned(spec)


def test_grammar_rows_beside_free_rows_and_under_preemption(model):
    """Grammar and free requests share batches; a pool too small for all of them preempts."""
    grammar = regex_grammar(TRIPLES)
    params = [GREEDY.replace(grammar=grammar if i % 2 else None, ignore_eos=not i % 2) for i in range(8)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    plain = Engine(engine_config(model[0]))
    expected = run_staggered(plain, prompts, params, every=1)
    spec = Engine(spec_config(model[0], model[1], 3, 3, 8, max_total_tokens=192, page_size=4))
    assert run_staggered(spec, prompts, params, every=1) == expected
    for i in range(1, 8, 2):
        assert re.fullmatch(TRIPLES, _text(plain, expected[i])), expected[i]
    assert_pages_returned(spec)


def test_verification_without_the_grammar_breaks_the_output(model, monkeypatch):
    """The mutation the previous tests exist for: with the target's logits left unmasked,
    acceptance takes tokens the grammar forbids."""
    params = GREEDY.replace(grammar=regex_grammar(TRIPLES))
    expected = [r.output_token_ids for r in Engine(engine_config(model[0])).generate(PROMPTS, params)]
    monkeypatch.setattr("eaglesrv.engine.eagle3.eagle3_runner.Eagle3Runner._grammar_masked",
                        lambda self, trees, seqs, logits: logits)
    spec = Engine(spec_config(model[0], model[1], 3, 3, 8))
    assert [r.output_token_ids for r in spec.generate(PROMPTS, params)] != expected


# ---- sampling keeps the masked distribution ---------------------------------------------
PATTERN = "[ab][cd01][0-3a]"
SAMPLED = SamplingParams(temperature=0.8, max_tokens=3, grammar=regex_grammar(PATTERN))


def _allowed(prefix: tuple[int, ...]) -> torch.Tensor:
    """The tokens PATTERN allows after `prefix`, from the pattern itself (not llguidance)."""
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    sets = ["ab", "cd01", "0123a"]
    for token, char in enumerate(CHARS):
        allowed[token] = len(prefix) < 3 and char in sets[len(prefix)]
    return allowed


@pytest.fixture(scope="module")
def exact_masked_marginals(model):
    """P(output token 2 = t), P(output token 3 = t) at temperature 0.8 under the grammar."""
    hf = AutoModelForCausalLM.from_pretrained(model[0], dtype=torch.float64).eval()
    prompt = PROMPTS[0]

    def dist(prefixes):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1] / 0.8
        masks = torch.stack([_allowed(p) for p in prefixes])
        return torch.softmax(logits.masked_fill(~masks, float("-inf")), dim=-1)

    p1 = dist([()])[0]
    p2 = dist([(a,) for a in range(VOCAB)])
    p3 = dist(list(itertools.product(range(VOCAB), repeat=2))).view(VOCAB, VOCAB, VOCAB)
    p2 = torch.nan_to_num(p2)  # prefixes the grammar forbids have no distribution (and no mass)
    p3 = torch.nan_to_num(p3)
    joint12 = p1[:, None] * p2
    return joint12.sum(0), (joint12[:, :, None] * p3).sum((0, 1))


def _sampled_marginals(model) -> tuple[torch.Tensor, int]:
    """The observed marginals of output tokens 2 and 3, and how many outputs left the grammar."""
    engine = Engine(spec_config(model[0], model[1], 3, 3, 8, max_total_tokens=1 << 16, max_running_requests=1024,
                                chunked_prefill_size=-1))
    results = engine.generate([PROMPTS[0]] * SAMPLES, [SAMPLED.replace(seed=s) for s in range(SAMPLES)])
    counts = torch.zeros(2, VOCAB, dtype=torch.float64)
    for r in results:
        counts[0, r.output_token_ids[1]] += 1
        counts[1, r.output_token_ids[2]] += 1
    stats = engine.spec_stats
    assert stats["spec_verifications"] > 0 and stats["avg_spec_accept_length"] > 1.05, stats
    invalid = sum(not re.fullmatch(PATTERN, _text(engine, r.output_token_ids)) for r in results)
    return counts / SAMPLES, invalid


def test_speculative_sampling_keeps_the_masked_distribution(model, exact_masked_marginals):
    observed, invalid = _sampled_marginals(model)
    assert invalid == 0
    for position in range(2):
        assert total_variation(observed[position], exact_masked_marginals[position]) < BOUND


def test_sampling_without_the_target_mask_fails_the_same_bound(model, exact_masked_marginals, monkeypatch):
    """The target masked at the root only, not along the tree's paths (the classic
    desynchronization of grammar and draft tree): the same checks catch it."""
    from eaglesrv.engine.eagle3.eagle3_runner import Eagle3Runner

    original = Eagle3Runner._grammar_masked

    def masked_only_where_the_draft_went(self, trees, seqs, logits):
        masked = original(self, trees, seqs, logits)
        masked[:, 1:] = logits[:, 1:]
        return masked

    monkeypatch.setattr(Eagle3Runner, "_grammar_masked", masked_only_where_the_draft_went)
    observed, invalid = _sampled_marginals(model)
    assert invalid > 0 or max(total_variation(observed[i], exact_masked_marginals[i]) for i in range(2)) > BOUND


# ---- GrammarMatchers alone ------------------------------------------------------------------
def _matchers(model):
    from transformers import AutoTokenizer

    from eaglesrv.engine.grammar_masks import GrammarMatchers

    tokenizer = AutoTokenizer.from_pretrained(model[0])
    return GrammarMatchers(lambda: tokenizer, VOCAB, [2])


def _seq(output, request_id="r"):
    from types import SimpleNamespace

    return SimpleNamespace(request_id=request_id, params=SamplingParams(grammar=regex_grammar(PATTERN)),
                           output_token_ids=output)


def _ids(mask: torch.Tensor) -> list[int]:
    return torch.nonzero(mask).flatten().tolist()


def test_masks_follow_the_output_and_a_broken_one_allows_only_eos(model, caplog):
    matchers = _matchers(model)
    output: list[int] = []
    seq = _seq(output)
    assert _ids(matchers.allowed_now([seq])[0]) == [0, 1]  # a, b
    output += [1, 3]  # "bc": the matcher catches up from the output itself
    assert _ids(matchers.allowed_now([seq])[0]) == [0, 5, 6, 7, 8]
    output += [7]
    assert _ids(matchers.allowed_now([seq])[0]) == [2]  # complete: EOS only
    broken = _seq([1, 1], "broken")  # "bb" breaks the grammar
    assert _ids(matchers.allowed_now([broken])[0]) == [2]
    broken.output_token_ids.append(0)
    assert _ids(matchers.allowed_now([broken])[0]) == [2]
    assert sum("broke its grammar" in r.message for r in caplog.records) == 1  # said once


def test_tree_masks_leave_the_matcher_where_it_was(model):
    """Every node's mask is the grammar's after its path; EOS nodes are not entered (a stopped
    matcher takes EOS again without recording it, so rolling that back would undo a real token)."""
    matchers = _matchers(model)
    seq = _seq([1])  # "b"
    # root b; children c (3), a (0: forbidden here), EOS (2, with a child EOS); c's child 2 ("c2"), then EOS
    tokens, parents = [1, 3, 0, 2, 7, 2, 2], [-1, 0, 0, 0, 1, 3, 4]
    masks = matchers.tree_masks(seq, tokens, parents)
    assert _ids(masks[0]) == [3, 4, 5, 6]  # after "b": c, d, 0, 1
    assert _ids(masks[1]) == [0, 5, 6, 7, 8]  # after "bc"
    assert _ids(masks[4]) == [2]  # after "bc2": complete
    assert masks[2].all() and masks[3].all() and masks[5].all() and masks[6].all()  # not entered
    assert _ids(matchers.allowed_now([seq])[0]) == [3, 4, 5, 6]  # unchanged

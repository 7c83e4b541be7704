"""eval_acceptance on the tiny chat model: held-out prompts only, one row per (tree, temperature)."""

from __future__ import annotations

import json

import pytest
import torch
from eagle3_helpers import save_random_head
from train_eagle3_helpers import save_tiny_chat_model, write_tiny_sharegpt

import eaglesrv.data.sharegpt as sharegpt_module
from eaglesrv.eval_acceptance import (
    _kept_counts,
    draft_vocab_coverage,
    evaluation_prompts,
    heldout_prompts,
    main,
    parse_args,
)


@pytest.fixture()
def small_split(monkeypatch):
    monkeypatch.setattr(sharegpt_module, "TRAINING_CONVERSATIONS", 40)  # 8 of the 48 are held out


def test_smoke_writes_every_tree_and_temperature(tmp_path, small_split):
    model = save_tiny_chat_model(tmp_path / "model")
    head = save_random_head(model, tmp_path / "head", draft_vocab_size=64)
    data = write_tiny_sharegpt(tmp_path / "sharegpt.json")
    out = tmp_path / "acceptance.json"
    main(["--model-path", model, "--draft-model-path", head, "--data-path", data, "--num-prompts", "3",
          "--trees", "3,1,4", "2,2,4", "--temperatures", "0", "1", "--max-tokens", "8", "--device", "cpu",
          "--speed-prompts", "2", "--output-json", str(out)])
    report = json.loads(out.read_text())
    assert [(r["tree"], r["temperature"]) for r in report["results"]] == [
        ([3, 1, 4], 0.0), ([3, 1, 4], 1.0), ([2, 2, 4], 0.0), ([2, 2, 4], 1.0)]
    for row in report["results"]:
        assert row["prompts"] == 3 and row["verifications"] > 0 and row["accept_length"] >= 1.0
        assert len(row["acceptance_by_depth"]) == row["tree"][0]
        assert 0.0 <= row["draft_vocab_coverage"] <= 1.0
    speed = report["batch1_speed"]
    assert [row["tree"] for row in speed] == [[3, 1, 4], [2, 2, 4]]
    for row in speed:  # greedy outputs are equal, so both sides decode the same tokens
        assert row["prompts"] == 2 and row["decode_tokens"] > 0 and row["plain_tok_s"] > 0 and row["speedup"] > 0


def test_prompts_come_from_the_held_out_conversations(tmp_path, small_split):
    from transformers import AutoTokenizer

    model = save_tiny_chat_model(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = heldout_prompts(tokenizer, 8, 1024, write_tiny_sharegpt(tmp_path / "sharegpt.json"))
    texts = [tokenizer.decode(p) for p in prompts]
    assert texts[0] == "<|im_start|>user\ntell me about cats<|im_end|>\n<|im_start|>assistant\n"  # conversation 40
    with pytest.raises(ValueError, match="only 8 held-out prompts"):
        heldout_prompts(tokenizer, 9, 1024, str(tmp_path / "sharegpt.json"))


def test_validation_prompts_are_the_training_splits_last(tmp_path, small_split):
    from transformers import AutoTokenizer

    model = save_tiny_chat_model(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(model)
    data = write_tiny_sharegpt(tmp_path / "sharegpt.json")
    args = parse_args(["--draft-model-path", "x", "--data-path", data, "--validation-conversations", "3"])
    texts = [tokenizer.decode(p) for p in evaluation_prompts(args, tokenizer)]
    # conversations 37, 38, 39 of the 40 training ones: what train_eagle3 --val-conversations 3 scores
    assert [t.split("about ")[1].split("<")[0] for t in texts] == ["stars", "owls", "salt"]


def test_per_depth_counts_survive_the_rate_snapshot():
    stats = {"spec_verifications": 7, "spec_acceptance_by_depth": [5 / 7, 2 / 5, 0 / 2]}
    assert _kept_counts(stats) == [5, 2, 0]


def test_draft_vocab_coverage_counts_the_tokens_a_draft_could_propose():
    draft_to_target = torch.tensor([2, 5, 7])
    assert draft_vocab_coverage(draft_to_target, [2, 5, 5, 9]) == 0.75
    assert draft_vocab_coverage(draft_to_target, [0, 1]) == 0.0
    assert draft_vocab_coverage(draft_to_target, []) == 0.0

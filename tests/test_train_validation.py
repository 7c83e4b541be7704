"""train_eagle3's validation: the greedy chain accept length read off features equals what
the engine's own draft chain would have accepted; reply sets and the validation split end
to end on a tiny chat model."""

from __future__ import annotations

import json

import pytest
import torch
from test_train_eagle3 import _small_head, chat_model, sharegpt  # noqa: F401 (fixtures)
from train_eagle3_helpers import train_argv

from eaglesrv.engine.eagle3.draft_model import Eagle3DraftModel
from eaglesrv.engine.forward_context import ForwardContext
from eaglesrv.engine.kv_cache import KVPool
from eaglesrv.kernels.attention.base import SequenceSpan
from eaglesrv.kernels.attention.torch_ref import TorchAttentionBackend
from eaglesrv.train_eagle3.__main__ import main
from eaglesrv.train_eagle3.distill import read_cache
from eaglesrv.train_eagle3.validate import chain_acceptance, decoding_walk, summarize

STEPS = 3


def test_decoding_walks_past_what_each_verification_committed():
    accepted = [2, 0, 2, 2, 0, 1, 0, 2]
    scored = [False, True, True, True, True, True, True, False]
    assert decoding_walk(accepted, scored, 2) == [0, 2, 1]  # roots 1, 2, then 2 + 3 = 5; 3 and 4 never verify
    assert decoding_walk(accepted, scored, 1) == [0, 1, 0, 1]  # roots 1, 2, 4, 5: each capped at 1
    figures = summarize({1: [0, 1, 1, 0], 2: [0, 0, 1, 2]})
    assert figures["verifications"] == 4
    assert figures["accept_length_by_steps"] == [1.5, 1.75]  # 1 + 2/4, 1 + 3/4
    assert figures["acceptance_by_depth"] == [0.5, 0.5]  # 2 of 4 reach depth 2, 1 of those 2 hits


def _greedy_chain(draft: Eagle3DraftModel, tokens: torch.Tensor, aux: torch.Tensor, root: int) -> list[int]:
    """The engine's paged draft at root `root` (the draft extend over positions 0..root),
    then passes that each read the previous pass's own token and output: target ids."""
    kv = KVPool(draft.config.arch, num_pages=16, page_size=4, dtype=torch.float32, device=torch.device("cpu"))
    attention = TorchAttentionBackend(4, torch.device("cpu"))

    def forward(ids, features, first, count):
        ctx = ForwardContext(attention, attention.plan([SequenceSpan(list(range(16)), first, count)]), kv)
        return draft(ids, features, torch.arange(first, first + count), ctx)

    logits, out = forward(tokens[1 : root + 2], aux[: root + 1], 0, root + 1)
    guesses, hidden = [int(draft.draft_to_target[logits[root].argmax()])], out[root:]
    for depth in range(1, STEPS):
        logits, hidden = forward(torch.tensor(guesses[-1:]), hidden, root + depth, 1)
        guesses.append(int(draft.draft_to_target[logits[0].argmax()]))
    return guesses


class _Features:
    """The FeatureCache interface over in-memory sequences."""

    def __init__(self, items: list[dict[str, torch.Tensor]]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def length(self, i: int) -> int:
        return len(self.items[i]["input_ids"])

    def get(self, i: int) -> dict[str, torch.Tensor]:
        return self.items[i]


def test_validation_counts_what_the_engines_greedy_chain_accepts():
    draft = _small_head()
    draft._set_vocab_map(torch.arange(20) + 1)  # draft token d is target token 2d + 1
    generator = torch.Generator().manual_seed(4)
    items = []
    with torch.no_grad():
        for b in range(8):  # each sequence continues one root's own chain, cut by a wrong token
            length, root, wrong_at = 12, b % 4, b % (STEPS + 1)
            tokens = torch.randint(0, 50, (length,), generator=generator)
            aux = torch.randn(length, 96, generator=generator)
            chain = _greedy_chain(draft, tokens, aux, root)
            tokens[root + 2 : root + 2 + STEPS] = torch.tensor(chain)
            if wrong_at < STEPS:
                tokens[root + 2 + wrong_at] = (chain[wrong_at] + 1) % 50
            top = torch.cat([tokens[1:], torch.tensor([-1])]).int()  # greedy data: the next token is the top one
            top[0] = -1  # the prompt: not reply text
            items.append({"input_ids": tokens.int(), "aux": aux, "hidden": torch.zeros(length, 32), "valid": top >= 0,
                          "top": top})
        # The oracle: greedy decoding's verifications, each drafted as the engine does, at the
        # roots whose own token and STEPS next ones are reply text.
        walks = {chain: [] for chain in range(1, STEPS + 1)}
        for item in items:
            tokens, aux, top = item["input_ids"].long(), item["aux"], item["top"].tolist()
            for chain, found in walks.items():
                root = 0
                while root < len(tokens):
                    wanted = top[root + 1 : root + 1 + STEPS]
                    if top[root] < 0 or len(wanted) < STEPS or min(wanted) < 0:  # token root + 1 is decoded
                        root += 1
                        continue
                    hits = [g == w for g, w in zip(_greedy_chain(draft, tokens, aux, root), wanted[:chain])]
                    found.append(hits.index(False) if False in hits else chain)
                    root += found[-1] + 1
    assert 0 < sum(k == STEPS for k in walks[STEPS]) < len(walks[STEPS])  # the test data reaches every depth
    assert any(k == 1 for k in walks[STEPS])
    figures = chain_acceptance(draft, _Features(items), STEPS, batch_tokens=48, device=torch.device("cpu"))
    assert figures == summarize(walks)


def test_validation_split_and_extra_reply_sets_end_to_end(chat_model, sharegpt, tmp_path):  # noqa: F811
    out = tmp_path / "head"
    argv = train_argv(chat_model, sharegpt, out, "--self-distill", "--val-conversations", "8",
                      "--distill-extra-samples", "1")
    metadata = main(argv)
    validation = metadata["validation"]["by_epoch"]
    assert [v["epochs"] for v in validation] == list(range(7))  # before training, then after each of 6 epochs
    assert validation[-1]["accept_length_by_steps"][0] > validation[0]["accept_length_by_steps"][0] + 0.05
    assert metadata["data"]["reply_sets"] == 2 and metadata["data"]["sequences"] == 64  # 32 conversations, twice
    caches = {path.name: [json.loads(line) for line in path.read_text().splitlines()[1:]]
              for path in (out / "work").glob("distill-*.jsonl")}
    (greedy,) = [records for name, records in caches.items() if "-s1" not in name]
    (extra,) = [records for name, records in caches.items() if "-s1" in name]
    # The greedy cache holds the 32 training conversations and the split's last 8 (validation), the
    # sampled one only the training ones; sampling changed some replies.
    assert sorted(r["index"] for r in greedy) == list(range(32)) + list(range(40, 48))
    assert sorted(r["index"] for r in extra) == list(range(32))
    by_index = {r["index"]: r["messages"] for r in greedy}
    assert any(r["messages"] != by_index[r["index"]] for r in extra)
    # --reply-sets 1: the sampled set alone, read from its cache (nothing regenerated)
    written = {path.name: read_cache(path) for path in (out / "work").glob("distill-*.jsonl")}
    only_extra = main(train_argv(chat_model, sharegpt, tmp_path / "extra", "--self-distill", "--val-conversations", "8",
                                 "--distill-extra-samples", "1", "--reply-sets", "1", "--work-dir", str(out / "work"),
                                 "--max-steps", "1"))
    assert only_extra["data"]["reply_set_indices"] == [1] and only_extra["data"]["sequences"] == 32
    assert {path.name: read_cache(path) for path in (out / "work").glob("distill-*.jsonl")} == written
    with pytest.raises(ValueError, match="validation conversations"):
        overlapping = train_argv(chat_model, sharegpt, tmp_path / "overlap", "--val-conversations", "20")
        main(overlapping)  # 32 training conversations and the last 20 of 48 overlap


def test_resume_keeps_the_validation_record(chat_model, sharegpt, tmp_path, monkeypatch):  # noqa: F811
    from eaglesrv.train_eagle3 import trainer as trainer_module

    def validated_run(out, *extra):
        argv = train_argv(chat_model, sharegpt, out, "--val-conversations", "8", "--epochs", "3", *extra)
        argv[argv.index("--num-conversations") + 1] = "24"
        return main(argv)["validation"]["by_epoch"]

    whole = validated_run(tmp_path / "whole")
    original_step = trainer_module.Trainer._step
    calls = {"n": 0}

    def crash_late(self, indices, batch, position):  # after epoch 1's validation, past the checkpoint at step 8
        calls["n"] += 1
        if calls["n"] > 11:
            raise KeyboardInterrupt
        return original_step(self, indices, batch, position)

    monkeypatch.setattr(trainer_module.Trainer, "_step", crash_late)
    with pytest.raises(KeyboardInterrupt):
        validated_run(tmp_path / "cut")
    monkeypatch.setattr(trainer_module.Trainer, "_step", original_step)
    assert validated_run(tmp_path / "cut", "--resume") == whole


def test_validation_walk_is_what_the_engine_serves(chat_model, sharegpt, tmp_path, monkeypatch):  # noqa: F811
    """Features of the engine's own greedy replies, walked as decoding would, accept at each
    verification what the engine's EAGLE-3 steps accepted (chain of STEPS, float32)."""
    from conftest import engine_config
    from eagle3_helpers import spec_config

    from eaglesrv.engine.eagle3.head_io import load_draft_head
    from eaglesrv.engine.llm_engine import Engine
    from eaglesrv.sampling_params import SamplingParams
    from eaglesrv.train_eagle3 import features as features_module
    from eaglesrv.train_eagle3.data import TrainingSequence, prompt_ids
    from eaglesrv.train_eagle3.features import FeatureCache, extract_features
    from eaglesrv.train_eagle3.validate import decoding_walks

    head_dir = tmp_path / "head"
    main(train_argv(chat_model, sharegpt, head_dir, "--self-distill", "--max-turns", "1"))
    served = Engine(spec_config(chat_model, str(head_dir), STEPS, 1, STEPS + 1))
    sequences, verified = [], []
    for topic in ("cats", "tea", "owls", "maps"):
        prompt = prompt_ids(served.tokenizer, [{"role": "user", "content": f"tell me about {topic}"}])
        served.add_request(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        reply, steps = [], []
        while served.has_unfinished:
            for out in served.step():
                reply += out.new_token_ids
                steps.append(len(out.new_token_ids) - 1)  # tokens the verification accepted
        sequences.append(TrainingSequence(prompt + reply, [False] * len(prompt) + [True] * len(reply)))
        verified.append(steps[1:])  # the first step is the prefill's token
    # The target's token ids as they are: no text round trip (this random byte model's bytes
    # are rarely valid UTF-8, so decoded text does not re-encode to the same ids).
    target = Engine(engine_config(chat_model))
    monkeypatch.setattr(features_module, "STORE_DTYPE", torch.float32)  # the engine's own precision
    capture = served.runner.capture_layers
    every_token = torch.ones(target.arch.vocab_size, dtype=torch.bool)
    extract_features(target, sequences, tmp_path / "features", "served", capture, every_token, 1024, progress=False)
    head = load_draft_head(str(head_dir), target.arch, target.model.model.embed_tokens.weight.detach(),
                           torch.float32, torch.device("cpu"))
    walks = decoding_walks(head, FeatureCache(tmp_path / "features"), STEPS, 1024, torch.device("cpu"))[STEPS]
    assert sum(sum(w) for w in walks) > 0  # the head accepts something, so the comparison bites
    for walk, steps in zip(walks, verified):
        # The walk stops STEPS roots before the reply ends, where the engine's last verifications
        # are cut by max_tokens.
        assert 0 < len(walk) <= len(steps) and walk == steps[: len(walk)]

"""EAGLE-3 head training on a tiny chat model: the unroll equals the engine's draft, the
loss falls, the head loads and keeps greedy output exact, resume is exact."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import engine_config
from eagle3_helpers import spec_config
from engine_helpers import random_prompts
from safetensors.torch import load_file
from train_eagle3_helpers import save_tiny_chat_model, train_argv, write_tiny_sharegpt

from eaglesrv.engine.eagle3.draft_model import Eagle3Config, Eagle3DraftModel
from eaglesrv.engine.eagle3.head_io import head_config_for
from eaglesrv.engine.forward_context import ForwardContext
from eaglesrv.engine.kv_cache import KVPool
from eaglesrv.engine.llm_engine import Engine
from eaglesrv.engine.model.arch import ModelArch
from eaglesrv.kernels.attention.base import SequenceSpan
from eaglesrv.kernels.attention.torch_ref import TorchAttentionBackend
from eaglesrv.sampling_params import SamplingParams
from eaglesrv.train_eagle3 import trainer as trainer_module
from eaglesrv.train_eagle3.__main__ import main
from eaglesrv.train_eagle3.config import RUN_FIELDS, TrainConfig
from eaglesrv.train_eagle3.data import TrainingSequence, encode, training_conversations
from eaglesrv.train_eagle3.trainer import plan_epoch, target_logprobs
from eaglesrv.train_eagle3.ttt import draft_logits, live_rows, unroll
from eaglesrv.train_eagle3.vocab import build_draft_vocab, grown_vocab

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> str:
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))


@pytest.fixture(scope="module")
def sharegpt(tmp_path_factory) -> str:
    return write_tiny_sharegpt(tmp_path_factory.mktemp("data") / "sharegpt.json")


@pytest.fixture(scope="module")
def trained(chat_model, sharegpt, tmp_path_factory):
    """One uninterrupted run: (head dir, metadata, per-step log)."""
    out = tmp_path_factory.mktemp("head")
    metadata = main(train_argv(chat_model, sharegpt, out))
    log = [json.loads(line) for line in (out / "train_state" / "train_log.jsonl").read_text().splitlines()]
    return out, metadata, log


# ---- the unroll is the inference-time draft ----------------------------------------------
def _engine_chain(draft: Eagle3DraftModel, tokens: torch.Tensor, aux: torch.Tensor, root: int, steps: int):
    """Logits of the engine's paged draft: the extend over positions 0..root-1, then a chain
    of `steps - 1` draft passes, each reading the token after the last and its own output."""
    kv = KVPool(draft.config.arch, num_pages=16, page_size=4, dtype=torch.float32, device=torch.device("cpu"))
    attention = TorchAttentionBackend(4, torch.device("cpu"))
    pages = list(range(16))

    def forward(ids, features, first, count):
        ctx = ForwardContext(attention, attention.plan([SequenceSpan(pages, first, count)]), kv)
        return draft(ids, features, torch.arange(first, first + count), ctx)

    logits, out = forward(tokens[1 : root + 1], aux[:root], 0, root)
    chain, hidden = [logits[root - 1]], out[root - 1 :]
    for depth in range(1, steps):
        logits, hidden = forward(tokens[root + depth : root + depth + 1], hidden, root + depth - 1, 1)
        chain.append(logits[0])
    return chain


def _small_head() -> Eagle3DraftModel:
    target = ModelArch.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 50, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
    })
    draft = Eagle3DraftModel(Eagle3Config.from_hf_config(head_config_for(target, 20)))
    draft.init_random_weights(3, torch.randn(50, 32, generator=torch.Generator().manual_seed(1)) * 0.5)
    return draft


def test_unroll_equals_the_engines_draft_chain():
    draft = _small_head()
    generator = torch.Generator().manual_seed(0)
    length, steps = 14, 4
    tokens = torch.randint(0, 50, (length,), generator=generator)
    aux = torch.randn(length, 96, generator=generator)
    with torch.no_grad():
        unrolled = [draft_logits(draft, h)[0] for h in unroll(draft, tokens[None], aux[None], steps)]
        for root in (1, 5, length - steps):
            chain = _engine_chain(draft, tokens, aux, root, steps)
            for step in range(steps):  # unroll step j at index root-1 = chain depth j
                torch.testing.assert_close(unrolled[step][root - 1], chain[step], atol=2e-5, rtol=1e-4)


def test_skipping_dead_rows_changes_no_live_output():
    draft = _small_head()
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 50, (3, 16), generator=generator)
    aux = torch.randn(3, 16, 96, generator=generator)
    valid = torch.rand(3, 16, generator=generator) < 0.3
    live = live_rows(valid, 4)
    assert live[0].sum() > live[3].sum() > 0 and not live[0].all()
    with torch.no_grad():
        for step, (dense, sparse) in enumerate(zip(unroll(draft, tokens, aux, 4), unroll(draft, tokens, aux, 4, live))):
            torch.testing.assert_close(sparse[live[step]], dense[live[step]], atol=1e-5, rtol=1e-5)
            needed = torch.zeros_like(valid)
            for later in range(step, 4):  # every position a loss at this step or later reads
                needed |= torch.cat([valid[:, 1 + later:], torch.zeros(3, 1 + later, dtype=torch.bool)], 1)
            assert torch.equal(live[step], needed)


# ---- data, vocabulary, batching ------------------------------------------------------------
def test_reply_mask_covers_exactly_the_assistant_text(chat_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "q"}, {"role": "assistant", "content": "ok"}]
    sequence = encode(tokenizer, messages, 200)
    reply = [t for t, m in zip(sequence.token_ids, sequence.loss_mask) if m]
    assert tokenizer.decode(reply) == "yo<|im_end|>ok<|im_end|>"
    cut = encode(tokenizer, messages, 24)
    assert len(cut.token_ids) == 24 and cut.loss_mask[-3:] == [True, True, True]
    assert encode(tokenizer, messages, 20) is None  # no reply token left


def test_training_data_stops_at_the_held_out_split(sharegpt, monkeypatch):
    import eaglesrv.data.sharegpt as sharegpt_module

    monkeypatch.setattr(sharegpt_module, "TRAINING_CONVERSATIONS", 10)
    assert len(training_conversations(None, sharegpt)) == 10
    assert len(training_conversations(40, sharegpt)) == 10
    assert [c.id for c in training_conversations(3, sharegpt)] == ["c0", "c1", "c2"]
    assert [c.id for c in training_conversations(2, sharegpt, offset=3)] == ["c3", "c4"]
    with pytest.raises(ValueError, match="held-out"):
        training_conversations(10, sharegpt, offset=7_995)


def test_draft_vocab_by_reply_frequency():
    sequences = [TrainingSequence([5, 7, 7, 9, 9, 9, 4, 3], [False, True, True, True, True, True, True, False])]
    vocab = build_draft_vocab(sequences, 2, 12)
    assert vocab.draft_to_target.tolist() == [7, 9] and vocab.coverage == pytest.approx(5 / 6)
    padded = build_draft_vocab(sequences, 5, 12)
    assert padded.draft_to_target.tolist() == [0, 1, 4, 7, 9] and padded.target_mask(12).sum() == 5


def test_a_grown_vocab_keeps_every_token_and_adds_the_most_frequent():
    sequences = [TrainingSequence([5, 7, 7, 9, 9, 9, 4, 3], [False, True, True, True, True, True, True, False])]
    grown = grown_vocab(torch.tensor([4, 11]), sequences, 4, 12)  # 9 (three times) and 7 (twice) join
    assert grown.draft_to_target.tolist() == [4, 7, 9, 11] and grown.coverage == pytest.approx(1.0)
    assert grown_vocab(torch.tensor([4, 11]), sequences, 6, 12).draft_to_target.tolist() == [0, 1, 4, 7, 9, 11]
    with pytest.raises(ValueError, match="must be larger than the head's vocabulary of 2"):
        grown_vocab(torch.tensor([4, 11]), sequences, 2, 12)
    with pytest.raises(ValueError, match="larger than the target's 12"):
        grown_vocab(torch.tensor([4, 11]), sequences, 13, 12)


def test_distill_cache_is_keyed_on_the_seed_only_when_the_data_is_sampled():
    greedy = TrainConfig(output_dir="out", self_distill=True, seed=0)
    reseeded = dataclasses.replace(greedy, seed=7)
    assert greedy.distill_fingerprint() == reseeded.distill_fingerprint()  # greedy replies: same data
    assert greedy.fingerprint(*RUN_FIELDS) != reseeded.fingerprint(*RUN_FIELDS)  # but another run
    sampled = dataclasses.replace(greedy, distill_temperature=1.0)
    assert sampled.distill_fingerprint() != dataclasses.replace(sampled, seed=7).distill_fingerprint()
    # Entries are whole conversations by file index: any slice of the data shares the cache.
    assert greedy.distill_fingerprint() == dataclasses.replace(greedy, num_conversations=5,
                                                               conversation_offset=3).distill_fingerprint()
    assert greedy.distill_fingerprint() != dataclasses.replace(greedy, distill_max_new_tokens=9).distill_fingerprint()


def test_reply_sets_name_existing_sets_and_a_lower_target_temperature_sharpens():
    config = TrainConfig(output_dir="out", self_distill=True, distill_extra_samples=2, reply_sets=(2, 1))
    assert config.used_reply_sets == (1, 2)
    assert dataclasses.replace(config, reply_sets=None).used_reply_sets == (0, 1, 2)
    for bad in [(3,), (1, 1), ()]:
        with pytest.raises(ValueError, match="--reply-sets must name distinct sets among 0 .. 2"):
            dataclasses.replace(config, reply_sets=bad)
    with pytest.raises(ValueError, match="--reply-sets needs --self-distill"):
        TrainConfig(output_dir="out", reply_sets=(0,))
    with pytest.raises(ValueError, match="--target-temperature must be > 0"):
        TrainConfig(output_dir="out", target_temperature=0.0)
    hidden, rows = torch.randn(5, 8), torch.randn(16, 8)
    plain, sharp = target_logprobs(hidden, rows), target_logprobs(hidden, rows, 0.5)
    torch.testing.assert_close(plain, torch.log_softmax(hidden @ rows.T, dim=-1))
    torch.testing.assert_close(sharp, torch.log_softmax(2 * hidden @ rows.T, dim=-1))
    assert torch.equal(plain.argmax(-1), sharp.argmax(-1)) and (sharp.max(-1).values > plain.max(-1).values).all()


def test_batch_plans_are_seeded_and_bounded():
    lengths = [int(x) for x in torch.randint(5, 90, (200,), generator=torch.Generator().manual_seed(1))]
    plan = plan_epoch(lengths, 256, seed=7, epoch=2)
    assert plan == plan_epoch(lengths, 256, seed=7, epoch=2) != plan_epoch(lengths, 256, seed=7, epoch=3)
    assert sorted(i for batch in plan for i in batch) == list(range(200))
    assert all(len(batch) * max(lengths[i] for i in batch) <= 256 for batch in plan)


def test_every_epoch_runs_to_its_last_batch(tmp_path):
    class Lengths:  # the part of FeatureCache the trainer's schedule reads
        def __init__(self, lengths):
            self.lengths = lengths

        def __len__(self):
            return len(self.lengths)

        def length(self, i):
            return self.lengths[i]

    lengths = [int(x) for x in torch.randint(5, 90, (200,), generator=torch.Generator().manual_seed(1))]
    plans = [len(plan_epoch(lengths, 256, seed=7, epoch=e)) for e in range(4)]
    assert len(set(plans)) > 1  # epochs batch differently: the first one's count is not every one's
    config = TrainConfig(output_dir=str(tmp_path), max_seq_len=8, batch_tokens=256, epochs=4, seed=7)
    trainer = trainer_module.Trainer(
        _small_head(), torch.zeros(20, 32), Lengths(lengths), config, "", torch.device("cpu"))
    assert trainer.total_steps == sum(plans)


# ---- the CLI end to end ------------------------------------------------------------------
def test_training_lowers_the_loss_and_writes_a_published_head(trained):
    out, metadata, log = trained
    # The loss is a cross-entropy to a random model's rather flat distributions: its floor
    # (the target's entropy) is high, so the part above it (the KL) shows the learning.
    def first_and_last(key: str) -> list[float]:  # step-0 figure, mean of 5 optimizer steps
        return [sum(r[key][0] for r in rows) / len(rows) for rows in (log[:5], log[-5:])]

    (first_loss, last_loss), (first_kl, last_kl) = first_and_last("step_loss"), first_and_last("step_kl")
    assert last_loss < first_loss - 0.2 and last_kl < 0.8 * first_kl, (first_loss, last_loss, first_kl, last_kl)
    first_acc, last_acc = first_and_last("step_acc")
    assert last_acc > first_acc + 0.1, (first_acc, last_acc)
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["lm_head.weight"].shape == (192, 64) and "embed_tokens.weight" not in tensors
    assert tensors["fc.weight"].dtype == torch.bfloat16 and tensors["d2t"].dtype == torch.int64
    assert int(tensors["t2d"].sum()) == 192 and "midlayer.self_attn.q_proj.weight" in tensors
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 192
    assert metadata["data"]["sequences"] == 32 and metadata["steps"] == len(log)
    assert json.loads((out / "TRAINING.json").read_text())["command"].startswith("python -m eaglesrv.train_eagle3")


def test_trained_head_loads_and_keeps_greedy_output_exact(chat_model, trained):
    out, _, _ = trained
    prompts = random_prompts([7, 20, 33], 256, seed=5)
    plain = [r.output_token_ids for r in Engine(engine_config(chat_model)).generate(prompts, GREEDY)]
    for tree in ((3, 1, 4), (5, 8, 32), (6, 10, 60)):
        engine = Engine(spec_config(chat_model, str(out), *tree))
        assert [r.output_token_ids for r in engine.generate(prompts, GREEDY)] == plain
        assert engine.spec_stats["spec_verifications"] > 0


def test_resume_continues_exactly(chat_model, sharegpt, trained, tmp_path, monkeypatch):
    out, _, log = trained
    interrupted = tmp_path / "head"
    original_step = trainer_module.Trainer._step
    calls = {"n": 0}

    def crash_after_ten(self, indices, batch, position):
        calls["n"] += 1
        if calls["n"] > 10:  # past the checkpoint at step 8: steps 9-10 must be redone
            raise KeyboardInterrupt
        return original_step(self, indices, batch, position)

    monkeypatch.setattr(trainer_module.Trainer, "_step", crash_after_ten)
    with pytest.raises(KeyboardInterrupt):
        main(train_argv(chat_model, sharegpt, interrupted))
    monkeypatch.setattr(trainer_module.Trainer, "_step", original_step)
    with pytest.raises(FileExistsError):  # a checkpoint is never silently overwritten
        main(train_argv(chat_model, sharegpt, interrupted))
    main(train_argv(chat_model, sharegpt, interrupted, "--resume"))
    resumed = [json.loads(line) for line in (interrupted / "train_state" / "train_log.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in log]
    expected, got = load_file(str(out / "model.safetensors")), load_file(str(interrupted / "model.safetensors"))
    assert all(torch.equal(expected[name], got[name]) for name in expected)


def test_time_limit_writes_the_head_and_resume_finishes_the_schedule(chat_model, sharegpt, trained, tmp_path):
    out, metadata, log = trained
    limited = tmp_path / "limited"
    stopped = main(train_argv(chat_model, sharegpt, limited, "--time-limit", "0"))  # past it before the first step
    assert stopped["stopped_by_time_limit"] and stopped["steps"] == 0
    assert stopped["planned_steps"] == metadata["planned_steps"] == len(log)
    assert json.loads((limited / "TRAINING.json").read_text())["stopped_by_time_limit"]
    assert load_file(str(limited / "model.safetensors"))["d2t"].numel() == 192  # a head, as it stood
    resumed = main(train_argv(chat_model, sharegpt, limited, "--resume"))
    assert not resumed["stopped_by_time_limit"] and resumed["steps"] == len(log)
    expected, got = load_file(str(out / "model.safetensors")), load_file(str(limited / "model.safetensors"))
    assert all(torch.equal(expected[name], got[name]) for name in expected)


def test_self_distillation_trains_on_the_targets_replies(chat_model, sharegpt, tmp_path, monkeypatch):
    out = tmp_path / "distilled"
    argv = train_argv(chat_model, sharegpt, out, "--self-distill", "--max-steps", "3")
    argv[argv.index("--num-conversations") + 1] = "6"
    argv[argv.index("--max-seq-len") + 1] = "64"
    summary = main(argv + ["--distill-only"])  # the replies only: nothing is trained
    (cache,) = (out / "work").glob("distill-*.jsonl")
    assert summary["distill_caches"] == [str(cache)] and not (out / "model.safetensors").exists()
    records = [json.loads(line) for line in cache.read_text().splitlines()[1:]]
    assert sorted(r["index"] for r in records) == list(range(6))
    engine = Engine(engine_config(chat_model))
    first = records[[r["index"] for r in records].index(0)]["messages"]
    prompt = engine.tokenizer.apply_chat_template(first[:1], tokenize=False, add_generation_prompt=True)
    ids = engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    reply = engine.generate([ids], SamplingParams(temperature=0, max_tokens=64 - len(ids)))[0]
    assert first[1] == {"role": "assistant", "content": reply.text, "token_ids": reply.output_token_ids}
    # The training sequence is what the target read and wrote, id for id; this random
    # byte-level model's replies are rarely valid UTF-8, so their text would not give it.
    assert encode(engine.tokenizer, first, 64).token_ids == ids + reply.output_token_ids
    # Training, and a run over a slice of those conversations, generate nothing: the cache
    # has them by index.
    monkeypatch.setattr(Engine, "add_request", lambda *a, **k: pytest.fail("regenerated a cached conversation"))
    main(argv)
    argv[argv.index("--num-conversations") + 1] = "3"
    main(argv + ["--conversation-offset", "2", "--output-dir", str(tmp_path / "slice"),
                 "--work-dir", str(out / "work")])
    assert len(cache.read_text().splitlines()) == 1 + 6


def test_each_reply_set_keeps_its_own_feature_cache(chat_model, sharegpt, tmp_path):
    """Training on sets 0 and 1 caches each set's target features apart, so a later stage
    over set 1 alone (or with a new set) reads them instead of running the target again.
    (The key holds the draft vocabulary too: a later stage keeps its parent's.)"""
    out = tmp_path / "both"
    argv = train_argv(chat_model, sharegpt, out, "--self-distill", "--distill-extra-samples", "1", "--max-steps", "1")
    argv[argv.index("--num-conversations") + 1] = "4"
    argv[argv.index("--max-seq-len") + 1] = "64"
    both = main(argv)
    caches = sorted((out / "work").glob("features-*"))
    assert len(caches) == 2 and both["throughput_tok_s"]["features"] > 0
    alone = main(argv + ["--reply-sets", "1", "--init-from", str(out), "--output-dir", str(tmp_path / "one"),
                         "--work-dir", str(out / "work")])
    assert sorted((out / "work").glob("features-*")) == caches and alone["throughput_tok_s"]["features"] == 0
    assert alone["data"]["sequences"] < both["data"]["sequences"]


def test_init_from_continues_a_trained_head(chat_model, sharegpt, trained, tmp_path):
    out, _, log = trained
    further = tmp_path / "further"
    main(train_argv(chat_model, sharegpt, further, "--init-from", str(out), "--max-steps", "2",
                    "--work-dir", str(out / "work")))  # the trained run's feature cache
    continued = [json.loads(line) for line in (further / "train_state" / "train_log.jsonl").read_text().splitlines()]
    # Its first step starts where the trained head ended, far below a fresh head's first loss.
    assert continued[0]["loss"] < (log[0]["loss"] + log[-1]["loss"]) / 2
    # The head keeps the vocabulary its lm_head was trained for, whatever --draft-vocab-size says,
    # and trains on other conversations than the ones it saw.
    other = train_argv(chat_model, sharegpt, tmp_path / "other", "--init-from", str(out), "--max-steps", "1",
                       "--conversation-offset", "3", "--num-conversations", "4")
    other[other.index("--draft-vocab-size") + 1] = "160"
    metadata = main(other)
    assert metadata["draft_vocab"]["size"] == json.loads((out / "config.json").read_text())["draft_vocab_size"]
    assert metadata["data"]["conversations"].startswith("usable conversations [3, 7)")
    earlier = json.loads((out / "TRAINING.json").read_text())  # the history travels with the head
    assert metadata["initialized_from"]["command"] == earlier["command"]
    assert torch.equal(load_file(str(tmp_path / "other" / "model.safetensors"))["d2t"],
                       load_file(str(out / "model.safetensors"))["d2t"])


def test_grow_draft_vocab_moves_each_row_to_its_token(chat_model, sharegpt, trained, tmp_path):
    out, _, _ = trained
    parent = load_file(str(out / "model.safetensors"))
    parent_ids = (torch.arange(len(parent["d2t"])) + parent["d2t"]).tolist()
    grown_dir = tmp_path / "grown"
    size = len(parent_ids) + 24
    argv = train_argv(chat_model, sharegpt, grown_dir, "--init-from", str(out), "--grow-draft-vocab", str(size),
                      "--max-steps", "1")
    argv[argv.index("--lr") + 1] = "0"  # a step that moves nothing: the written head is the grown start
    metadata = main(argv)
    grown = load_file(str(grown_dir / "model.safetensors"))
    grown_ids = (torch.arange(len(grown["d2t"])) + grown["d2t"]).tolist()
    assert len(grown_ids) == size == metadata["draft_vocab"]["size"] and set(parent_ids) < set(grown_ids)
    assert json.loads((grown_dir / "config.json").read_text())["draft_vocab_size"] == size
    rows = [grown_ids.index(t) for t in parent_ids]
    assert torch.equal(grown["lm_head.weight"][rows], parent["lm_head.weight"])
    added = [i for i, t in enumerate(grown_ids) if t not in set(parent_ids)]
    assert grown["lm_head.weight"][added].float().std() < parent["lm_head.weight"].float().std()  # small random rows
    for name in parent:
        if name not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(grown[name], parent[name]), name
    assert grown["t2d"].sum() == size and grown["t2d"][parent_ids].all()
    with pytest.raises(ValueError, match="--grow-draft-vocab needs --init-from"):
        main(train_argv(chat_model, sharegpt, tmp_path / "x", "--grow-draft-vocab", str(size)))

"""Tensor parallelism in one process group on the CPU (gloo): the sharding rules, the flags,
and engines split over 2 and 4 ranks against one rank, token for token (fp32).

Rank 0 runs in this process (Engine starts the others, each a spawned process), so the
passes' all-reduces and gathers really cross processes."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from conftest import engine_config, save_tiny_llama
from eagle3_helpers import save_random_head, spec_config

from eaglesrv.configs import ParallelConfig
from eaglesrv.configs.errors import ConfigError
from eaglesrv.engine.llm_engine import Engine
from eaglesrv.engine.model.arch import ModelArch, UnsupportedModel
from eaglesrv.engine.model.sharding import check_divisible, checkpoint_slice, per_rank
from eaglesrv.engine.parallel.group import TensorParallel
from eaglesrv.engine.parallel.ranks import node_placements
from eaglesrv.sampling_params import SamplingParams

# Grouped-query heads (8 query heads over 4 KV heads: 2 per KV head on every rank at TP 2 and
# 4), every bias (o_proj's and down_proj's are added once, after the all-reduce), and a
# vocabulary of 250, which 4 ranks split with padding (63 rows each, the last 61 real).
GQA_WITH_BIASES = dict(vocab_size=250, num_attention_heads=8, num_key_value_heads=4, attention_bias=True,
                       mlp_bias=True)
TIED = dict(vocab_size=250, num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True)

PROMPTS = [[1, 5, 9, 33, 70], [1, 200, 3], list(range(1, 40)), [1, 7] * 12]


def _save_model(path, **overrides) -> str:
    """save_tiny_llama, with random biases: transformers starts them at zero, which would let a
    bias added on every rank (instead of once) pass unseen."""
    from safetensors.torch import load_file, save_file

    save_tiny_llama(path, seed=3, **overrides)
    weights = load_file(f"{path}/model.safetensors")
    generator = torch.Generator().manual_seed(5)
    for name, tensor in weights.items():
        if name.endswith(".bias"):
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.2)
    save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
    return str(path)


def _params() -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True)
    return [greedy, sampled, greedy, sampled]


def _outputs(config, tp_size: int, params) -> list[list[int]]:
    engine = Engine(dataclasses.replace(config, parallel=ParallelConfig(tp_size=tp_size, dist_timeout=60)))
    try:
        return [result.output_token_ids for result in engine.generate(PROMPTS, params)]
    finally:
        engine.close()


@pytest.fixture(scope="module")
def gqa_dir(tmp_path_factory) -> str:
    return _save_model(tmp_path_factory.mktemp("tp_gqa"), **GQA_WITH_BIASES)


@pytest.mark.parametrize("overrides,tp_size", [(GQA_WITH_BIASES, 2), (GQA_WITH_BIASES, 4), (TIED, 4)],
                         ids=["gqa-biases-tp2", "gqa-biases-tp4-padded-vocab", "tied-tp4"])
def test_plain_decoding_split_over_ranks_equals_one_rank(overrides, tp_size, tmp_path):
    config = engine_config(_save_model(tmp_path, **overrides))
    params = _params()
    single = _outputs(config, 1, params)
    # Greedy and seeded sampling alike: the gathered logits are the whole vocabulary's.
    assert _outputs(config, tp_size, params) == single


@pytest.mark.parametrize("adaptive", [False, True], ids=["static", "adaptive"])
def test_eagle3_split_over_ranks_equals_plain_greedy(gqa_dir, tmp_path, adaptive):
    head = save_random_head(gqa_dir, tmp_path / "head")
    greedy = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(PROMPTS)
    plain = _outputs(engine_config(gqa_dir), 1, greedy)
    config = spec_config(gqa_dir, head, steps=3, topk=2, draft_tokens=4, adaptive=adaptive)
    assert _outputs(config, 2, greedy) == plain


def test_followers_wait_for_the_next_step_past_the_collective_timeout(gqa_dir):
    """An idle server's followers wait for rank 0's next command with no bound: only the
    collectives inside a step (and rank 0's sends) time out."""
    config = engine_config(gqa_dir, tp_size=2, dist_timeout=2.0)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine = Engine(config)
    try:
        first = engine.generate(PROMPTS[:1], params)[0].output_token_ids
        time.sleep(5.0)  # two and a half timeouts of idling
        assert engine.generate(PROMPTS[:1], params)[0].output_token_ids == first
    finally:
        engine.close()


def test_a_split_that_does_not_divide_the_heads_names_the_sizes_that_do(gqa_dir):
    arch = ModelArch.from_hf_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
                                     "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                                     "num_key_value_heads": 3})
    with pytest.raises(UnsupportedModel, match=r"--tp-size 2 does not divide .*attention heads 9, KV heads 3.*"
                                                r"sizes that do: 1, 3"):
        check_divisible(arch, 2)
    check_divisible(arch, 3)
    # An engine refuses before any rank waits at the rendezvous.
    with pytest.raises(UnsupportedModel, match="--tp-size 3 does not divide"):
        Engine(engine_config(gqa_dir, tp_size=3))


def test_each_rank_reads_its_own_slice_of_every_checkpoint_tensor():
    arch = ModelArch.from_hf_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 250, "hidden_size": 64,
                                     "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
                                     "num_key_value_heads": 4, "attention_bias": True})
    shard = per_rank(arch, 4)
    assert (shard.num_heads, shard.num_kv_heads, shard.intermediate_size) == (2, 1, 32)
    rank = TensorParallel(rank=3, size=4)
    layer = "model.layers.1."
    expected = {
        "self_attn.q_proj.weight": ((64, 64), (0, 48, 16)),
        "self_attn.k_proj.weight": ((32, 64), (0, 24, 8)),
        "self_attn.v_proj.bias": ((32,), (0, 24, 8)),
        "self_attn.o_proj.weight": ((64, 64), (1, 48, 16)),
        "self_attn.o_proj.bias": ((64,), None),  # whole, on rank 0 only
        "mlp.gate_proj.weight": ((128, 64), (0, 96, 32)),
        "mlp.down_proj.weight": ((64, 128), (1, 96, 32)),
        "input_layernorm.weight": ((64,), None),
    }
    for name, (shape, want) in expected.items():
        assert checkpoint_slice(layer + name, shape, arch, rank) == want, name
    # The vocabulary: 63 rows a rank, the last rank's 61 real ones and 2 of padding.
    assert checkpoint_slice("model.embed_tokens.weight", (250, 64), arch, rank) == (0, 189, 61)
    assert checkpoint_slice("lm_head.weight", (250, 64), arch, TensorParallel(rank=1, size=4)) == (0, 63, 63)
    assert checkpoint_slice("model.embed_tokens.weight", (250, 64), arch, TensorParallel()) is None


def test_parallel_flags_are_checked_and_ranks_numbered_node_by_node():
    with pytest.raises(ConfigError, match="--tp-size 3 must be a multiple of --nnodes 2"):
        ParallelConfig(tp_size=3, nnodes=2, dist_init_addr="10.0.0.1:5000")
    with pytest.raises(ConfigError, match="needs --dist-init-addr"):
        ParallelConfig(tp_size=4, nnodes=2)
    with pytest.raises(ConfigError, match="--node-rank must be in 0..1"):
        ParallelConfig(tp_size=4, nnodes=2, node_rank=2, dist_init_addr="10.0.0.1:5000")
    with pytest.raises(ConfigError, match="HOST:PORT"):
        ParallelConfig(tp_size=2, dist_init_addr="10.0.0.1")
    second_node = node_placements(ParallelConfig(tp_size=4, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:5000"))
    assert [(p.rank, p.local_rank, p.size, p.init_method) for p in second_node] == [
        (2, 0, 4, "tcp://10.0.0.1:5000"), (3, 1, 4, "tcp://10.0.0.1:5000")]
    assert not any(p.is_leader for p in second_node)
    one_node = node_placements(ParallelConfig(tp_size=2))
    assert [p.rank for p in one_node] == [0, 1] and one_node[0].init_method.startswith("tcp://127.0.0.1:")


def test_the_vocabulary_split_covers_every_row_once():
    for vocab, size in [(250, 4), (256, 2), (7, 3), (49152, 3)]:
        parts = [TensorParallel(rank, size).vocab_part(vocab) for rank in range(size)]
        covered = [row for start, length, _ in parts for row in range(start, start + length)]
        assert covered == list(range(vocab))
        assert len({padded for _, _, padded in parts}) == 1


def test_one_rank_changes_nothing():
    single = TensorParallel.single()
    x = torch.randn(3, 5)
    assert single.all_reduce(x) is x and single.gather_last_dim(x, 5) is x
    assert single.leader_value(lambda: 42) == 42 and single.smallest(7) == 7


def test_a_follower_that_sampled_other_tokens_than_rank_0_stops():
    """Each Step carries rank 0's checksum of the step before; a follower whose own tokens
    differ raises rather than go on from a diverged KV cache."""
    from eaglesrv.engine.parallel.followers import Step, Stop, follow, sampled_digest
    from eaglesrv.scheduler.batch import SequenceResult, StepResults

    class Runner:
        def __init__(self, tokens):
            self.tokens, self.ran = iter(tokens), 0

        def run(self, batch):
            self.ran += 1
            return StepResults([SequenceResult([next(self.tokens)], 1)])

    class FromRankZero:  # the control group, as a follower sees it
        def __init__(self, commands):
            self.rank, self.commands = 1, iter(commands)

        def leader_value(self, compute):
            return next(self.commands)

    ours = StepResults([SequenceResult([7], 1)])
    follow(Runner([7, 8]), FromRankZero([Step("batch", None), Step("batch", sampled_digest(ours)), Stop()]))
    diverged = Runner([7, 9])
    other = StepResults([SequenceResult([5], 1)])
    with pytest.raises(RuntimeError, match="sampled other tokens than rank 0"):
        follow(diverged, FromRankZero([Step("batch", None), Step("batch", sampled_digest(other)), Stop()]))
    assert diverged.ran == 1

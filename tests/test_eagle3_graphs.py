"""EAGLE-3 through captured graphs, on the CPU stand-in with CUDA-graph semantics.

The tree step (draft passes and verification), the plain step and the draft extend replay
a graph per rung of the batch-size ladder. Greedy output must still equal plain decoding,
static and adaptive, with requests joining and finishing mid-run so that batches land on
rungs, between rungs and above the top rung. The negative controls show that the checks
would catch a host value baked in at capture and padding rows left stale.
"""

from __future__ import annotations

import pytest
import torch
from conftest import engine_config
from eagle3_helpers import spec_config
from engine_helpers import assert_pages_returned, random_prompts, run_staggered
from flashinfer_oracle import serve_through_stand_in

from eaglesrv.engine.adaptive.policy import Decision
from eaglesrv.engine.graphs import GraphCaptureError
from eaglesrv.engine.graphs.runner import GraphRunner
from eaglesrv.engine.llm_engine import Engine
from eaglesrv.kernels.attention.torch_ref import TorchAttentionBackend
from eaglesrv.kernels.triton_support import triton_usable
from eaglesrv.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LENGTHS = (3, 40, 9, 1, 25, 12)
MAX_BS = 4  # rungs 1, 2, 4: a batch of 3 pads to 4, batches of 5 and 6 run eagerly


@pytest.fixture(scope="module")
def plain_outputs(tiny_llama_dir):
    engine = Engine(engine_config(tiny_llama_dir))
    return run_staggered(engine, random_prompts(LENGTHS, 256), GREEDY, every=2)


def graphed_engine(model_dir, head_dir, tree, attention_backend="torch", **kwargs) -> Engine:
    return Engine(spec_config(model_dir, head_dir, *tree, attention_backend=attention_backend, page_size=4,
                              graphs_on_cpu=True, cuda_graph_max_bs=MAX_BS, **kwargs))


def spy_on_tree_steps(engine: Engine) -> list[int]:
    """Batch sizes of the steps in which every request speculates with the configured tree."""
    sizes: list[int] = []
    graphs = engine.runner.graphs
    original = graphs.holds

    def holds(shape, batch_size):
        sizes.append(batch_size)
        return original(shape, batch_size)

    graphs.holds = holds
    return sizes


@pytest.mark.parametrize("tree", [(5, 8, 32), (3, 1, 4)], ids=lambda t: "x".join(map(str, t)))
def test_static_eagle3_through_graphs_equals_plain(tiny_llama_dir, head_dir, plain_outputs, tree):
    engine = graphed_engine(tiny_llama_dir, head_dir, tree)
    graphs = engine.runner.graphs
    assert graphs.batch_sizes == [1, 2, 4] and sorted(graphs.tree_runner.graphs) == [1, 2, 4]
    sizes = spy_on_tree_steps(engine)
    assert run_staggered(engine, random_prompts(LENGTHS, 256), GREEDY, every=2) == plain_outputs
    assert {1, 2, 3, 4} <= set(sizes) and max(sizes) > MAX_BS  # on rungs, between them, above the top
    replays = graphs.tree_runner.replays
    assert replays[1] and replays[2] and replays[4]
    assert sum(replays.values()) == sum(size <= MAX_BS for size in sizes)  # everything else ran eagerly
    assert sum(graphs.extend_runner.replays.values()) >= sum(replays.values())
    assert engine.spec_stats["spec_verifications"] > 0
    assert_pages_returned(engine)


def test_requests_that_cannot_speculate_ride_the_plain_step_graph(tiny_llama_dir, head_dir):
    penalized = GREEDY.replace(presence_penalty=0.5)  # penalties would change along a tree path
    prompts = random_prompts(LENGTHS[:3], 256)
    eager = Engine(spec_config(tiny_llama_dir, head_dir, 3, 2, 6, page_size=4))
    expected = [r.output_token_ids for r in eager.generate(prompts, penalized)]
    engine = graphed_engine(tiny_llama_dir, head_dir, (3, 2, 6))
    assert [r.output_token_ids for r in engine.generate(prompts, penalized)] == expected
    graphs = engine.runner.graphs
    assert sum(graphs.plain.runner.replays.values()) > 0 and not graphs.tree_runner.replays
    assert sum(graphs.extend_runner.replays.values()) > 0  # their one-token extends


def force_the_configured_tree_every_other_step(engine: Engine) -> None:
    """Adaptive steps alternate between the policy's choice and the configured tree for
    everyone, so that graphed tree steps follow plain spells (and their catch-ups)."""
    runner = engine.runner
    original, calls = runner._decide, [0]

    def decide(seqs, eligible):
        decision = original(seqs, eligible)
        calls[0] += 1
        if calls[0] % 2 or not eligible:
            return decision
        return Decision(runner.largest, tuple(range(len(eligible))), decision.tokens_per_s, decision.passes_s)

    runner._decide = decide


def test_adaptive_eagle3_through_graphs_equals_plain(tiny_llama_dir, head_dir, plain_outputs):
    engine = graphed_engine(tiny_llama_dir, head_dir, (4, 4, 12), adaptive=True)
    force_the_configured_tree_every_other_step(engine)
    assert run_staggered(engine, random_prompts(LENGTHS, 256), GREEDY, every=2) == plain_outputs
    graphs = engine.runner.graphs
    stats = engine.spec_stats
    # The forced tree steps bypass the controller, so its speculative-step counter sees only
    # the policy's own choices: the verifications and the tree graph's replays count them all.
    assert stats["spec_steps_plain"] > 0 and stats["spec_verifications"] > 0
    for runner in (graphs.tree_runner, graphs.plain.runner, graphs.extend_runner):
        assert sum(runner.replays.values()) > 0


@pytest.mark.skipif(not triton_usable(torch.device("cpu")), reason="needs triton and TRITON_INTERPRET=1")
def test_triton_eagle3_graphs_equal_plain(tiny_llama_dir, head_dir, plain_outputs):
    engine = graphed_engine(tiny_llama_dir, head_dir, (3, 2, 6), attention_backend="triton")
    short = GREEDY.replace(max_tokens=5)
    outputs = [r.output_token_ids for r in engine.generate(random_prompts(LENGTHS, 256)[:3], short)]
    assert outputs == [expected[:5] for expected in plain_outputs[:3]]
    assert engine.runner.graphs.tree_runner.replays[4] > 0


@pytest.mark.skipif(not triton_usable(torch.device("cpu")), reason="needs triton and TRITON_INTERPRET=1")
def test_flashinfer_eagle3_graphs_equal_plain(tiny_llama_dir, head_dir, plain_outputs, monkeypatch):
    """The draft extend and the plain step on flashinfer's graph passes (its stand-in), the
    tree step's masked passes on Triton's, adaptive so that all three graphs replay."""
    module = serve_through_stand_in(monkeypatch)
    engine = graphed_engine(tiny_llama_dir, head_dir, (3, 2, 6), adaptive=True)
    force_the_configured_tree_every_other_step(engine)
    short = GREEDY.replace(max_tokens=6)
    outputs = run_staggered(engine, random_prompts(LENGTHS, 256)[:4], short, every=2)
    assert outputs == [expected[:6] for expected in plain_outputs[:4]]
    graphs = engine.runner.graphs
    for runner in (graphs.tree_runner, graphs.plain.runner, graphs.extend_runner):
        assert sum(runner.replays.values()) > 0
    graphed = {type(wrapper).__name__ for wrapper in module.made if wrapper.use_cuda_graph}
    assert graphed == {"BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper"}  # plain, extend


# ---- negative controls ------------------------------------------------------------------

class _BakesTheCachedLength(TorchAttentionBackend):
    """Takes the cached length from Python state instead of the tensor: what a graph holds is
    the value at capture (the padding rows' 0) for every row of every replay."""

    cached_at_capture = 0

    def uniform_metadata(self, block_table, num_cached, num_new, tree_mask=None):
        baked = torch.full_like(num_cached, self.cached_at_capture)
        return super().uniform_metadata(block_table, baked, num_new, tree_mask)


def test_control_a_host_value_baked_in_at_capture_breaks_the_output(tiny_llama_dir, head_dir, plain_outputs,
                                                                     monkeypatch):
    from eaglesrv.engine import builder

    monkeypatch.setattr(builder, "select_attention_backend",
                        lambda name, page, device, *_: _BakesTheCachedLength(page, device))
    engine = graphed_engine(tiny_llama_dir, head_dir, (3, 2, 6))
    assert run_staggered(engine, random_prompts(LENGTHS, 256), GREEDY, every=2) != plain_outputs


def test_control_a_host_read_in_the_draft_passes_is_refused_at_start_up(tiny_llama_dir, head_dir, monkeypatch):
    from eaglesrv.engine.eagle3 import drafting

    original = drafting.scratch_masks
    monkeypatch.setattr(drafting, "scratch_masks", lambda ancestry: original(torch.tensor(ancestry.tolist())))
    with pytest.raises(GraphCaptureError, match="host sync during capture"):
        graphed_engine(tiny_llama_dir, head_dir, (3, 2, 6))


def tree_step_writes(engine: Engine, batch: list[tuple[list[int], int]]) -> tuple[set[int], set[int]]:
    """Slots of either KV pool the tree step writes for (page table, root position) rows, on
    fresh random contents: (slots off the padding page, slots on it)."""
    runner = engine.runner
    pools = (runner.target_kv, runner.draft_kv)
    g = torch.Generator().manual_seed(len(batch))
    for pool in pools:
        pool.k.copy_(torch.randn(pool.k.shape, generator=g))
        pool.v.copy_(torch.randn(pool.v.shape, generator=g))
    before = [(pool.k.clone(), pool.v.clone()) for pool in pools]
    draft_config = runner.draft.config
    logprobs = torch.log_softmax(torch.randn(len(batch), draft_config.draft_vocab_size, generator=g), -1)
    with torch.inference_mode():
        runner.graphs.tree_step([7] * len(batch), logprobs,
                                torch.randn(len(batch), draft_config.arch.hidden_size, generator=g),
                                [position for _, position in batch], [table for table, _ in batch])
    written: set[int] = set()
    for pool, (k, v) in zip(pools, before):
        changed = ((pool.k != k) | (pool.v != v)).flatten(2).any(-1).any(0)
        written |= set(changed.nonzero().flatten().tolist())
    padding = set(range(runner.kv.padding_page * 4, (runner.kv.padding_page + 1) * 4))
    return written - padding, written & padding


def request_slots(table: list[int], root: int, count: int) -> set[int]:
    return {table[p // 4] * 4 + p % 4 for p in range(root, root + count)}


@pytest.mark.parametrize("stale", [False, True], ids=["padded", "control-stale-padding"])
def test_padding_rows_of_the_tree_step_write_only_the_padding_page(tiny_llama_dir, head_dir, stale, monkeypatch):
    tree = (3, 2, 6)  # 6 nodes verified, 2 x 2 draft scratch slots: a request writes its root .. root + 5
    engine = graphed_engine(tiny_llama_dir, head_dir, tree)
    batch = [([3, 7], 1), ([1, 5], 0), ([9, 4, 0], 5), ([6, 2, 8], 2)]
    slots = [request_slots(table, root, 6) for table, root in batch]
    written, on_padding = tree_step_writes(engine, batch)  # rung 4, no padding row
    assert written == set().union(*slots) and not on_padding
    if stale:  # leave what the last batch put in the padding rows
        monkeypatch.setattr(GraphRunner, "_write_padding_rows", lambda self, batch_size, bs: None)
    written, on_padding = tree_step_writes(engine, batch[:3])  # rung 4 again, one padding row
    if stale:
        assert written == set().union(*slots)  # the fourth request's slots rewritten by a padding row
    else:
        assert written == set().union(*slots[:3]) and on_padding
    assert engine.runner.graphs.tree_runner.replays[4] == 2

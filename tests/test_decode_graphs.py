"""Plain decoding through captured graphs, on the CPU stand-in with CUDA-graph semantics.

The engine's decode-only steps replay a graph per rung of the batch-size ladder; greedy
output must still equal transformers, with requests joining and finishing mid-run so that
batches land on rungs, between rungs and above the top rung.
"""

from __future__ import annotations

import pytest
import torch
from conftest import engine_config
from engine_helpers import assert_pages_returned, hf_greedy, random_prompts, run_staggered
from flashinfer_oracle import serve_through_stand_in
from transformers import AutoModelForCausalLM

from eaglesrv.engine.graphs import GraphCaptureError
from eaglesrv.engine.llm_engine import Engine
from eaglesrv.kernels.attention.base import SequenceSpan
from eaglesrv.kernels.attention.torch_ref import TorchAttentionBackend
from eaglesrv.kernels.triton_support import triton_usable
from eaglesrv.sampling_params import SamplingParams
from eaglesrv.scheduler.batch import SequenceWork

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LENGTHS = (1, 5, 17, 40, 3, 29)
MAX_BS = 4  # rungs 1, 2, 4: a batch of 3 pads to 4, batches of 5 and 6 run eagerly


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    return [hf_greedy(hf_model, p, GREEDY.max_tokens) for p in random_prompts(LENGTHS, 256)]


def graphed_engine(model_dir: str, attention_backend: str = "torch") -> Engine:
    return Engine(engine_config(model_dir, attention_backend=attention_backend, graphs_on_cpu=True,
                                cuda_graph_max_bs=MAX_BS, page_size=4))


def spy_on_decode_batches(engine: Engine) -> list[int]:
    sizes: list[int] = []
    graphs = engine.runner.decode_graphs
    original = graphs.logits

    def logits(sequences):
        sizes.append(len(sequences))
        return original(sequences)

    graphs.logits = logits
    return sizes


def test_greedy_through_decode_graphs_equals_transformers(tiny_llama_dir, expected):
    engine = graphed_engine(tiny_llama_dir)
    graphs = engine.runner.decode_graphs
    assert graphs.batch_sizes == [1, 2, 4] and sorted(graphs.runner.graphs) == [1, 2, 4]
    sizes = spy_on_decode_batches(engine)
    prompts = random_prompts(LENGTHS, 256)
    assert [r.output_token_ids for r in engine.generate(prompts, GREEDY)] == expected
    assert run_staggered(engine, prompts, GREEDY, every=2) == expected
    assert {3, 5, 6} <= set(sizes) and {1, 2, 4} <= set(sizes)  # between rungs, above the top, on rungs
    replays = graphs.runner.replays
    assert replays[4] > 0 and replays[2] > 0 and replays[1] > 0
    assert sum(replays.values()) == sum(size <= MAX_BS for size in sizes)  # everything else ran eagerly
    assert_pages_returned(engine)


def test_graphs_are_off_unless_asked_for_on_the_cpu(tiny_llama_dir):
    assert Engine(engine_config(tiny_llama_dir, attention_backend="torch")).runner.decode_graphs is None
    disabled = engine_config(tiny_llama_dir, attention_backend="torch", graphs_on_cpu=True, disable_cuda_graph=True)
    assert Engine(disabled).runner.decode_graphs is None


@pytest.mark.skipif(not triton_usable(torch.device("cpu")), reason="needs triton and TRITON_INTERPRET=1")
def test_triton_decode_graphs_equal_transformers(tiny_llama_dir, expected):
    engine = graphed_engine(tiny_llama_dir, attention_backend="triton")
    prompts = random_prompts(LENGTHS, 256)[:3]
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert [r.output_token_ids for r in engine.generate(prompts, short)] == [e[:4] for e in expected[:3]]
    assert engine.runner.decode_graphs.runner.replays[4] > 0


@pytest.mark.skipif(not triton_usable(torch.device("cpu")), reason="needs triton and TRITON_INTERPRET=1")
def test_flashinfer_decode_graphs_equal_transformers(tiny_llama_dir, expected, monkeypatch):
    """flashinfer's graph passes read a schedule that plan() wrote on the host before the
    replay (its stand-in here): every replay must be planned for its own batch."""
    module = serve_through_stand_in(monkeypatch)
    engine = graphed_engine(tiny_llama_dir)
    assert engine.runner.attention.name == "flashinfer"
    assert run_staggered(engine, random_prompts(LENGTHS, 256), GREEDY, every=2) == expected
    replays = engine.runner.decode_graphs.runner.replays
    assert replays[4] > 0 and replays[2] > 0 and replays[1] > 0
    graphed = [wrapper for wrapper in module.made if wrapper.use_cuda_graph]
    assert len(graphed) == 3  # one decode wrapper per rung, with fixed buffers
    assert sum(wrapper.plans for wrapper in graphed) >= sum(replays.values())


@pytest.mark.skipif(not triton_usable(torch.device("cpu")), reason="needs triton and TRITON_INTERPRET=1")
def test_control_a_graph_replayed_on_its_capture_plan_breaks_the_output(tiny_llama_dir, expected, monkeypatch):
    from eaglesrv.kernels.attention.flashinfer_paged import FlashinferGraphPlanner

    serve_through_stand_in(monkeypatch)
    original = FlashinferGraphPlanner._plan

    def plan_once(self, graph_pass, num_new, shape):  # the warm-up's plan, then never again
        if graph_pass.planned < 0:
            original(self, graph_pass, num_new, shape)
        graph_pass.planned = self.current.serial

    monkeypatch.setattr(FlashinferGraphPlanner, "_plan", plan_once)
    assert run_staggered(graphed_engine(tiny_llama_dir), random_prompts(LENGTHS, 256), GREEDY, every=2) != expected


def decode_work(request: int, page_table: list[int], num_cached: int, token: int) -> SequenceWork:
    return SequenceWork(f"r{request}", [token], num_cached, page_table, True, GREEDY, 0, [])


def test_padding_rows_write_only_the_padding_page_and_never_go_stale(tiny_llama_dir):
    engine = graphed_engine(tiny_llama_dir)
    runner, kv = engine.runner, engine.runner.kv
    g = torch.Generator().manual_seed(0)
    work = [decode_work(0, [3, 7], 5, 11), decode_work(1, [1], 2, 12), decode_work(2, [9, 4, 0], 10, 13),
            decode_work(3, [6, 2], 7, 14)]
    slots = [7 * 4 + 1, 1 * 4 + 2, 0 * 4 + 2, 2 * 4 + 3]  # each new token's slot
    padding = torch.arange(kv.padding_page * 4, (kv.padding_page + 1) * 4)

    def changed_slots(batch) -> tuple[set[int], set[int], torch.Tensor]:
        # Fresh contents each time: a stale row rewriting what it wrote before would show.
        kv.k.copy_(torch.randn(kv.k.shape, generator=g))
        kv.v.copy_(torch.randn(kv.v.shape, generator=g))
        before_k, before_v = kv.k.clone(), kv.v.clone()
        logits = runner.decode_graphs.logits(batch).clone()
        changed = ((kv.k != before_k) | (kv.v != before_v)).flatten(2).any(-1).any(0)  # [slots]
        written = set(changed.nonzero().flatten().tolist())
        return written - set(padding.tolist()), written & set(padding.tolist()), logits

    written, on_padding, _ = changed_slots(work)  # rung 4, no padding row: leaves 4 rows behind in the buffers
    assert written == set(slots) and not on_padding
    written, on_padding, logits = changed_slots(work[:3])  # rung 4 again, one padding row
    assert written == set(slots[:3])  # not request 3's slot, whatever the last batch left in row 4
    assert on_padding == {kv.padding_page * 4}  # the padding row's token, at position 0 of the padding page
    assert runner.decode_graphs.runner.replays[4] == 2
    assert torch.allclose(logits, eager_logits(runner, work[:3]), atol=1e-5)


def eager_logits(runner, batch) -> torch.Tensor:
    """The same decodes through the eager pass (spans planned on the host)."""
    spans = [SequenceSpan(seq.page_table, seq.num_cached, 1) for seq in batch]
    with torch.inference_mode():
        hidden, _ = runner.target_pass([seq.token_ids[0] for seq in batch], [seq.num_cached for seq in batch], spans)
        return runner.target.compute_logits(hidden)


class _ReadsTheHost(TorchAttentionBackend):
    def uniform_metadata(self, block_table, num_cached, num_new, tree_mask=None):
        longest = int(num_cached.max())  # a host read: a graph would freeze it at capture
        return super().uniform_metadata(block_table[:, : longest // self.page_size + 1], num_cached, num_new,
                                        tree_mask)


def test_control_a_host_read_in_the_decode_step_is_refused_at_start_up(tiny_llama_dir, monkeypatch):
    from eaglesrv.engine import builder

    monkeypatch.setattr(builder, "select_attention_backend", lambda name, page, device, *_: _ReadsTheHost(page, device))
    with pytest.raises(GraphCaptureError, match="host sync during capture"):
        graphed_engine(tiny_llama_dir)

"""Graph capture and the graph runner (eaglesrv/engine/graphs), on the CPU stand-in.

Replay is compared with eager on inputs changed after capture, and the comparisons are
shown able to fail: a host value baked in at capture and padding rows left stale are both
caught, and a stand-in that merely re-ran the Python step would have missed the first.
"""

from __future__ import annotations

import pytest
import torch

from eaglesrv.engine.graphs import (
    CapturedGraph,
    CaptureMechanism,
    GraphCaptureError,
    GraphRunner,
    StaticInput,
    capture_mechanism_for,
    cuda_graph_batch_sizes,
    padded_batch_size,
)
from eaglesrv.engine.graphs.traced_capture import TracedGraphCapture
from eaglesrv.engine.sampler import draw_from_probs, request_uniforms

PAGE_SIZE, MAX_PAGES, NUM_PAGES, HIDDEN, VOCAB = 4, 3, 40, 8, 32
DUMMY_PAGE = 0  # reserved: padding rows read and write only here
MAX_BS = 8


class ToyPagedModel:
    """One decode step over a paged KV cache: embed, write K/V at each row's slot, attend
    over the row's pages, project to logits. The K/V write is what stale padding corrupts."""

    def __init__(self, device: str = "cpu"):
        gen = torch.Generator().manual_seed(0)
        self.embedding = torch.randn(VOCAB, HIDDEN, generator=gen).to(device)
        self.wq, self.wk, self.wv, self.wo = (torch.randn(HIDDEN, n, generator=gen).to(device) * 0.3
                                              for n in (HIDDEN, HIDDEN, HIDDEN, VOCAB))
        self.k_cache = torch.randn(NUM_PAGES * PAGE_SIZE, HIDDEN, generator=gen).to(device)
        self.v_cache = torch.randn(NUM_PAGES * PAGE_SIZE, HIDDEN, generator=gen).to(device)
        self.calls = 0  # Python-level calls: replays make none

    def step(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        self.calls += 1
        x = self.embedding[inputs["input_ids"]]
        self.k_cache.index_copy_(0, inputs["out_slot"], x @ self.wk)
        self.v_cache.index_copy_(0, inputs["out_slot"], x @ self.wv)
        page_table = inputs["page_table"]
        positions = torch.arange(page_table.shape[1] * PAGE_SIZE, device=x.device)
        slots = page_table[:, positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE  # [B, L]
        scores = torch.einsum("bh,blh->bl", x @ self.wq, self.k_cache[slots]) / HIDDEN**0.5
        scores = scores.masked_fill(positions[None, :] >= inputs["seq_lens"][:, None], float("-inf"))
        attended = torch.einsum("bl,blh->bh", scores.softmax(-1), self.v_cache[slots])
        return attended @ self.wo

    def live_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_cache[PAGE_SIZE:], self.v_cache[PAGE_SIZE:]  # all but the dummy page


TOY_INPUTS = {
    "input_ids": StaticInput((), torch.long, pad_value=0),
    "out_slot": StaticInput((), torch.long, pad_value=DUMMY_PAGE * PAGE_SIZE),
    "page_table": StaticInput((MAX_PAGES,), torch.long, pad_value=DUMMY_PAGE),
    "seq_lens": StaticInput((), torch.long, pad_value=1),
}


def random_batch(rows: int, gen: torch.Generator, columns: int = MAX_PAGES, pages: torch.Tensor | None = None):
    """Distinct live pages per request (never the dummy), a length within them, the last token's slot."""
    if pages is None:
        pages = torch.randperm(NUM_PAGES - 1, generator=gen)[: rows * columns] + 1
    page_table = pages.view(rows, columns)
    seq_lens = torch.randint(1, columns * PAGE_SIZE + 1, (rows,), generator=gen)
    last = seq_lens - 1
    out_slot = page_table.gather(1, (last // PAGE_SIZE)[:, None]).squeeze(1) * PAGE_SIZE + last % PAGE_SIZE
    return {"input_ids": torch.randint(0, VOCAB, (rows,), generator=gen), "out_slot": out_slot,
            "page_table": page_table, "seq_lens": seq_lens}


def assert_same_step(eager: ToyPagedModel, graphed: ToyPagedModel, ref: torch.Tensor, got: torch.Tensor) -> None:
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for graphed_kv, eager_kv in zip(graphed.live_kv(), eager.live_kv()):
        torch.testing.assert_close(graphed_kv, eager_kv, rtol=1e-5, atol=1e-5)


def toy_runner(model: ToyPagedModel, runner_class: type[GraphRunner] = GraphRunner, **kwargs) -> GraphRunner:
    runner = runner_class(model.step, TOY_INPUTS, MAX_BS, "cpu", **kwargs)
    runner.capture()
    return runner


# ---------------------------------------------------------------------------- the ladder


def test_ladder_follows_sglang_and_ends_at_the_maximum():
    assert cuda_graph_batch_sizes(1) == [1]
    assert cuda_graph_batch_sizes(6) == [1, 2, 4, 6]
    assert cuda_graph_batch_sizes(8) == [1, 2, 4, 8]
    assert cuda_graph_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert cuda_graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert cuda_graph_batch_sizes(160)[-3:] == [144, 152, 160]
    with pytest.raises(ValueError):
        cuda_graph_batch_sizes(0)


def test_batches_pad_to_the_next_rung_and_none_above_the_top():
    ladder = cuda_graph_batch_sizes(32)
    assert [padded_batch_size(ladder, n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 31, 32)] == \
        [1, 2, 4, 4, 8, 8, 16, 16, 24, 32, 32]
    assert padded_batch_size(ladder, 33) is None


# ---------------------------------------------------------------------------- the runner


def test_replay_equals_eager_at_every_batch_size_on_and_between_rungs():
    gen = torch.Generator().manual_seed(1)
    eager, graphed = ToyPagedModel(), ToyPagedModel()
    runner = toy_runner(graphed)
    assert sorted(runner.graphs) == [1, 2, 4, 8]
    calls_after_capture = graphed.calls
    for rows in [1, 2, 3, 4, 5, 6, 7, 8, 3, 8, 1]:  # a smaller batch after a larger one leaves rows to re-pad
        batch = random_batch(rows, gen)
        assert_same_step(eager, graphed, eager.step(batch), runner.run(batch))
    assert graphed.calls == calls_after_capture  # every one of them replayed a graph


def test_narrow_rows_are_padded_and_wide_rows_run_eagerly():
    gen = torch.Generator().manual_seed(2)
    eager, graphed = ToyPagedModel(), ToyPagedModel()
    runner = toy_runner(graphed)
    calls = graphed.calls
    full = random_batch(4, gen)
    assert_same_step(eager, graphed, eager.step(full), runner.run(full))
    narrow = random_batch(3, gen, columns=2)  # the third page-table column is the dummy page
    assert_same_step(eager, graphed, eager.step(narrow), runner.run(narrow))
    # Masking hides what the third column holds here; a kernel that walks whole rows would not.
    assert runner.static_inputs["page_table"][:4, 2].tolist() == [DUMMY_PAGE] * 4
    assert graphed.calls == calls
    wide = random_batch(2, gen, columns=MAX_PAGES + 1)  # longer than the graphs were captured for
    assert_same_step(eager, graphed, eager.step(wide), runner.run(wide))
    assert graphed.calls == calls + 1


def test_batches_above_the_top_rung_run_eagerly():
    gen = torch.Generator().manual_seed(3)
    eager, graphed = ToyPagedModel(), ToyPagedModel()
    runner = toy_runner(graphed)
    for rows in (MAX_BS + 1, 12):
        calls = graphed.calls
        batch = random_batch(rows, gen)
        assert runner.padded_batch_size(rows) is None
        assert_same_step(eager, graphed, eager.step(batch), runner.run(batch))
        assert graphed.calls == calls + 1


def test_disabled_runner_captures_nothing_and_runs_eagerly():
    gen = torch.Generator().manual_seed(4)
    eager, graphed = ToyPagedModel(), ToyPagedModel()
    runner = toy_runner(graphed, disabled=True)
    assert runner.graphs == {} and runner.mechanism is None and graphed.calls == 0
    for rows in (1, 3, 8):
        batch = random_batch(rows, gen)
        assert_same_step(eager, graphed, eager.step(batch), runner.run(batch))
    assert graphed.calls == 3


def test_replay_outputs_are_static_and_overwritten_by_the_next_replay():
    gen = torch.Generator().manual_seed(5)
    runner = toy_runner(ToyPagedModel())
    first = runner.run(random_batch(4, gen))
    kept = first.clone()
    runner.run(random_batch(4, gen))
    assert not torch.equal(first, kept)  # the engine must consume (or clone) outputs before the next step


def test_inputs_are_checked():
    gen = torch.Generator().manual_seed(6)
    runner = toy_runner(ToyPagedModel())
    batch = random_batch(2, gen)
    with pytest.raises(ValueError, match="differ from the declared"):
        runner.run({k: v for k, v in batch.items() if k != "seq_lens"})
    with pytest.raises(ValueError, match="disagree on the batch size"):
        runner.run({**batch, "seq_lens": batch["seq_lens"][:1]})
    with pytest.raises(ValueError, match="leading dimension is the batch"):
        GraphRunner(lambda inputs: inputs["seq_lens"].sum(), TOY_INPUTS, 2, "cpu").capture()
    with pytest.raises(ValueError, match="must ascend"):
        GraphRunner(ToyPagedModel().step, TOY_INPUTS, 4, "cpu", batch_sizes=[2, 8])


def test_a_runner_can_be_given_its_own_rungs():
    gen = torch.Generator().manual_seed(11)
    eager, graphed = ToyPagedModel(), ToyPagedModel()
    runner = toy_runner(graphed, batch_sizes=[2, 6])
    assert sorted(runner.graphs) == [2, 6] and runner.static_inputs["seq_lens"].shape == (6,)
    assert [runner.padded_batch_size(n) for n in (1, 2, 3, 6, 7)] == [2, 2, 6, 6, None]
    for rows in (1, 5, 7):
        batch = random_batch(rows, gen)
        assert_same_step(eager, graphed, eager.step(batch), runner.run(batch))


def test_the_mechanism_is_chosen_by_device():
    assert isinstance(capture_mechanism_for("cpu"), TracedGraphCapture)
    with pytest.raises(ValueError, match="no graph capture for device meta"):
        capture_mechanism_for("meta")


# ---------------------------------------------------------------------------- negative controls


def test_control_a_host_read_of_a_tensor_is_refused_at_capture():
    def step_sizing_by_max_length(inputs):
        int(inputs["seq_lens"].max())  # host sync: a graph would freeze the first batch's value
        return ToyPagedModel.step(model, inputs)

    model = ToyPagedModel()
    runner = GraphRunner(step_sizing_by_max_length, TOY_INPUTS, MAX_BS, "cpu")
    with pytest.raises(GraphCaptureError, match=r"int\(tensor\)"):
        runner.capture()


class _TemperatureModel(ToyPagedModel):
    temperature = 1.0  # host state read as a Python float: frozen at capture

    def step(self, inputs):
        return super().step(inputs) / self.temperature


class _ReRunPythonGraph(CapturedGraph):
    def __init__(self, step):
        super().__init__(step())
        self.step = step

    def replay(self):
        self.outputs.copy_(self.step())


class _ReRunPythonCapture(CaptureMechanism):
    """A naive stand-in: replay calls the Python step again, so nothing is ever frozen."""

    def __init__(self):
        super().__init__(warmup_runs=0)

    def capture(self, step):
        return _ReRunPythonGraph(step)


@pytest.mark.parametrize("mechanism, caught", [(TracedGraphCapture, True), (_ReRunPythonCapture, False)])
def test_control_b_a_python_value_baked_at_capture_is_caught_by_comparing_with_eager(mechanism, caught):
    gen = torch.Generator().manual_seed(7)
    eager, graphed = _TemperatureModel(), _TemperatureModel()
    runner = toy_runner(graphed, mechanism=mechanism())
    batch = random_batch(4, gen)
    assert_same_step(eager, graphed, eager.step(batch), runner.run(batch))
    eager.temperature = graphed.temperature = 0.5  # eager honours it; a real graph cannot
    batch = random_batch(4, gen)
    ref, got = eager.step(batch), runner.run(batch)
    if caught:
        with pytest.raises(AssertionError):
            assert_same_step(eager, graphed, ref, got)
    else:  # why the stand-in records ops: re-running Python hides the bug a GPU would show
        assert_same_step(eager, graphed, ref, got)


class _StalePaddingRunner(GraphRunner):
    def _write_padding_rows(self, batch_size: int, bs: int) -> None:
        pass  # the bug: padding rows keep what the previous batch left there


@pytest.mark.parametrize("runner_class, caught", [(_StalePaddingRunner, True), (GraphRunner, False)])
def test_control_c_stale_padding_is_caught_by_comparing_with_eager(runner_class, caught):
    """Four requests step; the fourth finishes and a new request gets its pages and fills
    them (a prefill); the next batch has three requests, so row 3 is padding. Left stale,
    it writes the finished request's K/V into the new request's page."""
    gen = torch.Generator().manual_seed(8)
    eager, graphed = ToyPagedModel(), ToyPagedModel()
    runner = toy_runner(graphed, runner_class=runner_class)
    first = random_batch(4, gen)
    assert_same_step(eager, graphed, eager.step(first), runner.run(first))
    freed = first["page_table"][3]
    prefill = torch.randn(MAX_PAGES * PAGE_SIZE, HIDDEN, generator=gen)
    for model in (eager, graphed):
        slots = (freed[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)).flatten()
        model.k_cache[slots] = prefill
        model.v_cache[slots] = prefill
    live = first["page_table"][:2].flatten()
    second = random_batch(3, gen, pages=torch.cat([live, freed]))
    ref, got = eager.step(second), runner.run(second)
    if caught:
        with pytest.raises(AssertionError):
            assert_same_step(eager, graphed, ref, got)
    else:
        assert_same_step(eager, graphed, ref, got)


# ---------------------------------------------------------------------------- refusals


REFUSED = [
    ("item", lambda x: x[0].item(), r"\.item\(\)"),
    ("tolist", lambda x: x.tolist(), r"\.tolist\(\)"),
    ("if tensor", lambda x: 1 if x.sum() > 0 else 0, r"bool\(tensor\)"),
    ("float", lambda x: float(x.max()), r"float\(tensor\)"),
    ("cpu", lambda x: x.cpu(), r"\.cpu\(\)"),
    ("numpy", lambda x: x.numpy(), r"\.numpy\(\)"),
    ("equal", lambda x: torch.equal(x, x), "host sync.*aten.equal"),
    ("nonzero", lambda x: x.nonzero(), "data-dependent output shape.*aten.nonzero"),
    ("mask index", lambda x: x[x > 0], "boolean-mask indexing"),
    ("mask assign", lambda x: x.clone().__setitem__(x > 0, 0.0), "boolean-mask indexing"),
    ("unique", lambda x: torch.unique(x), "data-dependent output shape.*unique"),
    ("repeat_interleave", lambda x: torch.repeat_interleave(torch.tensor([1, 2])), "aten.repeat_interleave"),
    ("rand", lambda x: x + torch.rand(4), "random-number op.*aten.rand"),
    ("randn_like", lambda x: torch.randn_like(x), "random-number op.*aten.randn_like"),
    ("multinomial", lambda x: torch.multinomial(x.abs() + 0.1, 1), "random-number op.*aten.multinomial"),
    ("dropout", lambda x: torch.nn.functional.dropout(x, 0.5, training=True), "random-number op.*bernoulli"),
    ("attention dropout", lambda x: torch.nn.functional.scaled_dot_product_attention(*[x.view(1, 2, 2)] * 3,
                                                                                     dropout_p=0.5),
     "random-number op"),
]


@pytest.mark.parametrize("name, fn, message", REFUSED, ids=[r[0] for r in REFUSED])
def test_the_stand_in_refuses_what_a_graph_cannot_hold(name, fn, message):
    x = torch.randn(4)
    with pytest.raises(GraphCaptureError, match=message):
        TracedGraphCapture(warmup_runs=0).capture(lambda: fn(x))


ALLOWED = [
    ("dropout off", lambda x: torch.nn.functional.dropout(x, 0.5, training=False) * 2),
    ("attention", lambda x: torch.nn.functional.scaled_dot_product_attention(*[x.view(1, 2, 2)] * 3)),
    ("integer index", lambda x: x[torch.tensor([3, 0])]),
    ("repeat with size", lambda x: torch.repeat_interleave(x[:2], torch.tensor([1, 2]), output_size=3)),
    ("masked_fill", lambda x: x.masked_fill(x > 0, 0.0)),
]


@pytest.mark.parametrize("name, fn", ALLOWED, ids=[a[0] for a in ALLOWED])
def test_the_stand_in_allows_graph_safe_lookalikes(name, fn):
    x = torch.randn(4)
    graph = TracedGraphCapture(warmup_runs=0).capture(lambda: fn(x))
    x.copy_(torch.randn(4))
    graph.replay()
    torch.testing.assert_close(graph.outputs, fn(x))


# ---------------------------------------------------------------------------- custom ops


@torch.library.custom_op("eaglesrv_test::gather_scaled", mutates_args=())
def gather_scaled(table: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    return table.index_select(0, rows) * scale


@torch.library.custom_op("eaglesrv_test::write_rows", mutates_args=("cache",))
def write_rows(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    cache.index_copy_(0, slots, values)


def test_a_custom_op_is_recorded_as_one_op_and_replayed():
    table, rows = torch.randn(10, 3), torch.tensor([4, 1])
    cache, slots = torch.zeros(6, 3), torch.tensor([0, 5])

    def step():
        gathered = gather_scaled(table, rows, 2.0)
        write_rows(cache, slots, gathered + 1)
        return gathered

    graph = TracedGraphCapture(warmup_runs=0).capture(step)
    names = [str(op) for op in graph.recorded_ops]
    assert names.count("eaglesrv_test.gather_scaled.default") == 1
    assert names.count("eaglesrv_test.write_rows.default") == 1
    assert not any("index_select" in n or "index_copy" in n for n in names)  # its body runs unrecorded
    table.copy_(torch.randn(10, 3))
    rows.copy_(torch.tensor([7, 2]))
    slots.copy_(torch.tensor([3, 2]))
    cache.zero_()
    graph.replay()
    expected = table[[7, 2]] * 2.0
    torch.testing.assert_close(graph.outputs, expected)
    torch.testing.assert_close(cache[[3, 2]], expected + 1)
    assert cache[[0, 1, 4, 5]].abs().sum() == 0


# ---------------------------------------------------------------------------- sampling under a graph


def test_sampling_draws_from_uniforms_given_as_graph_inputs():
    """The design in the package doc: the host derives uniforms from (seed, step); the graph draws."""
    gen = torch.Generator().manual_seed(9)

    def sample_step(inputs):
        probs = (inputs["logits"] / inputs["temperature"][:, None]).softmax(-1)
        return draw_from_probs(probs, inputs["uniforms"])

    spec = {"logits": StaticInput((VOCAB,), torch.float32), "temperature": StaticInput((), torch.float32, 1.0),
            "uniforms": StaticInput((), torch.float64, 0.5)}
    runner = GraphRunner(sample_step, spec, 4, "cpu")
    runner.capture()
    for step_index, rows in enumerate((3, 4, 1)):
        inputs = {"logits": torch.randn(rows, VOCAB, generator=gen) * 3,
                  "temperature": torch.rand(rows, generator=gen) + 0.5,
                  "uniforms": torch.cat([request_uniforms(seed, step_index, 1) for seed in range(rows)])}
        assert torch.equal(runner.run(inputs), sample_step(inputs))


# ---------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replay_equals_eager():
    gen = torch.Generator().manual_seed(10)
    eager, graphed = ToyPagedModel("cuda"), ToyPagedModel("cuda")
    runner = GraphRunner(graphed.step, TOY_INPUTS, MAX_BS, "cuda")
    runner.capture()
    calls = graphed.calls
    for rows in [1, 3, 8, 5, 2]:
        batch = {k: v.cuda() for k, v in random_batch(rows, gen).items()}
        assert_same_step(eager, graphed, eager.step(batch), runner.run(batch))
    assert graphed.calls == calls

"""Runs a step through one captured graph per batch size, padding each batch up to its rung.

The step is a function of a dict of named input tensors whose leading dimension is the
batch, returning tensors (or a tuple, list or dict of them) with the same leading
dimension. The runner owns one static buffer per input, `[largest rung, *row_shape]`;
the graph for rung `bs` is captured on the first `bs` rows of every buffer, largest rung
first. `run(inputs)` copies the real rows in, writes every padding row with its input's
pad value, replays the rung's graph and returns the outputs cut to the real rows.

Pad values are chosen by the caller so padding rows are harmless: a reserved dummy KV
page or slot, so a padding row never reads or writes a live request's K/V, a length of 1,
a uniform of 0.5. Padding rows are rewritten on every run: what a previous, larger batch
left there would otherwise point into live requests. A real input may be narrower than
its buffer after the batch dimension (a page table with fewer columns): the rest of its
rows are padded too.

Batches larger than the largest rung, batches whose rows are wider than the buffers (a
page table longer than the graphs were captured for), and every batch when the runner is
disabled (`--disable-cuda-graph`) call the step eagerly on the inputs as given, so the
step must also work on unpadded inputs of any batch size.

A backend whose graph passes are scheduled on the host (flashinfer) gives the runner a
`UniformPlanner`: every run of the step, warm-up, capture, replay and eager alike, happens
inside one of its sessions, given the host copies of the inputs it names as the step sees
them (padded rows included). Inputs may arrive on the host or on the device; the runner
moves them.

Outputs of a replay are the graph's static tensors: the next `run` that replays the same
rung overwrites them, so consume or clone them first. The real rows are copied in
without blocking, on the current stream: a pinned host source must stay untouched until
the step's outputs have been read.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._pytree import tree_leaves, tree_map

from eaglesrv.engine.graphs.capture import CapturedGraph, CaptureMechanism, StepOutputs, capture_mechanism_for
from eaglesrv.engine.graphs.ladder import cuda_graph_batch_sizes, padded_batch_size
from eaglesrv.kernels.attention.base import UniformPlanner

Step = Callable[[dict[str, torch.Tensor]], StepOutputs]


@dataclass(frozen=True)
class StaticInput:
    """One named input of the step: the shape of one row, its dtype, what padding rows hold."""

    row_shape: tuple[int, ...]
    dtype: torch.dtype
    pad_value: int | float = 0


class GraphRunner:
    def __init__(
        self,
        step: Step,
        inputs: Mapping[str, StaticInput],
        max_batch_size: int,
        device: torch.device | str,
        *,
        disabled: bool = False,
        mechanism: CaptureMechanism | None = None,
        batch_sizes: Sequence[int] | None = None,
        planner: UniformPlanner | None = None,
    ):
        """`mechanism`: share one across runners to share its memory pool (default: one for
        `device`). `batch_sizes`: the rungs, ascending, none above `max_batch_size`
        (default: the standard ladder up to `max_batch_size`). `planner`: the attention
        backend's, when it has one (`AttentionBackend.uniform_planner`)."""
        self.step = step
        self.planner = planner
        self.inputs = dict(inputs)
        self.device = torch.device(device)
        self.disabled = disabled
        if batch_sizes is None:
            batch_sizes = cuda_graph_batch_sizes(max_batch_size)
        elif not _ascending_within(list(batch_sizes), max_batch_size):
            raise ValueError(f"batch sizes must ascend from 1 or more to at most {max_batch_size}, got {batch_sizes}")
        self.batch_sizes = [] if disabled else list(batch_sizes)
        self.mechanism = None if disabled else (mechanism or capture_mechanism_for(self.device))
        rows = self.batch_sizes[-1] if self.batch_sizes else 0
        self.static_inputs = {
            name: torch.full((rows, *spec.row_shape), spec.pad_value, dtype=spec.dtype, device=self.device)
            for name, spec in self.inputs.items()
        }
        self.graphs: dict[int, CapturedGraph] = {}
        self.replays: Counter[int] = Counter()  # rung -> graph replays; eager runs are not counted

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per rung, largest first (smaller graphs reuse the largest one's memory)."""
        for bs in reversed(self.batch_sizes):
            rows = self._rows(bs)
            with self._session({name: tensor.cpu() for name, tensor in rows.items()}, rows, graphed=True):
                graph = self.mechanism.capture(lambda rows=rows: self.step(rows))
            self._check_outputs(graph.outputs, bs)
            self.graphs[bs] = graph

    def padded_batch_size(self, batch_size: int) -> int | None:
        """The rung a batch of this size replays, or None when it runs eagerly."""
        return None if self.disabled else padded_batch_size(self.batch_sizes, batch_size)

    @torch.inference_mode()
    def run(self, inputs: Mapping[str, torch.Tensor]) -> StepOutputs:
        batch_size = self._batch_size_of(inputs)
        bs = self.padded_batch_size(batch_size)
        if bs is None or not self._rows_fit(inputs):
            step_inputs = {name: tensor.to(self.device) for name, tensor in inputs.items()}
            with self._session(inputs, step_inputs, graphed=False):
                return self.step(step_inputs)
        if bs not in self.graphs:
            raise RuntimeError("GraphRunner.run before capture(): capture the graphs at start-up")
        self._load_real_rows(inputs, batch_size)
        self._write_padding_rows(batch_size, bs)
        graph = self.graphs[bs]
        with self._session(self._padded_host_inputs(inputs, bs), self._rows(bs), graphed=True):
            graph.replay()
        self.replays[bs] += 1
        return tree_map(lambda out: out[:batch_size], graph.outputs)

    def _session(self, host: Mapping[str, torch.Tensor], step_inputs: Mapping[str, torch.Tensor], graphed: bool):
        if self.planner is None:
            return nullcontext()
        return self.planner.session({name: host[name].cpu() for name in self.planner.input_names}, step_inputs,
                                    graphed)

    def _padded_host_inputs(self, inputs: Mapping[str, torch.Tensor], bs: int) -> dict[str, torch.Tensor]:
        """The planner's inputs as the graph of rung `bs` sees them, on the host."""
        if self.planner is None:
            return {}
        padded = {}
        for name in self.planner.input_names:
            spec, real = self.inputs[name], inputs[name]
            padded[name] = torch.full((bs, *spec.row_shape), spec.pad_value, dtype=spec.dtype)
            padded[name][tuple(slice(0, size) for size in real.shape)] = real.cpu()
        return padded

    def _rows(self, bs: int) -> dict[str, torch.Tensor]:
        return {name: buffer[:bs] for name, buffer in self.static_inputs.items()}

    def _load_real_rows(self, inputs: Mapping[str, torch.Tensor], batch_size: int) -> None:
        for name, buffer in self.static_inputs.items():
            real = inputs[name]
            rows = buffer[:batch_size]
            if real.shape[1:] != rows.shape[1:]:
                rows.fill_(self.inputs[name].pad_value)  # the part of each real row the input leaves out
                rows = rows[tuple(slice(0, size) for size in real.shape)]
            rows.copy_(real, non_blocking=True)

    def _write_padding_rows(self, batch_size: int, bs: int) -> None:
        for name, buffer in self.static_inputs.items():
            buffer[batch_size:bs].fill_(self.inputs[name].pad_value)

    def _batch_size_of(self, inputs: Mapping[str, torch.Tensor]) -> int:
        if inputs.keys() != self.inputs.keys():
            raise ValueError(f"step inputs {sorted(inputs)} differ from the declared {sorted(self.inputs)}")
        sizes = {name: tensor.shape[0] for name, tensor in inputs.items()}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"inputs disagree on the batch size: {sizes}")
        for name, tensor in inputs.items():
            if tensor.dim() != len(self.inputs[name].row_shape) + 1:
                raise ValueError(f"input {name!r} has rows of shape {tuple(tensor.shape[1:])}; "
                                 f"declared {self.inputs[name].row_shape}")
        return next(iter(sizes.values()))

    def _rows_fit(self, inputs: Mapping[str, torch.Tensor]) -> bool:
        return all(
            real <= held for name, tensor in inputs.items()
            for real, held in zip(tensor.shape[1:], self.inputs[name].row_shape)
        )

    @staticmethod
    def _check_outputs(outputs: StepOutputs, bs: int) -> None:
        for leaf in tree_leaves(outputs):
            if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0 or leaf.shape[0] != bs:
                shape = tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else type(leaf).__name__
                raise ValueError(f"a graphed step returns tensors whose leading dimension is the batch ({bs}); "
                                 f"got {shape}")


def _ascending_within(sizes: list[int], largest: int) -> bool:
    return bool(sizes) and sizes == sorted(set(sizes)) and 1 <= sizes[0] and sizes[-1] <= largest

"""A CPU stand-in for CUDA graphs that keeps their semantics, so graph code is tested without a GPU.

Capture runs the step once under a `TorchDispatchMode` that records every op that reaches
the dispatcher (aten ops and `torch.library.custom_op`s; a custom op is recorded as one op,
its Python body runs unrecorded, as a kernel launch would be captured). Replay re-runs
exactly the recorded ops on the same tensors and writes each result into the tensor the
capture produced, so later ops, and the caller, see the new values in the same tensors.
What the step decided in Python during capture (branches, Python scalars, shapes, host
state) stays frozen, as it does in a CUDA graph. A stand-in that re-ran the Python step
instead would hide exactly the bugs graphs cause.

The stand-in refuses what a real capture cannot hold (`graph_safety.py`) with an error
naming the op. It cannot see what only a GPU shows: illegal addresses, races, syncs outside
torch, library behaviour inside capture, pool reuse, speed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from eaglesrv.engine.graphs.capture import CapturedGraph, CaptureMechanism, GraphCaptureError, StepOutputs
from eaglesrv.engine.graphs.graph_safety import host_read_refusal, op_refusal


@dataclass
class RecordedOp:
    func: torch._ops.OpOverload
    args: tuple
    kwargs: dict
    result: Any  # what the capture produced: replay writes new values into these tensors

    def rerun(self) -> None:
        fresh = self.func(*self.args, **self.kwargs)
        for captured, new in zip(tree_leaves(self.result), tree_leaves(fresh)):
            # In-place ops and views return the captured tensor's memory again: nothing to copy.
            if isinstance(captured, torch.Tensor) and new.data_ptr() != captured.data_ptr():
                captured.copy_(new)


class TracedGraph(CapturedGraph):
    def __init__(self, ops: list[RecordedOp], outputs: StepOutputs, grad_enabled: bool, inference_mode: bool):
        super().__init__(outputs)
        self.ops = ops
        self._grad_enabled = grad_enabled
        self._inference_mode = inference_mode

    @property
    def recorded_ops(self) -> list[torch._ops.OpOverload]:
        return [op.func for op in self.ops]

    def replay(self) -> None:
        # The grad mode of the capture: in-place ops on inference tensors need inference mode.
        with torch.inference_mode(self._inference_mode), torch.set_grad_enabled(self._grad_enabled):
            for op in self.ops:
                op.rerun()


class TracedGraphCapture(CaptureMechanism):
    """No memory pool to share on the CPU: a graph keeps its own intermediates alive."""

    def __init__(self, warmup_runs: int = 1):
        super().__init__(warmup_runs)

    def capture(self, step: Callable[[], StepOutputs]) -> TracedGraph:
        for _ in range(self.warmup_runs):
            step()
        ops: list[RecordedOp] = []
        with _RefuseHostReads(), _RecordOps(ops):
            outputs = step()
        return TracedGraph(ops, outputs, torch.is_grad_enabled(), torch.is_inference_mode_enabled())


class _RecordOps(TorchDispatchMode):
    def __init__(self, ops: list[RecordedOp]):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = op_refusal(func, args, kwargs)
        if reason is not None:
            raise GraphCaptureError(reason)
        result = func(*args, **kwargs)
        self.ops.append(RecordedOp(func, args, kwargs, result))
        return result


class _RefuseHostReads(TorchFunctionMode):
    """Host reads that never reach the dispatcher on the CPU (`.tolist()`, `.cpu()`) are caught here."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        reason = host_read_refusal(func)
        if reason is not None:
            raise GraphCaptureError(reason)
        return func(*args, **(kwargs or {}))

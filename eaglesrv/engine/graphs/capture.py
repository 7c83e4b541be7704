"""The capture mechanism's interface: capture a step once on static tensors, replay it.

A mechanism makes graphs for one device. Every graph it makes shares its memory (the CUDA
graph pool), so one mechanism serves a whole batch-size ladder, and several runners (one
per tree shape, say) can share one mechanism.

A captured graph has CUDA-graph semantics on every device: `replay()` re-runs the tensor
work that the capture recorded on the same tensors, and writes the same output tensors.
Python control flow, Python scalars and shapes are frozen at capture; new inputs reach a
graph only by being copied into the tensors it was captured on.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

import torch

# A tensor or a (nested) tuple, list or dict of tensors.
StepOutputs = Any


class GraphCaptureError(RuntimeError):
    """A step did something a graph cannot hold (a host sync, a data-dependent shape, an RNG op)."""


class CapturedGraph(ABC):
    """One captured run of a step."""

    def __init__(self, outputs: StepOutputs):
        # Static: every replay overwrites these same tensors, so a caller consumes or clones
        # them before the next replay of this graph.
        self.outputs = outputs

    @abstractmethod
    def replay(self) -> None:
        """Re-run the captured work on the tensors it was captured on."""


class CaptureMechanism(ABC):
    """Makes captured graphs for one device; the graphs it makes share its memory."""

    def __init__(self, warmup_runs: int):
        # Warm-up runs happen eagerly before each capture (lazy initialisation, autotuning,
        # library workspaces must not happen inside a capture).
        self.warmup_runs = warmup_runs

    @abstractmethod
    def capture(self, step: Callable[[], StepOutputs]) -> CapturedGraph:
        """Warm `step` up, then capture one run of it."""


def capture_mechanism_for(device: torch.device | str) -> CaptureMechanism:
    """CUDA graphs on a CUDA device; on the CPU the recording stand-in with the same semantics."""
    device = torch.device(device)
    if device.type == "cuda":
        from eaglesrv.engine.graphs.cuda_capture import CudaGraphCapture

        return CudaGraphCapture(device)
    if device.type == "cpu":
        from eaglesrv.engine.graphs.traced_capture import TracedGraphCapture

        return TracedGraphCapture()
    raise ValueError(f"no graph capture for device {device}; run it with graphs disabled")

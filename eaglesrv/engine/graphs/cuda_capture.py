"""Capture over `torch.cuda.CUDAGraph`, the usual way.

Warm-up runs on a side stream (so lazy initialisation and library workspaces happen
outside the capture, and not on the stream the engine is using), then the capture runs on
that same stream with one memory pool shared by every graph this mechanism makes. Capture
the largest batch first: smaller graphs then fit inside the memory the largest one freed.
"""

from __future__ import annotations

from typing import Callable

import torch

from eaglesrv.engine.graphs.capture import CapturedGraph, CaptureMechanism, StepOutputs


class CudaGraph(CapturedGraph):
    def __init__(self, graph: torch.cuda.CUDAGraph, outputs: StepOutputs):
        super().__init__(outputs)
        self.graph = graph

    def replay(self) -> None:
        self.graph.replay()


class CudaGraphCapture(CaptureMechanism):
    def __init__(self, device: torch.device, warmup_runs: int = 2):
        super().__init__(warmup_runs)
        self.device = device
        with torch.cuda.device(device):
            self.stream = torch.cuda.Stream(device)
            self.pool = torch.cuda.graph_pool_handle()

    def capture(self, step: Callable[[], StepOutputs]) -> CudaGraph:
        with torch.cuda.device(self.device):
            current = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(current)
            with torch.cuda.stream(self.stream):
                for _ in range(self.warmup_runs):
                    step()
            current.wait_stream(self.stream)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            # The same stream for every capture: the pool is only shared across captures on one stream.
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                outputs = step()
            torch.cuda.synchronize(self.device)
        return CudaGraph(graph, outputs)

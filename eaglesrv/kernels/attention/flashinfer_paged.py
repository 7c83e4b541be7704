"""The flashinfer backend: flashinfer's paged attention kernels on CUDA.

flashinfer is imported when the backend is created, never at package import: it does not
import on a machine without a GPU. Its CPU-side tests run the same code against a stand-in
module whose wrappers compute from flashinfer's arguments alone (tests/flashinfer_oracle.py).

A pass planned on the host (`plan(spans)`: prefill chunks, extends, mixed steps, eager
decodes and trees) runs on one of flashinfer's batch wrappers over the paged cache:
- every sequence adds one token, no mask: the decode wrapper (tensor cores for grouped
  queries of 4 or more per KV head, as flashinfer advises);
- otherwise the prefill wrapper, causal, or under one custom mask for the whole batch when
  any span has a tree (flashinfer_plan.py builds the arguments).
A wrapper's plan() needs the head counts, dtype and scale, which only the first layer's
call sees, so a pass is planned there, once per wrapper and head shape; every other layer
reuses it. The wrappers are the backend's, and `_planned` records which pass each one
holds, so passes may be planned in any order and run in any order (a target pass and a
draft pass of one EAGLE-3 step): a wrapper holding another pass is planned again.

In graphs. flashinfer's plan() reads its inputs on the host, so it cannot run inside a
graph; its wrappers have a graph mode instead, in which plan() fills fixed device buffers
that the captured kernels read. Each graphed step has a planner (`uniform_planner`, held by
its GraphRunner) that opens a session around every run of the step, given the host copies
of its block table and cached lengths as the step sees them:

    session(host block table, host cached lengths)   warm-up, capture, eager run, replay
      uniform_metadata(the step's block table, its cached lengths, n)  no mask: a flashinfer pass
      forward() (warm-up, eager)   plans the pass's wrapper for this session, once per head shape
      replay                        every pass of the graph was planned when the session opened

A graph pass has its own wrapper with fixed buffers per (rows, tokens per row, head shape):
the decode wrapper for a decode step, the prefill wrapper (causal) for the draft extend.
Passes under a tree mask (draft passes, verification) and passes built from other cached
lengths run on the Triton kernels, whose metadata is built on the device: a flashinfer
mask spans every key of a sequence, so its size would follow the context length.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from eaglesrv.kernels.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    SequenceSpan,
    UniformPlanner,
    token_slots,
    uniform_positions,
)
from eaglesrv.kernels.attention.flashinfer_plan import FlashinferPlanInputs, flashinfer_plan_inputs, uniform_plan_inputs
from eaglesrv.kernels.attention.layout import PassLayout
from eaglesrv.kernels.attention.torch_ref import store_new_kv
from eaglesrv.kernels.triton_support import triton_usable

WORKSPACE_BYTES = 256 * 2**20  # flashinfer's scratch for split-KV partial results, shared by its wrappers
TENSOR_CORE_GROUP = 4  # query heads per KV head from which decode uses the tensor-core kernel


class HeadShape(NamedTuple):
    """What a wrapper's plan() needs beyond the indices; known at a pass's first layer."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    scale: float

    @classmethod
    def of(cls, q: torch.Tensor, k_cache: torch.Tensor, scale: float) -> "HeadShape":
        return cls(q.shape[1], k_cache.shape[1], q.shape[2], q.dtype, k_cache.dtype, scale)


@dataclass
class FlashinferMetadata(AttentionMetadata):
    """A pass planned on the host."""

    inputs: FlashinferPlanInputs  # on the host: plan() reads them there
    custom_mask: torch.Tensor | None  # inputs.custom_mask on the device
    new_slots: torch.Tensor  # [num_tokens] int64 cache slot of each new token, on the device
    serial: int  # which pass this is, for the wrappers' record of what they hold


@dataclass
class FlashinferGraphMetadata(AttentionMetadata):
    """A graph pass: served by its planner's session."""

    planner: "FlashinferGraphPlanner"
    rows: int
    num_new: int
    new_slots: torch.Tensor  # [rows * num_new] int64, built on the device


class FlashinferAttentionBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(self, page_size: int, device: torch.device, module: Any = None,
                 workspace_bytes: int = WORKSPACE_BYTES) -> None:
        """`module`: flashinfer itself unless given (the tests pass a stand-in)."""
        super().__init__(page_size, device)
        self.flashinfer = module if module is not None else import_flashinfer()
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self._wrappers: dict[tuple, Any] = {}
        self._planned: dict[tuple, tuple] = {}  # wrapper key -> the (pass, head shape) it was planned for
        self.pass_serials = itertools.count()  # numbers host-planned passes
        self.session: FlashinferGraphPlanner | None = None  # the planner whose session is open
        self.masked = None  # graph passes under a mask: Triton's device-built metadata and kernels
        if triton_usable(device):
            from eaglesrv.kernels.attention.triton_paged import TritonAttentionBackend

            self.masked = TritonAttentionBackend(page_size, device)
        self.graph_safe = self.masked is not None

    def plan(self, spans: list[SequenceSpan]) -> FlashinferMetadata:
        layout = PassLayout.of(spans, self.page_size)
        inputs = flashinfer_plan_inputs(layout)
        mask = None if inputs.custom_mask is None else inputs.custom_mask.to(self.device)
        return FlashinferMetadata(inputs, mask, layout.new_slots.to(self.device), next(self.pass_serials))

    def uniform_planner(self) -> "FlashinferGraphPlanner":
        return FlashinferGraphPlanner(self)

    def uniform_metadata(self, block_table, num_cached, num_new, tree_mask=None):
        planner = self.session
        if tree_mask is None and planner is not None and planner.serves(block_table, num_cached):
            slots = token_slots(block_table, uniform_positions(num_cached, num_new), self.page_size).reshape(-1)
            return planner.metadata(num_new, slots)
        if self.masked is None:
            return super().uniform_metadata(block_table, num_cached, num_new, tree_mask)
        return self.masked.uniform_metadata(block_table, num_cached, num_new, tree_mask)

    def decode_workspace_bytes(self, num_seqs, max_keys, num_kv_heads, head_dim, dtype) -> int:
        return self.workspace.numel()

    def forward(self, q, k, v, k_cache, v_cache, metadata, scale: float):
        if isinstance(metadata, FlashinferMetadata):
            wrapper = self._eager_wrapper(metadata, HeadShape.of(q, k_cache, scale))
        elif isinstance(metadata, FlashinferGraphMetadata):
            wrapper = metadata.planner.planned_wrapper(metadata, HeadShape.of(q, k_cache, scale))
        else:
            return self.masked.forward(q, k, v, k_cache, v_cache, metadata, scale)
        store_new_kv(k, v, k_cache, v_cache, metadata.new_slots)
        if q.shape[0] == 0:
            return torch.empty_like(q)
        pages = tuple(cache.view(-1, self.page_size, *cache.shape[1:]) for cache in (k_cache, v_cache))
        return wrapper.run(q.contiguous(), pages)

    def _eager_wrapper(self, metadata: FlashinferMetadata, shape: HeadShape):
        decode = metadata.inputs.decode_only
        key = ("decode", tensor_cores(shape)) if decode else ("prefill",)
        if key not in self._wrappers:
            self._wrappers[key] = self.new_wrapper(decode, shape)
        if self._planned.get(key) != (metadata.serial, shape):
            self.plan_wrapper(self._wrappers[key], metadata.inputs, metadata.custom_mask, shape, decode)
            self._planned[key] = (metadata.serial, shape)
        return self._wrappers[key]

    def new_wrapper(self, decode: bool, shape: HeadShape, graph_buffers: dict[str, torch.Tensor] | None = None):
        """A wrapper on the shared workspace; in graph mode over the given fixed buffers."""
        graph = {} if graph_buffers is None else {"use_cuda_graph": True, **graph_buffers}
        if decode:
            return self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=tensor_cores(shape), **_decode_buffer_names(graph))
        return self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", **graph)

    def plan_wrapper(self, wrapper, inputs: FlashinferPlanInputs, custom_mask: torch.Tensor | None,
                     shape: HeadShape, decode: bool) -> None:
        dtypes = dict(sm_scale=shape.scale, q_data_type=shape.q_dtype, kv_data_type=shape.kv_dtype)
        heads = (shape.num_heads, shape.num_kv_heads, shape.head_dim, self.page_size)
        if decode:
            wrapper.plan(inputs.kv_indptr, inputs.kv_indices, inputs.kv_last_page_len, *heads, **dtypes)
        else:
            wrapper.plan(inputs.qo_indptr, inputs.kv_indptr, inputs.kv_indices, inputs.kv_last_page_len, *heads,
                         custom_mask=custom_mask, causal=custom_mask is None, **dtypes)


@dataclass
class _GraphPass:
    wrapper: Any
    planned: int = -1  # the session it was last planned in


@dataclass(frozen=True)
class _Session:
    serial: int
    block_table: torch.Tensor  # host copies, as the step sees them
    num_cached: torch.Tensor
    step_block_table: torch.Tensor  # the tensors the step receives
    step_num_cached: torch.Tensor
    graphed: bool  # a graph's run (its passes on graph-mode wrappers), or an eager one


class FlashinferGraphPlanner(UniformPlanner):
    """Plans one graphed step's flashinfer passes on the host, around every run of the step."""

    def __init__(self, backend: FlashinferAttentionBackend) -> None:
        self.backend = backend
        self.passes: dict[tuple[int, int, HeadShape], _GraphPass] = {}  # (rows, num_new, shape) -> its wrapper
        self._serials = itertools.count()
        self.current: _Session | None = None

    @contextmanager
    def session(self, host, step_inputs, graphed):
        if self.backend.session is not None:
            raise RuntimeError("a flashinfer planning session is already open")
        self.current = _Session(next(self._serials), host["block_table"], host["num_cached"],
                                step_inputs["block_table"], step_inputs["num_cached"], graphed)
        rows = len(self.current.num_cached)
        for (pass_rows, num_new, shape), graph_pass in self.passes.items():  # a replay runs them all
            if graphed and pass_rows == rows:
                self._plan(graph_pass, num_new, shape)
        self.backend.session = self
        try:
            yield
        finally:
            self.backend.session = self.current = None

    def serves(self, block_table: torch.Tensor, num_cached: torch.Tensor) -> bool:
        """Whether a pass over these tensors is the one the session's host copies describe."""
        session = self.current
        return session is not None and block_table is session.step_block_table and \
            num_cached is session.step_num_cached

    def metadata(self, num_new: int, new_slots: torch.Tensor) -> FlashinferGraphMetadata | FlashinferMetadata:
        """A pass of the open session: a graph pass, or in an eager run a pass planned like any other."""
        session = self.current
        if session.graphed:
            return FlashinferGraphMetadata(self, len(session.num_cached), num_new, new_slots)
        inputs = uniform_plan_inputs(session.block_table, session.num_cached, num_new, self.backend.page_size)
        return FlashinferMetadata(inputs, None, new_slots, next(self.backend.pass_serials))

    def planned_wrapper(self, metadata: FlashinferGraphMetadata, shape: HeadShape):
        """The pass's wrapper, planned for the open session (at its first layer, outside a capture)."""
        if self.current is None:
            raise RuntimeError("a flashinfer graph pass ran outside its planning session")
        key = (metadata.rows, metadata.num_new, shape)
        graph_pass = self.passes.get(key)
        if graph_pass is None:
            graph_pass = self.passes[key] = _GraphPass(self._new_wrapper(metadata.rows, metadata.num_new, shape))
        if graph_pass.planned != self.current.serial:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("a flashinfer graph pass was first seen inside a capture, not in its warm-up")
            self._plan(graph_pass, metadata.num_new, shape)
        return graph_pass.wrapper

    def _plan(self, graph_pass: _GraphPass, num_new: int, shape: HeadShape) -> None:
        session, backend = self.current, self.backend
        inputs = uniform_plan_inputs(session.block_table, session.num_cached, num_new, backend.page_size)
        backend.plan_wrapper(graph_pass.wrapper, inputs, None, shape, decode=num_new == 1)
        graph_pass.planned = session.serial

    def _new_wrapper(self, rows: int, num_new: int, shape: HeadShape):
        """A graph-mode wrapper whose index buffers hold any plan of `rows` sequences."""
        max_pages = self.current.block_table.shape[1]
        device = self.backend.device

        def buffer(size: int) -> torch.Tensor:
            return torch.zeros(size, dtype=torch.int32, device=device)

        buffers = {"qo_indptr_buf": buffer(rows + 1), "paged_kv_indptr_buf": buffer(rows + 1),
                   "paged_kv_indices_buf": buffer(rows * max_pages), "paged_kv_last_page_len_buf": buffer(rows)}
        return self.backend.new_wrapper(num_new == 1, shape, buffers)


def tensor_cores(shape: HeadShape) -> bool:
    return shape.num_heads // shape.num_kv_heads >= TENSOR_CORE_GROUP


def _decode_buffer_names(graph: dict[str, Any]) -> dict[str, Any]:
    """The decode wrapper's names for the same buffers (and no query indptr: one query per row)."""
    names = {"paged_kv_indptr_buf": "paged_kv_indptr_buffer", "paged_kv_indices_buf": "paged_kv_indices_buffer",
             "paged_kv_last_page_len_buf": "paged_kv_last_page_len_buffer", "use_cuda_graph": "use_cuda_graph"}
    return {names[key]: value for key, value in graph.items() if key in names}


def flashinfer_installed() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def import_flashinfer():
    try:
        return importlib.import_module("flashinfer")
    except Exception as error:  # ImportError, or flashinfer's own failure to find a GPU at import
        raise ValueError(f"the flashinfer attention backend cannot run: importing flashinfer failed "
                         f"({type(error).__name__}: {error}); pip install flashinfer-python, or choose another "
                         "--attention-backend") from error

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

A pass built on the device for a graph (`uniform_metadata`) runs on the Triton kernels,
which need no host planning; flashinfer's plan() reads its inputs on the host, so it
cannot run inside a graph, and graph replays with flashinfer's kernels (planned before
each replay, into fixed buffers per batch size) are not built yet.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
from dataclasses import dataclass
from typing import Any

import torch

from eaglesrv.kernels.attention.base import AttentionBackend, AttentionMetadata, SequenceSpan
from eaglesrv.kernels.attention.flashinfer_plan import FlashinferPlanInputs, flashinfer_plan_inputs
from eaglesrv.kernels.attention.layout import PassLayout
from eaglesrv.kernels.attention.torch_ref import store_new_kv
from eaglesrv.kernels.triton_support import triton_usable

WORKSPACE_BYTES = 256 * 2**20  # flashinfer's scratch for split-KV partial results, shared by its wrappers
TENSOR_CORE_GROUP = 4  # query heads per KV head from which decode uses the tensor-core kernel


@dataclass
class FlashinferMetadata(AttentionMetadata):
    inputs: FlashinferPlanInputs  # on the host: plan() reads them there
    custom_mask: torch.Tensor | None  # inputs.custom_mask on the device
    new_slots: torch.Tensor  # [num_tokens] int64 cache slot of each new token, on the device
    serial: int  # which pass this is, for the wrappers' record of what they hold


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
        self._serials = itertools.count()
        self.uniform = None  # the graphs' passes: Triton's device-built metadata and kernels
        if triton_usable(device):
            from eaglesrv.kernels.attention.triton_paged import TritonAttentionBackend

            self.uniform = TritonAttentionBackend(page_size, device)
        self.graph_safe = self.uniform is not None

    def plan(self, spans: list[SequenceSpan]) -> FlashinferMetadata:
        layout = PassLayout.of(spans, self.page_size)
        inputs = flashinfer_plan_inputs(layout)
        mask = None if inputs.custom_mask is None else inputs.custom_mask.to(self.device)
        return FlashinferMetadata(inputs, mask, layout.new_slots.to(self.device), next(self._serials))

    def uniform_metadata(self, block_table, num_cached, num_new, tree_mask=None):
        if self.uniform is None:
            return super().uniform_metadata(block_table, num_cached, num_new, tree_mask)
        return self.uniform.uniform_metadata(block_table, num_cached, num_new, tree_mask)

    def decode_workspace_bytes(self, num_seqs, max_keys, num_kv_heads, head_dim, dtype) -> int:
        return self.workspace.numel()

    def forward(self, q, k, v, k_cache, v_cache, metadata, scale: float):
        if not isinstance(metadata, FlashinferMetadata):
            return self.uniform.forward(q, k, v, k_cache, v_cache, metadata, scale)
        store_new_kv(k, v, k_cache, v_cache, metadata.new_slots)
        if q.shape[0] == 0:
            return torch.empty_like(q)
        wrapper = self._planned_wrapper(metadata, q, k_cache, scale)
        pages = (k_cache.view(-1, self.page_size, *k_cache.shape[1:]), v_cache.view(-1, self.page_size,
                                                                                      *v_cache.shape[1:]))
        return wrapper.run(q.contiguous(), pages)

    def _planned_wrapper(self, metadata: FlashinferMetadata, q: torch.Tensor, k_cache: torch.Tensor, scale: float):
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k_cache.shape[1]
        inputs = metadata.inputs
        tensor_cores = num_heads // num_kv_heads >= TENSOR_CORE_GROUP
        key = ("decode", tensor_cores) if inputs.decode_only else ("prefill",)
        wanted = (metadata.serial, num_heads, num_kv_heads, head_dim, q.dtype, k_cache.dtype, scale)
        wrapper = self._wrappers.get(key)
        if wrapper is None:
            wrapper = self._wrappers[key] = self._new_wrapper(key)
        if self._planned.get(key) == wanted:
            return wrapper
        dtypes = dict(sm_scale=scale, q_data_type=q.dtype, kv_data_type=k_cache.dtype)
        if inputs.decode_only:
            wrapper.plan(inputs.kv_indptr, inputs.kv_indices, inputs.kv_last_page_len, num_heads, num_kv_heads,
                         head_dim, self.page_size, **dtypes)
        else:
            wrapper.plan(inputs.qo_indptr, inputs.kv_indptr, inputs.kv_indices, inputs.kv_last_page_len, num_heads,
                         num_kv_heads, head_dim, self.page_size, custom_mask=metadata.custom_mask,
                         causal=metadata.custom_mask is None, **dtypes)
        self._planned[key] = wanted
        return wrapper

    def _new_wrapper(self, key: tuple):
        if key[0] == "decode":
            return self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=key[1])
        return self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")


def flashinfer_installed() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def import_flashinfer():
    try:
        return importlib.import_module("flashinfer")
    except Exception as error:  # ImportError, or flashinfer's own failure to find a GPU at import
        raise ValueError(f"the flashinfer attention backend cannot run: importing flashinfer failed "
                         f"({type(error).__name__}: {error}); pip install flashinfer-python, or choose another "
                         "--attention-backend") from error

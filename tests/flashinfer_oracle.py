"""A stand-in for the `flashinfer` module on a machine where it cannot import (no GPU).

Its two wrappers take the arguments of flashinfer 0.6.18's BatchPrefillWithPagedKVCacheWrapper
and BatchDecodeWithPagedKVCacheWrapper (the parameters eaglesrv passes, by the same names)
and compute attention from those arguments alone, the way flashinfer documents and its
kernels read them:
- plan() derives each sequence's key count from kv_indptr and kv_last_page_len, its mask
  offset in bits from qo and kv lengths (num_new * kv_len per sequence), and packs the custom
  mask per sequence little-endian, each part starting on a byte (numpy.packbits per segment,
  as flashinfer's segment_packbits is documented to);
- run() reads the NHD pages [pages, page_size, kv_heads, head_dim] through kv_indices, and
  the mask bit by bit from the packed bytes at the byte offsets, as flashinfer's kernel does
  (`mask[offset / 8] >> (offset % 8) & 1`, offset = query * kv_len + key);
- in graph mode (`use_cuda_graph`) plan() writes the schedule into the fixed buffers given
  at construction, and a captured run() reads whatever the latest plan() left there;
- causal is bottom-right aligned: query i of qo_len sees keys j <= kv_len - qo_len + i.
It never looks at eaglesrv's spans or layout, so a backend that agrees with the torch
reference through it passes flashinfer exactly what flashinfer needs.
"""

from __future__ import annotations

import types

import numpy as np
import torch


class _Wrapper:
    """plan() leaves its schedule in tensors; run() is one op that reads them when it runs, so
    a graph captured over run() reads what the latest plan() wrote, as flashinfer's graph
    mode does. In graph mode plan() writes into the fixed buffers given at construction."""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None) -> None:
        assert kv_layout == "NHD"
        self.workspace = float_workspace_buffer
        self.use_cuda_graph = use_cuda_graph
        self.buffers = (qo_indptr_buf, paged_kv_indptr_buf, paged_kv_indices_buf, paged_kv_last_page_len_buf)
        if use_cuda_graph:
            assert all(isinstance(b, torch.Tensor) and b.dtype == torch.int32 for b in self.buffers[1:])
        self.plans = 0
        self.planned = None

    def _plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
              custom_mask, causal, sm_scale, q_data_type, kv_data_type):
        for tensor in (qo_indptr, kv_indptr, kv_indices, last_page_len):
            assert tensor.dtype == torch.int32 and tensor.dim() == 1
        qo_len = qo_indptr.diff().long()
        num_pages = kv_indptr.diff().long()
        assert bool((last_page_len >= 1).all() and (last_page_len <= page_size).all())
        kv_len = (num_pages - 1) * page_size + last_page_len.long()
        packed, byte_offsets = torch.zeros(0, dtype=torch.uint8), torch.zeros(0, dtype=torch.long)
        if custom_mask is not None:
            assert not self.use_cuda_graph, "eaglesrv's graph passes carry no custom mask"
            bit_offsets = torch.cat([torch.zeros(1, dtype=torch.long), (qo_len * kv_len).cumsum(0)])
            flat = custom_mask.cpu().numpy()
            assert flat.dtype == np.bool_ and len(flat) == int(bit_offsets[-1]), "mask length disagrees with lengths"
            parts = [np.packbits(flat[a:b], bitorder="little") for a, b in zip(bit_offsets[:-1], bit_offsets[1:])]
            byte_offsets = torch.tensor(np.concatenate([[0], np.cumsum([len(part) for part in parts])]))
            packed = torch.from_numpy(np.concatenate(parts))
        schedule = (qo_indptr, kv_indptr, kv_indices, last_page_len)
        if self.use_cuda_graph:  # into the fixed buffers, as flashinfer's plan() copies
            qo_buf, kv_buf, indices_buf, last_buf = self.buffers
            assert len(kv_buf) == len(kv_indptr) and len(indices_buf) >= len(kv_indices), "batch differs from capture"
            if qo_buf is None:  # the decode wrapper's: one query per row
                qo_buf = torch.zeros_like(kv_buf)
                self.buffers = (qo_buf, *self.buffers[1:])
            for buffer, values in zip((qo_buf, kv_buf, indices_buf, last_buf), schedule):
                buffer[: len(values)].copy_(values)
            schedule = (qo_buf, kv_buf, indices_buf, last_buf)
        else:
            schedule = tuple(tensor.clone() for tensor in schedule)
        self.plans += 1
        self.planned = types.SimpleNamespace(
            schedule=schedule, packed=packed, byte_offsets=byte_offsets, heads=(num_qo_heads, num_kv_heads, head_dim),
            page_size=page_size, causal=causal, scale=sm_scale, q_dtype=q_data_type, kv_dtype=kv_data_type,
        )

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        plan = self.planned
        k_pages, v_pages = paged_kv_cache
        assert q.dtype == plan.q_dtype and k_pages.dtype == plan.kv_dtype
        assert tuple(q.shape[1:]) == (plan.heads[0], plan.heads[2])
        assert tuple(k_pages.shape[1:]) == (plan.page_size, plan.heads[1], plan.heads[2]) == tuple(v_pages.shape[1:])
        return torch.ops.eaglesrv_tests.flashinfer_stand_in_run(
            q, k_pages, v_pages, *plan.schedule, plan.packed, plan.byte_offsets, plan.causal, plan.scale)


@torch.library.custom_op("eaglesrv_tests::flashinfer_stand_in_run", mutates_args=())
def flashinfer_stand_in_run(
    q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor, last_page_len: torch.Tensor, packed: torch.Tensor, byte_offsets: torch.Tensor,
    causal: bool, scale: float,
) -> torch.Tensor:
    """Attention from the schedule's current contents, as flashinfer's kernels read it."""
    page_size = k_pages.shape[1]
    out = torch.empty_like(q)
    for b in range(len(last_page_len)):
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        p0, p1 = int(kv_indptr[b]), int(kv_indptr[b + 1])
        kv_len, qo_len = (p1 - p0 - 1) * page_size + int(last_page_len[b]), q1 - q0
        pages = kv_indices[p0:p1].long()
        keys = k_pages[pages].reshape(-1, *k_pages.shape[2:])[:kv_len].float()
        values = v_pages[pages].reshape(-1, *v_pages.shape[2:])[:kv_len].float()
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        query, key = torch.arange(qo_len)[:, None], torch.arange(kv_len)[None, :]
        if len(packed):  # bit (query * kv_len + key) of the sequence's bytes, little-endian
            offset = query * kv_len + key
            part = packed[int(byte_offsets[b]) :].long()
            allowed = ((part[offset // 8] >> (offset % 8)) & 1).bool()
        elif causal:  # bottom-right aligned
            allowed = key <= kv_len - qo_len + query
        else:
            allowed = torch.ones(qo_len, kv_len, dtype=torch.bool)
        scores = torch.einsum("mhd,nhd->hmn", q[q0:q1].float(), keys) * scale
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[q0:q1] = torch.einsum("hmn,nhd->mhd", weights, values).to(q.dtype)
    return out


@flashinfer_stand_in_run.register_fake
def _(q, k_pages, v_pages, qo_indptr, kv_indptr, kv_indices, last_page_len, packed, byte_offsets, causal, scale):
    return torch.empty_like(q)


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, *, custom_mask=None, causal=False, sm_scale=None, q_data_type="float16",
             kv_data_type=None):
        self._plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
                   head_dim_qk, page_size, custom_mask, causal, sm_scale, q_data_type, kv_data_type or q_data_type)


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, None, paged_kv_indptr_buffer,
                         paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        self.use_tensor_cores = use_tensor_cores

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             sm_scale=None, q_data_type="float16", kv_data_type=None):
        qo_indptr = torch.arange(len(indptr), dtype=torch.int32)  # one query per sequence
        self._plan(qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                   None, False, sm_scale, q_data_type, kv_data_type or q_data_type)


def stand_in_module() -> types.SimpleNamespace:
    """What the backend uses of `flashinfer`, with counters of the wrappers it made."""
    module = types.SimpleNamespace(made=[])

    def make(cls):
        def build(*args, **kwargs):
            wrapper = cls(*args, **kwargs)
            module.made.append(wrapper)
            return wrapper
        return build

    module.BatchPrefillWithPagedKVCacheWrapper = make(BatchPrefillWithPagedKVCacheWrapper)
    module.BatchDecodeWithPagedKVCacheWrapper = make(BatchDecodeWithPagedKVCacheWrapper)
    return module


def serve_through_stand_in(monkeypatch) -> types.SimpleNamespace:
    """Engines built from here on use the flashinfer backend over a new stand-in module (returned)."""
    from eaglesrv.engine import builder
    from eaglesrv.kernels.attention.flashinfer_paged import FlashinferAttentionBackend

    module = stand_in_module()
    monkeypatch.setattr(builder, "select_attention_backend", lambda name, page, device, *_: (
        FlashinferAttentionBackend(page, device, module=module, workspace_bytes=16)))
    return module

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
- causal is bottom-right aligned: query i of qo_len sees keys j <= kv_len - qo_len + i.
It never looks at eaglesrv's spans or layout, so a backend that agrees with the torch
reference through it passes flashinfer exactly what flashinfer needs.
"""

from __future__ import annotations

import types

import numpy as np
import torch


class _Wrapper:
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD") -> None:
        assert kv_layout == "NHD"
        self.workspace = float_workspace_buffer
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
        packed = byte_offsets = None
        if custom_mask is not None:
            bit_offsets = torch.cat([torch.zeros(1, dtype=torch.long), (qo_len * kv_len).cumsum(0)])
            flat = custom_mask.cpu().numpy()
            assert flat.dtype == np.bool_ and len(flat) == int(bit_offsets[-1]), "mask length disagrees with lengths"
            parts = [np.packbits(flat[a:b], bitorder="little") for a, b in zip(bit_offsets[:-1], bit_offsets[1:])]
            byte_offsets = np.concatenate([[0], np.cumsum([len(part) for part in parts])])
            packed = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
        self.plans += 1
        self.planned = types.SimpleNamespace(
            qo_indptr=qo_indptr.cpu().long(), kv_indptr=kv_indptr.cpu().long(), kv_indices=kv_indices.cpu().long(),
            kv_len=kv_len, heads=(num_qo_heads, num_kv_heads, head_dim), page_size=page_size, packed=packed,
            byte_offsets=byte_offsets, causal=causal, scale=sm_scale, q_dtype=q_data_type, kv_dtype=kv_data_type,
        )

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        plan = self.planned
        k_pages, v_pages = paged_kv_cache
        assert q.dtype == plan.q_dtype and k_pages.dtype == plan.kv_dtype
        assert tuple(q.shape[1:]) == (plan.heads[0], plan.heads[2])
        assert tuple(k_pages.shape[1:]) == (plan.page_size, plan.heads[1], plan.heads[2]) == tuple(v_pages.shape[1:])
        out = torch.empty_like(q)
        for b in range(len(plan.kv_len)):
            q0, q1 = int(plan.qo_indptr[b]), int(plan.qo_indptr[b + 1])
            pages = plan.kv_indices[int(plan.kv_indptr[b]) : int(plan.kv_indptr[b + 1])]
            kv_len, qo_len = int(plan.kv_len[b]), q1 - q0
            keys = k_pages[pages].reshape(-1, *k_pages.shape[2:])[:kv_len].float()
            values = v_pages[pages].reshape(-1, *v_pages.shape[2:])[:kv_len].float()
            group = q.shape[1] // keys.shape[1]
            keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
            allowed = self._allowed(b, qo_len, kv_len)
            scores = torch.einsum("mhd,nhd->hmn", q[q0:q1].float(), keys) * plan.scale
            weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
            out[q0:q1] = torch.einsum("hmn,nhd->mhd", weights, values).to(q.dtype)
        return out

    def _allowed(self, b: int, qo_len: int, kv_len: int) -> torch.Tensor:
        plan = self.planned
        query, key = torch.arange(qo_len)[:, None], torch.arange(kv_len)[None, :]
        if plan.packed is not None:
            offset = (query * kv_len + key).numpy()
            part = plan.packed[plan.byte_offsets[b] :]
            return torch.from_numpy(((part[offset // 8] >> (offset % 8)) & 1).astype(bool))
        if plan.causal:
            return key <= kv_len - qo_len + query
        return torch.ones(qo_len, kv_len, dtype=torch.bool)


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, *, custom_mask=None, causal=False, sm_scale=None, q_data_type="float16",
             kv_data_type=None):
        self._plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
                   head_dim_qk, page_size, custom_mask, causal, sm_scale, q_data_type, kv_data_type or q_data_type)


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_tensor_cores=False):
        super().__init__(float_workspace_buffer, kv_layout)
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

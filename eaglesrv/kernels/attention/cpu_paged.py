"""The CPU backend: a C++ kernel reads keys and values in place in the pages.

Rows of sequences that add few tokens (decode, EAGLE-3 tree verification, draft steps)
go to the kernel, which never copies the keys. Prefill chunks (more than
KERNEL_MAX_NEW_TOKENS new tokens) go to the torch reference's grouped SDPA, whose blocked
matrix products beat a per-row loop once there are many queries per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaglesrv.kernels.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    SequenceSpan,
    check_page_tables,
    first_rows,
    full_mask,
    new_token_slots,
)
from eaglesrv.kernels.attention.cpu_build import load_cpu_attention
from eaglesrv.kernels.attention.torch_ref import SpanGroup, attend_groups, plan_groups, store_new_kv

KERNEL_MAX_NEW_TOKENS = 64


@dataclass
class KernelRows:
    """The kernel's inputs for its rows (see csrc/paged_attention_cpu.cpp)."""

    rows: torch.Tensor  # [R] packed query rows
    row_pages: torch.Tensor  # [R, max_pages] page table of each row's sequence
    row_num_keys: torch.Tensor  # [R] keys 0 .. n-1 are candidates
    row_mask_offset: torch.Tensor  # [R] offset into masks, -1 = causal (all n visible)
    masks: torch.Tensor  # [*] bool, the custom-mask rows back to back


@dataclass
class CpuAttentionMetadata(AttentionMetadata):
    new_slots: torch.Tensor
    groups: list[SpanGroup]  # prefill chunks, for the torch path
    kernel: KernelRows | None


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"

    def __init__(self, page_size: int, device: torch.device) -> None:
        if device.type != "cpu":
            raise ValueError("the cpu attention backend runs on the CPU only")
        super().__init__(page_size, device)
        self._ops = load_cpu_attention()

    def plan(self, spans: list[SequenceSpan]) -> CpuAttentionMetadata:
        check_page_tables(spans, self.page_size)
        starts = first_rows(spans)
        large = [i for i, s in enumerate(spans) if s.num_new > KERNEL_MAX_NEW_TOKENS]
        small = [i for i, s in enumerate(spans) if s.num_new <= KERNEL_MAX_NEW_TOKENS]
        groups = plan_groups([spans[i] for i in large], starts[large], self.page_size, self.device) if large else []
        kernel = _plan_rows([spans[i] for i in small], starts[small].tolist()) if small else None
        return CpuAttentionMetadata(new_token_slots(spans, self.page_size), groups, kernel)

    def forward(self, q, k, v, k_cache, v_cache, metadata: CpuAttentionMetadata, scale: float):
        store_new_kv(k, v, k_cache, v_cache, metadata.new_slots)
        out = torch.empty_like(q)
        attend_groups(q, k_cache, v_cache, metadata.groups, scale, out)
        rows = metadata.kernel
        if rows is not None:
            query = q.contiguous() if q.dtype == k_cache.dtype else q.to(k_cache.dtype).contiguous()
            target = out if out.dtype == k_cache.dtype else torch.empty_like(query)
            self._ops.paged_attention(
                query, k_cache, v_cache, target, rows.rows, rows.row_pages, rows.row_num_keys,
                rows.row_mask_offset, rows.masks, self.page_size, scale,
            )
            if target is not out:
                out.index_copy_(0, rows.rows, target.index_select(0, rows.rows).to(out.dtype))
        return out


def _plan_rows(spans: list[SequenceSpan], starts: list[int]) -> KernelRows:
    max_pages = max(len(s.page_table) for s in spans)
    rows, pages, num_keys, mask_offsets, masks = [], [], [], [], []
    mask_length = 0
    for span, start in zip(spans, starts):
        table = span.page_table + [0] * (max_pages - len(span.page_table))
        total = span.num_cached + span.num_new
        mask = full_mask(span) if span.custom_mask is not None else None
        for i in range(span.num_new):
            rows.append(start + i)
            pages.append(table)
            if mask is None:
                num_keys.append(span.num_cached + i + 1)  # causal
                mask_offsets.append(-1)
            else:
                num_keys.append(total)
                mask_offsets.append(mask_length + i * total)
        if mask is not None:
            masks.append(mask.reshape(-1))
            mask_length += mask.numel()
    return KernelRows(
        rows=torch.tensor(rows, dtype=torch.long),
        row_pages=torch.tensor(pages, dtype=torch.long),
        row_num_keys=torch.tensor(num_keys, dtype=torch.long),
        row_mask_offset=torch.tensor(mask_offsets, dtype=torch.long),
        masks=torch.cat(masks) if masks else torch.zeros(0, dtype=torch.bool),
    )

"""The CPU backend: a C++ kernel reads keys and values in place in the pages.

Rows of sequences that add few tokens (decode, EAGLE-3 tree verification, draft steps)
go to the kernel, which never copies the keys. Prefill chunks (more than
KERNEL_MAX_NEW_TOKENS new tokens) go to the torch reference's grouped SDPA, whose blocked
matrix products beat a per-row loop once there are many queries per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from eaglesrv.kernels.attention.base import AttentionBackend, AttentionMetadata, SequenceSpan
from eaglesrv.kernels.attention.cpu_build import load_cpu_attention
from eaglesrv.kernels.attention.layout import PassLayout
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
        layout = PassLayout.of(spans, self.page_size)
        large = layout.num_new.numpy() > KERNEL_MAX_NEW_TOKENS
        groups = plan_groups(layout, np.flatnonzero(large).tolist(), self.device) if large.any() else []
        kernel = _plan_rows(layout, ~large) if not large.all() else None
        return CpuAttentionMetadata(layout.new_slots, groups, kernel)

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


def _plan_rows(layout: PassLayout, small: np.ndarray) -> KernelRows:
    """The kernel's rows: every new token of the sequences marked `small` [S] (numpy, as
    the layout's arithmetic). The kernel reads a custom mask over all of a row's keys, so
    the masks are spelled out in full."""
    token_seq, positions = layout.token_seq.numpy(), layout.positions.numpy()
    num_cached = layout.num_cached.numpy().astype(np.int64)
    total = num_cached + layout.num_new.numpy()
    custom = layout.mask_offset.numpy() >= 0
    rows = np.flatnonzero(small[token_seq])
    seq = token_seq[rows]
    full_offset = np.full(len(layout.spans), -1, dtype=np.int64)
    masks = torch.zeros(0, dtype=torch.bool)
    masked = np.flatnonzero(custom & small)
    if len(masked):
        spelled = [layout.full_mask(i).reshape(-1) for i in masked]
        sizes = np.array([mask.numel() for mask in spelled])
        full_offset[masked] = np.cumsum(sizes) - sizes
        masks = torch.cat(spelled)
    row_positions, row_total, row_custom = positions[rows], total[seq], custom[seq]
    num_pages = -(-int(total[small].max()) // layout.page_size)
    arrays = (
        rows,
        layout.block_table.numpy()[seq, :num_pages].astype(np.int64),
        np.where(row_custom, row_total, row_positions + 1),  # causal: keys up to the row's own
        np.where(row_custom, full_offset[seq] + (row_positions - num_cached[seq]) * row_total, -1),
    )
    return KernelRows(*(torch.from_numpy(np.ascontiguousarray(array)) for array in arrays), masks=masks)

"""One forward pass's attention layout as tensors, built from its spans in a few vectorized ops.

Every backend plans from this (`AttentionBackend.plan`): the Triton backend copies it to
the device as it is, the torch reference and the CPU kernel derive their groups and rows
from it with array ops. The only Python loops are over sequences (their page tables and
custom masks arrive as Python objects from the scheduler and the runner), never over
tokens or pages. The arithmetic is numpy's, on the host: a numpy op costs about a
microsecond where a torch op on small CPU tensors costs several, which makes a decode
step's plan about four times cheaper; the fields are torch tensors sharing that memory.

    block_table  [S, P] int32   page ids, row s = sequence s; columns past its pages hold 0
    num_cached   [S] int32      keys already in the cache
    num_new      [S] int32      tokens the sequence adds
    query_start  [S + 1] int32  packed row of each sequence's first new token
    token_seq    [T] int64      the sequence of each packed row
    positions    [T] int64      each row's key position: num_cached + its index in the span
    new_slots    [T] int64      the cache slot each row's K/V go to
    mask_offset  [S] int32      start of the sequence's custom mask in `masks`, -1 = causal
    mask_width   [S] int32      W of its mask (over the last W keys), 0 = causal
    masks        [*] bool       the custom masks [num_new, W], row-major, back to back
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from eaglesrv.kernels.attention.base import SequenceSpan, checked_mask, padded_block_table


@dataclass(frozen=True)
class PassLayout:
    spans: list[SequenceSpan]
    page_size: int
    block_table: torch.Tensor
    num_cached: torch.Tensor
    num_new: torch.Tensor
    query_start: torch.Tensor
    token_seq: torch.Tensor
    positions: torch.Tensor
    new_slots: torch.Tensor
    mask_offset: torch.Tensor
    mask_width: torch.Tensor
    masks: torch.Tensor

    @classmethod
    def of(cls, spans: list[SequenceSpan], page_size: int) -> "PassLayout":
        num_seqs = len(spans)
        sizes = np.array([(s.num_cached, s.num_new, len(s.page_table)) for s in spans], dtype=np.int32)
        num_cached, num_new, num_pages = sizes.reshape(num_seqs, 3).T.copy()
        if (num_pages * page_size < num_cached + num_new).any():
            raise ValueError("a page table is too short for its sequence")
        query_start = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(num_new, out=query_start[1:])
        block_table = padded_block_table([span.page_table for span in spans]).numpy()
        token_seq = np.repeat(np.arange(num_seqs), num_new)
        positions = (num_cached - query_start[:-1]).astype(np.int64)[token_seq] + np.arange(len(token_seq))
        new_slots = block_table[token_seq, positions // page_size].astype(np.int64) * page_size + positions % page_size
        mask_offset, mask_width, masks = _packed_masks(spans)
        arrays = (block_table, num_cached, num_new, query_start, token_seq, positions, new_slots)
        return cls(spans, page_size, *(torch.from_numpy(array) for array in arrays), mask_offset, mask_width, masks)

    @property
    def max_new(self) -> int:
        return int(self.num_new.max()) if len(self.spans) else 0

    @property
    def has_masks(self) -> bool:
        return bool(self.masks.numel())

    def custom_mask(self, index: int) -> torch.Tensor:
        """Sequence `index`'s custom mask [num_new, W], a view into `masks` (it has one)."""
        offset, width = int(self.mask_offset[index]), int(self.mask_width[index])
        return self.masks[offset : offset + int(self.num_new[index]) * width].view(-1, width)

    def full_mask(self, index: int) -> torch.Tensor:
        """[num_new, num_cached + num_new]: the custom mask with its visible prefix spelled out."""
        mask = self.custom_mask(index)
        prefix = torch.ones(mask.shape[0], int(self.num_cached[index]) + mask.shape[0] - mask.shape[1],
                            dtype=torch.bool)
        return torch.cat([prefix, mask], dim=1)


def new_token_slots(spans: list[SequenceSpan], page_size: int) -> torch.Tensor:
    """[num_tokens] int64: the cache slot of every new token, packed in span order."""
    return PassLayout.of(spans, page_size).new_slots


def _packed_masks(spans: list[SequenceSpan]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mask_offset = torch.full((len(spans),), -1, dtype=torch.int32)
    mask_width = torch.zeros(len(spans), dtype=torch.int32)
    masked = [i for i, span in enumerate(spans) if span.custom_mask is not None]
    if not masked:
        return mask_offset, mask_width, torch.zeros(0, dtype=torch.bool)
    custom = [checked_mask(spans[i]) for i in masked]
    sizes = torch.tensor([mask.numel() for mask in custom], dtype=torch.int64)
    if int(sizes.sum()) >= 2**31:
        raise ValueError("custom masks too large for int32 offsets")
    mask_offset[masked] = (sizes.cumsum(0) - sizes).to(torch.int32)
    mask_width[masked] = torch.tensor([mask.shape[1] for mask in custom], dtype=torch.int32)
    return mask_offset, mask_width, torch.cat([mask.reshape(-1) for mask in custom])

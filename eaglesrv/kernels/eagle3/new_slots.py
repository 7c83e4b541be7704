"""Cache slots of a forward pass's new tokens, computed on the device from a block table.

    block_table  [batch, max_pages] int32   page ids of each sequence, row b = sequence b
    num_cached   [batch] int32              tokens of each sequence already in the cache
    qo_indptr    [batch + 1] int32          new tokens of sequence b are packed rows
                                            qo_indptr[b] .. qo_indptr[b + 1] - 1
    slots        [num_tokens] int64         cache slot of every packed new token

The new token i of sequence b sits at position t = num_cached[b] + i, in slot
block_table[b, t // page_size] * page_size + t % page_size (the layout of
kernels/attention/base.py). num_tokens is qo_indptr[batch], passed by the caller so that
nothing is read back from the device.
"""

from __future__ import annotations

import torch

from eaglesrv.kernels.triton_support import triton_usable


def new_token_slots(
    block_table: torch.Tensor, num_cached: torch.Tensor, qo_indptr: torch.Tensor, page_size: int, num_tokens: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """[num_tokens] int64 slots, written into `out` when given (a graph's static buffer)."""
    if not triton_usable(block_table.device):
        slots = new_token_slots_reference(block_table, num_cached, qo_indptr, page_size, num_tokens)
        return slots if out is None else out.copy_(slots)
    from eaglesrv.kernels.eagle3.new_slots_kernel import new_token_slots_op

    if out is None:
        out = torch.empty(num_tokens, dtype=torch.int64, device=block_table.device)
    new_token_slots_op(block_table.contiguous(), num_cached.contiguous(), qo_indptr.contiguous(), out, page_size)
    return out


def new_token_slots_reference(
    block_table: torch.Tensor, num_cached: torch.Tensor, qo_indptr: torch.Tensor, page_size: int, num_tokens: int
) -> torch.Tensor:
    """The same slots with torch ops, without a host sync."""
    rows = torch.arange(num_tokens, device=block_table.device)
    seq = torch.searchsorted(qo_indptr[1:].long(), rows, right=True)  # the sequence each packed row belongs to
    position = num_cached.long()[seq] + rows - qo_indptr.long()[seq]
    page = block_table.long()[seq, position // page_size]
    return page * page_size + position % page_size

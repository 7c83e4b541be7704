"""flashinfer's plan() arguments for one forward pass, built from its layout on the host.

flashinfer's batch wrappers take a paged cache as ragged index arrays (CSR), one row per
sequence. eaglesrv's cache [slots, kv_heads, head_dim] is flashinfer's NHD layout
[pages, page_size, kv_heads, head_dim] after a view, and page ids are the same numbers.

    qo_indptr         [S + 1] int32  packed row of each sequence's first new token (our query_start)
    kv_indptr         [S + 1] int32  start of the sequence's pages in kv_indices
    kv_indices        [*] int32      the pages holding keys [0, num_cached + num_new), in order
    kv_last_page_len  [S] int32      keys on the last of them, in [1, page_size]
    custom_mask       [*] bool       only when a span has a tree mask: every sequence's mask over
                                     ALL its keys [num_new, kv_len], row-major, back to back; a
                                     causal sequence's mask is written out (flashinfer applies one
                                     custom mask to the whole batch or none)

Our custom masks cover only the last W keys (base.py); here the keys before them are
spelled out as visible. Without a tree mask the pass is causal, which flashinfer aligns
bottom-right: new token i of a sequence with kv_len keys sees keys j <= kv_len - num_new + i,
which is our rule j <= num_cached + i.

The mask goes to plan() unpacked: flashinfer 0.6.18 finds each sequence's part from the
other arguments (num_new * kv_len bits each), packs the parts on the device little-endian,
each starting on a byte, and passes its kernel their byte offsets. Given an already packed
mask, its plan() would pass offsets counted in bits, which its kernel reads as bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from eaglesrv.kernels.attention.layout import PassLayout


@dataclass(frozen=True)
class FlashinferPlanInputs:
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    custom_mask: torch.Tensor | None

    @property
    def decode_only(self) -> bool:
        """Every sequence adds one token and none has a mask: the decode wrapper's case."""
        return self.custom_mask is None and bool((self.qo_indptr.diff() == 1).all())


def flashinfer_plan_inputs(layout: PassLayout) -> FlashinferPlanInputs:
    """A host-planned pass's arguments, from its layout."""
    custom_mask = None
    if layout.has_masks:
        kv_len = layout.num_cached + layout.num_new
        custom_mask = torch.from_numpy(np.concatenate([_full_mask(layout, i, int(n)) for i, n in enumerate(kv_len)]))
    return paged_inputs(layout.block_table.numpy(), layout.num_cached.numpy(), layout.num_new.numpy(),
                        layout.page_size, custom_mask)


def uniform_plan_inputs(block_table: torch.Tensor, num_cached: torch.Tensor, num_new: int,
                        page_size: int) -> FlashinferPlanInputs:
    """A causal pass in which every sequence adds `num_new` tokens (a graph's decode or
    extend), from the host copies of the block table [S, P] and cached lengths [S]."""
    num_cached = num_cached.numpy()
    return paged_inputs(block_table.numpy(), num_cached, np.full_like(num_cached, num_new), page_size, None)


def paged_inputs(block_table: np.ndarray, num_cached: np.ndarray, num_new: np.ndarray, page: int,
                 custom_mask: torch.Tensor | None) -> FlashinferPlanInputs:
    kv_len = num_cached.astype(np.int64) + num_new
    pages_used = -(-kv_len // page)
    kv_indptr, qo_indptr = np.zeros((2, len(kv_len) + 1), dtype=np.int32)
    np.cumsum(pages_used, out=kv_indptr[1:])
    np.cumsum(num_new, out=qo_indptr[1:])
    kv_indices = block_table[np.arange(block_table.shape[1]) < pages_used[:, None]]  # row-major: sequence order
    last_page_len = (kv_len - (pages_used - 1) * page).astype(np.int32)
    return FlashinferPlanInputs(
        qo_indptr=torch.from_numpy(qo_indptr), kv_indptr=torch.from_numpy(kv_indptr),
        kv_indices=torch.from_numpy(kv_indices.astype(np.int32)), kv_last_page_len=torch.from_numpy(last_page_len),
        custom_mask=custom_mask,
    )


def _full_mask(layout: PassLayout, index: int, kv_len: int) -> np.ndarray:
    """Sequence `index`'s mask over all its keys, flattened row-major."""
    if layout.mask_offset[index] >= 0:
        return layout.full_mask(index).numpy().reshape(-1)
    num_new = int(layout.num_new[index])
    keys, rows = np.arange(kv_len), np.arange(kv_len - num_new, kv_len)
    return (keys[None, :] <= rows[:, None]).reshape(-1)

"""The KV-cache tensors. Page ids are handed out by the scheduler's PageAllocator;
this class only owns the memory they index.

    k[layer]: [(num_pages + 1) * page_size, num_kv_heads, head_dim]   (v likewise)
    page p holds slots p * page_size .. (p + 1) * page_size - 1

The last page, `padding_page` (= num_pages), is never handed out: the allocator knows
num_pages pages. A graph's padding rows read and write only it, never a live request's.
"""

from __future__ import annotations

import torch

from eaglesrv.engine.model.arch import ModelArch


class KVPool:
    def __init__(
        self, arch: ModelArch, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.padding_page = num_pages
        shape = (arch.num_layers, (num_pages + 1) * page_size, arch.num_kv_heads, arch.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(arch: ModelArch, dtype: torch.dtype) -> int:
        element = dtype.itemsize
        return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * element

    @property
    def num_tokens(self) -> int:
        """Slots on the pages the allocator hands out (the padding page not included)."""
        return self.num_pages * self.page_size

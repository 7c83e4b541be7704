"""The attention backend interface.

A forward pass covers a batch of sequences. Each sequence has `num_cached` tokens whose
K/V are already in the paged cache and adds `num_new` tokens. The new tokens' queries
are packed back to back across sequences ([num_tokens, heads, head_dim]); their K/V are
written into the cache at the slots their positions map to, then every query attends
over its sequence's keys [0, num_cached + num_new) under a mask:

    default (causal):  new token i sees keys j <= num_cached + i
    custom (tree):     mask[i, j] given, shape [num_new, num_cached + num_new]

Paged layout: the cache of one layer is [num_pages * page_size, kv_heads, head_dim];
token t of a sequence lives in slot page_table[t // page_size] * page_size + t % page_size.

    page_table = [7, 2]  page_size = 4
    tokens 0..3 -> slots 28..31 (page 7),  tokens 4..7 -> slots 8..11 (page 2)
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SequenceSpan:
    """The attention view of one sequence in a forward pass."""

    page_table: list[int]
    num_cached: int
    num_new: int
    custom_mask: torch.Tensor | None = None  # [num_new, num_cached + num_new] bool, True = may attend


class AttentionMetadata:
    """Per-pass tensors a backend precomputes once and reuses in every layer."""


class AttentionBackend(abc.ABC):
    name: str = "abstract"
    # Whether decode_metadata is implemented: only such a backend can run in a graph.
    graph_safe_decode: bool = False

    def __init__(self, page_size: int, device: torch.device) -> None:
        self.page_size = page_size
        self.device = device

    @abc.abstractmethod
    def plan(self, spans: list[SequenceSpan]) -> AttentionMetadata:
        """Precompute slot mappings and masks for one forward pass."""

    def decode_metadata(self, block_table: torch.Tensor, num_cached: torch.Tensor) -> AttentionMetadata:
        """The metadata of a decode-only pass (one new token per sequence, causal), built
        from device tensors by tensor ops alone, so that a graph can hold it: no host reads,
        no shapes that depend on values. block_table [num_seqs, max_pages] int32 (columns
        past a sequence's pages hold any valid page), num_cached [num_seqs] int32; the new
        token of sequence i is at position num_cached[i]."""
        raise NotImplementedError(f"the {self.name} attention backend has no graph-safe decode metadata")

    def decode_workspace_bytes(self, num_seqs: int, max_keys: int, num_kv_heads: int, head_dim: int,
                               dtype: torch.dtype) -> int:
        """Memory one layer's decode attention allocates beyond its output, for num_seqs
        sequences of up to max_keys keys (what a graph of that batch keeps)."""
        return 0

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim], this layer's
        v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store the new K/V in the cache, then attend."""


def check_page_tables(spans: list[SequenceSpan], page_size: int) -> None:
    if any(len(s.page_table) * page_size < s.num_cached + s.num_new for s in spans):
        raise ValueError("a page table is too short for its sequence")


def checked_mask(span: SequenceSpan) -> torch.Tensor:
    """The span's custom mask as a contiguous CPU bool tensor, after checking its shape."""
    expected = (span.num_new, span.num_cached + span.num_new)
    if tuple(span.custom_mask.shape) != expected:
        raise ValueError(f"custom mask shape {tuple(span.custom_mask.shape)} != {expected}")
    return span.custom_mask.to(device="cpu", dtype=torch.bool).contiguous()


def first_rows(spans: list[SequenceSpan]) -> torch.Tensor:
    """Packed row of each span's first new token."""
    sizes = torch.tensor([s.num_new for s in spans], dtype=torch.long)
    return sizes.cumsum(0) - sizes


def new_token_slots(spans: list[SequenceSpan], page_size: int) -> torch.Tensor:
    """[num_tokens] cache slot of every new token, packed in span order."""
    slots = [
        span.page_table[t // page_size] * page_size + t % page_size
        for span in spans
        for t in range(span.num_cached, span.num_cached + span.num_new)
    ]
    return torch.tensor(slots, dtype=torch.long)


def padded_block_table(page_tables: Sequence[Sequence[int]], fill: int = 0) -> torch.Tensor:
    """[num_seqs, longest table (at least 1)] int32: each row a page table, padded with `fill`."""
    num_pages = torch.tensor([len(table) for table in page_tables], dtype=torch.long)
    pages = torch.tensor([page for table in page_tables for page in table], dtype=torch.int32)
    width = max(1, int(num_pages.max())) if len(page_tables) else 1
    block_table = torch.full((len(page_tables), width), fill, dtype=torch.int32)
    rows = torch.repeat_interleave(torch.arange(len(page_tables)), num_pages)
    columns = torch.arange(len(pages)) - torch.repeat_interleave(num_pages.cumsum(0) - num_pages, num_pages)
    block_table[rows, columns] = pages
    return block_table


def decode_slots(block_table: torch.Tensor, num_cached: torch.Tensor, page_size: int) -> torch.Tensor:
    """[num_seqs] long: the cache slot of each sequence's token at position num_cached
    (tensor ops only, graph-safe)."""
    position = num_cached.long()
    page = block_table.long().gather(1, (position // page_size)[:, None]).squeeze(1)
    return page * page_size + position % page_size


def slot_positions(spans: list[SequenceSpan], page_size: int) -> list[list[int]]:
    """Cache slot of every token 0 .. num_cached + num_new - 1 of each sequence."""
    slots = []
    for span in spans:
        total = span.num_cached + span.num_new
        if len(span.page_table) * page_size < total:
            raise ValueError(f"page table of {len(span.page_table)} pages cannot hold {total} tokens")
        slots.append([span.page_table[t // page_size] * page_size + t % page_size for t in range(total)])
    return slots

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

    def __init__(self, page_size: int, device: torch.device) -> None:
        self.page_size = page_size
        self.device = device

    @abc.abstractmethod
    def plan(self, spans: list[SequenceSpan]) -> AttentionMetadata:
        """Precompute slot mappings and masks for one forward pass."""

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


def slot_positions(spans: list[SequenceSpan], page_size: int) -> list[list[int]]:
    """Cache slot of every token 0 .. num_cached + num_new - 1 of each sequence."""
    slots = []
    for span in spans:
        total = span.num_cached + span.num_new
        if len(span.page_table) * page_size < total:
            raise ValueError(f"page table of {len(span.page_table)} pages cannot hold {total} tokens")
        slots.append([span.page_table[t // page_size] * page_size + t % page_size for t in range(total)])
    return slots

"""The pure-torch reference backend. Runs everywhere; the oracle for the other backends.

Sequences are grouped by how many new tokens they add, and each group runs one masked
scaled-dot-product attention over its sequences' keys gathered from the pages. Grouping
keeps padding small: single-token decodes batch together (only their key lengths are
padded), equal-size draft trees batch together, and a prefill chunk runs on its own
instead of padding every decode in the step to its length.

    queries  [G, Q, H, D]    the group's packed new tokens (Q = tokens per sequence)
    keys     [G, K, Hkv, D]  K = the group's longest sequence (padding keys masked)
    mask     [G, 1, Q, K]    causal-with-prefix, or the span's custom mask; none for a group
                             of fresh prompts (nothing cached, no custom mask), which SDPA's
                             own causal rule serves without computing the masked half
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eaglesrv.kernels.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    SequenceSpan,
    check_tree_mask,
    token_slots,
    uniform_positions,
)
from eaglesrv.kernels.attention.layout import PassLayout


@dataclass
class SpanGroup:
    query_rows: torch.Tensor  # [G, Q] rows of the packed queries
    key_slots: torch.Tensor  # [G, K] cache slot of each key (0 where padding)
    mask: torch.Tensor | None  # [G, 1, Q, K] bool, True = may attend; None = plain causal (Q == K)


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    new_slots: torch.Tensor  # [num_tokens] cache slot of each new token
    groups: list[SpanGroup]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    graph_safe = True

    def plan(self, spans: list[SequenceSpan]) -> TorchAttentionMetadata:
        layout = PassLayout.of(spans, self.page_size)
        return TorchAttentionMetadata(new_slots=layout.new_slots.to(self.device),
                                      groups=plan_groups(layout, range(len(spans)), self.device))

    def uniform_metadata(self, block_table, num_cached, num_new, tree_mask=None) -> TorchAttentionMetadata:
        """One group over every column of the block table, the keys past each sequence's
        new tokens masked: the key count is fixed by the table's width, not by its values."""
        num_seqs, max_pages = block_table.shape
        device = block_table.device
        key_pos = torch.arange(max_pages * self.page_size, device=device)
        key_slots = block_table.long()[:, key_pos // self.page_size] * self.page_size + key_pos % self.page_size
        query_pos = uniform_positions(num_cached, num_new)  # [S, Q]
        mask = key_pos[None, None, :] <= query_pos[:, :, None]  # [S, Q, K] causal
        if tree_mask is not None:
            width = check_tree_mask(tree_mask, num_seqs, num_new)
            offset = key_pos[None, :] - (num_cached.long() + num_new - width)[:, None]  # [S, K] key in the tree part
            in_tree = (offset >= 0) & (offset < width)
            bits = tree_mask.gather(2, offset.clamp(0, width - 1)[:, None, :].expand(-1, num_new, -1))
            mask = torch.where(in_tree[:, None, :], bits, mask)
        return TorchAttentionMetadata(
            new_slots=token_slots(block_table, query_pos, self.page_size).reshape(-1),
            groups=[SpanGroup(query_rows=torch.arange(num_seqs * num_new, device=device).view(num_seqs, num_new),
                              key_slots=key_slots, mask=mask[:, None])],
        )

    def decode_workspace_bytes(self, num_seqs, max_keys, num_kv_heads, head_dim, dtype) -> int:
        # The gathered keys and values (and their copies in the query's layout), the key
        # slots and the mask: uniform_metadata spans the block table's full width.
        element = dtype.itemsize
        return num_seqs * max_keys * (4 * num_kv_heads * head_dim * element + 8 + 1)

    def forward(self, q, k, v, k_cache, v_cache, metadata: TorchAttentionMetadata, scale: float):
        store_new_kv(k, v, k_cache, v_cache, metadata.new_slots)
        out = torch.empty_like(q)
        attend_groups(q, k_cache, v_cache, metadata.groups, scale, out)
        return out


def store_new_kv(k, v, k_cache, v_cache, new_slots: torch.Tensor) -> None:
    # index_copy_ rather than advanced indexing: several times faster on the CPU.
    k_cache.index_copy_(0, new_slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, new_slots, v.to(v_cache.dtype))


def plan_groups(layout: PassLayout, members: Sequence[int], device) -> list[SpanGroup]:
    """Groups of same-size, similar-length sequences among `members` (span indices)."""
    by_size: dict[int, list[int]] = {}
    for index in members:
        by_size.setdefault(layout.spans[index].num_new, []).append(index)
    return [
        _to(_plan_group(layout, bucket, size), device)
        for size, same_size in by_size.items()
        for bucket in _length_buckets(same_size, layout.spans)
    ]


def attend_groups(q, k_cache, v_cache, groups: list[SpanGroup], scale: float, out: torch.Tensor) -> None:
    """Gather each group's keys out of the pages and run one masked SDPA per group into `out`."""
    for group in groups:
        size, length = group.query_rows.shape[1], group.key_slots.shape[1]
        rows, slots = group.query_rows.reshape(-1), group.key_slots.reshape(-1)
        queries = q.index_select(0, rows).view(-1, size, *q.shape[1:]).transpose(1, 2)  # [G, H, Q, D]
        keys = k_cache.index_select(0, slots).view(-1, length, *k_cache.shape[1:]).transpose(1, 2)
        values = v_cache.index_select(0, slots).view(-1, length, *v_cache.shape[1:]).transpose(1, 2)
        attended = F.scaled_dot_product_attention(
            queries, keys.to(q.dtype), values.to(q.dtype), attn_mask=group.mask, is_causal=group.mask is None,
            scale=scale, enable_gqa=queries.shape[1] != keys.shape[1],
        )
        out.index_copy_(0, rows, attended.transpose(1, 2).reshape(-1, *q.shape[1:]))


def _length_buckets(members: list[int], spans: list[SequenceSpan], ratio: float = 1.5, floor: int = 256):
    """Split sequences into runs of similar length, so that padding every key set to the
    longest one (gathered, then masked) wastes at most about `ratio` of the memory traffic,
    which is what decode attention costs on a CPU."""
    ordered = sorted(members, key=lambda i: spans[i].num_cached + spans[i].num_new)
    buckets: list[list[int]] = []
    for index in ordered:
        length = spans[index].num_cached + spans[index].num_new
        if buckets and length <= max(floor, ratio * buckets[-1][0][1]):
            buckets[-1].append((index, length))
        else:
            buckets.append([(index, length)])
    return [[index for index, _ in bucket] for bucket in buckets]


def _plan_group(layout: PassLayout, members: list[int], size: int) -> SpanGroup:
    """Tensors for sequences that all add `size` tokens."""
    page_size = layout.page_size
    index = torch.tensor(members)
    cached = layout.num_cached[index].long()
    total = cached + size
    key_pos = torch.arange(int(total.max()))  # [K]
    key_valid = key_pos < total[:, None]  # [G, K]
    pages = layout.block_table[index].long().gather(1, (key_pos // page_size).expand(len(members), -1))
    key_slots = torch.where(key_valid, pages * page_size + key_pos % page_size, 0)
    query_pos = torch.arange(size)
    query_rows = layout.query_start[index].long()[:, None] + query_pos[None, :]
    if not cached.any() and (layout.mask_offset[index] < 0).all():
        # Fresh prompts, causal: SDPA's own causal rule skips the blocks above the diagonal,
        # which an explicit mask makes it compute (half the pairs; 1.8-2x faster on the CPU).
        return SpanGroup(query_rows=query_rows, key_slots=key_slots, mask=None)
    mask = (key_pos[None, None, :] <= cached[:, None, None] + query_pos[None, :, None]) & key_valid[:, None, :]
    for g, span_index in enumerate(members):  # the keys before a custom mask's are visible under the causal rule
        if layout.mask_offset[span_index] >= 0:
            custom, end = layout.custom_mask(span_index), int(total[g])
            mask[g, :, end - custom.shape[1] : end] = custom
    return SpanGroup(query_rows=query_rows, key_slots=key_slots, mask=mask.unsqueeze(1))


def _to(group: SpanGroup, device: torch.device) -> SpanGroup:
    mask = None if group.mask is None else group.mask.to(device)
    return SpanGroup(group.query_rows.to(device), group.key_slots.to(device), mask)

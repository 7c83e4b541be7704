"""The pure-torch reference backend: gathers each sequence's keys into a padded batch
and runs one masked scaled-dot-product attention. Runs everywhere; the oracle for the
other backends.

    queries  [B, Q, H, D]   Q = most new tokens of any sequence (padding rows masked)
    keys     [B, K, Hkv, D] K = longest sequence (padding keys masked)
    mask     [B, 1, Q, K]   causal-with-prefix by default, or the span's custom mask
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eaglesrv.kernels.attention.base import AttentionBackend, AttentionMetadata, SequenceSpan


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    new_slots: torch.Tensor  # [num_tokens] cache slot of each new token
    key_slots: torch.Tensor  # [B, K] cache slot of each key (0 where padding)
    query_index: torch.Tensor  # [B, Q] index into the packed queries (0 where padding)
    query_valid: torch.Tensor  # [B, Q] bool
    mask: torch.Tensor  # [B, 1, Q, K] bool, True = may attend


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def plan(self, spans: list[SequenceSpan]) -> TorchAttentionMetadata:
        cached = torch.tensor([s.num_cached for s in spans])
        new = torch.tensor([s.num_new for s in spans])
        total = cached + new
        max_pages = max(len(s.page_table) for s in spans)
        if any(len(s.page_table) * self.page_size < s.num_cached + s.num_new for s in spans):
            raise ValueError("a page table is too short for its sequence")
        page_tables = torch.tensor([s.page_table + [0] * (max_pages - len(s.page_table)) for s in spans])
        key_pos = torch.arange(int(total.max()))  # [K]
        key_valid = key_pos < total[:, None]  # [B, K]
        pages = page_tables.gather(1, (key_pos // self.page_size).expand(len(spans), -1))
        key_slots = torch.where(key_valid, pages * self.page_size + key_pos % self.page_size, 0)
        is_new_key = key_valid & (key_pos >= cached[:, None])
        new_slots = key_slots[is_new_key]  # row-major: packed in sequence order

        query_pos = torch.arange(int(new.max()))  # [Q]
        query_valid = query_pos < new[:, None]  # [B, Q]
        query_index = torch.where(query_valid, (new.cumsum(0) - new)[:, None] + query_pos, 0)
        causal = key_pos[None, None, :] <= (cached[:, None, None] + query_pos[None, :, None])
        mask = causal & key_valid[:, None, :] & query_valid[:, :, None]  # [B, Q, K]
        for b, span in enumerate(spans):
            if span.custom_mask is not None:
                mask[b, : span.num_new, : span.num_cached + span.num_new] = _checked_mask(span)
        mask[:, :, 0] |= ~query_valid  # padding rows see one key so softmax stays finite
        to = dict(device=self.device)
        return TorchAttentionMetadata(
            new_slots=new_slots.to(**to),
            key_slots=key_slots.to(**to),
            query_index=query_index.to(**to),
            query_valid=query_valid.to(**to),
            mask=mask.unsqueeze(1).to(**to),
        )

    def forward(self, q, k, v, k_cache, v_cache, metadata: TorchAttentionMetadata, scale: float):
        k_cache[metadata.new_slots] = k.to(k_cache.dtype)
        v_cache[metadata.new_slots] = v.to(v_cache.dtype)
        queries = q[metadata.query_index].transpose(1, 2)  # [B, H, Q, D]
        keys = k_cache[metadata.key_slots].transpose(1, 2).to(q.dtype)  # [B, Hkv, K, D]
        values = v_cache[metadata.key_slots].transpose(1, 2).to(q.dtype)
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=metadata.mask, scale=scale,
            enable_gqa=queries.shape[1] != keys.shape[1],
        )
        return out.transpose(1, 2)[metadata.query_valid]  # [num_tokens, H, D]


def _checked_mask(span: SequenceSpan) -> torch.Tensor:
    expected = (span.num_new, span.num_cached + span.num_new)
    if tuple(span.custom_mask.shape) != expected:
        raise ValueError(f"custom mask shape {tuple(span.custom_mask.shape)} != {expected}")
    return span.custom_mask.to(device="cpu", dtype=torch.bool)

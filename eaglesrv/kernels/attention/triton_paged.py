"""The Triton backend: paged attention on CUDA (and, for tests, in Triton's CPU interpreter).

plan() copies the pass's layout (layout.py, a few vectorized ops over the spans) to
the device in one host-to-device copy of an int32 buffer (plus one of the custom masks,
when any span has one):

    int32 buffer  [block_table (num_seqs x max_pages) | num_cached | query_start | mask_offset | mask_width
                   | new_slots]
    masks         uint8, every custom mask [num_new, W] row-major back to back (mask_offset[b] = its
                  start, -1 = causal; mask_width[b] = its W)

uniform_metadata() builds the same tensors on the device for a pass in which every sequence
adds the same number of tokens (a decode step, a verified tree, a draft pass), for graphs.

forward() launches two kernels (triton_kernels.py), each wrapped as a torch custom op so
that graph capture and torch.compile see one op per launch: store the new K/V at new_slots,
then attend for every packed query row (decodes, prefill chunks and masked trees together).
The launch shapes depend only on the tensors' sizes and on two plain values of the plan
(the longest span, whether any span has a mask), never on tensor contents.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from eaglesrv.kernels.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    SequenceSpan,
    check_tree_mask,
    token_slots,
    uniform_positions,
)
from eaglesrv.kernels.attention.layout import PassLayout
from eaglesrv.kernels.attention.triton_kernels import (
    attention_blocks,
    paged_attention_kernel,
    store_blocks,
    store_kv_kernel,
)
from eaglesrv.kernels.triton_support import triton_unusable_reason, triton_usable, upcast_loads


@dataclass
class TritonAttentionMetadata(AttentionMetadata):
    block_table: torch.Tensor  # [num_seqs, max_pages] int32
    num_cached: torch.Tensor  # [num_seqs] int32
    query_start: torch.Tensor  # [num_seqs + 1] int32
    mask_offset: torch.Tensor  # [num_seqs] int32, -1 = causal
    mask_width: torch.Tensor  # [num_seqs] int32, W of each custom mask
    masks: torch.Tensor  # [*] uint8 (one unused element when no span has a mask)
    new_slots: torch.Tensor  # [num_tokens] int32 cache slot of each new token
    max_new: int  # the most tokens any span adds: picks the query tile
    has_masks: bool


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    graph_safe = True

    def __init__(self, page_size: int, device: torch.device) -> None:
        if not triton_usable(device):
            raise ValueError(f"the triton attention backend cannot run: {triton_unusable_reason(device)}")
        super().__init__(page_size, device)

    def plan(self, spans: list[SequenceSpan]) -> TritonAttentionMetadata:
        return plan_metadata(spans, self.page_size, self.device)

    def uniform_metadata(self, block_table, num_cached, num_new, tree_mask=None) -> TritonAttentionMetadata:
        num_seqs, device = block_table.shape[0], block_table.device
        seqs = torch.arange(num_seqs + 1, dtype=torch.int32, device=device)
        width = 0 if tree_mask is None else check_tree_mask(tree_mask, num_seqs, num_new)
        slots = token_slots(block_table, uniform_positions(num_cached, num_new), self.page_size)
        return TritonAttentionMetadata(
            block_table=block_table, num_cached=num_cached, query_start=seqs * num_new,
            mask_offset=seqs[:-1] * (num_new * width) if width else torch.full_like(seqs[:-1], -1),
            mask_width=torch.full_like(seqs[:-1], width),
            masks=tree_mask.reshape(-1).to(torch.uint8) if width else torch.zeros(1, dtype=torch.uint8, device=device),
            new_slots=slots.reshape(-1).to(torch.int32), max_new=num_new, has_masks=bool(width),
        )

    def forward(self, q, k, v, k_cache, v_cache, metadata: TritonAttentionMetadata, scale: float):
        torch.ops.eaglesrv.triton_store_kv(k, v, k_cache, v_cache, metadata.new_slots)
        return torch.ops.eaglesrv.triton_paged_attention(
            q, k_cache, v_cache, metadata.block_table, metadata.num_cached, metadata.query_start,
            metadata.mask_offset, metadata.mask_width, metadata.masks, self.page_size, scale, metadata.max_new,
            metadata.has_masks,
        )


def plan_metadata(spans: list[SequenceSpan], page_size: int, device: torch.device) -> TritonAttentionMetadata:
    layout = PassLayout.of(spans, page_size)
    num_seqs, max_pages = layout.block_table.shape
    # One copy to the device for every index tensor, then views into it.
    parts = [layout.block_table.reshape(-1), layout.num_cached, layout.query_start, layout.mask_offset,
             layout.mask_width, layout.new_slots.to(torch.int32)]
    buffer = _to_device(torch.cat(parts), device).split([len(part) for part in parts])
    masks = layout.masks.to(torch.uint8) if layout.has_masks else torch.zeros(1, dtype=torch.uint8)
    return TritonAttentionMetadata(
        block_table=buffer[0].view(num_seqs, max_pages), num_cached=buffer[1], query_start=buffer[2],
        mask_offset=buffer[3], mask_width=buffer[4], masks=_to_device(masks, device), new_slots=buffer[5],
        max_new=layout.max_new, has_masks=layout.has_masks,
    )


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


@torch.library.custom_op("eaglesrv::triton_store_kv", mutates_args=("k_cache", "v_cache"))
def triton_store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """k_cache[slots[t]] = k[t] and v_cache[slots[t]] = v[t] (negative slots skipped)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = _last_dim_dense(k), _last_dim_dense(v)
    _check_caches(k_cache, v_cache)
    block_h, block_d = store_blocks(num_kv_heads, head_dim)
    store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, UPCAST_LOADS=upcast_loads(),
    )


@triton_store_kv.register_fake
def _(k, v, k_cache, v_cache, slots) -> None:
    return None


@torch.library.custom_op("eaglesrv::triton_paged_attention", mutates_args=())
def triton_paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    num_cached: torch.Tensor, query_start: torch.Tensor, mask_offset: torch.Tensor, mask_width: torch.Tensor,
    masks: torch.Tensor, page_size: int, scale: float, max_new: int, has_masks: bool,
) -> torch.Tensor:
    """[num_tokens, num_heads, head_dim]: every packed query row attended over its sequence's
    cached keys (see triton_kernels.py for the tiling and the metadata)."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = num_cached.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    q = _last_dim_dense(q)
    _check_caches(k_cache, v_cache)
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    group = num_heads // num_kv_heads
    block_m, block_n, block_d, num_warps = attention_blocks(group, max_new, head_dim, k_cache.dtype == torch.float32)
    num_tiles = num_tokens // (block_m // group) + num_seqs
    paged_attention_kernel[(num_tiles, num_kv_heads)](
        q, k_cache, v_cache, out, block_table, num_cached, query_start, mask_offset, mask_width, masks,
        num_seqs, scale * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), block_table.stride(0),
        HEAD_DIM=head_dim, GROUP=group, PAGE_SIZE=page_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        HAS_MASKS=has_masks, DOT_PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
        UPCAST_LOADS=upcast_loads(), num_warps=num_warps,
    )
    return out


@triton_paged_attention.register_fake
def _(q, k_cache, v_cache, block_table, num_cached, query_start, mask_offset, mask_width, masks, page_size, scale,
      max_new, has_masks) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _last_dim_dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    # The kernels index both caches with one set of strides and write them in place.
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share strides and have a dense last dimension")

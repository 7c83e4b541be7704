"""Triton kernels of the paged-attention backend (the launches are in triton_paged.py).

store_kv_kernel: one program per new token copies its K and V rows [kv_heads, head_dim]
into the cache slot new_slots[token] (a negative slot is padding and is skipped).

paged_attention_kernel: one program per (query tile, kv head). A tile holds up to
TOKENS_PER_TILE = BLOCK_M // GROUP consecutive new tokens of one sequence, each with the
GROUP query heads that share the kv head, so a decode token of a grouped-query model still
fills several rows of the tl.dot:

    tile row r  ->  token first + r // GROUP,  query head kv_head * GROUP + r % GROUP

The program walks its sequence's keys BLOCK_N at a time through the block table (an online
softmax in fp32, exp2 with the scale folded in), under the causal rule or the sequence's
custom mask. Tiles need no table of their own: sequence b owns the tiles from
query_start[b] // TOKENS_PER_TILE + b on, enough for its tokens; a program finds its
sequence by binary search and returns at once if its tile is past the sequence's tokens. So
a grid of num_tokens // TOKENS_PER_TILE + num_seqs tiles covers any batch of that size,
which keeps the launch replayable in a CUDA graph.

Metadata (built by TritonAttentionBackend.plan):
    block_table   [num_seqs, max_pages] int32   page ids, row b = sequence b
    num_cached    [num_seqs] int32              keys already in the cache
    query_start   [num_seqs + 1] int32          packed row of each sequence's first new token
    mask_offset   [num_seqs] int32              start of its custom mask in `masks`, -1 = causal
    mask_width    [num_seqs] int32              W: the mask covers the last W keys, the ones
                                                before are visible (W >= num_new)
    masks         [*] uint8                     custom masks [num_new, W], row-major, back to back
"""

from __future__ import annotations

import triton
import triton.language as tl

from eaglesrv.kernels.triton_support import KernelBuild


@triton.jit
def store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    stride_k_token, stride_k_head, stride_v_token, stride_v_head, stride_cache_slot, stride_cache_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST_LOADS: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        inside = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
        k = tl.load(k_ptr + token * stride_k_token + heads * stride_k_head + dims, mask=inside)
        v = tl.load(v_ptr + token * stride_v_token + heads * stride_v_head + dims, mask=inside)
        if UPCAST_LOADS:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        target = slot * stride_cache_slot + heads * stride_cache_head + dims
        tl.store(k_cache_ptr + target, k.to(k_cache_ptr.dtype.element_ty), mask=inside)
        tl.store(v_cache_ptr + target, v.to(v_cache_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _sequence_of_tile(query_start_ptr, num_seqs, tile, TOKENS_PER_TILE: tl.constexpr):
    """The last sequence b whose first tile, query_start[b] // TOKENS_PER_TILE + b, is <= tile."""
    low = tile * 0  # a tensor, even where num_seqs is specialized to a constant
    high = low + num_seqs - 1
    while low < high:
        middle = (low + high + 1) // 2
        first_tile = tl.load(query_start_ptr + middle) // TOKENS_PER_TILE + middle
        low = tl.where(first_tile <= tile, middle, low)
        high = tl.where(first_tile <= tile, high, middle - 1)
    return low


@triton.jit
def paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_table_ptr, num_cached_ptr, query_start_ptr, mask_offset_ptr, mask_width_ptr, masks_ptr,
    num_seqs, scale_log2,
    stride_q_token, stride_q_head, stride_out_token, stride_out_head,
    stride_cache_slot, stride_cache_head, stride_table,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_MASKS: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_LOADS: tl.constexpr,
):
    TOKENS_PER_TILE: tl.constexpr = BLOCK_M // GROUP
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _sequence_of_tile(query_start_ptr, num_seqs, tile, TOKENS_PER_TILE)
    query_begin = tl.load(query_start_ptr + seq)
    num_new = tl.load(query_start_ptr + seq + 1) - query_begin
    first = (tile - query_begin // TOKENS_PER_TILE - seq) * TOKENS_PER_TILE
    if first < num_new:
        num_cached = tl.load(num_cached_ptr + seq)
        num_keys = num_cached + num_new
        rows = tl.arange(0, BLOCK_M)
        token = first + rows // GROUP  # index among the sequence's new tokens
        head = kv_head * GROUP + rows % GROUP
        row_valid = (rows < TOKENS_PER_TILE * GROUP) & (token < num_new)
        dims = tl.arange(0, BLOCK_D)
        dim_valid = dims < HEAD_DIM  # all true, folded away, where HEAD_DIM is a power of two
        packed_row = (query_begin + token).to(tl.int64)

        q = tl.load(
            q_ptr + packed_row[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
            mask=row_valid[:, None] & dim_valid[None, :], other=0.0,
        )
        if UPCAST_LOADS:
            q = q.to(tl.float32)
        else:
            q = q.to(k_cache_ptr.dtype.element_ty)  # tl.dot wants both sides of one type

        # Causal rows need no key past the tile's last token; a custom mask may need them all.
        key_end = num_cached + tl.minimum(first + TOKENS_PER_TILE, num_new)
        if HAS_MASKS:
            mask_offset = tl.load(mask_offset_ptr + seq)
            mask_width = tl.load(mask_width_ptr + seq)
            mask_start = num_keys - mask_width  # keys before it are cached ones, visible to every row
            key_end = tl.where(mask_offset < 0, key_end, num_keys)

        running_max = tl.full((BLOCK_M,), -1.0e30, tl.float32)
        running_sum = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        head_offset = kv_head * stride_cache_head
        for key_start in range(0, key_end, BLOCK_N):
            keys = key_start + tl.arange(0, BLOCK_N)
            key_valid = keys < key_end
            page = tl.load(block_table_ptr + seq * stride_table + keys // PAGE_SIZE, mask=key_valid, other=0)
            slot = page.to(tl.int64) * PAGE_SIZE + keys % PAGE_SIZE
            k_t = tl.load(  # [BLOCK_D, BLOCK_N]: keys as columns, ready for q @ k_t
                k_cache_ptr + slot[None, :] * stride_cache_slot + head_offset + dims[:, None],
                mask=key_valid[None, :] & dim_valid[:, None], other=0.0,
            )
            v = tl.load(
                v_cache_ptr + slot[:, None] * stride_cache_slot + head_offset + dims[None, :],
                mask=key_valid[:, None] & dim_valid[None, :], other=0.0,
            )
            if UPCAST_LOADS:
                k_t = k_t.to(tl.float32)
                v = v.to(tl.float32)
            scores = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale_log2
            allowed = row_valid[:, None] & key_valid[None, :]
            causal = keys[None, :] <= (num_cached + token)[:, None]
            if HAS_MASKS:
                custom = (mask_offset >= 0) & (keys[None, :] >= mask_start)
                bits = tl.load(
                    masks_ptr + mask_offset + token[:, None] * mask_width + (keys[None, :] - mask_start),
                    mask=allowed & custom, other=0,
                )
                allowed = allowed & tl.where(custom, bits != 0, causal)
            else:
                allowed = allowed & causal
            scores = tl.where(allowed, scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, 1))
            probs = tl.exp2(scores - new_max[:, None])
            rescale = tl.exp2(running_max - new_max)
            running_sum = running_sum * rescale + tl.sum(probs, 1)
            acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
            running_max = new_max
        out = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
        tl.store(
            out_ptr + packed_row[:, None] * stride_out_token + head[:, None] * stride_out_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :],
        )


def attention_blocks(group: int, max_new: int, head_dim: int, fp32: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps) for a batch whose longest span adds max_new
    tokens. Powers of two, at least 16 (tl.dot's smallest tile): 16 query rows for decodes,
    up to 64 for trees and prefill chunks."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    rows = max(16, triton.next_power_of_2(group))
    block_m = max(rows, min(64, triton.next_power_of_2(max(1, max_new * group))))
    block_n = 64 if block_d <= 64 else 32
    if fp32:  # no tensor cores: smaller tiles, or the registers spill
        block_n = 32 if block_d <= 64 else 16
    return block_m, block_n, block_d, 4 if block_m <= 16 else 8


def store_blocks(num_kv_heads: int, head_dim: int) -> tuple[int, int]:
    return triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)


# The configurations compiled ahead of time for sm_90 (eaglesrv/kernels/sm90_report.py):
# Llama-3-8B-like (32 query heads over 8 kv heads, D=128) and SmolLM2-like (9 over 3, D=64)
# models; decode, tree and prefill tiles; fp32 caches too.
_TYPES = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}


def _signature(kernel, pointers: dict[str, str], floats: tuple[str, ...], constexprs: dict) -> dict[str, str]:
    """Triton's signature strings for every argument: pointers as given, floats fp32, the
    rest i32."""
    return {
        name: "constexpr" if name in constexprs else pointers.get(name, "fp32" if name in floats else "i32")
        for name in kernel.arg_names
    }


def _attention_build(dtype: str, head_dim: int, group: int, max_new: int, has_masks: bool) -> KernelBuild:
    block_m, block_n, block_d, num_warps = attention_blocks(group, max_new, head_dim, dtype == "fp32")
    constexprs = dict(
        HEAD_DIM=head_dim, GROUP=group, PAGE_SIZE=16, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        HAS_MASKS=has_masks, DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", UPCAST_LOADS=False,
    )
    data = {name: _TYPES[dtype] for name in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
    index = {name: "*i32" for name in ("block_table_ptr", "num_cached_ptr", "query_start_ptr", "mask_offset_ptr",
                                       "mask_width_ptr")}
    pointers = {**data, **index, "masks_ptr": "*u8"}
    # Strides that are multiples of the head size; max_pages and num_seqs may be anything.
    strides = ("stride_q_token", "stride_q_head", "stride_out_token", "stride_out_head", "stride_cache_slot",
               "stride_cache_head")
    kind = {1: "decode", 8: "tree"}.get(max_new, "prefill") + (" masks" if has_masks else "")
    return KernelBuild(
        name=f"paged_attention {dtype} D={head_dim} group={group} {kind} (M={block_m} N={block_n})",
        kernel=paged_attention_kernel,
        signature=_signature(paged_attention_kernel, pointers, ("scale_log2",), constexprs),
        constexprs=constexprs, num_warps=num_warps, aligned=(*pointers, *strides),
    )


def _store_build(dtype: str, num_kv_heads: int, head_dim: int) -> KernelBuild:
    block_h, block_d = store_blocks(num_kv_heads, head_dim)
    constexprs = dict(NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
                      UPCAST_LOADS=False)
    pointers = {name: _TYPES[dtype] for name in ("k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr")}
    pointers["slots_ptr"] = "*i32"
    strides = ("stride_k_token", "stride_k_head", "stride_v_token", "stride_v_head", "stride_cache_slot",
               "stride_cache_head")
    return KernelBuild(
        name=f"store_kv {dtype} kv_heads={num_kv_heads} D={head_dim}",
        kernel=store_kv_kernel,
        signature=_signature(store_kv_kernel, pointers, (), constexprs),
        constexprs=constexprs, aligned=(*pointers, *strides),
    )


SM90_BUILDS: list[KernelBuild] = [
    *(
        _attention_build(dtype, head_dim, group, max_new, has_masks)
        for dtype in ("bf16", "fp16")
        for head_dim, group in ((128, 4), (64, 3))
        for max_new, has_masks in ((1, False), (8, True), (512, False), (512, True))
    ),
    *(_attention_build("fp32", 64, 3, max_new, has_masks) for max_new, has_masks in ((1, False), (512, True))),
    *(_store_build(dtype, heads, dim) for dtype in ("bf16", "fp16", "fp32") for heads, dim in ((8, 128), (3, 64))),
]

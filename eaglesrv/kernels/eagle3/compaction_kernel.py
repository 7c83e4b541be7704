"""The Triton kernel behind compaction.compact_kv (layouts in compaction.py).

Grid: (request, layer, part of a slot's [kv_heads * head_dim] row). A program moves its
part of the row for every accepted node of its request, in path order, with a barrier
between each move's loads and its stores: a later move may overwrite an earlier move's
source (never the reverse, see compaction.py), and another thread of the program may hold
that source element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eaglesrv.kernels.triton_support import KernelBuild, upcast_loads

MAX_ROW_BLOCK = 1024  # row elements per program


@triton.jit
def _slot(pages, position, PAGE_SIZE: tl.constexpr):
    return tl.load(pages + position // PAGE_SIZE).to(tl.int64) * PAGE_SIZE + position % PAGE_SIZE


@triton.jit
def compact_kv_kernel(
    k_ptr, v_ptr, layer_stride, slot_stride,
    accepted_nodes_ptr, accepted_stride, accept_length_ptr, block_table_ptr, block_table_stride, root_position_ptr,
    row_size, PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr, UPCAST_LOADS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < row_size
    length = tl.load(accept_length_ptr + seq)
    root = tl.load(root_position_ptr + seq)
    pages = block_table_ptr + seq * block_table_stride
    layer_k = k_ptr + layer * layer_stride
    layer_v = v_ptr + layer * layer_stride
    for depth in range(1, length):
        node = tl.load(accepted_nodes_ptr + seq * accepted_stride + depth)
        moves = in_row & (node != depth)  # a node already in place stays
        source = _slot(pages, root + node, PAGE_SIZE) * slot_stride + cols
        target = _slot(pages, root + depth, PAGE_SIZE) * slot_stride + cols
        k = tl.load(layer_k + source, mask=moves)
        v = tl.load(layer_v + source, mask=moves)
        if UPCAST_LOADS:  # the interpreter's bf16 is raw bits; the store converts back
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        tl.debug_barrier()
        tl.store(layer_k + target, k, mask=moves)
        tl.store(layer_v + target, v, mask=moves)


@torch.library.custom_op("eaglesrv::eagle3_compact_kv", mutates_args=("k_pool", "v_pool"))
def compact_kv_op(
    k_pool: torch.Tensor, v_pool: torch.Tensor, accepted_nodes: torch.Tensor, accept_length: torch.Tensor,
    block_table: torch.Tensor, root_position: torch.Tensor, page_size: int,
) -> None:
    layers, _, kv_heads, head_dim = k_pool.shape
    row_size = kv_heads * head_dim
    block = min(triton.next_power_of_2(row_size), MAX_ROW_BLOCK)
    grid = (accepted_nodes.shape[0], layers, triton.cdiv(row_size, block))
    compact_kv_kernel[grid](
        k_pool, v_pool, k_pool.stride(0), k_pool.stride(1),
        accepted_nodes, accepted_nodes.stride(0), accept_length, block_table, block_table.stride(0), root_position,
        row_size, PAGE_SIZE=page_size, BLOCK=block, UPCAST_LOADS=upcast_loads(),
    )


@compact_kv_op.register_fake
def _(k_pool, v_pool, accepted_nodes, accept_length, block_table, root_position, page_size) -> None:
    return None


def _signature(dtype: str) -> dict[str, str]:
    return {
        "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "layer_stride": "i64", "slot_stride": "i32",
        "accepted_nodes_ptr": "*i64", "accepted_stride": "i32", "accept_length_ptr": "*i64",
        "block_table_ptr": "*i32", "block_table_stride": "i32", "root_position_ptr": "*i32", "row_size": "i32",
        "PAGE_SIZE": "constexpr", "BLOCK": "constexpr", "UPCAST_LOADS": "constexpr",
    }


# Rows (kv_heads x head_dim) of 2 x 64 (the tiny test Llama), 8 x 64 and 8 x 128 (1024 and over).
SM90_BUILDS: list[KernelBuild] = [
    KernelBuild(f"eagle3_compact_kv_{dtype}_block{block}", compact_kv_kernel, _signature(dtype),
                {"PAGE_SIZE": 16, "BLOCK": block, "UPCAST_LOADS": False})
    for dtype in ("bf16", "fp16", "fp32")
    for block in (128, 512, MAX_ROW_BLOCK)
]

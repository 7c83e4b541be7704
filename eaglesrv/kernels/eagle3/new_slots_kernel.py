"""The Triton kernel behind new_slots.new_token_slots (layouts in new_slots.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eaglesrv.kernels.triton_support import KernelBuild

TOKENS_PER_ITERATION = 128


@triton.jit
def new_token_slots_kernel(
    block_table_ptr, block_table_stride, num_cached_ptr, qo_indptr_ptr, slots_ptr,
    PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr,
):
    # One program per sequence; a long prefill chunk loops over blocks of its tokens.
    seq = tl.program_id(0)
    first_row = tl.load(qo_indptr_ptr + seq)
    num_new = tl.load(qo_indptr_ptr + seq + 1) - first_row
    cached = tl.load(num_cached_ptr + seq)
    pages = block_table_ptr + seq.to(tl.int64) * block_table_stride
    for start in range(0, num_new, BLOCK):
        i = start + tl.arange(0, BLOCK)
        valid = i < num_new
        position = cached + i
        page = tl.load(pages + position // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        tl.store(slots_ptr + first_row + i, page * PAGE_SIZE + position % PAGE_SIZE, mask=valid)


@torch.library.custom_op("eaglesrv::eagle3_new_token_slots", mutates_args=("slots",))
def new_token_slots_op(
    block_table: torch.Tensor, num_cached: torch.Tensor, qo_indptr: torch.Tensor, slots: torch.Tensor, page_size: int
) -> None:
    new_token_slots_kernel[(block_table.shape[0],)](
        block_table, block_table.stride(0), num_cached, qo_indptr, slots,
        PAGE_SIZE=page_size, BLOCK=TOKENS_PER_ITERATION,
    )


@new_token_slots_op.register_fake
def _(block_table, num_cached, qo_indptr, slots, page_size) -> None:
    return None


_SIGNATURE = {
    "block_table_ptr": "*i32", "block_table_stride": "i32", "num_cached_ptr": "*i32", "qo_indptr_ptr": "*i32",
    "slots_ptr": "*i64", "PAGE_SIZE": "constexpr", "BLOCK": "constexpr",
}
SM90_BUILDS: list[KernelBuild] = [
    KernelBuild(f"eagle3_new_token_slots_page{page}", new_token_slots_kernel, _SIGNATURE,
                {"PAGE_SIZE": page, "BLOCK": TOKENS_PER_ITERATION})
    for page in (1, 16, 64)
]

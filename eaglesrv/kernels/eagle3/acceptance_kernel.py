"""The Triton kernel behind acceptance.greedy_accept (layouts in acceptance.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eaglesrv.kernels.triton_support import KernelBuild


@triton.jit
def greedy_accept_kernel(
    tokens_ptr, parents_ptr, target_argmax_ptr, accepted_nodes_ptr, accept_length_ptr, bonus_ptr,
    num_nodes, max_depth, NODES_P2: tl.constexpr,
):
    # One program per tree; the whole tree sits in registers and each step of the walk is
    # a masked min over its nodes.
    row = tl.program_id(0).to(tl.int64)
    node_ids = tl.arange(0, NODES_P2)
    in_tree = node_ids < num_nodes
    tree_tokens = tl.load(tokens_ptr + row * num_nodes + node_ids, mask=in_tree, other=-1)
    tree_parents = tl.load(parents_ptr + row * num_nodes + node_ids, mask=in_tree, other=-2)
    argmax_row = target_argmax_ptr + row * num_nodes
    path_row = accepted_nodes_ptr + row * (max_depth + 1)

    node = 0
    length = 1  # the root counts
    want = tl.load(argmax_row)
    searching = 1
    while searching != 0:
        hit = (tree_parents == node) & (tree_tokens == want) & in_tree
        child = tl.min(tl.where(hit, node_ids, NODES_P2), axis=0)
        found = (child < NODES_P2) & (length <= max_depth)
        tl.store(path_row + length, child.to(tl.int64), mask=found)
        length += found.to(tl.int32)
        node = tl.where(found, child, node)
        want = tl.load(argmax_row + node)
        searching = found.to(tl.int32)

    # Column 0 is the root; columns past the path are padding. max_depth + 1 <= num_nodes.
    tl.store(path_row + node_ids, tl.where(node_ids == 0, 0, -1).to(tl.int64),
             mask=((node_ids == 0) | (node_ids >= length)) & (node_ids <= max_depth))
    tl.store(accept_length_ptr + row, length.to(tl.int64))
    tl.store(bonus_ptr + row, want.to(tl.int64))


@torch.library.custom_op(
    "eaglesrv::eagle3_greedy_accept", mutates_args=("accepted_nodes", "accept_length", "bonus"))
def greedy_accept_op(
    tokens: torch.Tensor, parents: torch.Tensor, target_argmax: torch.Tensor,
    accepted_nodes: torch.Tensor, accept_length: torch.Tensor, bonus: torch.Tensor,
) -> None:
    batch, num_nodes = tokens.shape
    greedy_accept_kernel[(batch,)](
        tokens, parents, target_argmax, accepted_nodes, accept_length, bonus,
        num_nodes, accepted_nodes.shape[1] - 1, NODES_P2=triton.next_power_of_2(num_nodes), num_warps=1,
    )


@greedy_accept_op.register_fake
def _(tokens, parents, target_argmax, accepted_nodes, accept_length, bonus) -> None:
    return None


_SIGNATURE = {
    "tokens_ptr": "*i64", "parents_ptr": "*i64", "target_argmax_ptr": "*i64", "accepted_nodes_ptr": "*i64",
    "accept_length_ptr": "*i64", "bonus_ptr": "*i64", "num_nodes": "i32", "max_depth": "i32",
    "NODES_P2": "constexpr",
}
SM90_BUILDS: list[KernelBuild] = [
    KernelBuild(f"eagle3_greedy_accept_nodes{nodes}", greedy_accept_kernel, _SIGNATURE, {"NODES_P2": nodes},
                num_warps=1)
    for nodes in (8, 32, 64, 128)
]

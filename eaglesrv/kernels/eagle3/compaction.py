"""Compaction of the accepted draft nodes' K/V, for a batch of trees, on the device.

    k_pool, v_pool  [layers, num_slots, kv_heads, head_dim]   KVPool.k / KVPool.v (mutated)
    accepted_nodes  [batch, width] int64   0, then the accepted nodes in path order, -1 padded
                                           (greedy_accept's output; for a sampled tree,
                                           [0] + Acceptance.path in the same layout)
    accept_length   [batch] int64          entries of accepted_nodes used (0 or 1: no moves)
    block_table     [batch, max_pages] int32   each request's page ids
    root_position   [batch] int32          position of each tree's root (num_cached)

A tree's node i was verified at position root + i. After acceptance the node in column d
of accepted_nodes belongs at position root + d, so for 1 <= d < accept_length the K/V of
every layer are copied from slot(root + accepted_nodes[b, d]) to slot(root + d); nodes
already in place are skipped. This is Eagle3Runner._compact for all requests at once.

Overlap: a source may be another move's destination. Accepted nodes increase along the
path (parents precede children), so node(d) >= d and a move's destination is never the
source of a later move, only possibly of an earlier one. The kernel copies in path order;
the torch reference gathers every source before writing; both give the same result.
"""

from __future__ import annotations

import torch

from eaglesrv.kernels.triton_support import triton_usable


def compact_kv(
    k_pool: torch.Tensor, v_pool: torch.Tensor, accepted_nodes: torch.Tensor, accept_length: torch.Tensor,
    block_table: torch.Tensor, root_position: torch.Tensor, page_size: int, kernel: bool = True,
) -> None:
    """Move every request's accepted K/V next to its root, in place; `kernel=False` runs
    the torch reference even where Triton could run."""
    if k_pool.shape != v_pool.shape or k_pool.stride() != v_pool.stride():
        raise ValueError("k_pool and v_pool must have the same shape and strides")
    if not (kernel and triton_usable(k_pool.device)):
        compact_kv_reference(k_pool, v_pool, accepted_nodes, accept_length, block_table, root_position, page_size)
        return
    if k_pool.stride(3) != 1 or k_pool.stride(2) != k_pool.shape[3]:
        raise ValueError("each slot's [kv_heads, head_dim] row must be contiguous")
    from eaglesrv.kernels.eagle3.compaction_kernel import compact_kv_op

    compact_kv_op(k_pool, v_pool, accepted_nodes.contiguous(), accept_length.contiguous(),
                  block_table.contiguous(), root_position.contiguous(), page_size)


def compact_kv_reference(
    k_pool: torch.Tensor, v_pool: torch.Tensor, accepted_nodes: torch.Tensor, accept_length: torch.Tensor,
    block_table: torch.Tensor, root_position: torch.Tensor, page_size: int,
) -> None:
    """The same moves with torch ops (the boolean selection syncs with the host on a GPU)."""
    depth = torch.arange(accepted_nodes.shape[1], device=accepted_nodes.device)
    moves = (depth >= 1) & (depth < accept_length[:, None]) & (accepted_nodes != depth)
    root = root_position.long()[:, None]
    source = _slots(block_table, root + accepted_nodes.long().clamp(min=0), page_size)[moves]
    target = _slots(block_table, root + depth, page_size)[moves]
    k_pool[:, target] = k_pool[:, source]  # the gather copies first, so overlaps are safe
    v_pool[:, target] = v_pool[:, source]


def _slots(block_table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Slots of positions [batch, width]; positions past the table (unused columns) are clamped."""
    pages = (positions // page_size).clamp(max=block_table.shape[1] - 1)
    return block_table.long().gather(1, pages) * page_size + positions % page_size

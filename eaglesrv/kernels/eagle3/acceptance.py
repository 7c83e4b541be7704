"""Greedy acceptance of a batch of verified draft trees, on the device.

    tokens          [batch, N] int    node tokens; node 0 is the root
    parents         [batch, N] int    parent node of each node, -1 for the root; parents
                                      precede their children (DraftTree's order)
    target_argmax   [batch, N] int    the target's greedy token after each node
  ->
    accepted_nodes  [batch, max_depth + 1] int64   0 (the root), then the accepted nodes
                                                   in path order, padded with -1
    accept_length   [batch] int64     entries of accepted_nodes used: accepted nodes + 1
                                      (the tokens this verification emits)
    bonus           [batch] int64     target_argmax at the last accepted node

The walk is verify.accept_greedy's: from the root, step to the first child (lowest node
index) whose token equals the target's argmax, until none does. It stops after max_depth
accepted nodes (the tree's depth, so it never cuts a walk short; a smaller value would
keep a prefix of the greedy path, still a correct greedy output). Row b's emitted tokens
are tokens[b, accepted_nodes[b, 1:accept_length[b]]] followed by bonus[b].
"""

from __future__ import annotations

import torch

from eaglesrv.kernels.triton_support import triton_usable


def greedy_accept(
    tokens: torch.Tensor, parents: torch.Tensor, target_argmax: torch.Tensor, max_depth: int, kernel: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(accepted_nodes, accept_length, bonus) for every tree (see the module docstring);
    `kernel=False` runs the torch reference even where Triton could run."""
    batch, num_nodes = tokens.shape
    if not 0 <= max_depth < num_nodes:
        raise ValueError(f"max_depth {max_depth} must be in [0, {num_nodes - 1}] for trees of {num_nodes} nodes")
    if not (kernel and triton_usable(tokens.device)):
        return greedy_accept_reference(tokens, parents, target_argmax, max_depth)
    from eaglesrv.kernels.eagle3.acceptance_kernel import greedy_accept_op

    device = tokens.device
    accepted_nodes = torch.empty(batch, max_depth + 1, dtype=torch.long, device=device)
    accept_length = torch.empty(batch, dtype=torch.long, device=device)
    bonus = torch.empty(batch, dtype=torch.long, device=device)
    greedy_accept_op(tokens.contiguous(), parents.contiguous(), target_argmax.contiguous(),
                     accepted_nodes, accept_length, bonus)
    return accepted_nodes, accept_length, bonus


def greedy_accept_reference(
    tokens: torch.Tensor, parents: torch.Tensor, target_argmax: torch.Tensor, max_depth: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same walk with batched torch ops: one step per depth, no host sync."""
    batch, num_nodes = tokens.shape
    device = tokens.device
    node_ids = torch.arange(num_nodes, device=device)
    node = torch.zeros(batch, dtype=torch.long, device=device)
    walking = torch.ones(batch, dtype=torch.bool, device=device)
    accepted = torch.full((batch, max_depth + 1), -1, dtype=torch.long, device=device)
    accepted[:, 0] = 0
    for depth in range(1, max_depth + 1):
        want = target_argmax.gather(1, node[:, None])
        hit = (parents == node[:, None]) & (tokens == want) & walking[:, None]
        child = torch.where(hit, node_ids, num_nodes).amin(dim=1)  # lowest index: accept_greedy's order
        walking = child < num_nodes
        accepted[:, depth] = torch.where(walking, child, -1)
        node = torch.where(walking, child, node)
    accept_length = (accepted >= 0).sum(dim=1)
    bonus = target_argmax.gather(1, node[:, None])[:, 0].long()
    return accepted, accept_length, bonus

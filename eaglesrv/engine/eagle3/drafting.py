"""Growing a batch of draft trees on the device: the draft passes and the tree builder.

One function serves the eager step and its graph (engine/eagle3/graphs.py): every
tensor stays on the device and nothing is read back to the host, so a graph can hold it.
The caller says how each draft pass attends (`PassContext`): spans planned on the host
(eager), or metadata built from device tensors (a graph's `uniform_metadata`).

Draft pass f (1 .. steps - 1) runs the topk frontier nodes of every request. Its K/V go
to scratch slots past the root n, and each node attends to the committed prefix and to
the scratch slots of its own ancestors:

    slots   n + (f-1)*topk + j   frontier node j of pass f          position n + f - 1
    mask    [topk, f * topk] over the last f * topk keys (the scratch of passes 1 .. f)
"""

from __future__ import annotations

from typing import Callable

import torch

from eaglesrv.engine.eagle3.draft_model import Eagle3DraftModel
from eaglesrv.engine.eagle3.tree import DraftTree, TreeBuilder
from eaglesrv.engine.forward_context import ForwardContext
from eaglesrv.engine.tree_shape import TreeShape

# (pass f, scratch masks [B, topk, f * topk]) -> how pass f attends over the draft's KV
PassContext = Callable[[int, torch.Tensor], ForwardContext]
# (log-probabilities [B, m, draft_vocab] at m nodes per tree, each node's path of target
# ids past the root [B][m]) -> the log-probabilities a grammar leaves, renormalized
Constraint = Callable[[torch.Tensor, list[list[list[int]]]], torch.Tensor]


def grow_trees(
    draft: Eagle3DraftModel,
    shape: TreeShape,
    root_tokens: torch.Tensor,  # [B] target ids of the last committed tokens
    root_logprobs: torch.Tensor,  # [B, draft_vocab] the draft's log-probabilities at the roots
    root_hidden: torch.Tensor,  # [B, H] the draft's pre-norm output at the roots
    num_cached: torch.Tensor,  # [B] the root positions
    context: PassContext,
    constraint: Constraint | None = None,
) -> DraftTree:
    """The trees; with a `constraint` (structured output, eager steps only: it reads the
    frontier back to the host) every expansion proposes only what the grammar allows."""
    batch, k = root_tokens.shape[0], shape.topk
    device = root_tokens.device
    builder = TreeBuilder(root_tokens, k, shape.nodes)
    if constraint is not None:
        root_logprobs = constraint(root_logprobs[:, None], [[[]] for _ in range(batch)])[:, 0]
    frontier = builder.expand_root(root_logprobs)
    features = root_hidden[:, None].expand(-1, k, -1)  # [B, k, H] the parent's output for each node
    own_slot = torch.arange(k, device=device).expand(batch, k)[..., None]
    ancestry = own_slot  # [B, k, f] scratch slot (within its pass) of each node's ancestor in pass 1 .. f
    for f in range(1, shape.steps):
        positions = (num_cached.long()[:, None] + f - 1).expand(batch, k).reshape(-1)
        input_ids = draft.draft_to_target[frontier].reshape(-1)
        logits, out = draft(input_ids, features.reshape(batch * k, -1), positions, context(f, scratch_masks(ancestry)))
        logprobs = torch.log_softmax(logits, dim=-1).view(batch, k, -1)
        if constraint is not None:
            logprobs = constraint(logprobs, builder.frontier_paths(draft.draft_to_target))
        frontier, parent_slot = builder.expand(logprobs)
        width = out.shape[-1]
        features = out.view(batch, k, width).gather(1, parent_slot[..., None].expand(-1, -1, width))
        ancestry = torch.cat([ancestry.gather(1, parent_slot[..., None].expand(-1, -1, f)), own_slot], dim=-1)
    return builder.finish(draft.draft_to_target)


def scratch_masks(ancestry: torch.Tensor) -> torch.Tensor:
    """[B, k, f * k] bool: frontier node j sees the scratch slot of its ancestor (and of
    itself) in every pass so far. ancestry [B, k, f]: that slot within each pass."""
    batch, k, passes = ancestry.shape
    columns = ancestry + torch.arange(passes, device=ancestry.device) * k
    masks = torch.zeros(batch, k, passes * k, dtype=torch.bool, device=ancestry.device)
    return masks.scatter_(2, columns, True)

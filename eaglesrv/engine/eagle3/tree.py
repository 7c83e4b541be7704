"""Draft-tree construction with SGLang's meaning of the three knobs.

    num_steps         depth of the tree (draft expansions)
    topk              children kept per expanded node, and width of the frontier
    num_draft_tokens  nodes verified by the target, root included

Expansion 1 takes the topk children of the root. Each later expansion gives every
frontier node topk children (topk * topk candidates), scored by cumulative draft
log-probability; the topk best become the next frontier. All candidates form a pool,
and the tree is the root plus the num_draft_tokens - 1 best of the pool. A child never
scores above its parent, and ties are broken towards earlier (shallower) pool entries,
so every chosen node's parent is chosen too.

    pool:   [ depth-1: topk ][ depth-2: topk*topk ][ depth-3: topk*topk ] ...
    tree:   node 0 = root (last accepted token), nodes 1.. = chosen pool entries in pool order
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """Trees for a batch of B requests, N nodes each (root included), in a topological order."""

    tokens: torch.Tensor  # [B, N] target-vocabulary ids; column 0 is the root token
    parents: torch.Tensor  # [B, N] index of each node's parent; -1 for the root
    depths: torch.Tensor  # [B, N] 0 for the root
    ranks: torch.Tensor  # [B, N] place among its parent's topk draft children (0 = best); -1 for the root

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def ancestor_mask(self) -> torch.Tensor:
        """[B, N, N] bool: node i may attend to node j (j is i or an ancestor of i)."""
        batch, n = self.tokens.shape
        device = self.parents.device
        mask = torch.eye(n, dtype=torch.bool, device=device).expand(batch, n, n).clone()
        rows = torch.arange(batch, device=device)
        for i in range(1, n):  # parents precede children, so row parent(i) is complete
            mask[:, i] |= mask[rows, self.parents[:, i]]
        return mask

    def children(self, row: int) -> list[list[int]]:
        """Children of every node of request `row`, in node order."""
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for node, parent in enumerate(self.parents[row].tolist()):
            if parent >= 0:
                kids[parent].append(node)
        return kids

    def trials(self, row: int, children: list[list[int]], path: list[int]) -> list[tuple[int, int, bool]]:
        """(depth, rank, hit) for every child of every node the acceptance walk of request
        `row` visited: what the adaptive acceptance table learns from."""
        depths, ranks = self.depths[row].tolist(), self.ranks[row].tolist()
        trials = []
        for visited, following in zip([0] + path, path + [None]):
            for child in children[visited]:
                trials.append((int(depths[child]), ranks[child], child == following))
        return trials


class TreeBuilder:
    """Accumulates the candidate pool one expansion at a time, for B requests at once.

    Pool entries are draft-vocabulary ids; `finish` maps them through `draft_to_target`.
    Every tensor stays on the root tokens' device and nothing is read back to the host, so
    the same builder serves the CPU and a GPU step (and a graph capture of it).
    """

    def __init__(self, root_tokens: torch.Tensor, topk: int, num_draft_tokens: int) -> None:
        self.root_tokens = root_tokens  # [B] target ids
        self.topk = topk
        self.num_draft_tokens = num_draft_tokens
        self.device = root_tokens.device
        self._child_rank = torch.arange(topk, device=self.device)
        self._scores: list[torch.Tensor] = []  # per expansion [B, m] cumulative log-probs
        self._tokens: list[torch.Tensor] = []  # per expansion [B, m] draft ids
        self._parents: list[torch.Tensor] = []  # per expansion [B, m] pool index of the parent (-1 root)
        self._ranks: list[torch.Tensor] = []  # per expansion [B, m] rank among the parent's children
        self._size = 0
        self.frontier_pool_index: torch.Tensor | None = None  # [B, topk]
        self.frontier_scores: torch.Tensor | None = None  # [B, topk]

    def expand_root(self, logprobs: torch.Tensor) -> torch.Tensor:
        """logprobs [B, Vd] at the root. Returns the frontier's draft ids [B, topk]."""
        scores, tokens = logprobs.topk(self.topk, dim=-1)
        ranks = self._child_rank.expand_as(tokens)
        return self._add(scores, tokens, torch.full_like(tokens, -1), ranks, keep=ranks)

    def expand(self, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logprobs [B, topk, Vd] at the frontier nodes. Returns the new frontier's draft ids
        [B, topk] and, for each, the slot of its parent in the previous frontier [B, topk]."""
        batch = logprobs.shape[0]
        child_scores, child_tokens = logprobs.topk(self.topk, dim=-1)  # [B, topk, topk]
        scores = (self.frontier_scores.unsqueeze(-1) + child_scores).reshape(batch, -1)
        parents = self.frontier_pool_index.unsqueeze(-1).expand(-1, -1, self.topk).reshape(batch, -1)
        order = _stable_best(scores, self.topk)  # [B, topk] positions within this expansion
        ranks = self._child_rank.repeat(self.topk).expand(batch, -1)
        tokens = self._add(scores, child_tokens.reshape(batch, -1), parents, ranks, keep=order)
        return tokens, order // self.topk

    def frontier_paths(self, draft_to_target: torch.Tensor) -> list[list[list[int]]]:
        """Each frontier node's tokens from the root's child down to itself, as target ids
        [B][topk], on the host (for grammars; the rest of the builder never syncs)."""
        tokens = draft_to_target[torch.cat(self._tokens, dim=1)].tolist()
        parents = torch.cat(self._parents, dim=1).tolist()
        paths = []
        for row, frontier in enumerate(self.frontier_pool_index.tolist()):
            paths.append([])
            for entry in frontier:
                path = []
                while entry >= 0:
                    path.append(tokens[row][entry])
                    entry = parents[row][entry]
                paths[-1].append(path[::-1])
        return paths

    def finish(self, draft_to_target: torch.Tensor) -> DraftTree:
        """The root plus the best num_draft_tokens - 1 pool entries. A chosen node's parent
        is always chosen (a child never scores above its parent and ties go to the earlier
        entry), which the tests check rather than a host sync here."""
        scores = torch.cat(self._scores, dim=1)
        pool_tokens = draft_to_target[torch.cat(self._tokens, dim=1)]
        pool_parents = torch.cat(self._parents, dim=1)
        pool_depths = torch.cat([torch.full_like(s, i + 1, dtype=torch.long) for i, s in enumerate(self._scores)], 1)
        chosen = _stable_best(scores, min(self.num_draft_tokens - 1, scores.shape[1])).sort(dim=1).values
        batch, count = chosen.shape
        # tree index of each pool entry, shifted by one so that the root's -1 maps to column 0
        tree_index = torch.zeros(batch, scores.shape[1] + 1, dtype=torch.long, device=self.device)
        tree_index.scatter_(1, chosen + 1, torch.arange(1, count + 1, device=self.device).expand(batch, -1))
        tree_parents = tree_index.gather(1, pool_parents.gather(1, chosen) + 1)

        def column(pool: torch.Tensor, root_value: torch.Tensor) -> torch.Tensor:
            return torch.cat([root_value[:, None], pool.gather(1, chosen)], dim=1)

        def constant(value: int) -> torch.Tensor:
            return torch.full((batch,), value, dtype=torch.long, device=self.device)

        return DraftTree(
            tokens=column(pool_tokens, self.root_tokens.to(pool_tokens.dtype)),
            parents=torch.cat([constant(-1)[:, None], tree_parents], dim=1),
            depths=column(pool_depths, constant(0)),
            ranks=column(torch.cat(self._ranks, dim=1), constant(-1)),
        )

    def _add(self, scores, tokens, parents, ranks, keep) -> torch.Tensor:
        self._scores.append(scores)
        self._tokens.append(tokens)
        self._parents.append(parents)
        self._ranks.append(ranks)
        self.frontier_pool_index = self._size + keep
        self.frontier_scores = scores.gather(1, keep)
        self._size += scores.shape[1]
        return tokens.gather(1, keep)


def _stable_best(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the `count` highest scores per row; ties go to the lower index."""
    return torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :count]

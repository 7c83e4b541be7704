"""Draft-tree construction against a brute-force reference on hand-made score tables."""

from __future__ import annotations

import hashlib

import pytest
import torch

from eaglesrv.engine.eagle3.tree import TreeBuilder
from eaglesrv.engine.tree_shape import tree_size

VOCAB = 12


def table(path: tuple[int, ...], seed: int) -> torch.Tensor:
    """A made-up draft distribution after `path` (log-probs over VOCAB, no ties within it:
    children are taken with topk, whose order among equal values is unspecified)."""
    digest = hashlib.sha256(repr((seed, path)).encode()).digest()
    raw = torch.tensor([digest[i] % 6 + i / 64 for i in range(VOCAB)], dtype=torch.float64)
    return torch.log_softmax(raw, dim=0)


def brute_force(num_steps, topk, num_draft, seed) -> set[tuple[int, ...]]:
    """Every candidate path with its score, frontier kept by score (stable), then the best."""
    pool: list[tuple[float, tuple[int, ...]]] = []
    frontier = [(0.0, ())]
    for _ in range(num_steps):
        candidates = []
        for score, path in frontier:
            logprobs = table(path, seed)
            ranked = sorted(range(VOCAB), key=lambda t: (-logprobs[t].item(), t))[:topk]
            candidates += [(score + logprobs[t].item(), path + (t,)) for t in ranked]
        pool += candidates
        frontier = sorted(candidates, key=lambda c: -c[0])[:topk]  # sorted() is stable
    best = sorted(pool, key=lambda c: -c[0])[: num_draft - 1]
    return {path for _, path in best}


def build(num_steps, topk, num_draft, seed) -> set[tuple[int, ...]]:
    builder = TreeBuilder(torch.tensor([0]), topk, num_draft)
    frontier = builder.expand_root(table((), seed).unsqueeze(0))
    paths = [(t,) for t in frontier[0].tolist()]
    for _ in range(1, num_steps):
        logprobs = torch.stack([table(p, seed) for p in paths]).unsqueeze(0)
        frontier, parent_slot = builder.expand(logprobs)
        paths = [paths[s] + (t,) for s, t in zip(parent_slot[0].tolist(), frontier[0].tolist())]
    tree = builder.finish(torch.arange(VOCAB))
    assert tree.num_nodes == tree_size(num_steps, topk, num_draft)
    tokens, parents = tree.tokens[0].tolist(), tree.parents[0].tolist()
    node_paths: list[tuple[int, ...]] = [()]
    for node in range(1, tree.num_nodes):
        assert 0 <= parents[node] < node  # topological order
        node_paths.append(node_paths[parents[node]] + (tokens[node],))
        assert tree.depths[0, node] == len(node_paths[-1])
    return set(node_paths[1:])


@pytest.mark.parametrize("num_steps,topk,num_draft", [(5, 8, 32), (3, 1, 4), (6, 10, 60), (4, 3, 12), (2, 4, 30)])
@pytest.mark.parametrize("seed", range(4))
def test_tree_matches_brute_force(num_steps, topk, num_draft, seed):
    if topk > VOCAB:
        pytest.skip("topk above the toy vocabulary")
    assert build(num_steps, topk, num_draft, seed) == brute_force(num_steps, topk, num_draft, seed)


def test_chain_is_the_greedy_path_and_mask_follows_ancestry():
    builder = TreeBuilder(torch.tensor([7]), 1, 4)
    builder.expand_root(table((), 0).unsqueeze(0))
    for _ in range(2):
        builder.expand(table((), 0).view(1, 1, -1))
    tree = builder.finish(torch.arange(VOCAB))
    assert tree.parents[0].tolist() == [-1, 0, 1, 2] and tree.depths[0].tolist() == [0, 1, 2, 3]
    assert torch.equal(tree.ancestor_mask()[0], torch.tril(torch.ones(4, 4, dtype=torch.bool)))

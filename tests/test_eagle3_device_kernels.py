"""The EAGLE-3 step's device bookkeeping (eaglesrv/kernels/eagle3) against host-side oracles:
new_token_slots, accept_greedy and a direct computation of compaction; TreeBuilder on the
device. Without a GPU the Triton kernels run in the interpreter (conftest sets TRITON_INTERPRET), so shapes
stay small."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from eaglesrv.engine.eagle3.tree import TreeBuilder
from eaglesrv.engine.eagle3.verify import accept_greedy
from eaglesrv.kernels.attention.base import SequenceSpan
from eaglesrv.kernels.eagle3 import (
    acceptance,
    compact_kv,
    compact_kv_reference,
    compaction,
    greedy_accept,
    greedy_accept_reference,
    new_slots,
    new_token_slots,
    new_token_slots_reference,
)
from eaglesrv.kernels.triton_support import triton_usable

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not triton_usable(CPU), reason="needs Triton's interpreter (TRITON_INTERPRET=1)")


# ---- shared helpers -------------------------------------------------------------------
def block_table(page_tables: list[list[int]]) -> torch.Tensor:
    """[batch, max_pages] int32, short rows padded with page 0 (never read)."""
    width = max(len(pages) for pages in page_tables)
    return torch.tensor([pages + [0] * (width - len(pages)) for pages in page_tables], dtype=torch.int32)


def random_tree(num_nodes: int, vocab: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """(tokens, parents) in a topological order: every parent precedes its children."""
    parents = [-1] + [rng.randrange(node) for node in range(1, num_nodes)]
    return [rng.randrange(vocab) for _ in range(num_nodes)], parents


def children_of(parents: list[int]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents):
        if parent >= 0:
            kids[parent].append(node)
    return kids


def depth_of(parents: list[int]) -> int:
    depths = [0] * len(parents)
    for node in range(1, len(parents)):
        depths[node] = depths[parents[node]] + 1
    return max(depths)


# ---- 1. new-token slots ---------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_new_token_slots_equal_the_span_computation(page_size):
    from test_attention import span_new_slots

    rng = random.Random(page_size)
    shapes = [(0, 37), (20, 1), (50, 8), (0, 0), (63, 1), (5, 19), (31, 0), (7, 2)]  # (num_cached, num_new)
    free = list(range(400))
    rng.shuffle(free)
    spans = [SequenceSpan([free.pop() for _ in range(-(-(c + n) // page_size) or 1)], c, n) for c, n in shapes]
    table = block_table([s.page_table for s in spans])
    num_cached = torch.tensor([s.num_cached for s in spans], dtype=torch.int32)
    qo_indptr = torch.tensor([0] + [s.num_new for s in spans]).cumsum(0).to(torch.int32)
    num_tokens = int(qo_indptr[-1])
    expected = torch.tensor(span_new_slots(spans, page_size), dtype=torch.long)

    assert torch.equal(new_token_slots_reference(table, num_cached, qo_indptr, page_size, num_tokens), expected)
    slots = new_token_slots(table, num_cached, qo_indptr, page_size, num_tokens)
    assert slots.dtype == torch.int64 and torch.equal(slots, expected)
    out = torch.full((num_tokens,), -7, dtype=torch.int64)
    assert new_token_slots(table, num_cached, qo_indptr, page_size, num_tokens, out=out) is out
    assert torch.equal(out, expected)


# ---- 2. greedy acceptance -------------------------------------------------------------
def check_against_accept_greedy(tokens, parents, argmax, max_depth):
    """Both implementations on the batch, every row against accept_greedy."""
    for accepted, length, bonus in (greedy_accept(tokens, parents, argmax, max_depth),
                                    greedy_accept_reference(tokens, parents, argmax, max_depth)):
        assert accepted.shape == (tokens.shape[0], max_depth + 1)
        for b in range(tokens.shape[0]):
            oracle = accept_greedy(tokens[b].tolist(), children_of(parents[b].tolist()), argmax[b].tolist())
            n = int(length[b])
            assert n == len(oracle.path) + 1
            assert accepted[b].tolist() == [0] + oracle.path + [-1] * (max_depth + 1 - n)
            assert int(bonus[b]) == oracle.bonus
    return greedy_accept(tokens, parents, argmax, max_depth)


@pytest.mark.parametrize("num_nodes,vocab,count", [(11, 2, 150), (11, 3, 150), (6, 1, 20)])
def test_greedy_accept_equals_accept_greedy_on_random_trees(num_nodes, vocab, count):
    # small vocabularies: long accepted paths, and siblings that tie on the target's token
    rng = random.Random(num_nodes * 100 + vocab)
    trees = [random_tree(num_nodes, vocab, rng) for _ in range(count)]
    tokens = torch.tensor([t for t, _ in trees])
    parents = torch.tensor([p for _, p in trees])
    argmax = torch.randint(0, vocab, (count, num_nodes), generator=torch.Generator().manual_seed(vocab))
    max_depth = max(depth_of(p) for _, p in trees)
    _, length, _ = check_against_accept_greedy(tokens, parents, argmax, max_depth)
    assert int(length.max()) >= 4  # the walks went deep


def test_greedy_accept_picks_the_lowest_matching_sibling():
    # root -> nodes 1, 2, 3 all carry token 5; node 2 has the only deeper match
    tokens = torch.tensor([[0, 5, 5, 5, 7]])
    parents = torch.tensor([[-1, 0, 0, 0, 2]])
    argmax = torch.tensor([[5, 7, 7, 7, 9]])
    accepted, length, bonus = check_against_accept_greedy(tokens, parents, argmax, 2)
    assert accepted.tolist() == [[0, 1, -1]] and length.tolist() == [2] and bonus.tolist() == [7]


def test_greedy_accept_stops_at_max_depth_with_a_correct_bonus():
    tokens = torch.tensor([[0, 1, 2, 3, 4]] * 2)
    parents = torch.tensor([[-1, 0, 1, 2, 3]] * 2)  # a chain the target accepts to the end
    argmax = torch.tensor([[1, 2, 3, 4, 9], [1, 2, 8, 4, 9]])
    for accepted, length, bonus in (greedy_accept(tokens, parents, argmax, 2),
                                    greedy_accept_reference(tokens, parents, argmax, 2)):
        assert accepted.tolist() == [[0, 1, 2], [0, 1, 2]]
        assert length.tolist() == [3, 3] and bonus.tolist() == [3, 8]


# ---- 3. compaction --------------------------------------------------------------------
PAGE = 4


def compaction_case(dtype, seed=0):
    """Requests with scattered pages, trees of 12 nodes and paths of every kind: none,
    already in place, across pages, reaching the last node; plus a padded row."""
    rng = random.Random(seed)
    num_nodes, layers, kv_heads, head_dim = 12, 2, 2, 8
    paths = [[], [1, 2, 3], [3, 7, 9, 11], [2, 5], [1, 4, 5, 6], None]  # None: padding (accept_length 0)
    for _ in range(4):  # random walks down random trees
        _, parents = random_tree(num_nodes, 1, rng)
        kids, node, path = children_of(parents), 0, []
        while kids[node] and rng.random() < 0.85:
            node = rng.choice(kids[node])
            path.append(node)
        paths.append(path)
    free = list(range(1, 64))
    rng.shuffle(free)
    roots = [rng.randrange(0, 14) for _ in paths]
    page_tables = [[free.pop() for _ in range(-(-(root + num_nodes) // PAGE))] for root in roots]
    width = max(len(p) for p in paths if p is not None) + 2
    accepted = torch.full((len(paths), width), -1, dtype=torch.long)
    lengths = torch.zeros(len(paths), dtype=torch.long)
    for b, path in enumerate(paths):
        if path is not None:
            accepted[b, : len(path) + 1] = torch.tensor([0] + path)
            lengths[b] = len(path) + 1
    g = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(layers, 64 * PAGE, kv_heads, head_dim, generator=g).to(dtype)
    v_pool = torch.randn(layers, 64 * PAGE, kv_heads, head_dim, generator=g).to(dtype)
    case = SimpleNamespace(k=k_pool, v=v_pool, accepted=accepted, lengths=lengths, table=block_table(page_tables),
                           roots=torch.tensor(roots, dtype=torch.int32))
    return case, paths, roots, page_tables


def directly_compacted(pool, paths, roots, page_tables):
    """Each accepted node's K/V, read before any move, written next to its root."""
    slot = lambda pages, position: pages[position // PAGE] * PAGE + position % PAGE  # noqa: E731
    expected = pool.clone()
    for path, root, pages in zip(paths, roots, page_tables):
        for d, node in enumerate(path or [], start=1):
            expected[:, slot(pages, root + d)] = pool[:, slot(pages, root + node)]
    return expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compact_kv_matches_a_direct_computation(dtype):
    case, paths, roots, page_tables = compaction_case(dtype)
    expected_k = directly_compacted(case.k, paths, roots, page_tables)
    expected_v = directly_compacted(case.v, paths, roots, page_tables)
    assert not torch.equal(expected_k, case.k)  # something moved

    for compact in (compact_kv, compact_kv_reference):
        k, v = case.k.clone(), case.v.clone()
        compact(k, v, case.accepted, case.lengths, case.table, case.roots, PAGE)
        assert torch.equal(k, expected_k) and torch.equal(v, expected_v), compact.__name__


def test_greedy_accept_feeds_compaction():
    """The two kernels chained on device tensors, as the runner calls them."""
    case, _, roots, page_tables = compaction_case(torch.float32, seed=1)
    rng = random.Random(1)
    trees = [random_tree(12, 2, rng) for _ in roots]
    tokens = torch.tensor([t for t, _ in trees])
    parents = torch.tensor([p for _, p in trees])
    argmax = torch.randint(0, 2, tokens.shape, generator=torch.Generator().manual_seed(1))
    accepted, length, _ = greedy_accept(tokens, parents, argmax, 11)
    paths = [accepted[b, 1: int(length[b])].tolist() for b in range(len(roots))]
    k, v = case.k.clone(), case.v.clone()
    compact_kv(k, v, accepted, length, case.table, case.roots, PAGE)
    assert torch.equal(k, directly_compacted(case.k, paths, roots, page_tables))
    assert torch.equal(v, directly_compacted(case.v, paths, roots, page_tables))


# ---- 4. tree building -----------------------------------------------------------------
@pytest.mark.parametrize("num_steps,topk,num_draft", [(5, 8, 32), (3, 1, 4), (4, 3, 12), (2, 4, 30)])
def test_every_chosen_tree_node_has_its_parent_chosen(num_steps, topk, num_draft):
    """TreeBuilder.finish relies on this instead of checking it with a host sync."""
    batch, vocab = 3, 16
    g = torch.Generator().manual_seed(num_steps * 10 + topk)
    # few distinct values: ties inside a distribution and between cumulative scores
    logprobs = lambda *shape: torch.log_softmax(torch.randint(0, 4, (*shape, vocab), generator=g).float(), -1)  # noqa: E731
    builder = TreeBuilder(torch.randint(0, 50, (batch,), generator=g), topk, num_draft)
    builder.expand_root(logprobs(batch))
    for _ in range(1, num_steps):
        builder.expand(logprobs(batch, topk))
    tree = builder.finish(torch.randperm(vocab, generator=g) + 100)
    parents = tree.parents[:, 1:]
    assert bool(((parents >= 0) & (parents < torch.arange(1, tree.num_nodes))).all())  # parents precede children
    assert torch.equal(tree.depths[:, 1:], tree.depths.gather(1, parents) + 1)


def test_sync_free_code_runs_on_another_device():
    """On the meta device (no data) any tensor made on the CPU or read back to the host fails."""
    meta = torch.device("meta")
    builder = TreeBuilder(torch.zeros(2, dtype=torch.long, device=meta), 3, 8)
    builder.expand_root(torch.randn(2, 10, device=meta))
    builder.expand(torch.randn(2, 3, 10, device=meta))
    tree = builder.finish(torch.arange(10, device=meta))
    assert tree.tokens.device == meta and tree.ancestor_mask().shape == (2, 8, 8)
    accepted, _, _ = greedy_accept_reference(tree.tokens, tree.parents, tree.tokens, 2)
    slots = new_token_slots_reference(torch.zeros(2, 3, dtype=torch.int32, device=meta),
                                      torch.zeros(2, dtype=torch.int32, device=meta),
                                      torch.zeros(3, dtype=torch.int32, device=meta), 16, 5)
    assert accepted.shape == (2, 3) and slots.shape == (5,)


# ---- 5. one op per launch, and the fallback -------------------------------------------
class RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_each_launch_is_one_custom_op():
    tokens, parents = torch.tensor([[0, 5, 6]]), torch.tensor([[-1, 0, 1]])
    argmax = torch.tensor([[5, 6, 7]])
    table, num_cached = torch.tensor([[3, 1]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    qo_indptr, slots = torch.tensor([0, 3], dtype=torch.int32), torch.empty(3, dtype=torch.long)
    accepted, length = torch.tensor([[0, 2]]), torch.tensor([2])
    k, v = torch.randn(2, 16, 1, 4), torch.randn(2, 16, 1, 4)  # pages 0..3
    with RecordOps() as recorded:
        new_token_slots(table, num_cached, qo_indptr, 4, 3, out=slots)
        compact_kv(k, v, accepted, length, table, num_cached, 4)
    assert recorded.ops == ["eaglesrv.eagle3_new_token_slots", "eaglesrv.eagle3_compact_kv"]
    with RecordOps() as recorded:
        greedy_accept(tokens, parents, argmax, 2)
    assert [op for op in recorded.ops if op != "aten.empty"] == ["eaglesrv.eagle3_greedy_accept"]

    from eaglesrv.kernels.eagle3.acceptance_kernel import greedy_accept_op
    from eaglesrv.kernels.eagle3.compaction_kernel import compact_kv_op
    from eaglesrv.kernels.eagle3.new_slots_kernel import new_token_slots_op

    checks = ("test_schema", "test_faketensor")  # declared mutations, fake registrations
    torch.library.opcheck(new_token_slots_op, (table, num_cached, qo_indptr, slots, 4), test_utils=checks)
    torch.library.opcheck(compact_kv_op, (k, v, accepted, length, table, num_cached, 4), test_utils=checks)
    outputs = (torch.empty(1, 3, dtype=torch.long), torch.empty(1, dtype=torch.long), torch.empty(1, dtype=torch.long))
    torch.library.opcheck(greedy_accept_op, (tokens, parents, argmax, *outputs), test_utils=checks)


def test_without_triton_the_references_run(monkeypatch):
    for module in (new_slots, acceptance, compaction):
        monkeypatch.setattr(module, "triton_usable", lambda device: False)
    with RecordOps() as recorded:
        slots = new_token_slots(torch.tensor([[3, 1]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32),
                                torch.tensor([0, 3], dtype=torch.int32), 4, 3)
        _, length, bonus = greedy_accept(torch.tensor([[0, 5, 6]]), torch.tensor([[-1, 0, 1]]),
                                         torch.tensor([[5, 6, 7]]), 2)
    assert slots.tolist() == [14, 15, 4] and length.tolist() == [3] and bonus.tolist() == [7]
    assert not any(op.startswith("eaglesrv.") for op in recorded.ops)

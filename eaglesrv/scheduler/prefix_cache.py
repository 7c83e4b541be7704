"""The prefix cache: full KV pages of earlier requests, found again by their tokens.

A radix tree whose edges are pages. A node stands for one full page of some request's
tokens; its key is the page's page_size tokens *and the token after them*. The EAGLE-3
draft's KV at a position is computed from the token after it, so the page's last slot is
only right for a continuation that starts with that token; the target's KV alone would not
need it. A prompt therefore matches a page only if it goes on past the page, which the
scheduler needs anyway: at least one token of every request is computed, to sample from.

Who holds what:
  - the cache holds one reference (PageAllocator) to each node's page, until it evicts it;
  - a request holds its page table's pages, matched ones included, and *locks* the path
    from the root to the deepest node it matched or inserted.
A lock covers every ancestor, so an unlocked node's whole subtree is unlocked: eviction
(least recently used leaf first) can reach every unlocked page, and `num_evictable` is
exactly the number of pages eviction can free.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Iterator, Sequence

from eaglesrv.scheduler.page_allocator import PageAllocator


def page_keys(tokens: Sequence[int], page_size: int, limit: int, first_page: int = 0) -> Iterator[tuple[int, ...]]:
    """The keys of the full pages of `tokens` from page `first_page` on, within the first
    `limit` tokens: each page's tokens and the token after them (a page with no token after
    it has no key yet)."""
    end = (first_page + 1) * page_size
    while end <= limit and end < len(tokens):
        yield tuple(tokens[end - page_size : end + 1])
        end += page_size


class CacheNode:
    __slots__ = ("key", "page", "parent", "depth", "children", "locks", "last_used")

    def __init__(self, key: tuple[int, ...], page: int, parent: "CacheNode | None") -> None:
        self.key = key  # the page's tokens and the one after them
        self.page = page
        self.parent = parent
        self.depth = parent.depth + 1 if parent is not None else 0  # pages from the start of the sequence
        self.children: dict[tuple[int, ...], CacheNode] = {}
        self.locks = 0  # requests whose path runs through this node
        self.last_used = 0


class PrefixCache:
    def __init__(self, pages: PageAllocator, page_size: int) -> None:
        self.pages = pages
        self.page_size = page_size
        self.root = CacheNode((), -1, None)
        self.root.locks = 1  # never evicted, never counted
        self.num_pages = 0  # pages the cache holds
        self.num_evictable = 0  # of those, pages no request uses
        self._clock = itertools.count(1)
        # hit rate: prompt tokens looked up at admission, and how many were found
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evicted_pages = 0

    # ---- lookups --------------------------------------------------------------------
    def match(self, tokens: Sequence[int], limit: int) -> list[CacheNode]:
        """The nodes of the longest cached prefix of `tokens`, at most `limit` tokens long."""
        node, found = self.root, []
        for key in page_keys(tokens, self.page_size, limit):
            node = node.children.get(key)
            if node is None:
                break
            found.append(node)
        return found

    def record_lookup(self, queried: int, hit: int) -> None:
        self.queried_tokens += queried
        self.hit_tokens += hit

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    # ---- requests' locks --------------------------------------------------------------
    def lock(self, node: CacheNode) -> None:
        """A request uses `node` and every node above it."""
        now = next(self._clock)
        while node is not self.root:
            if node.locks == 0:
                self.num_evictable -= 1
            node.locks += 1
            node.last_used = now
            node = node.parent

    def unlock(self, node: CacheNode) -> None:
        while node is not self.root:
            node.locks -= 1
            if node.locks == 0:
                self.num_evictable += 1
            node = node.parent

    # ---- filling and emptying ---------------------------------------------------------
    def insert(self, tokens: Sequence[int], page_table: Sequence[int], num_tokens: int,
               start: CacheNode | None = None) -> CacheNode:
        """Cache the full pages among the first `num_tokens` tokens (whose KV `page_table`
        holds, complete); returns the deepest node of that prefix (the root if none).
        `start`: a node of that prefix already cached (locked by the caller), to go on from.

        A page whose key is cached already keeps the cached page: the request's own copy
        stays its own and is freed with it."""
        node = start or self.root
        now = next(self._clock)
        for key in page_keys(tokens, self.page_size, num_tokens, first_page=node.depth):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = CacheNode(key, page_table[node.depth], node)
                self.pages.share([child.page])
                self.num_pages += 1
                self.num_evictable += 1
            child.last_used = now
            node = child
        return node

    def evict(self, count: int) -> int:
        """Free up to `count` unlocked pages, least recently used leaves first; returns how many."""
        if count <= 0 or not self.num_evictable:
            return 0
        leaves = [(n.last_used, id(n), n) for n in self._nodes() if n.locks == 0 and not n.children]
        heapq.heapify(leaves)
        freed = 0
        while leaves and freed < count:
            _, _, node = heapq.heappop(leaves)
            parent = node.parent
            del parent.children[node.key]
            self.pages.free([node.page])
            self.num_pages -= 1
            self.num_evictable -= 1
            self.evicted_pages += 1
            freed += 1
            if parent is not self.root and parent.locks == 0 and not parent.children:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))
        return freed

    def flush(self) -> int:
        """Evict every page no request uses; returns how many."""
        return self.evict(self.num_evictable)

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

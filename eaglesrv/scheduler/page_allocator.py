"""KV-cache page accounting. The pages themselves (tensors) live in the engine."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence


class OutOfPages(RuntimeError):
    """Not enough free pages; the caller decides whether to preempt or wait."""


class PageAllocator:
    """A free list of page ids in [0, num_pages), with a reference count per page.

    A page has one reference per holder: each request whose page table lists it, and the
    prefix cache while it keeps the page. It returns to the free list when the last one
    lets go. It refuses to free a page nobody holds and foreign ids, so a leak or a double
    use shows up as an error at the point it happens rather than as corrupted attention later.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"need at least one KV page, got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfPages(f"asked for {count} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(count)]
        for page in pages:
            self._refs[page] = 1
        return pages

    def share(self, pages: Sequence[int]) -> None:
        """One more holder for each of `pages`, which must be in use."""
        for page in pages:
            self._check_held(page)
            self._refs[page] += 1

    def free(self, pages: Sequence[int]) -> None:
        """Drop one reference to each of `pages`; a page nobody holds any more is free again."""
        for page in pages:
            self._check_held(page)
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)

    def holders(self, page: int) -> int:
        return self._refs[page]

    def _check_held(self, page: int) -> None:
        if not 0 <= page < self.num_pages or self._refs[page] == 0:
            raise ValueError(f"page {page} is not allocated")

    @contextmanager
    def borrowed(self, counts: Sequence[int]) -> Iterator[list[list[int]]]:
        """Page tables of counts[i] pages for a pass outside serving (cost-model timing,
        scoring, feature capture), given back on exit whatever happens. The one way pages
        leave the allocator other than through the scheduler."""
        tables: list[list[int]] = []
        try:
            for count in counts:
                tables.append(self.allocate(count))
            yield tables
        finally:
            for table in tables:
                self.free(table)

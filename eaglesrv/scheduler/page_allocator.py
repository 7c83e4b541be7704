"""KV-cache page accounting. The pages themselves (tensors) live in the engine."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence


class OutOfPages(RuntimeError):
    """Not enough free pages; the caller decides whether to preempt or wait."""


class PageAllocator:
    """A free list of page ids in [0, num_pages).

    It refuses double frees and foreign ids, so a leak or a double use shows up as an
    error at the point it happens rather than as corrupted attention later.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"need at least one KV page, got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._is_free = [True] * num_pages

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
            self._is_free[page] = False
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if not 0 <= page < self.num_pages or self._is_free[page]:
                raise ValueError(f"page {page} is not allocated")
            self._is_free[page] = True
            self._free.append(page)

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

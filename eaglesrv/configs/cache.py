from __future__ import annotations

from dataclasses import dataclass

from eaglesrv.configs.errors import require


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: page size, pool size, and whether finished prefixes are kept.

    The pool holds max_total_tokens tokens when given. Otherwise, on the CPU, it takes
    mem_fraction_static of the memory available at start-up (default 0.3) after the
    weights; on a GPU, of device memory.
    """

    page_size: int = 16
    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None
    disable_radix_cache: bool = False  # SGLang's name; off, every prompt is computed whole

    def __post_init__(self) -> None:
        require(1 <= self.page_size <= 1024, f"--page-size must be in [1, 1024], got {self.page_size}")
        require(
            self.max_total_tokens is None or self.max_total_tokens >= self.page_size,
            f"--max-total-tokens must be at least one page ({self.page_size}), got {self.max_total_tokens}",
        )
        require(
            self.mem_fraction_static is None or 0.0 < self.mem_fraction_static < 1.0,
            f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}",
        )

"""The batch sizes graphs are captured for, and the one a batch is padded to.

1, 2, 4, 8, then every multiple of 8 up to `--cuda-graph-max-bs`, as SGLang does. Unlike
SGLang, a maximum that is not on that ladder (say 20) is captured too, so the flag's value
is always the largest batch that runs in a graph.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

_SMALL_BATCH_SIZES = (1, 2, 4, 8)
_STEP = 8


def cuda_graph_batch_sizes(max_batch_size: int) -> list[int]:
    """Ascending batch sizes to capture, the largest being `max_batch_size`."""
    if max_batch_size < 1:
        raise ValueError(f"the largest graph batch size must be at least 1, got {max_batch_size}")
    sizes = [bs for bs in _SMALL_BATCH_SIZES if bs <= max_batch_size]
    sizes += range(2 * _STEP, max_batch_size + 1, _STEP)
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


def padded_batch_size(batch_sizes: Sequence[int], batch_size: int) -> int | None:
    """The smallest captured size that holds `batch_size` rows; None above the largest (run eagerly)."""
    if batch_size < 1:
        raise ValueError(f"a batch has at least one row, got {batch_size}")
    i = bisect.bisect_left(batch_sizes, batch_size)
    return batch_sizes[i] if i < len(batch_sizes) else None

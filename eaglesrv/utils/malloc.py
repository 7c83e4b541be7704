"""glibc malloc settings for the CPU engine: keep freed memory for the next step.

A CPU step allocates several [rows, vocab] float32 buffers (12.6 MB each at 64 rows of
the default model): logits, scaled logits, probabilities. By default glibc hands the
freed top of the heap back to the OS once it exceeds its trim threshold, so the next step
page-faults the same memory in again: 10,000-12,000 faults a step at 64 sampled rows
(a step 1.11-1.23x slower on a 2-core CPU), 6,700 for a sampled EAGLE-3 step at batch 1
with a 32-node tree (1.15-1.63x slower). Greedy batches mostly stayed under the
threshold (`scripts/malloc_step_cost.py` measures all of these).

Raising the trim threshold keeps that memory. Setting it disables glibc's dynamic mmap
threshold, so the mmap threshold is set too, to its largest value (32 MiB on 64-bit):
smaller buffers then come from the reused heap. The cost is that the process keeps its
peak heap instead of shrinking after it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's upper limit for M_MMAP_THRESHOLD on 64-bit
TRIM_THRESHOLD_BYTES = (1 << 31) - 1  # the largest a C int takes: in effect never trim
DISABLE_ENV = "EAGLESRV_KEEP_FREED_MEMORY"  # "0" leaves glibc's defaults

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Apply the settings once per process; True if they are in effect.

    Does nothing (False) off glibc, when EAGLESRV_KEEP_FREED_MEMORY=0, or when the
    MALLOC_TRIM_THRESHOLD_ / MALLOC_MMAP_THRESHOLD_ environment variables already chose.
    """
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> bool:
    if os.environ.get(DISABLE_ENV) == "0" or platform.libc_ver()[0] != "glibc":
        return False
    if "MALLOC_TRIM_THRESHOLD_" in os.environ or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False  # the user's own glibc tuning wins
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        done = (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    except (OSError, AttributeError, ctypes.ArgumentError):
        return False
    if done:
        logger.info("glibc malloc keeps freed memory (trim threshold off, mmap threshold 32 MiB); %s=0 to disable",
                    DISABLE_ENV)
    return bool(done)

"""Flags that are accepted but have no effect (yet): the one place that says so at start-up.

When a feature lands, delete its check here; nothing else in the server changes.
EAGLE-3 has landed: --speculative-algorithm EAGLE3 reaches the engine as given, so only
--speculative-* flags without an algorithm are reported. So have CUDA graphs for EAGLE-3's
steps. Flags that only matter with others are reported when given without them.
"""

from __future__ import annotations

import logging
from typing import Callable

from eaglesrv.configs import EngineConfig, ParallelConfig, SpeculativeConfig

logger = logging.getLogger(__name__)


def _speculation(config: EngineConfig) -> str | None:
    spec = config.speculative
    if not spec.enabled and spec != SpeculativeConfig():
        return "--speculative-* flags are ignored without --speculative-algorithm"
    return None


def _distributed_flags(config: EngineConfig) -> str | None:
    parallel = config.parallel
    defaults = ParallelConfig()
    if parallel.tp_size == 1 and (parallel.dist_init_addr, parallel.dist_timeout) != (defaults.dist_init_addr,
                                                                                      defaults.dist_timeout):
        return "--dist-init-addr and --dist-timeout are ignored without --tp-size above 1"
    return None


def _memory_flags(config: EngineConfig) -> str | None:
    cache = config.cache
    if cache.mem_fraction_static is not None and cache.max_total_tokens is not None:
        return "--mem-fraction-static is ignored because --max-total-tokens sizes the KV cache"
    return None


_CHECKS: tuple[Callable[[EngineConfig], str | None], ...] = (_speculation, _distributed_flags, _memory_flags)


def report_ignored_flags(config: EngineConfig) -> list[str]:
    """Log (as warnings) and return one notice per flag that has no effect with this config."""
    notices = [notice for check in _CHECKS if (notice := check(config))]
    for notice in notices:
        logger.warning("%s", notice)
    return notices

"""Flags that are accepted but have no effect (yet): the one place that says so at start-up.

When a feature lands, delete its check here; nothing else in the server changes.
- CUDA graphs for speculative steps: delete `_cuda_graphs` (plain decoding has them).
EAGLE-3 has landed: --speculative-algorithm EAGLE3 reaches the engine as given, so only
--speculative-* flags without an algorithm are reported.
"""

from __future__ import annotations

import logging
from typing import Callable

from eaglesrv.configs import EngineConfig, SpeculativeConfig

logger = logging.getLogger(__name__)


def _speculation(config: EngineConfig) -> str | None:
    spec = config.speculative
    if not spec.enabled and spec != SpeculativeConfig():
        return "--speculative-* flags are ignored without --speculative-algorithm"
    return None


def _cuda_graphs(config: EngineConfig) -> str | None:
    runtime = config.runtime
    if config.speculative.enabled and (runtime.cuda_graph_max_bs is not None or runtime.disable_cuda_graph):
        return ("CUDA graphs cover plain decoding only so far: with --speculative-algorithm every step runs "
                "eagerly, and --cuda-graph-max-bs and --disable-cuda-graph have no effect")
    return None


def _memory_flags(config: EngineConfig) -> str | None:
    cache = config.cache
    if cache.mem_fraction_static is not None and cache.max_total_tokens is not None:
        return "--mem-fraction-static is ignored because --max-total-tokens sizes the KV cache"
    return None


_CHECKS: tuple[Callable[[EngineConfig], str | None], ...] = (_speculation, _cuda_graphs, _memory_flags)


def report_ignored_flags(config: EngineConfig) -> list[str]:
    """Log (as warnings) and return one notice per flag that has no effect with this config."""
    notices = [notice for check in _CHECKS if (notice := check(config))]
    for notice in notices:
        logger.warning("%s", notice)
    return notices

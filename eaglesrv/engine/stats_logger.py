"""A periodic one-line summary of the engine loop, as SGLang's decode log does."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("eaglesrv.engine")


class StepStatsLogger:
    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._window_start = time.monotonic()
        self._window_tokens = 0
        self._window_accepted = 0  # spec counters at the window start, for a windowed accept length
        self._window_verifications = 0

    def record(self, new_tokens: int, running: int, waiting: int, pages_used: int, pages_total: int,
               spec: dict | None) -> None:
        self._window_tokens += new_tokens
        elapsed = time.monotonic() - self._window_start
        if elapsed < self.interval_s:
            return
        line = (f"running {running}, waiting {waiting}, KV pages {pages_used}/{pages_total} "
                f"({pages_used / pages_total:.0%}), generation {self._window_tokens / elapsed:.1f} tok/s")
        if spec is not None:
            verifications = spec["spec_verifications"] - self._window_verifications
            accepted = spec["spec_accepted_tokens"] - self._window_accepted
            if verifications:
                line += f", accept length {accepted / verifications:.2f}"
            if spec.get("spec_adaptive"):
                line += f", speculation {spec['spec_mode']}"
            self._window_verifications = spec["spec_verifications"]
            self._window_accepted = spec["spec_accepted_tokens"]
        logger.info(line)
        self._window_start = time.monotonic()
        self._window_tokens = 0

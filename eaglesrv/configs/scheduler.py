from __future__ import annotations

from dataclasses import dataclass

from eaglesrv.configs.errors import require


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits.

    chunked_prefill_size: the most tokens one forward pass computes (prefill chunks plus
    one per decoding request); -1 disables chunking (a prompt is prefilled whole).
    """

    max_running_requests: int = 256
    chunked_prefill_size: int = 2048
    # Pages kept free when admitting new requests, so that running ones can keep decoding
    # without being preempted at once.
    admission_watermark: float = 0.01

    def __post_init__(self) -> None:
        require(
            self.max_running_requests >= 1,
            f"--max-running-requests must be at least 1, got {self.max_running_requests}",
        )
        require(
            self.chunked_prefill_size == -1 or self.chunked_prefill_size >= 1,
            f"--chunked-prefill-size must be -1 (off) or at least 1, got {self.chunked_prefill_size}",
        )
        require(0.0 <= self.admission_watermark < 1.0, "admission_watermark must be in [0, 1)")

    @property
    def token_budget(self) -> int | None:
        """Most tokens per forward pass; None when unlimited."""
        return None if self.chunked_prefill_size == -1 else self.chunked_prefill_size

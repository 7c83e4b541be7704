from __future__ import annotations

from dataclasses import dataclass

from eaglesrv.configs.errors import require

# fcfs: arrival order (the default, as in SGLang and vLLM). lpm (longest prefix match): with
# the prefix cache on, the waiting request with the longest cached prefix first, so that
# requests whose prompts are mostly computed get their first token without waiting behind
# cold ones, at the cost of arrival order (SGLang's names).
SCHEDULE_POLICIES = ("fcfs", "lpm")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits.

    chunked_prefill_size: the most tokens one forward pass computes (prefill chunks plus
    one per decoding request); -1 disables chunking (a prompt is prefilled whole).
    schedule_policy: the order waiting requests are admitted in (SCHEDULE_POLICIES).
    """

    max_running_requests: int = 256
    chunked_prefill_size: int = 2048
    # Pages kept free when admitting new requests, so that running ones can keep decoding
    # without being preempted at once.
    admission_watermark: float = 0.01
    schedule_policy: str = "fcfs"

    def __post_init__(self) -> None:
        require(
            self.max_running_requests >= 1,
            f"--max-running-requests must be at least 1, got {self.max_running_requests}",
        )
        require(
            self.chunked_prefill_size == -1 or self.chunked_prefill_size >= 1,
            f"--chunked-prefill-size must be -1 (off) or at least 1, got {self.chunked_prefill_size}",
        )
        require(self.schedule_policy in SCHEDULE_POLICIES,
                f"--schedule-policy must be one of {', '.join(SCHEDULE_POLICIES)}, got {self.schedule_policy!r}")
        require(0.0 <= self.admission_watermark < 1.0, "admission_watermark must be in [0, 1)")

    @property
    def token_budget(self) -> int | None:
        """Most tokens per forward pass; None when unlimited."""
        return None if self.chunked_prefill_size == -1 else self.chunked_prefill_size

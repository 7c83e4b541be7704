from __future__ import annotations

from dataclasses import dataclass

from eaglesrv.configs.errors import require

ALGORITHMS = (None, "EAGLE3")


@dataclass(frozen=True)
class SpeculativeConfig:
    """EAGLE-3 settings, with SGLang's meanings.

    num_steps: draft depth; eagle_topk: branching per step; num_draft_tokens: tree nodes
    verified per request, root included. adaptive (the default): those three are the
    largest tree a step may use, and each step chooses how much to speculate, plain
    decoding included (engine/adaptive/); off, every step verifies that tree, as SGLang does.
    """

    algorithm: str | None = None
    draft_model_path: str | None = None
    num_steps: int = 5
    eagle_topk: int = 8
    num_draft_tokens: int = 32
    # On by default, since it is what keeps speculation from ever being slower than plain
    # decoding under load (docs/adaptive_speculation.md).
    adaptive: bool = True

    def __post_init__(self) -> None:
        require(
            self.algorithm in ALGORITHMS,
            f"--speculative-algorithm must be EAGLE3 or unset, got {self.algorithm!r}",
        )
        require(self.num_steps >= 1, f"--speculative-num-steps must be at least 1, got {self.num_steps}")
        require(self.eagle_topk >= 1, f"--speculative-eagle-topk must be at least 1, got {self.eagle_topk}")
        require(
            self.num_draft_tokens >= 2,
            f"--speculative-num-draft-tokens must be at least 2, got {self.num_draft_tokens}",
        )

    @property
    def enabled(self) -> bool:
        return self.algorithm is not None

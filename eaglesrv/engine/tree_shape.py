"""The shape of one speculative step, and the shapes an adaptive step may choose from.

Below both engine/eagle3 (which builds and verifies trees of a shape) and engine/adaptive
(which chooses a shape per step), so that neither imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from eaglesrv.configs import SpeculativeConfig


def tree_size(num_steps: int, topk: int, num_draft_tokens: int) -> int:
    """Nodes actually verified: no more than the pool can supply, root included."""
    pool = topk + (num_steps - 1) * topk * topk
    return min(num_draft_tokens - 1, pool) + 1


@dataclass(frozen=True, order=True)
class TreeShape:
    """SGLang's (num_steps, eagle_topk, num_draft_tokens); `nodes` is what is actually
    verified per request, root included (never more than the pool can supply)."""

    steps: int
    topk: int
    nodes: int

    @classmethod
    def of(cls, steps: int, topk: int, num_draft_tokens: int) -> "TreeShape":
        return cls(steps, topk, tree_size(steps, topk, num_draft_tokens))

    @classmethod
    def from_config(cls, spec: SpeculativeConfig) -> "TreeShape":
        return cls.of(spec.num_steps, spec.eagle_topk, spec.num_draft_tokens)

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    def fits_in(self, largest: "TreeShape") -> bool:
        return self.steps <= largest.steps and self.topk <= largest.topk and self.nodes <= largest.nodes

    def __str__(self) -> str:
        return f"({self.steps},{self.topk},{self.nodes})"


def candidate_shapes(largest: TreeShape) -> list[TreeShape]:
    """Every chain up to the largest depth, and trees on a power-of-two ladder of topk and
    node counts (plus the configured values), none larger than `largest` in any knob."""
    shapes = {TreeShape.of(steps, 1, steps + 1) for steps in range(1, largest.steps + 1)}
    topks = sorted({k for k in _ladder(largest.topk) if k > 1} | ({largest.topk} if largest.topk > 1 else set()))
    node_counts = sorted(set(_ladder(largest.nodes)) | {largest.nodes})
    for steps in range(1, largest.steps + 1):
        for topk in topks:
            for nodes in node_counts:
                if nodes > steps + 1 or steps == 1:  # shallower than its depth it would be a chain
                    shape = TreeShape.of(steps, topk, nodes)
                    if shape.nodes >= 3 and shape.fits_in(largest):
                        shapes.add(shape)
    return sorted(shapes)


def _ladder(limit: int) -> list[int]:
    values, value = [], 2
    while value <= limit:
        values.append(value)
        value *= 2
    return values

"""What a step costs: seconds of a target pass and of a draft pass, by rows computed.

So is the target's output layer, priced apart because it runs only on the rows that are
sampled or verified (not on prefill chunks). All are measured once on the machine at hand and interpolated linearly between the
measured row counts (past the largest, time grows in proportion to rows: passes that big
are compute-bound). Rows are packed tokens: a plain decode is one row per request, a
verification `nodes` rows per request, a draft pass topk rows per speculating request.

The measured times leave out what the passes do not show (tree building, acceptance on the
host). `corrections` holds, per kind of step, a decayed ratio of the step times actually
seen to the times predicted, so that the policy compares what steps really cost. Only
steps without prefill chunks feed it: a chunk's cost depends on its own length and
context, which the decode-shaped measurement does not model, and letting it in would
make plain decoding look dearer than it is whenever requests arrive.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

CORRECTION_DECAY = 0.95
CORRECTION_RANGE = (0.5, 2.0)


@dataclass
class CostCurve:
    """Seconds by rows, from measured points (rows ascending)."""

    rows: list[int]
    seconds: list[float]

    @classmethod
    def monotone(cls, rows: list[int], seconds: list[float]) -> "CostCurve":
        """More rows never cost less: a point below an earlier one is noise, raised to it."""
        return cls(list(rows), [float(t) for t in np.maximum.accumulate(np.asarray(seconds, dtype=float))])

    def __call__(self, rows) -> np.ndarray:
        rows = np.asarray(rows, dtype=float)
        x, y = np.asarray(self.rows, dtype=float), np.asarray(self.seconds)
        inside = np.interp(rows, x, y)
        beyond = y[-1] * rows / x[-1]
        return np.where(rows > x[-1], beyond, inside)

    def to_json(self) -> dict:
        return {"rows": self.rows, "seconds": self.seconds}


@dataclass
class CostModel:
    target: CostCurve  # one target pass (features captured), by rows, without the output layer
    logits: CostCurve  # the target's output layer, by rows it is applied to (sampled or verified rows)
    draft: CostCurve  # one draft pass, by rows
    context_tokens: int = 0  # cached tokens per request while measuring
    corrections: dict[str, float] = field(default_factory=lambda: {"plain": 1.0, "speculative": 1.0})

    def plain_step(self, decode_rows, other_rows: int = 0) -> np.ndarray:
        decode_rows = np.asarray(decode_rows)
        return (self.target(decode_rows + other_rows) + self.logits(decode_rows)) * self.corrections["plain"]

    def speculative_step(self, nodes, topk, steps, speculating, plain_rows, accept_length,
                         other_rows: int = 0) -> np.ndarray:
        """A step where `speculating` requests verify trees of (steps, topk, nodes) and
        `plain_rows` rows decode plainly beside them: steps - 1 draft passes of topk rows per
        speculating request, one target pass, one draft extend over the committed tokens.
        Arguments broadcast (numpy), so one call prices many shapes and set sizes."""
        speculating = np.asarray(speculating, dtype=float)
        decode_rows = speculating * np.asarray(nodes) + np.asarray(plain_rows)  # every row gets logits
        drafting = (np.asarray(steps) - 1) * self.draft(speculating * np.asarray(topk))
        extend = self.draft(speculating * np.asarray(accept_length))
        passes = self.target(decode_rows + other_rows) + self.logits(decode_rows)
        return (passes + drafting + extend) * self.corrections["speculative"]

    def observe(self, kind: str, predicted_s: float, actual_s: float) -> None:
        if predicted_s <= 0:
            return
        ratio = min(max(actual_s / predicted_s, CORRECTION_RANGE[0]), CORRECTION_RANGE[1])
        old = self.corrections[kind]
        # Ratios are of corrected predictions: fold the old factor back in.
        self.corrections[kind] = old * (CORRECTION_DECAY + (1 - CORRECTION_DECAY) * ratio)

    def to_json(self) -> dict:
        return {"target": self.target.to_json(), "logits": self.logits.to_json(), "draft": self.draft.to_json(),
                "context_tokens": self.context_tokens}

    @classmethod
    def from_json(cls, data: dict) -> "CostModel":
        return cls(CostCurve(**data["target"]), CostCurve(**data["logits"]), CostCurve(**data["draft"]),
                   data.get("context_tokens", 0))

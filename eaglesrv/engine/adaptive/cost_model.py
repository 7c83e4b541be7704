"""What a step costs: seconds of a target pass and of a draft pass, by rows computed and by
the context those rows attend over.

Passes are measured once on the machine at hand with every request CONTEXT_TOKENS deep
(calibrate.py) and interpolated linearly between the measured row counts (past the
largest, time grows in proportion to rows: passes that big are compute-bound). Rows are
packed tokens: a plain decode is one row per request, a verification `nodes` rows per
request, a draft pass topk rows per speculating request. The target's output layer is
priced apart, since it runs only on the rows that are sampled or verified.

Attention grows with the context each row attends over, and a tree multiplies it: at 16
requests 2,048 tokens deep, a pass of 8 rows each took 5.4x a plain decode's pass, against
2.9x at 128 tokens (default model, float32, 2-core AMD EPYC). A cost model measured at one
depth then prices long-context trees far too low, and a correction learnt on plain steps
cannot fix that (it drifted to a factor of 1.53 on ShareGPT prompts, and adaptive ran at
0.91x plain). So each pass also pays a measured price per row per context token beyond the
measured depth (`attention_s`, `draft_attention_s`); the policy hands in the excess:
sum over rows of (context - measured context).

The measured passes still leave out what a real step adds. `correction` learns it from
the step times seen (StepCorrection): a factor on the passes and a fixed host cost per
speculating request (tree building, acceptance, compaction). Only steps without prefill
chunks feed it: a chunk's cost depends on its own length and context, which the
decode-shaped measurement does not model, and letting it in would make plain decoding look
dearer than it is whenever requests arrive.

The draft's catch-up over a backlog (backlog.py) is priced apart (`catch_up`: a draft
pass over the backlog tokens, times a learnt ratio): it is paid once, in the step where a
request starts speculating, and its size varies from a few tokens to a whole prompt,
which a per-request constant cannot fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

CORRECTION_DECAY = 0.97  # per observed step: the fit follows the last ~30 steps
FACTOR_RANGE = (0.5, 3.0)
PER_REQUEST_RANGE_S = (0.0, 0.05)
PRIOR_WEIGHT = 0.1  # the prior (factor 1, no host cost) weighs a tenth of one step: it only keeps the fit defined
PER_REQUEST_SCALE_S = 0.01  # a host cost this large is as far from the prior as a factor of 2
CATCH_UP_DECAY = 0.8  # per observed catch-up: the learnt ratio follows the last few


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
class StepCorrection:
    """actual step seconds ~= factor * predicted passes + per_request_s * speculating requests.

    A multiplicative correction alone cannot tell the two apart: a host cost per
    speculating request is a large fraction of a one-request step and a small one of a
    64-request step, so one ratio learnt at one load misprices the others (with 16
    requests in flight on a 2-core CPU, steps running a one-token chain for all 16 took
    1.4x their ratio-corrected prediction, 94 against 68 ms). Fitted by decayed least
    squares on relative errors (each step weighs alike whatever its length), with a weak
    prior at (1, 0) so that it is defined from the first step and stays so while only one
    kind of step is seen.

    Plain and speculative steps keep their evidence apart, each decayed only by steps of
    its own kind. Only speculative steps say anything about the host cost, and with one
    shared decay a long plain spell faded that evidence back to the prior (no host cost):
    speculation then looked cheap again, the server switched to it, relearnt its cost and
    switched back, every few seconds (seen at 16 requests in flight on a 2-core CPU)."""

    factor: float = 1.0
    per_request_s: float = 0.0
    # Per kind [plain, speculative], the decayed normal equations of the least squares:
    # (g00, g01, g11) of the symmetric 2x2 Gram matrix and (m0, m1) of the moment. Plain
    # floats: this runs after every decode step, and numpy's per-call cost on 2x2 arrays
    # was most of its time.
    _gram: list = field(default_factory=lambda: [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    _moment: list = field(default_factory=lambda: [[0.0, 0.0], [0.0, 0.0]])

    def __call__(self, passes_s, speculating=0) -> np.ndarray:
        return self.factor * np.asarray(passes_s) + self.per_request_s * np.asarray(speculating)

    def observe(self, passes_s: float, speculating: int, actual_s: float) -> None:
        if passes_s <= 0 or actual_s <= 0:
            return
        x0, x1 = passes_s / actual_s, speculating / actual_s  # the equation x . (factor, h) = 1
        kind = int(speculating > 0)
        g, m = self._gram[kind], self._moment[kind]
        g[0], g[1], g[2] = CORRECTION_DECAY * g[0] + x0 * x0, CORRECTION_DECAY * g[1] + x0 * x1, \
            CORRECTION_DECAY * g[2] + x1 * x1
        m[0], m[1] = CORRECTION_DECAY * m[0] + x0, CORRECTION_DECAY * m[1] + x1
        # Both kinds' equations plus the prior at (1, 0), solved in closed form (Cramer).
        a = self._gram[0][0] + self._gram[1][0] + PRIOR_WEIGHT
        b = self._gram[0][1] + self._gram[1][1]
        d = self._gram[0][2] + self._gram[1][2] + PRIOR_WEIGHT / PER_REQUEST_SCALE_S**2
        r0 = self._moment[0][0] + self._moment[1][0] + PRIOR_WEIGHT
        r1 = self._moment[0][1] + self._moment[1][1]
        det = a * d - b * b  # > 0: the prior makes the matrix positive definite
        factor, per_request_s = (d * r0 - b * r1) / det, (a * r1 - b * r0) / det
        self.factor = min(max(factor, FACTOR_RANGE[0]), FACTOR_RANGE[1])
        self.per_request_s = min(max(per_request_s, PER_REQUEST_RANGE_S[0]), PER_REQUEST_RANGE_S[1])

    def to_json(self) -> dict:
        return {"factor": self.factor, "per_request_ms": 1e3 * self.per_request_s}


@dataclass
class CostModel:
    target: CostCurve  # one target pass (features captured), by rows, without the output layer
    logits: CostCurve  # the target's output layer, by rows it is applied to (sampled or verified rows)
    draft: CostCurve  # one draft pass, by rows
    context_tokens: int = 0  # cached tokens per request while measuring
    attention_s: float = 0.0  # target pass seconds per row per context token beyond context_tokens
    draft_attention_s: float = 0.0  # the same for a draft pass
    correction: StepCorrection = field(default_factory=StepCorrection)
    catch_up_factor: float = 1.0  # actual catch-up seconds over the draft curve's price, learnt

    def measured(self) -> "CostModel":
        """The measurement alone, with nothing learnt."""
        return CostModel(self.target, self.logits, self.draft, self.context_tokens, self.attention_s,
                         self.draft_attention_s)

    def catch_up(self, tokens) -> np.ndarray:
        """Seconds of the draft's catch-up over `tokens` backlog tokens in all (one draft
        pass over them; nothing when there are none)."""
        tokens = np.asarray(tokens, dtype=float)
        return np.where(tokens > 0, self.catch_up_factor * self.draft(np.maximum(tokens, 1)), 0.0)

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            ratio = float(np.clip(seconds / float(self.draft(tokens)), *FACTOR_RANGE))
            self.catch_up_factor = CATCH_UP_DECAY * self.catch_up_factor + (1 - CATCH_UP_DECAY) * ratio

    def plain_passes(self, decode_rows, other_rows: int = 0, excess=0.0) -> np.ndarray:
        """excess: over the decoding rows, the summed context beyond the measured depth."""
        decode_rows = np.asarray(decode_rows)
        return (self.target(decode_rows + other_rows) + self.logits(decode_rows)
                + self.attention_s * np.asarray(excess, dtype=float))

    def speculative_passes(self, nodes, topk, steps, speculating, plain_rows, accept_length,
                           spec_excess=0.0, plain_excess=0.0) -> np.ndarray:
        """The passes of a step where `speculating` requests verify trees of (steps, topk,
        nodes) and `plain_rows` rows decode plainly beside them: steps - 1 draft passes of
        topk rows per speculating request, one target pass, one draft extend over the
        committed tokens. spec_excess / plain_excess: the summed context beyond the measured
        depth of the speculating requests and of the plain rows (one per request: a tree
        multiplies its request's by its rows). Arguments broadcast (numpy), so one call
        prices many shapes and set sizes."""
        speculating = np.asarray(speculating, dtype=float)
        nodes, topk, steps = np.asarray(nodes), np.asarray(topk), np.asarray(steps)
        decode_rows = speculating * nodes + np.asarray(plain_rows)  # every row gets logits
        drafting = (steps - 1) * self.draft(speculating * topk)
        extend = self.draft(speculating * np.asarray(accept_length))
        spec_excess, plain_excess = np.asarray(spec_excess, dtype=float), np.asarray(plain_excess, dtype=float)
        attention = self.attention_s * (nodes * spec_excess + plain_excess)
        draft_attention = self.draft_attention_s * ((steps - 1) * topk + np.asarray(accept_length)) * spec_excess
        return self.target(decode_rows) + self.logits(decode_rows) + drafting + extend + attention + draft_attention

    def plain_step(self, decode_rows, other_rows: int = 0, excess=0.0) -> np.ndarray:
        """Predicted seconds of a plain step, corrected."""
        return self.correction(self.plain_passes(decode_rows, other_rows, excess))

    def speculative_step(self, nodes, topk, steps, speculating, plain_rows, accept_length,
                         spec_excess=0.0, plain_excess=0.0) -> np.ndarray:
        """Predicted seconds of a speculative step, corrected (see speculative_passes)."""
        passes = self.speculative_passes(nodes, topk, steps, speculating, plain_rows, accept_length,
                                         spec_excess, plain_excess)
        return self.correction(passes, speculating)

    def observe(self, passes_s: float, speculating: int, actual_s: float) -> None:
        self.correction.observe(passes_s, speculating, actual_s)

    def to_json(self) -> dict:
        return {"target": self.target.to_json(), "logits": self.logits.to_json(), "draft": self.draft.to_json(),
                "context_tokens": self.context_tokens, "attention_s": self.attention_s,
                "draft_attention_s": self.draft_attention_s}

    @classmethod
    def from_json(cls, data: dict) -> "CostModel":
        return cls(CostCurve(**data["target"]), CostCurve(**data["logits"]), CostCurve(**data["draft"]),
                   data.get("context_tokens", 0), data.get("attention_s", 0.0), data.get("draft_attention_s", 0.0))

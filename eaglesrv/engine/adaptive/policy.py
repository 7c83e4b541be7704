"""The per-step choice: how much to speculate, and for which requests.

For the decoding requests of a step, pick a shape s (plain decoding, or a chain or tree no
larger than the configured one) and the set S of requests that speculate with it, to
maximize the expected output tokens per second of the step:

    tokens(s, S) = decoding + (L(s) - 1) * sum of m_i over S
    value(s, S)  = tokens(s, S) / (seconds(s, |S|, contexts of S) + catch-up(S))

A step with a prefill chunk in its pass decodes plainly (see decide).

L(s) is the accept length the acceptance table predicts and m_i request i's multiplier
(acceptance.py). catch-up(S) is the draft's catch-up over the backlogs of the requests in
S (backlog.py): one draft pass over their backlogs, whose fixed cost is charged in full and
the rest spread over the steps it serves (the next CATCH_UP_HORIZON, or fewer when the
reply ends sooner). Without it, switching 16 requests to a chain for a predicted 2-7%
gain first paid a draft pass over their whole prompts, 157 ms on a 2-core CPU.

Apart from the catch-up and the contexts its trees attend over (cost_model.py), the step's
cost depends on S only through |S| and the gain is additive, so for each size j the S
searched is the j requests with the largest m_i (shorter backlogs, then shorter contexts,
first among equals): the search runs over shapes and j only, all at once with numpy. Tests
check it against every subset when no request has a backlog and all are equally deep; with
backlogs or mixed depths it is a heuristic, since a request may gain a little more than
another yet cost a much longer catch-up or a deeper tree.

Hysteresis: a tree changes for another only when the best value beats the current shape's
own best value by more than `hysteresis` (a fraction), so that noise in the estimates does
not make it flap; the set S is re-chosen every step. Against plain decoding the margin is
one-sided: speculation starts when it beats plain by `hysteresis` and goes on while it
beats it by half that, so it is never kept at break-even.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from eaglesrv.engine.adaptive.acceptance import AcceptanceTable
from eaglesrv.engine.adaptive.cost_model import CostModel
from eaglesrv.engine.tree_shape import TreeShape, candidate_shapes

HYSTERESIS = 0.05
CATCH_UP_HORIZON = 16  # steps a catch-up is spread over (what it buys lasts until the request stops speculating)
ACCEPT_REFRESH = 16  # verifications between recomputing every shape's predicted accept length


@dataclass(frozen=True)
class Decision:
    shape: TreeShape | None  # None: plain decoding for everyone
    speculating: tuple[int, ...]  # indices into the eligible list, best multipliers first
    tokens_per_s: float
    passes_s: float  # the step's predicted passes, uncorrected: what the correction learns from
    catch_up_s: float = 0.0  # predicted catch-up paid in this step, in full

    @property
    def kind(self) -> str:
        return "plain" if self.shape is None else "speculative"

    def describe(self) -> str:
        return "plain" if self.shape is None else f"{self.shape} for {len(self.speculating)}"


@dataclass(frozen=True)
class StepLoad:
    """What a step has to run, as the policy sees it."""

    decoding: int  # requests decoding one token (eligible or not)
    multipliers: Sequence[float]  # per eligible decoding request (may speculate)
    other_rows: int = 0  # prefill-chunk tokens computed in the same pass
    backlogs: Sequence[int] = ()  # per eligible request, tokens its draft must catch up on first (none if empty)
    remaining: Sequence[int] = ()  # per eligible request, tokens it may still generate (unbounded if empty)
    contexts: Sequence[int] = ()  # per eligible request, tokens in its cache (the measured depth if empty)
    other_context: int | None = None  # summed over decoding requests that may not speculate (measured depth if None)


class SpeculationPolicy:
    def __init__(self, largest: TreeShape, costs: CostModel, acceptance: AcceptanceTable,
                 hysteresis: float = HYSTERESIS, shapes: Sequence[TreeShape] | None = None) -> None:
        self.shapes = list(shapes) if shapes is not None else candidate_shapes(largest)
        self.costs = costs
        self.acceptance = acceptance
        self.hysteresis = hysteresis
        self.current: TreeShape | None = largest  # start as configured; the first steps measure acceptance
        self._nodes = np.array([[s.nodes] for s in self.shapes])  # [S, 1], to broadcast against set sizes
        self._topk = np.array([[s.topk] for s in self.shapes])
        self._steps = np.array([[s.steps] for s in self.shapes])
        self._accept: np.ndarray | None = None
        self._accept_version = -ACCEPT_REFRESH

    def decide(self, load: StepLoad) -> Decision:
        depth = self.costs.context_tokens
        excess = (np.asarray(load.contexts, dtype=float) - depth if len(load.contexts)
                  else np.zeros(len(load.multipliers)))  # [J] context beyond the measured depth
        other_excess = 0.0 if load.other_context is None else (
            load.other_context - depth * (load.decoding - len(load.multipliers)))
        total_excess = float(excess.sum()) + other_excess
        plain = Decision(None, (), load.decoding / float(self.costs.plain_step(load.decoding, excess=total_excess)),
                         float(self.costs.plain_passes(load.decoding, load.other_rows, total_excess)))
        if not load.multipliers:
            return plain  # nobody can speculate: the shape says nothing, keep it
        if load.other_rows:
            # Beside a prefill chunk, decode plainly and keep the shape. Trees there were
            # measured to lose: requests admitted a step earlier pay their draft catch-up
            # over the whole prompt, and since such steps cannot feed the correction
            # (cost_model.py), the policy would never learn that cost.
            return plain
        multipliers = np.asarray(load.multipliers, dtype=float)
        backlogs = np.asarray(load.backlogs, dtype=float) if len(load.backlogs) else np.zeros(len(multipliers))
        horizons = np.clip(np.asarray(load.remaining, dtype=float) if len(load.remaining) else CATCH_UP_HORIZON,
                           1, CATCH_UP_HORIZON)
        order = np.lexsort((excess, backlogs, -multipliers))  # best multiplier, then shortest backlog, context
        gains = np.cumsum(multipliers[order])  # [J] summed multipliers of the best j + 1
        sizes = np.arange(1, len(order) + 1)
        paid_tokens = np.cumsum(backlogs[order])  # [J] caught up in this step
        spread_tokens = np.cumsum((backlogs / horizons)[order])  # [J] the share this step is charged
        paid_s = self.costs.catch_up(paid_tokens)
        # The pass's fixed cost recurs at every return from a plain spell, however short:
        # only the rest, which grows with the tokens, is spread.
        fixed_s = self.costs.catch_up(np.minimum(paid_tokens, 1))
        spread_s = fixed_s + (paid_s - fixed_s) * spread_tokens / np.maximum(paid_tokens, 1)
        accept = self.accept_lengths()  # [S, 1]
        spec_excess = np.cumsum(excess[order])  # [J] of the best j + 1
        passes = self.costs.speculative_passes(self._nodes, self._topk, self._steps, sizes, load.decoding - sizes,
                                               accept, spec_excess, total_excess - spec_excess)  # [S, J]
        rates = (load.decoding + (accept - 1) * gains) / (self.costs.correction(passes, sizes) + spread_s)
        best_j = rates.argmax(axis=1)
        best_rates = rates[np.arange(len(self.shapes)), best_j]

        def option(index: int) -> Decision:
            j = int(best_j[index])
            return Decision(self.shapes[index], tuple(int(i) for i in order[: j + 1]), float(best_rates[index]),
                            float(passes[index, j]), float(paid_s[j]))

        speculative = option(int(best_rates.argmax()))
        if self.current in self.shapes:  # between trees: change only for a clear gain
            held = option(self.shapes.index(self.current))
            if speculative.tokens_per_s <= held.tokens_per_s * (1 + self.hysteresis):
                speculative = held
        # Against plain decoding, speculation must show a margin to start (the hysteresis)
        # and half of it to go on: near break-even its catch-ups and the estimates' noise
        # made it lose, by 2-7% at 16 requests on a CPU where trees barely paid.
        margin = self.hysteresis if self.current is None else self.hysteresis / 2
        best = speculative if speculative.tokens_per_s > plain.tokens_per_s * (1 + margin) else plain
        self.current = best.shape
        return best

    def accept_lengths(self) -> np.ndarray:
        """[S, 1] predicted accept length per candidate shape (refreshed every few verifications)."""
        if self._accept is None or self.acceptance.version - self._accept_version >= ACCEPT_REFRESH:
            self._accept = np.array([[self.acceptance.expected_accept_length(s)] for s in self.shapes])
            self._accept_version = self.acceptance.version
        return self._accept

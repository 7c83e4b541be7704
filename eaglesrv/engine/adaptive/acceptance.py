"""Online acceptance statistics, and the accept length they predict for any tree shape.

Model: at depth d, the target's next token is the draft's rank-r child of the node just
accepted with probability q[d][r] (ranks are mutually exclusive). A node is then accepted
with the product of q along its path, and the expected accept length of a tree is
1 + the sum of that over its nodes (the accepted path visits each node at most once).

q is estimated from verifications: each child present in a verified tree under a visited
node is one trial of (its depth, its rank), a hit if the walk went through it. Counts decay
by DECAY per verification (about the last 1/(1-DECAY) verifications count), so the table
follows the traffic. Each entry carries a prior of PRIOR_TRIALS pseudo-trials borrowed
from its neighbour: depth d from depth d - 1 at the same rank, rank r of depth 1 from half
of rank r - 1. So a head seen only as a chain predicts trees and deeper chains from what it
showed, instead of from a fixed guess, and wider trees are not tried on optimism alone.

The counts also fade by PLAIN_STEP_DECAY at every step that could have speculated and
decoded plainly (fade): the table falls back towards its prior, and the policy tries again.
Without that, evidence outlived the moment it was learnt in. Under load the policy
speculates only in brief spells, such as just after a wave of prompts, where the shipped
head keeps about a quarter of its depth-1 drafts against half later in a reply. One such
step at 16 requests took the first choice's q from 0.6 to 0.36. At 4 requests no tree
looked worth it after that, so none ran, nothing could correct the table, and the engine
decoded plainly there for good (83 against 100 tok/s with the fade, 2-core CPU).

Per request, a multiplier m = (accepted draft tokens + prior) / (predicted + prior), also
decayed, scales the table's prediction: L_request = 1 + m (L - 1). The table is shared;
each request's RequestAcceptance lives in that request's record in the EAGLE-3 runner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from eaglesrv.engine.tree_shape import TreeShape

DECAY = 0.998  # per verification: a window of about 500
PLAIN_STEP_DECAY = 0.98  # per step that could have speculated and did not: evidence halves in about 35
PRIOR_TRIALS = 4.0
PRIOR_TOP = 0.6  # prior q of the draft's first choice at depth 1, before any verification
PRIOR_NEXT_RANK = 0.5  # prior of rank r at depth 1: this fraction of rank r - 1's rate
REQUEST_DECAY = 0.9  # per verification of that request
REQUEST_PRIOR_TOKENS = 2.0  # pseudo-tokens behind a request's multiplier of 1
IDLE_DECAY = 0.95  # per step a request sits out: its record fades back towards the prior
MIN_Q = 1e-6


@dataclass
class RequestAcceptance:
    """One request's record: decayed accepted vs. predicted draft tokens."""

    accepted: float = 0.0
    predicted: float = 0.0

    @property
    def multiplier(self) -> float:
        return (self.accepted + REQUEST_PRIOR_TOKENS) / (self.predicted + REQUEST_PRIOR_TOKENS)

    def record(self, accepted: int, predicted: float) -> None:
        self.accepted = self.accepted * REQUEST_DECAY + accepted
        self.predicted = self.predicted * REQUEST_DECAY + predicted

    def relax(self) -> None:
        self.accepted *= IDLE_DECAY
        self.predicted *= IDLE_DECAY


@dataclass
class AcceptanceTable:
    depths: int  # largest tree depth (num_steps)
    ranks: int  # largest topk
    trials: np.ndarray = field(init=False)  # [depths, ranks], decayed
    hits: np.ndarray = field(init=False)
    version: int = 0  # bumped on every update, so predictions can be cached

    def __post_init__(self) -> None:
        self.trials = np.zeros((self.depths, self.ranks))  # observed, decayed
        self.hits = np.zeros((self.depths, self.ranks))
        self._cache: dict[TreeShape, float] = {}
        self._cache_version = -1
        self._cached_rates = np.zeros((0, 0))  # rates() at _cache_version

    def rates(self) -> np.ndarray:
        """q[d][r]: depth d + 1, rank r (0 = the draft's first choice)."""
        rates = np.zeros((self.depths, self.ranks))
        for d in range(self.depths):
            for r in range(self.ranks):
                if d > 0:
                    prior = rates[d - 1, r]
                else:
                    prior = PRIOR_TOP if r == 0 else PRIOR_NEXT_RANK * rates[0, r - 1]
                rates[d, r] = (self.hits[d, r] + PRIOR_TRIALS * prior) / (self.trials[d, r] + PRIOR_TRIALS)
        return rates

    def record(self, shape: TreeShape, trials: list[tuple[int, int, bool]], request: RequestAcceptance) -> None:
        """One verification of `request`: (depth 1-based, rank 0-based, hit) per child examined."""
        predicted = self.expected_accept_length(shape) - 1
        self.trials *= DECAY
        self.hits *= DECAY
        accepted = 0
        for depth, rank, hit in trials:
            self.trials[depth - 1, rank] += 1
            if hit:
                self.hits[depth - 1, rank] += 1
                accepted += 1
        request.record(accepted, predicted)
        self.version += 1

    def fade(self) -> None:
        """A step that could have speculated and decoded plainly: the evidence fades towards
        the prior. A table built on thousands of trials stays close to what it learnt for a
        few hundred such steps; one built on a handful of trials is back at its prior in
        well under a hundred."""
        self.trials *= PLAIN_STEP_DECAY
        self.hits *= PLAIN_STEP_DECAY
        self.version += 1

    def expected_accept_length(self, shape: TreeShape) -> float:
        if self._cache_version != self.version:  # rates once per version, not per shape (fade bumps it often)
            self._cache, self._cache_version, self._cached_rates = {}, self.version, self.rates()
        if shape not in self._cache:
            self._cache[shape] = expected_accept_length(self._cached_rates, shape)
        return self._cache[shape]

    def snapshot(self) -> list[list[float]]:
        return [[round(float(q), 4) for q in row] for row in self.rates()]


def expected_accept_length(rates: np.ndarray, shape: TreeShape) -> float:
    """1 + the summed path probabilities of the nodes a tree of `shape` would verify, built
    the way TreeBuilder builds it (a beam of topk per depth, then the best nodes of the
    pool) with log q standing in for the draft's log-probabilities."""
    log_q = np.log(np.clip(rates, MIN_Q, 1.0))
    k = shape.topk
    frontier = log_q[0, :k]
    pool = [frontier]
    for depth in range(1, shape.steps):
        children = (frontier[:, None] + log_q[depth, :k][None, :]).reshape(-1)
        pool.append(children)
        frontier = np.sort(children)[::-1][:k]
    scores = np.sort(np.concatenate(pool))[::-1][: shape.nodes - 1]
    return 1.0 + float(np.exp(scores).sum())


def chain_accept_length(rates_top: list[float]) -> float:
    """Closed form for a chain, for tests: 1 + q1 + q1 q2 + ..."""
    total, running = 1.0, 1.0
    for q in rates_top:
        running *= q
        total += running
    return total if math.isfinite(total) else 1.0

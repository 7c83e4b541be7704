"""The adaptive mode's shared state in one place: cost model, acceptance table, policy,
feature pool, and the record of what it chose (for /metrics and the logs). What it keeps
per request (acceptance record, backlog) lives in the EAGLE-3 runner's request records."""

from __future__ import annotations

import logging
import time

from eaglesrv.engine.adaptive.acceptance import AcceptanceTable, RequestAcceptance
from eaglesrv.engine.adaptive.backlog import FeaturePool
from eaglesrv.engine.adaptive.cost_model import CostModel
from eaglesrv.engine.adaptive.policy import HYSTERESIS, Decision, SpeculationPolicy, StepLoad
from eaglesrv.engine.tree_shape import TreeShape

logger = logging.getLogger(__name__)

LOG_INTERVAL_S = 2.0  # mode changes are logged at most this often (the stats line shows the rest)
PLAIN_RECHECK_STEPS = 3  # steps a plain decision may be repeated without a search (see repeat_plain)


class AdaptiveSpeculation:
    def __init__(self, largest: TreeShape, costs: CostModel, features: FeaturePool,
                 hysteresis: float = HYSTERESIS) -> None:
        self.largest = largest
        self.costs = costs
        self.acceptance = AcceptanceTable(largest.steps, largest.topk)
        self.policy = SpeculationPolicy(largest, costs, self.acceptance, hysteresis)
        self.features = features
        self.last: Decision | None = None
        self.steps = {"plain": 0, "speculative": 0}
        self._logged_shape: object = "unset"
        self._logged_at = 0.0
        # requests decoding at the last search, if it chose plain for a decode-only step (else None)
        self._plain_decoding: int | None = None
        self._repeats = 0  # steps that repeated that decision since

    def restart(self) -> "AdaptiveSpeculation":
        """The same measured costs and feature pool with nothing learnt: after warm-up,
        whose first-call steps and dummy prompts say nothing about real traffic."""
        return AdaptiveSpeculation(self.largest, self.costs.measured(), self.features, self.policy.hysteresis)

    def repeat_plain(self, decoding: int, other_rows: int, eligible: list[RequestAcceptance]) -> Decision | None:
        """The last decision again, without a search, when it chose plain decoding for a
        decode-only step of the same number of requests at most PLAIN_RECHECK_STEPS ago,
        and this step is decode-only too; else None (search). A long plain spell is where
        the search costs most against what it can change: it was about 1% of a 64-request
        step on a 2-core CPU, and a change of load (a request finishing or arriving)
        searches again at once."""
        if other_rows or self._plain_decoding != decoding or self._repeats >= PLAIN_RECHECK_STEPS:
            return None
        self._repeats += 1
        self._record(self.last, decoding, eligible)
        return self.last

    def decide(self, load: StepLoad, eligible: list[RequestAcceptance]) -> Decision:
        """The step's shape and speculating requests; `eligible` holds the records of the
        requests that may speculate, in the order of load.multipliers."""
        decision = self.policy.decide(load)
        if not load.decoding:
            return decision  # a prefill-only step: nothing was chosen, nothing to record
        # Only a decode-only plain step may be repeated: beside a prefill chunk the step's
        # passes differ, and the chunk's request joins the decoding ones next step.
        self._plain_decoding = load.decoding if decision.shape is None and not load.other_rows else None
        self._repeats = 0
        self._record(decision, load.decoding, eligible)
        return decision

    def _record(self, decision: Decision, decoding: int, eligible: list[RequestAcceptance]) -> None:
        chosen = set(decision.speculating)
        for index, record in enumerate(eligible):
            if index not in chosen:  # sat this step out: a poor record is retried after a while
                record.relax()
        if eligible and decision.shape is None:  # and so is a poor table (acceptance.py)
            self.acceptance.fade()
        self.last = decision
        self.steps[decision.kind] += 1
        now = time.monotonic()
        if decision.shape != self._logged_shape and now - self._logged_at >= LOG_INTERVAL_S:
            logger.info("speculation: %s of %d decoding (predicted %.0f tok/s)", decision.describe(),
                        decoding, decision.tokens_per_s)
            self._logged_shape, self._logged_at = decision.shape, now

    def observe(self, decision: Decision, seconds: float) -> None:
        self.costs.observe(decision.passes_s, len(decision.speculating), seconds)

    def snapshot(self) -> dict:
        shape = self.last.shape if self.last is not None else None
        return {
            "spec_adaptive": True,
            "spec_mode": self.last.describe() if self.last is not None else "none yet",
            "spec_mode_num_steps": shape.steps if shape else 0,
            "spec_mode_topk": shape.topk if shape else 0,
            "spec_mode_draft_tokens": shape.nodes if shape else 0,
            "spec_mode_requests": len(self.last.speculating) if self.last is not None else 0,
            "spec_steps_plain": self.steps["plain"],
            "spec_steps_speculative": self.steps["speculative"],
            "spec_acceptance_table": self.acceptance.snapshot(),
            "spec_cost_correction": self.costs.correction.to_json(),
        }

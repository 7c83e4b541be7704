"""The adaptive mode's state in one place: cost model, acceptance table, policy, backlog,
and the record of what it chose (for /metrics and the logs)."""

from __future__ import annotations

import logging
import time

from eaglesrv.engine.adaptive.acceptance import AcceptanceTable
from eaglesrv.engine.adaptive.backlog import FeatureBacklog
from eaglesrv.engine.adaptive.cost_model import CostModel
from eaglesrv.engine.adaptive.policy import HYSTERESIS, Decision, SpeculationPolicy, StepLoad
from eaglesrv.engine.eagle3.shape import TreeShape

logger = logging.getLogger(__name__)

LOG_INTERVAL_S = 2.0  # mode changes are logged at most this often (the stats line shows the rest)


class AdaptiveSpeculation:
    def __init__(self, largest: TreeShape, costs: CostModel, hysteresis: float = HYSTERESIS) -> None:
        self.largest = largest
        self.costs = costs
        self.acceptance = AcceptanceTable(largest.steps, largest.topk)
        self.policy = SpeculationPolicy(largest, costs, self.acceptance, hysteresis)
        self.backlog = FeatureBacklog()
        self.last: Decision | None = None
        self.steps = {"plain": 0, "speculative": 0}
        self._logged_shape: object = "unset"
        self._logged_at = 0.0

    def restart(self) -> "AdaptiveSpeculation":
        """The same measured costs with nothing learnt: after warm-up, whose first-call
        steps and dummy prompts say nothing about real traffic."""
        fresh = CostModel(self.costs.target, self.costs.logits, self.costs.draft, self.costs.context_tokens)
        return AdaptiveSpeculation(self.largest, fresh, self.policy.hysteresis)

    def decide(self, load: StepLoad, eligible_ids: list[str]) -> Decision:
        decision = self.policy.decide(load)
        if not load.decoding:
            return decision  # a prefill-only step: nothing was chosen, nothing to record
        chosen = set(decision.speculating)
        self.acceptance.relax(rid for index, rid in enumerate(eligible_ids) if index not in chosen)
        self.last = decision
        self.steps[decision.kind] += 1
        now = time.monotonic()
        if decision.shape != self._logged_shape and now - self._logged_at >= LOG_INTERVAL_S:
            logger.info("speculation: %s of %d decoding (predicted %.0f tok/s)", decision.describe(),
                        load.decoding, decision.tokens_per_s)
            self._logged_shape, self._logged_at = decision.shape, now
        return decision

    def observe(self, decision: Decision, seconds: float) -> None:
        self.costs.observe(decision.passes_s, len(decision.speculating), seconds)

    def forget(self, request_id: str) -> None:
        self.acceptance.forget(request_id)
        self.backlog.forget(request_id)

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

"""Adaptive speculation, the pure parts: predicted accept lengths, the acceptance table,
the cost model, and the policy against a brute-force search over shapes and request sets."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from eaglesrv.engine.adaptive.acceptance import AcceptanceTable, chain_accept_length, expected_accept_length
from eaglesrv.engine.adaptive.cost_model import CostCurve, CostModel, StepCorrection
from eaglesrv.engine.adaptive.policy import SpeculationPolicy, StepLoad
from eaglesrv.engine.tree_shape import TreeShape, candidate_shapes

ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def synthetic_costs(rng: np.random.Generator) -> CostModel:
    """A memory-bound floor, then time growing with rows; random knee, slope and draft cost."""
    floor, knee = rng.uniform(0.01, 0.05), rng.choice([4, 8, 16, 32])
    target = [floor * max(1.0, r / knee) * rng.uniform(1.0, 1.05) for r in ROWS]
    target = list(np.maximum.accumulate(target))
    draft_floor = floor * rng.uniform(0.02, 0.2)
    draft = list(np.maximum.accumulate([draft_floor * max(1.0, r / 64) for r in ROWS]))
    logits = [0.2 * t for t in target]
    correction = StepCorrection(factor=rng.uniform(0.7, 1.5), per_request_s=rng.uniform(0, 0.3) * floor)
    return CostModel(CostCurve(ROWS, target), CostCurve(ROWS, logits), CostCurve(ROWS, draft), correction=correction)


def knee_costs(knee: int, draft_s: float) -> CostModel:
    """Target passes at 40 ms up to `knee` rows, then growing with rows; a free output layer
    and a flat draft pass."""
    return CostModel(CostCurve(ROWS, [0.04 * max(1, r / knee) for r in ROWS]), CostCurve(ROWS, [0.0] * len(ROWS)),
                     CostCurve(ROWS, [draft_s] * len(ROWS)))


def fixed_table(rates: np.ndarray) -> AcceptanceTable:
    """A table that has seen 100 trials at every (depth, rank), with these hit rates."""
    table = AcceptanceTable(*rates.shape)
    table.hits, table.trials = rates * 100.0, np.full(rates.shape, 100.0)
    table.version += 1
    return table


def synthetic_table(rng: np.random.Generator, depths: int, ranks: int) -> AcceptanceTable:
    rates = rng.dirichlet(np.ones(ranks + 1), size=depths)[:, :ranks]  # rank shares, plus "no child matches"
    rates[:, 0] += rng.uniform(0, 1) * (1 - rates.sum(axis=1))  # make the first choice likelier
    return fixed_table(rates)


def brute_force(shapes, costs: CostModel, table: AcceptanceTable, load: StepLoad) -> float:
    """The best tokens/s over plain decoding and every (shape, subset of eligible requests)."""
    best = load.decoding / float(costs.plain_step(load.decoding))
    if load.other_rows:
        return best  # beside a prefill chunk: plain
    eligible = range(len(load.multipliers))
    for shape in shapes:
        accept = table.expected_accept_length(shape)
        for size in range(1, len(load.multipliers) + 1):
            for subset in itertools.combinations(eligible, size):
                tokens = load.decoding + sum(1 + load.multipliers[i] * (accept - 1) - 1 for i in subset)
                seconds = float(costs.speculative_step(shape.nodes, shape.topk, shape.steps, size,
                                                       load.decoding - size, accept))
                best = max(best, tokens / seconds)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_policy_choice_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    largest = TreeShape.of(*[(5, 8, 32), (4, 4, 16), (3, 1, 4), (6, 3, 20)][seed % 4])
    costs, table = synthetic_costs(rng), synthetic_table(rng, largest.steps, largest.topk)
    eligible = int(rng.integers(0, 6))
    load = StepLoad(decoding=eligible + int(rng.integers(0, 3)),
                    multipliers=list(rng.uniform(0.2, 1.6, size=eligible)),
                    other_rows=int(rng.integers(0, 40)) if seed % 3 == 0 else 0)
    if load.decoding == 0:
        load = StepLoad(1, [1.0])
    policy = SpeculationPolicy(largest, costs, table, hysteresis=0.0)
    policy.current = None
    decision = policy.decide(load)
    assert decision.tokens_per_s == pytest.approx(brute_force(policy.shapes, costs, table, load), rel=1e-9)
    # The decision's set is the best-multiplier requests, and its rate is what it claims.
    if decision.shape is not None:
        chosen = sorted(decision.speculating, key=lambda i: -load.multipliers[i])
        assert chosen == list(decision.speculating)
        assert min(load.multipliers[i] for i in chosen) >= max(
            [load.multipliers[i] for i in range(len(load.multipliers)) if i not in chosen], default=0.0)


def test_policy_goes_plain_under_load_and_speculates_alone():
    costs = knee_costs(16, 0.002)
    table = fixed_table(np.tile([0.8, 0.1, 0.05, 0, 0, 0, 0, 0], (5, 1)))
    policy = SpeculationPolicy(TreeShape.of(5, 8, 32), costs, table)
    alone = policy.decide(StepLoad(1, [1.0]))
    assert alone.shape is not None and alone.tokens_per_s > 1 / 0.04 * 2  # better than twice plain decoding
    policy.current = None
    assert policy.decide(StepLoad(64, [1.0] * 64)).shape is None  # 64 x trees cost far more than they gain
    # A request whose own acceptance is poor sits out while the others speculate.
    mixed = policy.decide(StepLoad(3, [1.0, 0.01, 1.0]))
    assert mixed.shape is not None and sorted(mixed.speculating) == [0, 2]


def test_a_step_with_a_prefill_chunk_decodes_plainly_and_keeps_the_shape():
    costs, table = knee_costs(16, 0.002), fixed_table(np.full((3, 1), 0.6))
    policy = SpeculationPolicy(TreeShape.of(3, 1, 4), costs, table, hysteresis=0.0)
    alone = policy.decide(StepLoad(1, [1.0]))
    assert alone.shape is not None  # one request speculates...
    beside = policy.decide(StepLoad(1, [1.0], other_rows=8))
    assert beside.shape is None and beside.tokens_per_s == pytest.approx(1 / float(costs.plain_step(1)))
    assert beside.passes_s == pytest.approx(float(costs.plain_passes(1, 8)))  # ...but not beside a chunk
    assert policy.current == alone.shape  # and takes its shape up again after it


def test_hysteresis_keeps_the_shape_until_the_margin_is_passed():
    costs, table = knee_costs(16, 0.002), AcceptanceTable(5, 8)
    policy = SpeculationPolicy(TreeShape.of(5, 8, 32), costs, table, hysteresis=0.05)
    free = SpeculationPolicy(TreeShape.of(5, 8, 32), costs, table, hysteresis=0.0)
    load = StepLoad(1, [1.0])
    best = free.decide(load)
    options = {shape: None for shape in policy.shapes}
    for shape in options:  # a shape within 5% of the best is kept once current
        policy.current = shape
        kept = policy.decide(load)
        rate = kept.tokens_per_s
        if kept.shape == shape:
            assert rate * 1.05 >= best.tokens_per_s
        else:
            assert kept.tokens_per_s == pytest.approx(best.tokens_per_s)


def test_expected_accept_length_closed_forms():
    rates = np.tile([0.7, 0.2, 0.05], (4, 1))
    assert expected_accept_length(rates, TreeShape.of(4, 1, 5)) == pytest.approx(chain_accept_length([0.7] * 4))
    assert expected_accept_length(np.ones((3, 2)) * [1.0, 0.0], TreeShape.of(3, 2, 8)) == pytest.approx(4.0, abs=1e-4)
    assert expected_accept_length(np.zeros((3, 2)), TreeShape.of(3, 2, 8)) == pytest.approx(1.0, abs=1e-3)
    # A full tree of depth 2, topk 2: 1 + (a + b) + (a + b)^2 when every node is verified.
    two = np.array([[0.5, 0.3], [0.5, 0.3]])
    assert expected_accept_length(two, TreeShape.of(2, 2, 7)) == pytest.approx(1 + 0.8 + 0.8**2)
    # Wider and deeper trees never predict less.
    small, big = TreeShape.of(3, 2, 6), TreeShape.of(3, 3, 12)
    assert expected_accept_length(rates, big) >= expected_accept_length(rates, small)


def test_acceptance_table_learns_rates_and_request_multipliers():
    from eaglesrv.engine.adaptive.acceptance import RequestAcceptance

    table = AcceptanceTable(3, 2)
    good, poor = RequestAcceptance(), RequestAcceptance()
    shape = TreeShape.of(3, 2, 6)
    rng = np.random.default_rng(0)
    for _ in range(3000):  # depth-1 first choice right 90% of the time, second 5%
        r = rng.uniform()
        table.record(shape, [(1, 0, r < 0.9), (1, 1, 0.9 <= r < 0.95)], good)
        table.record(shape, [(1, 0, False), (1, 1, False)], poor)
    q = table.rates()
    assert q[0, 0] == pytest.approx(0.45, abs=0.05)  # both requests count: (0.9 + 0) / 2
    assert good.multiplier > 0.9 > 0.25 > poor.multiplier
    for _ in range(200):
        poor.relax()
    assert poor.multiplier > 0.9  # sitting out long enough earns a retry
    assert RequestAcceptance().multiplier == 1.0


def test_cost_model_interpolates_and_extrapolates():
    curve = CostCurve([1, 4, 16], [0.01, 0.01, 0.04])
    assert curve(2) == pytest.approx(0.01) and curve(10) == pytest.approx(0.025) and curve(32) == pytest.approx(0.08)
    model = CostModel(curve, CostCurve([1, 16], [0.0, 0.0]), CostCurve([1, 16], [0.001, 0.002]))
    assert float(model.plain_step(4)) == pytest.approx(0.01)  # uncorrected until a step is seen


def test_correction_separates_the_pass_factor_from_the_host_cost_per_speculating_request():
    rng = np.random.default_rng(0)
    correction = StepCorrection()
    for _ in range(300):  # steps at mixed loads: 0 to 64 speculating requests, noisy by 2%
        passes, speculating = rng.uniform(0.02, 0.2), int(rng.integers(0, 65))
        correction.observe(passes, speculating, (1.3 * passes + 0.0008 * speculating) * rng.uniform(0.98, 1.02))
    assert correction.factor == pytest.approx(1.3, rel=0.03)
    assert correction.per_request_s == pytest.approx(0.0008, rel=0.1)
    plain_only = StepCorrection()
    for _ in range(100):  # plain steps say nothing about speculation's host cost
        plain_only.observe(0.05, 0, 0.08)
    assert plain_only.factor == pytest.approx(1.6, rel=0.01) and plain_only.per_request_s == 0.0
    assert StepCorrection()(0.05, 3) == pytest.approx(0.05)  # the prior: no correction


def test_a_plain_spell_does_not_erase_what_speculative_steps_taught():
    correction = StepCorrection()
    for step in range(60):  # speculating steps of 4 or 16 requests: 2 ms of host cost each
        passes, speculating = (0.03, 4) if step % 2 else (0.05, 16)
        correction.observe(passes, speculating, 1.2 * passes + 0.002 * speculating)
    learnt = correction.per_request_s
    assert learnt == pytest.approx(0.002, rel=0.1)
    for _ in range(2000):  # a long plain spell, on a machine that has become 10% slower
        correction.observe(0.05, 0, 1.32 * 0.05)
    assert correction.factor == pytest.approx(1.32, rel=0.03)
    assert correction.per_request_s > 0.5 * learnt  # still known: no switch back just to relearn it


def test_catch_up_is_priced_and_spread_over_the_steps_it_serves():
    # 16 requests, memory-bound to 64 rows: a one-token chain gains 50% for free...
    costs, table = knee_costs(64, 0.0), fixed_table(np.full((1, 1), 0.5))
    costs.draft = CostCurve([1, 1024], [0.002, 0.04])  # a catch-up over 1,024 tokens: 40 ms
    policy = SpeculationPolicy(TreeShape.of(1, 1, 2), costs, table, hysteresis=0.0)
    assert policy.decide(StepLoad(16, [1.0] * 16)).shape is not None
    # ...but not when each must first catch up on a 2,000-token prompt, within this reply:
    # 32,000 tokens, 1.25 s, for 8 extra tokens a step over at most 16 steps.
    long = policy.decide(StepLoad(16, [1.0] * 16, backlogs=[2000] * 16))
    assert long.shape is None
    # Short backlogs are cheap; among equals, the requests with the shorter ones go first.
    mixed = policy.decide(StepLoad(4, [1.0] * 4, backlogs=[5000, 2, 2, 5000]))
    assert mixed.shape is not None and sorted(mixed.speculating) == [1, 2]
    assert mixed.catch_up_s == pytest.approx(float(costs.catch_up(4)))
    # A request about to finish has few steps left to repay its catch-up.
    one = SpeculationPolicy(TreeShape.of(1, 1, 2), costs, table, hysteresis=0.0)
    assert one.decide(StepLoad(1, [1.0], backlogs=[1000], remaining=[1000])).shape is not None
    assert one.decide(StepLoad(1, [1.0], backlogs=[1000], remaining=[1])).shape is None


def test_catch_up_cost_learns_from_the_catch_ups_seen():
    costs = knee_costs(16, 0.0)
    costs.draft = CostCurve([1, 1024], [0.002, 0.04])
    assert float(costs.catch_up(0)) == 0.0 and float(costs.catch_up(1024)) == pytest.approx(0.04)
    for _ in range(30):
        costs.observe_catch_up(2048, 0.16)  # twice the draft curve's price
    assert float(costs.catch_up(1024)) == pytest.approx(0.08, rel=0.02)


def test_host_cost_per_request_turns_off_speculation_for_many_requests_not_for_one():
    # Memory-bound up to 64 rows: 16 requests x (1,1,2) is 32 rows, as cheap as 16. Half
    # the one-token drafts are accepted: without a host cost, 16 speculating requests gain
    # 50%; at 2 ms each (32 ms on a 40 ms step) they lose.
    costs, table = knee_costs(64, 0.0), fixed_table(np.full((1, 1), 0.5))
    policy = SpeculationPolicy(TreeShape.of(1, 1, 2), costs, table, hysteresis=0.0)
    assert policy.decide(StepLoad(16, [1.0] * 16)).speculating == tuple(range(16))
    costs.correction = StepCorrection(per_request_s=0.002)
    policy.current = None
    assert policy.decide(StepLoad(16, [1.0] * 16)).shape is None
    assert policy.decide(StepLoad(1, [1.0])).shape is not None  # 1.5 tokens in 42 ms beats 1 in 40


def test_candidate_shapes_stay_inside_the_configured_tree():
    largest = TreeShape.of(5, 8, 32)
    shapes = candidate_shapes(largest)
    assert largest in shapes and TreeShape.of(3, 1, 4) in shapes and TreeShape.of(1, 1, 2) in shapes
    assert all(s.fits_in(largest) for s in shapes)
    assert candidate_shapes(TreeShape.of(3, 1, 4)) == [TreeShape.of(1, 1, 2), TreeShape.of(2, 1, 3),
                                                       TreeShape.of(3, 1, 4)]


def _pool(num_pages=64, page_size=4, width=6, limit=2048):
    import torch

    from eaglesrv.engine.adaptive.backlog import FeaturePool

    pool = FeaturePool.allocate(num_pages, page_size, width, torch.float32, torch.device("cpu"))
    pool.limit = limit
    return pool


def test_backlog_holds_every_piece_in_order_at_its_requests_slots():
    """Two requests on interleaved, out-of-order pages: each gets back its own features in
    position order, held a prompt at a time and then a token a step."""
    import torch

    from eaglesrv.engine.adaptive.backlog import Backlog, HeldStep

    pool = _pool()
    pages = {"a": [9, 2, 30, 4, 17, 11, 0, 5], "b": [1, 8, 3, 29, 6, 12, 7, 10]}  # 32 positions each
    features = {rid: torch.randn(30, 6) for rid in pages}
    held: dict[str, Backlog | None] = {rid: None for rid in pages}

    def hold(steps: dict[str, HeldStep], rows: torch.Tensor) -> None:
        pool.write(list(steps.values()), rows)
        for rid, step in steps.items():
            held[rid] = Backlog.grow(held[rid], step)

    hold({rid: HeldStep(pages[rid], 1, list(range(10))) for rid in pages},
         torch.cat([features[rid][:10] for rid in pages]))
    for i in range(10, 30):
        hold({rid: HeldStep(pages[rid], 1 + i, [i]) for rid in pages},
             torch.cat([features[rid][i : i + 1] for rid in pages]))
    assert len(held["a"].tokens) == 30 and held["a"].end == 31
    for rid in pages:
        assert held[rid].start == 1 and held[rid].tokens == list(range(30))
        assert torch.equal(pool.read(held[rid], pages[rid]), features[rid])


def test_backlog_restarts_where_a_recomputed_request_resumes():
    """A preempted request recomputes from an earlier position: what was held past it
    would desynchronize the draft, so the backlog starts over there."""
    import torch

    from eaglesrv.engine.adaptive.backlog import Backlog, HeldStep

    pool = _pool()
    pages = list(range(10, 20))
    features = torch.randn(50, 6)
    first, again = HeldStep(pages, 0, list(range(40))), HeldStep(pages, 20, list(range(10)))
    pool.write([first], features[:40])
    held = Backlog.grow(None, first)
    pool.write([again], features[40:])
    held = Backlog.grow(held, again)
    assert held.start == 20 and held.tokens == list(range(10)) and torch.equal(pool.read(held, pages), features[40:])


def test_backlog_over_the_pools_limit():
    from eaglesrv.engine.adaptive.backlog import Backlog, HeldStep

    pool = _pool(limit=8)
    held = Backlog.grow(None, HeldStep(list(range(8)), 0, list(range(8))))
    assert not pool.over_limit(held)
    assert pool.over_limit(Backlog.grow(held, HeldStep(list(range(8)), 8, [8])))


def test_a_plain_spell_repeats_its_decision_only_while_the_load_stands():
    from eaglesrv.engine.adaptive.controller import PLAIN_RECHECK_STEPS, AdaptiveSpeculation

    adaptive = AdaptiveSpeculation(TreeShape.of(5, 8, 32), knee_costs(16, 0.002), _pool())
    searches = []
    search = adaptive.policy.decide
    adaptive.policy.decide = lambda load: searches.append(load.decoding) or search(load)
    from eaglesrv.engine.adaptive.acceptance import RequestAcceptance

    ids = [RequestAcceptance() for _ in range(64)]
    assert adaptive.decide(StepLoad(64, [1.0] * 64), ids).shape is None  # 64 trees would cost far more
    repeats = [adaptive.repeat_plain(64, 0, ids) for _ in range(PLAIN_RECHECK_STEPS + 1)]
    assert all(r is adaptive.last for r in repeats[:-1]) and repeats[-1] is None  # then searched again
    assert adaptive.steps["plain"] == 1 + PLAIN_RECHECK_STEPS and searches == [64]
    adaptive.decide(StepLoad(64, [1.0] * 64), ids)
    assert adaptive.repeat_plain(64, 8, ids) is None  # this step has a prefill chunk
    assert adaptive.repeat_plain(63, 0, ids[:63]) is None  # a request finished: the load changed
    alone = adaptive.decide(StepLoad(1, [1.0]), ids[:1])
    assert alone.shape is not None and adaptive.repeat_plain(1, 0, ids[:1]) is None  # only plain repeats
    adaptive.decide(StepLoad(64, [1.0] * 64, other_rows=100), ids)
    assert adaptive.repeat_plain(64, 0, ids) is None  # a step beside a prefill chunk is not repeated


def test_deep_contexts_price_trees_by_their_rows_times_depth():
    """Attention per row per context token: a tree pays it on each of its rows, so deep
    requests get smaller trees (or none) where shallow ones speculate in full."""
    costs = knee_costs(64, 0.002)
    costs.context_tokens, costs.attention_s, costs.draft_attention_s = 128, 2e-6, 1e-7
    shape = TreeShape.of(3, 2, 6)
    # Two requests, one 1,128 tokens deep speculating, one 128 deep decoding plainly beside it.
    passes = costs.speculative_passes(shape.nodes, shape.topk, shape.steps, 1, 1, 2.0,
                                      spec_excess=1000.0, plain_excess=0.0)
    flat = costs.speculative_passes(shape.nodes, shape.topk, shape.steps, 1, 1, 2.0)
    assert float(passes - flat) == pytest.approx(2e-6 * 6 * 1000 + 1e-7 * ((3 - 1) * 2 + 2.0) * 1000)
    assert float(costs.plain_passes(2, excess=1000.0) - costs.plain_passes(2)) == pytest.approx(2e-6 * 1000)

    table = fixed_table(np.full((5, 8), 0.5))
    shallow = SpeculationPolicy(TreeShape.of(5, 8, 32), costs, table, hysteresis=0.0).decide(
        StepLoad(4, [1.0] * 4, contexts=[128] * 4))
    deep = SpeculationPolicy(TreeShape.of(5, 8, 32), costs, table, hysteresis=0.0).decide(
        StepLoad(4, [1.0] * 4, contexts=[8192] * 4))
    assert shallow.shape is not None and len(shallow.speculating) == 4 and deep.shape is None
    # Among equally good requests, the shallower ones speculate, the deep ones decode plainly.
    mixed = SpeculationPolicy(TreeShape.of(5, 8, 32), costs, table, hysteresis=0.0).decide(
        StepLoad(4, [1.0] * 4, contexts=[8192, 128, 8192, 128]))
    assert mixed.shape is not None and sorted(mixed.speculating) == [1, 3]


def test_speculation_starts_with_a_margin_over_plain_and_stops_below_half_of_it():
    """A chain predicted 4% better than plain decoding: not worth starting (5% margin), worth
    keeping (2.5%); predicted about 2% better, it is dropped. Near break-even, trees lost
    to plain decoding on the catch-ups and the estimates' noise."""
    costs, table = knee_costs(16, 0.0), fixed_table(np.full((1, 1), 0.02))
    chain = TreeShape.of(1, 1, 2)
    policy = SpeculationPolicy(chain, costs, table, hysteresis=0.05)
    plain_rate = 1 / float(costs.plain_step(1))
    policy.current = None
    assert policy.decide(StepLoad(1, [1.0])).shape is None
    policy.current = chain
    kept = policy.decide(StepLoad(1, [1.0]))
    assert kept.shape == chain and 1.025 < kept.tokens_per_s / plain_rate < 1.05
    policy.current = chain
    dropped = policy.decide(StepLoad(1, [0.5]))  # this request's drafts land half as often
    assert dropped.shape is None and policy.current is None


def test_a_table_soured_in_one_spell_is_tried_again_after_plain_steps():
    """A few poor verifications (drafts kept 1 time in 10) make trees look worthless; the
    steps that decode plainly instead fade that evidence until the prior earns a retry. A
    table built on thousands of trials survives such a spell."""
    from eaglesrv.engine.adaptive.acceptance import RequestAcceptance
    from eaglesrv.engine.adaptive.controller import AdaptiveSpeculation

    adaptive = AdaptiveSpeculation(TreeShape.of(3, 1, 3), knee_costs(16, 0.005), _pool())
    alone = [RequestAcceptance()]
    assert adaptive.decide(StepLoad(1, [1.0]), alone).shape is not None  # the prior (q = 0.6) says trees pay
    chain = TreeShape.of(2, 1, 2)
    for trial in range(40):
        adaptive.acceptance.record(chain, [(1, 0, trial % 10 == 0)], RequestAcceptance())
    plain_steps = 0
    while adaptive.decide(StepLoad(1, [1.0]), alone).shape is None:
        plain_steps += 1
        assert plain_steps < 100, "the soured table never faded"
    assert plain_steps > 10  # it did sour the choice for a while

    learnt = fixed_table(np.full((3, 1), 0.8))
    learnt.trials *= 30  # 3,000 trials per entry
    learnt.hits *= 30
    for _ in range(35):
        learnt.fade()
    assert learnt.rates()[0, 0] == pytest.approx(0.8, abs=0.01)

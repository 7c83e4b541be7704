"""Tests for eaglesrv.engine.sampler: greedy, seeded reproducibility, filters, the drawn
distribution, penalties and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from eaglesrv.engine.sampler import (
    SamplingBatch,
    apply_penalties,
    draw_from_probs,
    processed_probs,
    request_uniforms,
    sample,
)
from eaglesrv.sampling_params import SamplingParams

V = 64


def make_batch(params, outputs=None, seeds=None, steps=None) -> SamplingBatch:
    n = len(params)
    outputs = outputs if outputs is not None else [[] for _ in range(n)]
    return SamplingBatch(
        params=list(params),
        output_token_ids=outputs,
        seeds=seeds if seeds is not None else list(range(n)),
        step_indices=steps if steps is not None else [len(o) for o in outputs],
    )


def logits_from_probs(probs: list[float], perm: list[int] | None = None) -> torch.Tensor:
    """[1, V] logits whose softmax is probs, placed at token ids perm (to exercise sorting)."""
    p = torch.tensor(probs, dtype=torch.float32)
    logits = torch.full((len(probs),), float("-inf"))
    ids = perm if perm is not None else list(range(len(probs)))
    logits[ids] = p.log()
    return logits.unsqueeze(0)


# ---------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_equals_argmax(dtype):
    torch.manual_seed(0)
    logits = torch.randn(6, V).to(dtype)
    out = sample(logits, make_batch([SamplingParams(temperature=0.0)] * 6))
    assert out.token_ids == logits.float().argmax(-1).tolist()
    assert out.logprobs == [None] * 6


def test_greedy_ties_pick_lowest_id():
    logits = torch.zeros(1, V)
    logits[0, [7, 3, 40]] = 5.0
    assert sample(logits, make_batch([SamplingParams(temperature=0.0)])).token_ids == [3]


def test_top_k_1_is_greedy():
    torch.manual_seed(1)
    logits = torch.randn(4, V)
    params = [SamplingParams(top_k=1, temperature=1.5)] * 4
    for seed in range(20):
        out = sample(logits, make_batch(params, seeds=[seed] * 4))
        assert out.token_ids == logits.argmax(-1).tolist()
    probs = processed_probs(logits, make_batch(params))
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), V).float())


def test_temperature_to_zero_limit():
    torch.manual_seed(2)
    logits = torch.randn(3, V) * 3
    for temp in (1e-3, 1e-8):  # 1e-8 is floored internally; must stay finite
        params = [SamplingParams(temperature=temp)] * 3
        probs = processed_probs(logits, make_batch(params))
        assert torch.isfinite(probs).all()
        assert torch.allclose(probs, torch.nn.functional.one_hot(logits.argmax(-1), V).float())
        for seed in range(30):
            out = sample(logits, make_batch(params, seeds=[seed, seed + 1, seed + 2]))
            assert out.token_ids == logits.argmax(-1).tolist()


# ---------------------------------------------------------------------------- seeding


def test_request_uniforms_reproducible_and_step_dependent():
    a = request_uniforms(1234, 5, 8)
    assert a.shape == (8,) and ((a >= 0) & (a < 1)).all()
    assert torch.equal(a, request_uniforms(1234, 5, 8))
    assert torch.equal(a[:3], request_uniforms(1234, 5, 3))  # prefix-stable
    firsts = {float(request_uniforms(1234, k, 1)[0]) for k in range(100)}
    assert len(firsts) == 100  # different steps -> different uniforms
    assert not torch.equal(a, request_uniforms(1235, 5, 8))
    # Extreme and negative seeds stay within manual_seed's range.
    for seed in (0, -1, 2**63, 2**64 - 1, -(2**70)):
        request_uniforms(seed, 2**40, 2)


def test_seeded_token_independent_of_batch_and_position():
    torch.manual_seed(3)
    target = torch.randn(1, V) * 0.5  # flat-ish, so uniforms matter
    params = SamplingParams(temperature=0.9, top_p=0.95)
    alone = [sample(target, make_batch([params], seeds=[42], steps=[k])).token_ids[0]
             for k in range(40)]
    assert len(set(alone)) > 5  # different steps draw different tokens

    other = [SamplingParams(temperature=0.0), SamplingParams(top_k=5, logprobs=2),
             SamplingParams(presence_penalty=1.0, min_p=0.1)]
    for k in range(40):
        for pos in range(4):
            rows = torch.randn(3, V)
            logits = torch.cat([rows[:pos], target, rows[pos:]])
            plist = other[:pos] + [params] + other[pos:]
            seeds = [7, 8, 9]
            seeds.insert(pos, 42)
            steps = [k + 1, k + 2, k + 3]
            steps.insert(pos, k)
            outs = [[1, 2, 2]] * 3
            outs.insert(pos, [])
            out = sample(logits, make_batch(plist, outs, seeds, steps))
            assert out.token_ids[pos] == alone[k]


# ---------------------------------------------------------------------------- filters

HAND = [0.5, 0.3, 0.15, 0.05]
PERM = [2, 0, 3, 1]  # token id of each entry in HAND


@pytest.mark.parametrize(
    "kwargs, kept",
    [
        (dict(top_p=0.8), [0, 1]),  # mass of first two == top_p: reached, stop there
        (dict(top_p=0.81), [0, 1, 2]),
        (dict(top_p=0.5), [0]),
        (dict(top_p=0.01), [0]),
        (dict(top_p=1.0), [0, 1, 2, 3]),
        (dict(top_k=2), [0, 1]),
        (dict(top_k=3), [0, 1, 2]),
        (dict(top_k=100), [0, 1, 2, 3]),
        (dict(min_p=0.35), [0, 1]),  # threshold 0.175
        (dict(min_p=0.2), [0, 1, 2]),  # threshold 0.1
        (dict(min_p=1.0), [0]),
        (dict(top_p=0.84), [0, 1, 2]),
        (dict(top_k=3, top_p=0.84), [0, 1]),  # top-p on top-k renormalized: (.5+.3)/.95
        (dict(top_k=3, min_p=0.25), [0, 1, 2]),
    ],
)
def test_kept_set_on_hand_made_distribution(kwargs, kept):
    logits = logits_from_probs(HAND, PERM)
    probs = processed_probs(logits, make_batch([SamplingParams(**kwargs)]))[0]
    kept_ids = [PERM[i] for i in kept]
    assert sorted(torch.nonzero(probs).flatten().tolist()) == sorted(kept_ids)
    mass = sum(HAND[i] for i in kept)
    for i in kept:  # renormalized over the kept set
        assert probs[PERM[i]].item() == pytest.approx(HAND[i] / mass, rel=1e-5)
    # Over many draws, nothing outside the kept set.
    n = 400
    out = sample(logits.expand(n, -1), make_batch([SamplingParams(**kwargs)] * n))
    assert set(out.token_ids) <= set(kept_ids)
    assert set(out.token_ids) == set(kept_ids)  # every kept token does turn up


def test_filtered_tokens_never_sampled_random_logits():
    torch.manual_seed(4)
    logits = torch.randn(3, V) * 2
    params = [SamplingParams(top_k=5), SamplingParams(top_p=0.6), SamplingParams(min_p=0.3)]
    allowed = [set(logits[0].topk(5).indices.tolist())]
    p1 = torch.softmax(logits[1], -1)
    order = p1.argsort(descending=True)
    n_keep = int((p1[order].cumsum(0) < 0.6).sum()) + 1
    allowed.append(set(order[:n_keep].tolist()))
    p2 = torch.softmax(logits[2], -1)
    allowed.append(set(torch.nonzero(p2 >= 0.3 * p2.max()).flatten().tolist()))
    seen = [set(), set(), set()]
    for seed in range(300):
        out = sample(logits, make_batch(params, seeds=[seed, seed + 1000, seed + 2000]))
        for row, tok in enumerate(out.token_ids):
            seen[row].add(tok)
    for row in range(3):
        assert seen[row] <= allowed[row]
        assert len(seen[row]) > 1


# ---------------------------------------------------------------------------- distribution


def reference_probs(logits: torch.Tensor, temp: float, top_p: float) -> torch.Tensor:
    """Independent top-p reference with a python loop over the few tokens."""
    p = torch.softmax(logits.double() / temp, -1)
    order = sorted(range(len(p)), key=lambda i: -p[i].item())
    kept, mass = [], 0.0
    for i in order:
        kept.append(i)
        mass += p[i].item()
        if mass >= top_p:
            break
    out = torch.zeros_like(p)
    out[kept] = p[kept] / mass
    return out


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a.double() - b.double()).abs().sum())


def test_empirical_distribution_matches_processed_probs():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.7, 0.3, 0.0, -0.5, -1.0]])
    temp, top_p = 0.6, 0.75
    ref = reference_probs(logits[0], temp, top_p)
    probs = processed_probs(logits, make_batch([SamplingParams(temperature=temp, top_p=top_p)]))
    assert torch.allclose(probs[0].double(), ref, atol=1e-6)

    n = 20000
    batch = make_batch([SamplingParams(temperature=temp, top_p=top_p)] * n,
                       seeds=list(range(n)), steps=[3] * n)
    tokens = torch.tensor(sample(logits.expand(n, -1), batch).token_ids)
    empirical = torch.bincount(tokens, minlength=8).double() / n
    bound = 0.015  # sampling noise is ~0.005 at n=20000
    assert tv(empirical, ref) < bound
    # The bound is tight enough to catch typical bugs:
    unnormalized = torch.softmax(logits[0].double() / temp, -1) * (ref > 0)
    last_kept = int(torch.nonzero(ref).max())
    unnormalized[last_kept] += 1 - unnormalized.sum()  # leftover mass lands on the clamp token
    wrong = {
        "no renormalization": unnormalized,
        "temperature twice": reference_probs(logits[0], temp * temp, top_p),
        "no temperature": reference_probs(logits[0], 1.0, top_p),
        "no top_p": reference_probs(logits[0], temp, 1.0),
    }
    for name, dist in wrong.items():
        assert tv(dist, ref) > 3 * bound, name


# ---------------------------------------------------------------------------- penalties


def test_penalties_follow_formula():
    torch.manual_seed(5)
    logits = torch.randn(3, V)
    original = logits.clone()
    outputs = [[1, 5, 5, 5, 9], [2, 2], [1, 5]]
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.3),
              SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.25),
              SamplingParams()]  # no penalties: untouched
    got = apply_penalties(logits, make_batch(params, outputs))
    expected = original.clone()
    for row in range(2):
        p = params[row]
        for tok in set(outputs[row]):
            count = outputs[row].count(tok)
            expected[row, tok] -= p.presence_penalty + p.frequency_penalty * count
    assert torch.allclose(got, expected, atol=1e-6)
    assert torch.equal(got[2], original[2])
    assert torch.equal(logits, original)  # input not modified


def test_no_penalties_is_skipped_and_greedy_uses_penalized_logits():
    logits = torch.zeros(1, V)
    logits[0, 4] = 1.0
    logits[0, 9] = 0.9
    batch = make_batch([SamplingParams()], [[4, 4]])
    assert apply_penalties(logits, batch) is logits  # float32 in, nothing to do
    params = SamplingParams(temperature=0.0, frequency_penalty=0.2)
    out = sample(logits, make_batch([params], [[4]]))
    assert out.token_ids == [9]  # 1.0 - 0.2 < 0.9


# ---------------------------------------------------------------------------- logprobs


def test_logprobs_match_log_softmax_of_raw_logits():
    torch.manual_seed(6)
    logits = torch.randn(3, V)
    params = [SamplingParams(logprobs=5, temperature=0.5, presence_penalty=2.0),
              SamplingParams(logprobs=0), SamplingParams(logprobs=20, top_k=3)]
    out = sample(logits, make_batch(params, [[1, 2, 3], [], [4]]))
    ref = torch.log_softmax(logits, -1)
    for row, n in enumerate([5, 0, 20]):
        lp = out.logprobs[row]
        assert lp.token_id == out.token_ids[row]
        assert lp.logprob == pytest.approx(ref[row, lp.token_id].item(), abs=1e-5)
        assert len(lp.top) == n
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert [t for t, _ in lp.top] == ref[row].topk(n).indices.tolist()
        for tok, v in lp.top:
            assert v == pytest.approx(ref[row, tok].item(), abs=1e-5)


# ---------------------------------------------------------------------------- mixed


def test_mixed_batch():
    torch.manual_seed(7)
    logits = torch.randn(6, V).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0, logprobs=3),
              SamplingParams(temperature=0.7, top_k=10),
              SamplingParams(temperature=0.0),
              SamplingParams(top_p=0.9, logprobs=1, frequency_penalty=0.5),
              SamplingParams(min_p=0.05, logprobs=0),
              SamplingParams()]
    outputs = [[], [3], [3, 3], [5, 6], [], [1]]
    seeds, steps = [11, 12, 13, 14, 15, 16], [0, 1, 2, 2, 0, 1]
    out = sample(logits, make_batch(params, outputs, seeds, steps))
    argmax = logits.float().argmax(-1).tolist()
    assert out.token_ids[0] == argmax[0] and out.token_ids[2] == argmax[2]
    assert [lp is None for lp in out.logprobs] == [False, True, True, False, False, True]
    assert [len(out.logprobs[i].top) for i in (0, 3, 4)] == [3, 1, 0]
    for i in range(6):  # each row equals sampling it alone
        single = make_batch([params[i]], [outputs[i]], [seeds[i]], [steps[i]])
        alone = sample(logits[i : i + 1], single)
        assert alone.token_ids[0] == out.token_ids[i]
        if alone.logprobs[0] is not None:
            assert alone.logprobs[0].logprob == pytest.approx(out.logprobs[i].logprob, abs=1e-6)


def test_empty_batch_and_row_mismatch():
    assert sample(torch.zeros(0, V), make_batch([])).token_ids == []
    with pytest.raises(ValueError):
        sample(torch.zeros(2, V), make_batch([SamplingParams()]))


def test_draw_clamps_rounding_overflow_to_last_nonzero_token():
    probs = torch.tensor([[0.5, 0.4999, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    got = draw_from_probs(probs, torch.tensor([0.99995, 0.3], dtype=torch.float64))
    assert got.tolist() == [1, 2]
    # Zero-probability tokens are never drawn, even at CDF boundaries.
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5]])
    for u in (0.0, 0.5, math.nextafter(0.5, 0.0), 0.999999):
        assert draw_from_probs(probs, torch.tensor([u], dtype=torch.float64)).item() in (1, 3)


@pytest.mark.parametrize("vocab", [49152, 50003])  # blocks that divide it; padded blocks
def test_blockwise_draw_equals_the_whole_float64_cdf(vocab):
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(8, vocab, generator=gen) * 4, dim=-1)
    probs[:, ::7] = 0.0  # zero-probability tokens scattered through every block
    probs /= probs.sum(-1, keepdim=True)
    cdf = torch.cumsum(probs.double(), dim=-1)
    for _ in range(50):
        u = torch.rand(8, generator=gen, dtype=torch.float64)
        want = torch.searchsorted(cdf, u.unsqueeze(1), right=True).squeeze(1)
        assert torch.equal(draw_from_probs(probs, u), want)


def test_blockwise_draw_skips_empty_blocks_and_clamps_past_the_end():
    probs = torch.zeros(1, 4096)  # four blocks of 1,024; mass only in the second
    probs[0, 1024], probs[0, 1030] = 0.5, 0.4999
    for u, want in ((0.0, 1024), (0.3, 1024), (0.5, 1030), (0.99985, 1030), (0.99995, 1030)):
        assert draw_from_probs(probs, torch.tensor([u], dtype=torch.float64)).item() == want

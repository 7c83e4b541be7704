"""The prefix cache's tree and the scheduler around it, with fake model outputs (no torch)."""

from __future__ import annotations

import random

from eaglesrv.configs import SchedulerConfig
from eaglesrv.sampling_params import SamplingParams
from eaglesrv.scheduler import PageAllocator, Request, Scheduler, SequenceResult
from eaglesrv.scheduler.prefix_cache import PrefixCache

PAGE = 4
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def _request(rid: str, prompt: list[int], **params) -> Request:
    return Request(rid, prompt, GREEDY.replace(**params) if params else GREEDY, seed=0)


def _accounted(scheduler: Scheduler) -> None:
    """Every page is free, or held by the cache and/or requests, with matching counts."""
    pages, cache = scheduler.pages, scheduler.cache
    holders = [0] * pages.num_pages
    for request in scheduler.running:
        for page in request.page_table:
            holders[page] += 1
    for node in cache._nodes():
        holders[node.page] += 1
    assert holders == [pages.holders(p) for p in range(pages.num_pages)]
    assert pages.num_free == holders.count(0)
    locked = sum(1 for node in cache._nodes() if node.locks)
    assert cache.num_pages - cache.num_evictable == locked


def _step(scheduler: Scheduler, token: int = 7, reusable: dict | None = None):
    batch = scheduler.schedule()
    results = [SequenceResult.single(work, token) for work in batch.sequences if work.sample]
    outputs = scheduler.update(batch, results, reusable_tokens=reusable)
    _accounted(scheduler)
    return batch, outputs


def _drain(scheduler: Scheduler) -> None:
    while scheduler.has_work:
        _step(scheduler)


# ---- the tree ------------------------------------------------------------------------
def test_match_needs_the_token_after_each_page_and_stops_at_the_limit():
    pages = PageAllocator(16)
    cache = PrefixCache(pages, PAGE)
    tokens = list(range(10, 23))  # 13 tokens: 3 full pages, the third followed by token 22
    table = pages.allocate(4)
    node = cache.insert(tokens, table, num_tokens=12)
    assert cache.num_pages == 3 and [pages.holders(p) for p in table] == [2, 2, 2, 1]
    assert node.page == table[2]
    assert [n.page for n in cache.match(tokens, limit=12)] == table[:3]
    assert [n.page for n in cache.match(tokens, limit=11)] == table[:2]  # page-aligned within the limit
    assert [n.page for n in cache.match(tokens[:12], limit=12)] == table[:2]  # page 3 needs token 12 after it
    other_next = tokens[:12] + [99]
    assert [n.page for n in cache.match(other_next, limit=12)] == table[:2]  # another continuation
    assert cache.match([0] + tokens[1:], limit=12) == []


def test_insert_keeps_the_cached_copy_of_a_page_computed_twice():
    pages = PageAllocator(16)
    cache = PrefixCache(pages, PAGE)
    tokens = list(range(9))
    first, second = pages.allocate(3), pages.allocate(3)
    cache.insert(tokens, first, 8)
    node = cache.insert(tokens, second, 8)
    assert node.page == first[1] and cache.num_pages == 2
    assert [pages.holders(p) for p in second] == [1, 1, 1]  # still only the second request's


def test_eviction_frees_least_recently_used_leaves_and_never_a_locked_path():
    pages = PageAllocator(32)
    cache = PrefixCache(pages, PAGE)
    shared = list(range(100, 109))  # two shared pages (their keys take token 108 too), then a page per branch
    branches = [shared + [b] * 3 + [0] for b in (1, 2, 3)]
    tables = []
    for tokens in branches:
        table = pages.allocate(3)
        cache.insert(tokens, table, 12)
        pages.free(table)  # the request is gone: only the cache holds its pages
        tables.append(table)
    assert cache.num_pages == 2 + 3 and cache.num_evictable == 5 and pages.num_free == 32 - 5
    locked = cache.match(branches[0], 12)
    cache.lock(locked[-1])  # a request uses branch 1 (now the most recent too)
    cache.match(branches[2], 12)
    assert cache.num_evictable == 2
    assert cache.evict(5) == 2  # branches 2 and 3; branch 1 and the shared pages are locked
    assert cache.match(branches[1], 12)[-1].page == tables[0][1] and len(cache.match(branches[1], 12)) == 2
    cache.unlock(locked[-1])
    assert cache.num_evictable == 3 and cache.flush() == 3
    assert cache.num_pages == 0 and pages.num_free == 32


def test_lru_order():
    pages = PageAllocator(8)
    cache = PrefixCache(pages, PAGE)
    a, b = [1] * 5, [2] * 5
    for tokens in (a, b):
        table = pages.allocate(2)
        cache.insert(tokens, table, 4)
        pages.free(table)
    cache.lock(cache.match(a, 4)[-1])  # a used last
    cache.unlock(cache.match(a, 4)[-1])
    cache.evict(1)
    assert cache.match(a, 4) and not cache.match(b, 4)


# ---- the scheduler ------------------------------------------------------------------
def test_a_second_request_starts_from_the_cached_prefix():
    scheduler = Scheduler(SchedulerConfig(), num_pages=64, page_size=PAGE, prefix_cache=True)
    prompt = list(range(1, 15))  # 14 tokens
    scheduler.add(_request("a", prompt))
    _drain(scheduler)
    assert scheduler.cache.num_pages == 4  # 14 prompt + 2 computed outputs = 16 computed; page 4 has no next token
    scheduler.add(_request("b", prompt + [50, 51]))
    batch, _ = _step(scheduler)
    work = batch.sequences[0]
    assert work.num_cached == 12 and work.token_ids == (prompt + [50, 51])[12:] and work.admitted
    assert scheduler.running[0].num_cached_prompt_tokens == 12
    _drain(scheduler)
    assert scheduler.cache.hit_tokens == 12 and scheduler.cache.queried_tokens == 14 + 16


def test_a_hit_leaves_prompt_tokens_to_score_uncached():
    scheduler = Scheduler(SchedulerConfig(), num_pages=64, page_size=PAGE, prefix_cache=True)
    prompt = list(range(1, 20))
    scheduler.add(_request("a", prompt))
    _drain(scheduler)
    scheduler.add(_request("b", prompt, prompt_logprobs=0, logprob_start_len=6))
    batch, _ = _step(scheduler)
    assert batch.sequences[0].num_cached == 4  # the row at position 5 scores token 6


def test_requests_sharing_a_prefix_wait_for_the_one_computing_it():
    scheduler = Scheduler(SchedulerConfig(chunked_prefill_size=10), num_pages=64, page_size=PAGE, prefix_cache=True)
    system = list(range(100, 117))  # 17 tokens: 4 full pages
    for i in range(3):
        scheduler.add(_request(f"r{i}", system + [i, i + 1]))
    scheduler.add(_request("other", [5, 6, 7]))
    batch, _ = _step(scheduler)
    assert [w.request_id for w in batch.sequences] == ["r0"]  # "other" has no budget left this step
    batch, _ = _step(scheduler)
    assert [w.request_id for w in batch.sequences] == ["r0", "other"]  # r0 completes page 3 of 4 only now
    batch, _ = _step(scheduler)
    assert [w.request_id for w in batch.sequences] == ["r0", "other", "r1", "r2"]
    cached = {w.request_id: w.num_cached for w in batch.sequences}
    assert cached["r1"] == cached["r2"] == 16
    _drain(scheduler)


def _warm_then_queue(policy: str) -> Scheduler:
    """A cache holding a 16-token system prompt, then a cold 12-token prompt queued before a
    warm one (the system prompt, the token after it in the cache, and one more), with 8 tokens of
    budget a step."""
    scheduler = Scheduler(SchedulerConfig(chunked_prefill_size=8, schedule_policy=policy), num_pages=64,
                          page_size=PAGE, prefix_cache=True)
    system = list(range(100, 116))
    scheduler.add(_request("first", system + [1, 2]))
    _drain(scheduler)
    scheduler.add(_request("cold", list(range(200, 212))))
    scheduler.add(_request("warm", system + [1, 9]))
    return scheduler


def test_lpm_admits_the_longest_cached_prefix_first():
    scheduler = _warm_then_queue("lpm")
    batch, outputs = _step(scheduler)  # nothing running: the first in lpm's order is the one that must progress
    admitted = [(w.request_id, w.num_cached, len(w.token_ids)) for w in batch.sequences]
    assert admitted == [("warm", 16, 2), ("cold", 0, 6)]
    assert [out.request_id for out in outputs] == ["warm"]  # its first token after one step
    _drain(scheduler)


def test_fcfs_admits_in_arrival_order():
    scheduler = _warm_then_queue("fcfs")
    batch, outputs = _step(scheduler)
    assert [(w.request_id, len(w.token_ids)) for w in batch.sequences] == [("cold", 8)] and not outputs
    batch, outputs = _step(scheduler)
    assert [w.request_id for w in batch.sequences] == ["cold", "warm"]
    _drain(scheduler)


def test_lpm_keeps_arrival_order_past_its_queue_limit(monkeypatch):
    monkeypatch.setattr("eaglesrv.scheduler.scheduler.LPM_MAX_WAITING", 1)
    scheduler = _warm_then_queue("lpm")
    batch, _ = _step(scheduler)
    assert [w.request_id for w in batch.sequences] == ["cold"]
    _drain(scheduler)


def test_only_state_the_engine_reports_complete_enters_the_cache():
    scheduler = Scheduler(SchedulerConfig(), num_pages=64, page_size=PAGE, prefix_cache=True)
    scheduler.add(_request("a", list(range(1, 14)), max_tokens=1))
    _step(scheduler, reusable={0: 5})  # e.g. the draft's KV reaches position 4 only
    assert scheduler.cache.num_pages == 1


def _spy_on_preemption(scheduler: Scheduler) -> list[int]:
    """Unused cached pages left at each preemption (there should be none)."""
    seen: list[int] = []
    original = scheduler._preempt

    def preempt(request):
        seen.append(scheduler.cache.num_evictable)
        original(request)

    scheduler._preempt = preempt
    return seen


def test_eviction_comes_before_preemption_and_every_page_is_accounted_for():
    rng = random.Random(0)
    scheduler = Scheduler(SchedulerConfig(admission_watermark=0.0, chunked_prefill_size=24), num_pages=16,
                          page_size=PAGE, prefix_cache=True)
    evictable_at_preemption = _spy_on_preemption(scheduler)
    systems = [[rng.randrange(3, 200) for _ in range(n)] for n in (13, 22, 9)]
    for i in range(40):
        prompt = systems[i % 3] + [rng.randrange(3, 200) for _ in range(rng.randrange(1, 9))]
        scheduler.add(_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 30)))
        if i % 7 == 3:
            scheduler.abort(f"r{i - 1}")
        for _ in range(2):
            _step(scheduler)
    _drain(scheduler)
    assert scheduler.cache.evicted_pages > 0 and scheduler.cache.hit_tokens > 0
    assert evictable_at_preemption and set(evictable_at_preemption) == {0}
    assert scheduler.pages.num_free + scheduler.cache.num_pages == scheduler.pages.num_pages
    assert scheduler.cache.num_evictable == scheduler.cache.num_pages


def test_disabled_cache_changes_nothing():
    scheduler = Scheduler(SchedulerConfig(), num_pages=64, page_size=PAGE)
    prompt = list(range(1, 15))
    for rid in ("a", "b"):
        scheduler.add(_request(rid, prompt))
        batch = scheduler.schedule()
        assert batch.sequences[0].num_cached == 0
        scheduler.abort(rid)
    assert scheduler.cache is None and scheduler.pages.num_free == 64 and scheduler.flush_cache() == 0

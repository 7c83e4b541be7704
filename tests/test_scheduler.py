"""The scheduler on its own, driven with fake model outputs (no torch)."""

from __future__ import annotations

import pytest

from eaglesrv.configs import SchedulerConfig
from eaglesrv.sampling_params import SamplingParams
from eaglesrv.scheduler import FixedDemand, OutOfPages, PageAllocator, Request, Scheduler
from eaglesrv.scheduler.batch import ForwardMode, SequenceResult
from eaglesrv.scheduler.scheduler import RequestRejected

EOS = 2


def make_request(rid: str, prompt_len: int, max_tokens: int = 8, **params) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(10, 10 + prompt_len)),
        params=SamplingParams(max_tokens=max_tokens, temperature=0, **params),
        seed=0,
        eos_token_ids=frozenset({EOS}),
        max_context_len=1000,
    )


def fake_next_token(work) -> int:
    """A deterministic 'model': the next token depends only on the sequence so far."""
    return 100 + (work.num_cached + len(work.token_ids)) % 50


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_work:
            return outputs
        batch = scheduler.schedule()
        sampled = [SequenceResult.single(w, fake_next_token(w)) for w in batch.sequences if w.sample]
        for out in scheduler.update(batch, sampled):
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError("scheduler did not finish")


def test_page_allocator_refuses_double_free_and_overdraw():
    pages = PageAllocator(4)
    got = pages.allocate(3)
    assert pages.num_free == 1
    with pytest.raises(OutOfPages):
        pages.allocate(2)
    pages.free(got)
    assert pages.num_free == 4
    with pytest.raises(ValueError):
        pages.free([got[0]])
    with pytest.raises(ValueError):
        pages.free([99])


def test_prefill_then_decode_and_pages_return():
    scheduler = Scheduler(SchedulerConfig(), num_pages=64, page_size=4)
    scheduler.add(make_request("a", 10, max_tokens=5))
    first = scheduler.schedule()
    assert first.mode is ForwardMode.EXTEND and first.sequences[0].token_ids == list(range(10, 20))
    assert first.sequences[0].sample and len(first.sequences[0].page_table) == 3
    scheduler.update(first, [SequenceResult.single(first.sequences[0], 7)])
    second = scheduler.schedule()
    assert second.mode is ForwardMode.DECODE
    assert second.sequences[0].token_ids == [7] and second.sequences[0].num_cached == 10
    scheduler.update(second, [SequenceResult.single(second.sequences[0], 8)])
    outputs = run_to_completion(scheduler)
    assert len(outputs["a"]) == 3  # 5 in total
    assert scheduler.pages.num_free == 64 and scheduler.num_requests == 0


def test_chunked_prefill_respects_budget_and_samples_only_at_the_end():
    scheduler = Scheduler(SchedulerConfig(chunked_prefill_size=8), num_pages=64, page_size=4)
    scheduler.add(make_request("a", 20))
    chunks = []
    while True:
        batch = scheduler.schedule()
        work = batch.sequences[0]
        chunks.append((work.num_cached, len(work.token_ids), work.sample))
        scheduler.update(batch, [SequenceResult.single(work, 5)] if work.sample else [])
        if work.sample:
            break
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]


def test_decodes_share_the_budget_with_a_prefill_chunk():
    scheduler = Scheduler(SchedulerConfig(chunked_prefill_size=8), num_pages=64, page_size=4)
    scheduler.add(make_request("a", 4))
    batch = scheduler.schedule()
    scheduler.update(batch, [SequenceResult.single(batch.sequences[0], 5)])
    scheduler.add(make_request("b", 30))
    batch = scheduler.schedule()
    assert [(w.request_id, len(w.token_ids)) for w in batch.sequences] == [("a", 1), ("b", 7)]


def test_max_running_requests_caps_admission():
    scheduler = Scheduler(SchedulerConfig(max_running_requests=2), num_pages=64, page_size=4)
    for rid in "abc":
        scheduler.add(make_request(rid, 3))
    batch = scheduler.schedule()
    assert [w.request_id for w in batch.sequences] == ["a", "b"]
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_preemption_recomputes_and_gives_identical_outputs():
    def outputs_with(num_pages: int) -> tuple[dict[str, list[int]], int]:
        scheduler = Scheduler(SchedulerConfig(admission_watermark=0.0), num_pages=num_pages, page_size=4)
        for i in range(6):
            scheduler.add(make_request(f"r{i}", 5 + 3 * i, max_tokens=12))
        preemptions = 0
        outputs: dict[str, list[int]] = {}
        while scheduler.has_work:
            batch = scheduler.schedule()
            preemptions += len(batch.preempted_ids)
            sampled = [SequenceResult.single(w, fake_next_token(w)) for w in batch.sequences if w.sample]
            for out in scheduler.update(batch, sampled):
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            assert scheduler.pages.num_free + sum(len(r.page_table) for r in scheduler.running) == num_pages
        assert scheduler.pages.num_free == num_pages
        return outputs, preemptions

    roomy, roomy_preemptions = outputs_with(200)
    tight, tight_preemptions = outputs_with(12)
    assert roomy_preemptions == 0 and tight_preemptions > 0
    assert tight == roomy


def test_finish_on_eos_stop_ids_max_tokens_and_context():
    scheduler = Scheduler(SchedulerConfig(), num_pages=64, page_size=4)
    scheduler.add(make_request("eos", 3, max_tokens=10))
    scheduler.add(make_request("stop_id", 3, max_tokens=10, stop_token_ids=(77,)))
    scheduler.add(make_request("ignore", 3, max_tokens=2, ignore_eos=True))
    context = make_request("ctx", 3, max_tokens=None)
    context.max_context_len = 6
    scheduler.add(context)
    reasons = {}
    tokens = {"eos": EOS, "stop_id": 77, "ignore": EOS, "ctx": 50}
    while scheduler.has_work:
        batch = scheduler.schedule()
        sampled = [SequenceResult.single(w, tokens[w.request_id]) for w in batch.sequences if w.sample]
        for out in scheduler.update(batch, sampled):
            if out.finished:
                reasons[out.request_id] = (out.finish_reason, out.num_output_tokens)
    assert reasons == {"eos": ("stop", 1), "stop_id": ("stop", 1), "ignore": ("length", 2), "ctx": ("length", 3)}


def test_abort_anywhere_frees_pages():
    scheduler = Scheduler(SchedulerConfig(max_running_requests=1), num_pages=64, page_size=4)
    scheduler.add(make_request("running", 10))
    scheduler.add(make_request("waiting", 10))
    batch = scheduler.schedule()
    assert scheduler.pages.num_free < 64
    assert scheduler.abort("waiting").finish_reason == "abort"
    assert scheduler.abort("running").finish_reason == "abort"
    # the aborted step's result is void
    assert scheduler.update(batch, [SequenceResult.single(batch.sequences[0], 5)]) == []
    assert scheduler.abort("unknown") is None
    assert scheduler.pages.num_free == 64 and not scheduler.has_work


def test_rejects_prompts_that_can_never_fit():
    scheduler = Scheduler(SchedulerConfig(), num_pages=4, page_size=4)
    with pytest.raises(RequestRejected, match="limit is 15"):
        scheduler.add(make_request("big", 16))
    with pytest.raises(RequestRejected, match="empty"):
        scheduler.add(make_request("empty", 0))


def test_a_lone_request_stops_when_the_pool_is_full():
    scheduler = Scheduler(SchedulerConfig(), num_pages=2, page_size=4)
    scheduler.add(make_request("a", 3, max_tokens=None))
    outputs = run_to_completion(scheduler)
    assert len(outputs["a"]) == 5  # 3 + 5 = 8 tokens = the whole pool
    assert scheduler.pages.num_free == 2


def decode_once(scheduler: Scheduler) -> list[int]:
    """One step with fake outputs; the lookahead each sequence was given."""
    batch = scheduler.schedule()
    scheduler.update(batch, [SequenceResult.single(w, fake_next_token(w)) for w in batch.sequences if w.sample])
    return [w.lookahead for w in batch.sequences]


def test_lookahead_comes_from_free_pages_and_preempts_nobody():
    scheduler = Scheduler(SchedulerConfig(admission_watermark=0.0), num_pages=8, page_size=4,
                          demand=FixedDemand(decode_lookahead=5))
    scheduler.add(make_request("a", 10, max_tokens=20))
    scheduler.add(make_request("b", 11, max_tokens=20))
    decode_once(scheduler)  # both prefill: a holds 3 pages, b 3, 2 free
    batch = scheduler.schedule()
    # a's tree needs 11 + 5 = 16 slots, 4 pages: one more, free. b's would need 2 more: none left,
    # so b decodes plainly, and nobody is preempted for a draft.
    assert [(w.request_id, w.lookahead, len(w.page_table)) for w in batch.sequences] == [("a", 5, 4), ("b", 0, 3)]
    assert batch.preempted_ids == []
    scheduler.update(batch, [SequenceResult.single(w, 5) for w in batch.sequences])
    assert len(scheduler.running[0].page_table) == 3, "the tree's pages come back after the step"


def test_no_lookahead_past_the_context_or_without_a_budget_for_the_tree():
    scheduler = Scheduler(SchedulerConfig(chunked_prefill_size=4), num_pages=64, page_size=4,
                          demand=FixedDemand(decode_lookahead=5, decode_cost=6))
    request = make_request("a", 3, max_tokens=None)
    request.max_context_len = 12
    scheduler.add(request)
    lookaheads = [decode_once(scheduler)]  # the prefill
    lookaheads.append(decode_once(scheduler))  # a budget of 4 cannot take a 6-row tree: plainly, but it runs
    scheduler.config = SchedulerConfig()
    while scheduler.has_work:
        lookaheads.append(decode_once(scheduler))
    # root at 4, 5, 6: its tree's last slot is 10, 11, 12 <= 12; from root 7 on, no tree fits the context
    assert lookaheads == [[0], [0], [5], [5], [5], [0], [0], [0], [0]]


def test_admission_takes_pages_for_the_whole_prompt():
    scheduler = Scheduler(SchedulerConfig(chunked_prefill_size=8, admission_watermark=0.0), num_pages=10, page_size=4)
    scheduler.add(make_request("long", 30))
    batch = scheduler.schedule()
    assert len(batch.sequences[0].token_ids) == 8 and len(batch.sequences[0].page_table) == 8


def test_a_step_that_leaves_the_oldest_request_out_raises():
    from eaglesrv.scheduler.scheduler import NoProgress

    scheduler = Scheduler(SchedulerConfig(), num_pages=4, page_size=4)
    scheduler.add(make_request("a", 4, max_tokens=8))
    decode_once(scheduler)
    scheduler.pages.allocate(scheduler.pages.num_free)  # pages leaked elsewhere: "a" cannot grow
    with pytest.raises(NoProgress, match="'a'.*got nothing this step"):
        scheduler.schedule()


def test_borrowed_pages_come_back_even_when_the_pass_fails():
    pages = PageAllocator(8)
    with pages.borrowed([2, 3]) as tables:
        assert [len(t) for t in tables] == [2, 3] and pages.num_free == 3
    assert pages.num_free == 8
    with pytest.raises(RuntimeError, match="boom"), pages.borrowed([4]):
        raise RuntimeError("boom")
    with pytest.raises(OutOfPages), pages.borrowed([5, 5]):
        pass
    assert pages.num_free == 8

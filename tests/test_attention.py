"""The attention backends (torch reference, CPU kernel) against plain per-sequence attention."""

from __future__ import annotations

import math

import pytest
import torch

from eaglesrv.kernels.attention import SequenceSpan, create_attention_backend
from eaglesrv.kernels.attention.base import checked_mask, padded_block_table
from eaglesrv.kernels.attention.layout import PassLayout

PAGE = 4
HEADS, KV_HEADS, DIM = 4, 2, 8


def naive_attention(q, k, v, mask):
    """q [n, H, D], k/v [total, Hkv, D], mask [n, total] -> [n, H, D]."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def full_mask(span) -> torch.Tensor:
    """The oracle's [num_new, num_cached + num_new] mask: the custom mask after its visible prefix."""
    mask = checked_mask(span)
    prefix = torch.ones(span.num_new, span.num_cached + span.num_new - mask.shape[1], dtype=torch.bool)
    return torch.cat([prefix, mask], dim=1)


def slot_positions(spans, page_size: int) -> list[list[int]]:
    """The oracle, one token at a time: the cache slot of every token 0 .. num_cached +
    num_new - 1 of each sequence."""
    return [[span.page_table[t // page_size] * page_size + t % page_size
             for t in range(span.num_cached + span.num_new)] for span in spans]


def span_new_slots(spans, page_size: int) -> list[int]:
    """The oracle's slots of the new tokens, packed in span order."""
    return [slot for span, slots in zip(spans, slot_positions(spans, page_size)) for slot in slots[span.num_cached:]]


def random_case(spans_shape, seed=0, custom=False, heads=(HEADS, KV_HEADS, DIM), page_size=PAGE):
    """spans_shape: (num_cached, num_new) per sequence; heads: (query heads, kv heads, head size).
    Returns spans, caches, new q/k/v, full k/v."""
    num_heads, num_kv_heads, dim = heads
    g = torch.Generator().manual_seed(seed)
    num_pages = 512
    k_cache = torch.zeros(num_pages * page_size, num_kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    free_pages = torch.randperm(num_pages, generator=g).tolist()  # scattered pages
    spans, full = [], []
    for cached, new in spans_shape:
        total = cached + new
        pages = [free_pages.pop() for _ in range(-(-total // page_size))]
        mask = None
        if custom:  # over every key, or over the last few (the keys before them visible)
            width = total if len(spans) % 2 == 0 else new + cached // 2
            mask = torch.rand(new, width, generator=g) > 0.5
            mask[:, 0] = True
        spans.append(SequenceSpan(pages, cached, new, mask))
        full.append((torch.randn(total, num_kv_heads, dim, generator=g),
                     torch.randn(total, num_kv_heads, dim, generator=g)))
    for span, slots, (k, v) in zip(spans, slot_positions(spans, page_size), full):
        k_cache[slots[: span.num_cached]] = k[: span.num_cached]
        v_cache[slots[: span.num_cached]] = v[: span.num_cached]
    q = torch.randn(sum(n for _, n in spans_shape), num_heads, dim, generator=g)
    k_new = torch.cat([k[s.num_cached :] for s, (k, _) in zip(spans, full)])
    v_new = torch.cat([v[s.num_cached :] for s, (_, v) in zip(spans, full)])
    return spans, k_cache, v_cache, q, k_new, v_new, full


@pytest.mark.parametrize(
    "shape,custom",
    [
        ([(0, 7)], False),  # plain prefill
        ([(5, 6), (0, 3), (13, 1)], False),  # prefill over a cached prefix, mixed with decode
        ([(9, 1), (3, 1), (16, 1)], False),  # pure decode
        ([(6, 5), (0, 4)], True),  # arbitrary masks (tree verification)
        ([(6, 4), (2, 4), (5, 1), (0, 4)], True),  # equal-size trees grouped together
        ([(3, 1), (300, 1), (20, 1), (700, 1), (260, 1), (0, 2)], False),  # decodes bucketed by length
        ([(40, 100), (7, 1), (0, 65), (12, 64)], False),  # prefill chunks beside kernel rows (cpu: > 64 new -> SDPA)
        ([(40, 70), (9, 1), (30, 33)], True),  # a large tree beside small ones
        ([(0, 80), (0, 80), (0, 66)], False),  # fresh prompts: SDPA's own causal rule, no mask
    ],
)
@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_matches_naive_attention(shape, custom, backend_name, dtype):
    check_against_naive(shape, custom, backend_name, dtype)


# The CPU kernel's vectorised path takes head sizes 64 and 128 (where the build has AVX-512):
# SmolLM2's 9 query heads over 3 kv heads, and a Llama-8B-like 4 per kv head. Pages of 4
# and 32 tokens: blocks of 16 keys cut short by a page, and pages holding several blocks.
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 128)])
@pytest.mark.parametrize("page_size", [4, 32])
@pytest.mark.parametrize(
    "shape,custom",
    [
        ([(9, 1), (40, 1), (70, 1)], False),  # decode, lengths that end mid-block
        ([(37, 4), (3, 5)], True),  # trees, one shorter than a block
        ([(0, 7), (20, 3)], False),  # causal chunks
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_kernel_matches_naive_attention_at_model_head_sizes(shape, custom, heads, page_size, dtype):
    check_against_naive(shape, custom, "cpu", dtype, heads, page_size)


def check_against_naive(shape, custom, backend_name, dtype, heads=(HEADS, KV_HEADS, DIM), page_size=PAGE):
    spans, k_cache, v_cache, q, k_new, v_new, full = random_case(shape, custom=custom, heads=heads, page_size=page_size)
    k_cache, v_cache, q, k_new, v_new = (t.to(dtype) for t in (k_cache, v_cache, q, k_new, v_new))
    backend = create_attention_backend(backend_name, page_size, torch.device("cpu"))
    out = backend.forward(q, k_new, v_new, k_cache, v_cache, backend.plan(spans), heads[2]**-0.5).float()
    q, k_cache = q.float(), k_cache.float()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    offset = 0
    for span, slots, (k, v) in zip(spans, slot_positions(spans, page_size), full):
        total = span.num_cached + span.num_new
        if span.custom_mask is not None:
            mask = full_mask(span)
        else:
            mask = torch.arange(total)[None, :] <= (span.num_cached + torch.arange(span.num_new))[:, None]
        k, v = k.to(dtype).float(), v.to(dtype).float()
        expected = naive_attention(q[offset : offset + span.num_new], k, v, mask)
        torch.testing.assert_close(out[offset : offset + span.num_new], expected, rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(k_cache[slots], k)  # new keys stored at their slots
        offset += span.num_new


def test_pass_layout_equals_the_token_by_token_oracle():
    spans, *_ = random_case([(5, 6), (0, 3), (13, 1), (40, 70)], custom=True, page_size=4)
    spans[1] = SequenceSpan(spans[1].page_table, 0, 3)  # a causal one among the masked
    layout = PassLayout.of(spans, 4)
    assert layout.new_slots.tolist() == span_new_slots(spans, 4)
    assert layout.query_start.tolist() == [0, 6, 9, 10, 80]
    assert layout.token_seq.tolist() == [0] * 6 + [1] * 3 + [2] + [3] * 70
    assert layout.positions.tolist() == [*range(5, 11), *range(3), 13, *range(40, 110)]
    for row, span in zip(layout.block_table.tolist(), spans):
        assert row[: len(span.page_table)] == span.page_table and not any(row[len(span.page_table):])
    masked = [span.custom_mask for span in spans if span.custom_mask is not None]
    assert layout.mask_offset.tolist()[1] == -1 and layout.mask_width.tolist()[1] == 0
    assert [width for width in layout.mask_width.tolist() if width] == [m.shape[1] for m in masked]
    assert torch.equal(layout.masks, torch.cat([m.reshape(-1) for m in masked]))
    assert padded_block_table([[3, 1], [], [7]], fill=9).tolist() == [[3, 1], [9, 9], [7, 9]]


def check_uniform_metadata(backend_name: str, dtype: torch.dtype, num_new: int, width: int | None) -> None:
    """A graph's metadata (uniform_metadata, from device tensors) attends and stores exactly
    as the host-planned metadata of the same spans. width: the tree masks' W, None = causal."""
    g = torch.Generator().manual_seed(3)
    num_cached = [5, 4, 13]
    spans, k_cache, v_cache, q, k_new, v_new, _ = random_case([(c, num_new) for c in num_cached], page_size=4)
    masks = None
    if width is not None:
        masks = torch.rand(len(spans), num_new, width, generator=g) > 0.4
        masks[:, :, -num_new:] |= torch.eye(num_new, dtype=torch.bool)  # every token sees itself
        spans = [SequenceSpan(s.page_table, s.num_cached, s.num_new, m) for s, m in zip(spans, masks)]
    k_cache, v_cache, q, k_new, v_new = (t.to(dtype) for t in (k_cache, v_cache, q, k_new, v_new))
    backend = create_attention_backend(backend_name, 4, torch.device("cpu"))
    planned_k, planned_v = k_cache.clone(), v_cache.clone()
    expected = backend.forward(q, k_new, v_new, planned_k, planned_v, backend.plan(spans), 0.25)
    table = padded_block_table([s.page_table + [s.page_table[0]] * 2 for s in spans])  # wider than needed
    metadata = backend.uniform_metadata(table, torch.tensor(num_cached, dtype=torch.int32), num_new, masks)
    out = backend.forward(q, k_new, v_new, k_cache, v_cache, metadata, 0.25)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), rtol=tolerance, atol=tolerance)
    assert torch.equal(k_cache, planned_k) and torch.equal(v_cache, planned_v)


@pytest.mark.parametrize("num_new,width", [(1, None), (3, None), (4, 4), (4, 8)],
                         ids=["decode", "causal", "tree", "draft-scratch"])
def test_uniform_metadata_matches_the_planned_pass(num_new, width):
    check_uniform_metadata("torch", torch.float32, num_new, width)


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
def test_rejects_bad_mask_shape_and_short_page_table(backend_name):
    backend = create_attention_backend(backend_name, PAGE, torch.device("cpu"))
    with pytest.raises(ValueError, match="mask shape"):
        backend.plan([SequenceSpan([0, 1], 2, 3, torch.ones(3, 6, dtype=torch.bool))])  # wider than the keys
    with pytest.raises(ValueError, match="mask shape"):
        backend.plan([SequenceSpan([0, 1], 2, 3, torch.ones(3, 2, dtype=torch.bool))])  # narrower than the rows
    with pytest.raises(ValueError, match="too short"):
        backend.plan([SequenceSpan([0], 2, 3)])


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_attention_backend("nope", PAGE, torch.device("cpu"))


def test_auto_picks_the_cpu_kernel_and_falls_back_to_torch_without_it(monkeypatch):
    from eaglesrv.kernels.attention import cpu_build, resolve_backend_name

    assert resolve_backend_name("auto", torch.device("cpu")) == "cpu"

    def no_compiler():
        raise RuntimeError("could not build the CPU attention kernel: no g++")

    monkeypatch.setattr(cpu_build, "load_cpu_attention", no_compiler)
    assert resolve_backend_name("auto", torch.device("cpu")) == "torch"
    assert create_attention_backend("auto", PAGE, torch.device("cpu")).name == "torch"


def test_the_cpu_kernel_build_is_one_at_a_time(tmp_path):
    import threading
    import time
    from types import SimpleNamespace

    from eaglesrv.kernels.attention.cpu_build import _build_lock

    fake_extension = SimpleNamespace(get_default_build_root=lambda: str(tmp_path / "builds"))
    inside, overlaps = [], []

    def build():
        with _build_lock("kernel", fake_extension):
            overlaps.append(len(inside))
            inside.append(1)
            time.sleep(0.05)
            inside.pop()

    threads = [threading.Thread(target=build) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert overlaps == [0, 0, 0]

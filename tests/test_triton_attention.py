"""The Triton attention backend against the torch reference, in Triton's CPU interpreter.

Small shapes: the interpreter runs every program one after another in numpy.
"""

from __future__ import annotations

import pytest
import torch
from conftest import engine_config

from eaglesrv.kernels.attention import SequenceSpan, create_attention_backend
from eaglesrv.kernels.attention.torch_ref import TorchAttentionBackend
from eaglesrv.kernels.triton_support import triton_usable

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not triton_usable(CPU), reason="needs triton and TRITON_INTERPRET=1")

# (num_cached, num_new, has a tree mask): decodes, prefill chunks over cached prefixes, a
# fresh prefill, and trees beside them, in one batch.
MIXED = [(9, 1, False), (5, 20, False), (12, 6, True), (0, 7, False), (30, 1, False), (3, 5, "full")]
DECODES = [(9, 1, False), (17, 1, False), (40, 1, False), (0, 1, False)]
LONG_CHUNK = [(5, 40, False), (2, 1, False), (20, 33, True)]  # several 64-row tiles per sequence


def tree_mask(num_cached: int, num_new: int, g: torch.Generator, full: bool) -> torch.Tensor:
    """A random tree over the new tokens (each node's parent comes before it): a node sees
    the prefix, its ancestors and itself. The mask covers the nodes only (as the engine
    passes it), or, `full`, every key with the prefix spelled out."""
    ancestors = torch.eye(num_new, dtype=torch.bool)
    for node in range(1, num_new):
        ancestors[node] |= ancestors[int(torch.randint(0, node, (1,), generator=g))]
    return torch.cat([torch.ones(num_new, num_cached, dtype=torch.bool), ancestors], 1) if full else ancestors


def random_batch(shape, heads, page_size, dtype, seed=0):
    """Spans on scattered pages, caches holding the cached tokens, and new q/k/v."""
    num_heads, num_kv_heads, dim = heads
    g = torch.Generator().manual_seed(seed)
    num_pages = 4 + sum(-(-(c + n) // page_size) for c, n, _ in shape)
    free = torch.randperm(num_pages, generator=g).tolist()
    spans = []
    for cached, new, masked in shape:
        pages = [free.pop() for _ in range(-(-(cached + new) // page_size))]
        spans.append(SequenceSpan(pages, cached, new, tree_mask(cached, new, g, masked == "full") if masked else None))
    k_cache = torch.randn(num_pages * page_size, num_kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(num_pages * page_size, num_kv_heads, dim, generator=g).to(dtype)
    tokens = sum(n for _, n, _ in shape)
    # q, k and v as views of one projection, as the model passes them (rows not contiguous)
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * dim, generator=g).to(dtype)
    q, k, v = qkv.split([num_heads * dim, num_kv_heads * dim, num_kv_heads * dim], dim=-1)
    return spans, k_cache, v_cache, q.view(tokens, num_heads, dim), k.view(tokens, -1, dim), v.view(tokens, -1, dim)


def check_against_torch(shape, heads, page_size, dtype):
    spans, k_cache, v_cache, q, k, v = random_batch(shape, heads, page_size, dtype)
    scale = heads[2] ** -0.5
    reference = TorchAttentionBackend(page_size, CPU)
    expected_k, expected_v = k_cache.float(), v_cache.float()
    expected = reference.forward(q.float(), k.float(), v.float(), expected_k, expected_v, reference.plan(spans), scale)
    backend = create_attention_backend("triton", page_size, CPU)
    out = backend.forward(q, k, v, k_cache, v_cache, backend.plan(spans), scale)
    assert out.dtype == dtype and out.shape == q.shape
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(k_cache.float(), expected_k.to(dtype).float(), rtol=0, atol=0)
    torch.testing.assert_close(v_cache.float(), expected_v.to(dtype).float(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "heads,page_size",
    [((4, 2, 16), 4), ((4, 2, 16), 16), ((6, 2, 64), 16), ((2, 2, 8), 4)],  # d8: a 16-wide tile, masked
    ids=lambda p: "q%d-kv%d-d%d" % p if isinstance(p, tuple) else f"page{p}",
)
def test_mixed_batch_matches_torch(heads, page_size, dtype):
    check_against_torch(MIXED, heads, page_size, dtype)


@pytest.mark.parametrize(
    "shape,heads,dtype",
    [
        (DECODES, (8, 2, 128), torch.bfloat16),  # 16-row decode tiles, 4 tokens of 4 heads each
        (DECODES, (3, 3, 16), torch.float32),
        (LONG_CHUNK, (4, 2, 16), torch.bfloat16),  # 64-row tiles, a chunk spread over several
        ([(6, 4, True), (2, 4, True)], (9, 3, 64), torch.float16),  # trees only, a group of 3
        ([(0, 9, False)], (4, 2, 16), torch.float32),  # one sequence (a constant num_seqs on a GPU)
    ],
    ids=["decode-d128", "decode-mha", "long-chunks", "trees-group3", "one-prefill"],
)
def test_batch_shapes_match_torch(shape, heads, dtype):
    check_against_torch(shape, heads, 4, dtype)


def test_plan_builds_the_tables_the_kernels_read():
    from test_attention import span_new_slots

    spans, *_ = random_batch(MIXED, (4, 2, 16), 4, torch.float32)
    metadata = create_attention_backend("triton", 4, CPU).plan(spans)
    assert metadata.new_slots.tolist() == span_new_slots(spans, 4)
    assert metadata.query_start.tolist() == [0, 1, 21, 27, 34, 35, 40]
    assert metadata.num_cached.tolist() == [c for c, _, _ in MIXED]
    for row, span in zip(metadata.block_table.tolist(), spans):
        assert row[: len(span.page_table)] == span.page_table
    assert metadata.mask_offset.tolist() == [-1, -1, 0, -1, -1, 6 * 6]
    assert metadata.mask_width.tolist()[2::3] == [6, 8]
    assert metadata.masks.tolist() == torch.cat([spans[2].custom_mask.reshape(-1),
                                                 spans[5].custom_mask.reshape(-1)]).int().tolist()
    assert metadata.max_new == 20 and metadata.has_masks


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.float16)], ids=str)
def test_store_kernel_matches_index_copy(dtype, cache_dtype):
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(7, 2 * 3 * 16, generator=g).to(dtype)
    k, v = (t.reshape(7, 3, 16) for t in kv.chunk(2, dim=-1))  # strided views
    k_cache = torch.randn(40, 3, 16, generator=g).to(cache_dtype)
    v_cache = torch.randn(40, 3, 16, generator=g).to(cache_dtype)
    slots = torch.randperm(40, generator=g)[:7]
    expected_k = k_cache.clone().index_copy_(0, slots, k.to(cache_dtype))
    expected_v = v_cache.clone().index_copy_(0, slots, v.to(cache_dtype))
    torch.ops.eaglesrv.triton_store_kv(k, v, k_cache, v_cache, slots.to(torch.int32))
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    # a negative slot is padding: nothing is written
    torch.ops.eaglesrv.triton_store_kv(k * 0, v * 0, k_cache, v_cache, torch.full((7,), -1, dtype=torch.int32))
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_custom_ops_pass_opcheck():
    spans, k_cache, v_cache, q, k, v = random_batch([(3, 2, True), (4, 1, False)], (2, 1, 16), 4, torch.float32)
    metadata = create_attention_backend("triton", 4, CPU).plan(spans)
    torch.library.opcheck(torch.ops.eaglesrv.triton_store_kv.default,
                          (k.contiguous(), v.contiguous(), k_cache, v_cache, metadata.new_slots))
    torch.library.opcheck(
        torch.ops.eaglesrv.triton_paged_attention.default,
        (q.contiguous(), k_cache, v_cache, metadata.block_table, metadata.num_cached, metadata.query_start,
         metadata.mask_offset, metadata.mask_width, metadata.masks, 4, 0.25, metadata.max_new, metadata.has_masks),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_new,width", [(1, None), (4, 4), (4, 8)], ids=["decode", "tree", "draft-scratch"])
def test_uniform_metadata_matches_the_planned_pass(num_new, width, dtype):
    from test_attention import check_uniform_metadata

    check_uniform_metadata("triton", dtype, num_new, width)


def test_greedy_output_equals_the_torch_backend(tiny_llama_dir):
    from engine_helpers import random_prompts

    from eaglesrv.engine.llm_engine import Engine
    from eaglesrv.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = random_prompts((5, 11, 2), 256)
    outputs = {
        name: [r.output_token_ids for r in Engine(engine_config(tiny_llama_dir, attention_backend=name,
                                                                page_size=4)).generate(prompts, greedy)]
        for name in ("torch", "triton")
    }
    assert outputs["triton"] == outputs["torch"]


def test_triton_on_the_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1") as refused:
        create_attention_backend("triton", 4, CPU)
    assert "\n" not in str(refused.value)


def test_eagle3_greedy_output_equals_the_torch_backend(tiny_llama_dir, tmp_path):
    from eagle3_helpers import save_random_head, spec_config
    from engine_helpers import random_prompts

    from eaglesrv.engine.llm_engine import Engine
    from eaglesrv.sampling_params import SamplingParams

    head_dir = save_random_head(tiny_llama_dir, tmp_path / "head")
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = random_prompts((5, 11), 256)
    outputs = {}
    for name in ("torch", "triton"):  # a static tree of 4 nodes (2 steps, top 2) at every step
        engine = Engine(spec_config(tiny_llama_dir, head_dir, 2, 2, 4, attention_backend=name, page_size=4))
        outputs[name] = [r.output_token_ids for r in engine.generate(prompts, greedy)]
        assert engine.spec_stats["spec_verifications"] > 0
    assert outputs["triton"] == outputs["torch"]



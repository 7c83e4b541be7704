"""The flashinfer backend on the CPU: its plan() arguments, and everything around the kernels.

flashinfer does not import without a GPU, so these tests never import it. The plan inputs
are checked against a per-sequence construction written from flashinfer's documentation;
the backend runs against a stand-in module (flashinfer_oracle.py) whose wrappers compute
attention from flashinfer-format arguments alone, and must equal the torch reference. The
real kernels are checked on a GPU (test_gpu.py) and at every start-up (self_check.py).
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import engine_config
from eagle3_helpers import spec_config
from engine_helpers import random_prompts
from flashinfer_oracle import serve_through_stand_in, stand_in_module
from test_triton_attention import DECODES, LONG_CHUNK, MIXED, random_batch

from eaglesrv.engine.llm_engine import Engine
from eaglesrv.kernels.attention.base import SequenceSpan
from eaglesrv.kernels.attention.flashinfer_paged import FlashinferAttentionBackend
from eaglesrv.kernels.attention.flashinfer_plan import flashinfer_plan_inputs
from eaglesrv.kernels.attention.layout import PassLayout
from eaglesrv.kernels.attention.torch_ref import TorchAttentionBackend
from eaglesrv.sampling_params import SamplingParams

CPU = torch.device("cpu")
HEADS = [(4, 2, 16), (8, 1, 32), (3, 3, 8)]  # grouped queries (2 and 8 per KV head) and none


def random_spans(rng: random.Random, page_size: int):
    """Decodes, trees and prefill chunks on scattered pages, sometimes with spare pages."""
    num_pages = 700 // page_size + 6  # room for the longest batch and its spare pages
    free = rng.sample(range(num_pages), num_pages)
    spans = []
    for _ in range(rng.randint(1, 6)):
        kind = rng.choice(["decode", "tree", "prefill"])
        cached = rng.randint(0, 90) if kind != "prefill" else rng.choice([0, rng.randint(1, 60)])
        new = {"decode": 1, "tree": rng.randint(1, 12), "prefill": rng.randint(1, 50)}[kind]
        pages = [free.pop() for _ in range(-(-(cached + new) // page_size) + rng.randint(0, 1))]
        mask = None
        if kind == "tree":
            ancestors = torch.eye(new, dtype=torch.bool)
            for node in range(1, new):
                ancestors[node] |= ancestors[rng.randrange(node)]
            prefix = rng.randint(0, cached)  # a mask over the last W keys, W from num_new to every key
            mask = torch.cat([torch.ones(new, prefix, dtype=torch.bool), ancestors], 1)
        spans.append(SequenceSpan(pages, cached, new, mask))
    return spans


@pytest.mark.parametrize("seed", range(20))
def test_plan_inputs_equal_a_per_sequence_construction(seed):
    rng = random.Random(seed)
    page = rng.choice([1, 4, 16])
    spans = random_spans(rng, page)
    inputs = flashinfer_plan_inputs(PassLayout.of(spans, page))
    qo, kv, indices, last, masks = [0], [0], [], [], []
    for span in spans:  # flashinfer's definitions, one sequence at a time
        kv_len = span.num_cached + span.num_new
        pages = -(-kv_len // page)
        qo.append(qo[-1] + span.num_new)
        kv.append(kv[-1] + pages)
        indices += span.page_table[:pages]
        last.append(kv_len - (pages - 1) * page)
        full = torch.zeros(span.num_new, kv_len, dtype=torch.bool)
        for i in range(span.num_new):
            full[i, : span.num_cached + i + 1] = True
        if span.custom_mask is not None:
            width = span.custom_mask.shape[1]
            full[:, :kv_len - width] = True
            full[:, kv_len - width:] = span.custom_mask
        masks.append(full.reshape(-1))
    for name, expected in (("qo_indptr", qo), ("kv_indptr", kv), ("kv_indices", indices), ("kv_last_page_len", last)):
        got = getattr(inputs, name)
        assert got.dtype == torch.int32 and got.tolist() == expected, name
    if any(span.custom_mask is not None for span in spans):
        assert torch.equal(inputs.custom_mask, torch.cat(masks))
    else:
        assert inputs.custom_mask is None
    assert inputs.decode_only == all(span.num_new == 1 and span.custom_mask is None for span in spans)


@pytest.mark.parametrize("seed", range(30))
def test_flashinfer_format_arguments_attend_as_the_torch_reference(seed):
    rng = random.Random(seed)
    page, heads = rng.choice([4, 16]), rng.choice(HEADS)
    spans = random_spans(rng, page)
    backend = FlashinferAttentionBackend(page, CPU, module=stand_in_module(), workspace_bytes=16)
    check_backend(backend, spans, heads, page, torch.float32, seed)


def check_backend(backend, spans, heads, page, dtype, seed=0):
    num_heads, num_kv_heads, dim = heads
    g = torch.Generator().manual_seed(seed)
    num_pages = 1 + max(max(span.page_table) for span in spans)
    k_cache, v_cache = (torch.randn(num_pages * page, num_kv_heads, dim, generator=g).to(dtype) for _ in range(2))
    tokens = sum(span.num_new for span in spans)
    q = torch.randn(tokens, num_heads, dim, generator=g).to(dtype)
    k, v = (torch.randn(tokens, num_kv_heads, dim, generator=g).to(dtype) for _ in range(2))
    reference = TorchAttentionBackend(page, CPU)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    expected = reference.forward(q, k, v, ref_k, ref_v, reference.plan(spans), dim**-0.5)
    out = backend.forward(q, k, v, k_cache, v_cache, backend.plan(spans), dim**-0.5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


@pytest.mark.parametrize("shape", [MIXED, DECODES, LONG_CHUNK], ids=["mixed", "decodes", "long-chunk"])
def test_the_backend_picks_the_decode_wrapper_only_for_decodes(shape):
    module = stand_in_module()
    backend = FlashinferAttentionBackend(4, CPU, module=module, workspace_bytes=16)
    spans, *_ = random_batch(shape, (8, 2, 16), 4, torch.float32)
    check_backend(backend, spans, (8, 2, 16), 4, torch.float32)
    kinds = [type(wrapper).__name__ for wrapper in module.made]
    assert kinds == (["BatchDecodeWithPagedKVCacheWrapper"] if shape is DECODES
                     else ["BatchPrefillWithPagedKVCacheWrapper"])
    assert module.made[0].workspace is backend.workspace
    if shape is DECODES:
        assert module.made[0].use_tensor_cores  # 4 query heads per KV head


def test_passes_planned_in_one_order_and_run_in_another_are_each_planned_for_themselves():
    """An EAGLE-3 step plans the target's pass and the draft's; a layer loop runs one pass
    many times. Each wrapper is planned once per (pass, head shape) it serves in turn."""
    module = stand_in_module()
    backend = FlashinferAttentionBackend(4, CPU, module=module, workspace_bytes=16)
    first, *_ = random_batch(MIXED, (4, 2, 16), 4, torch.float32, seed=1)
    second, *_ = random_batch(LONG_CHUNK, (4, 2, 16), 4, torch.float32, seed=2)
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(400, 2, 16, generator=g)
    runs = []
    metadata = {"first": backend.plan(first), "second": backend.plan(second)}
    spans = {"first": first, "second": second}
    reference = TorchAttentionBackend(4, CPU)
    for name, layers in (("second", 3), ("first", 2), ("second", 1)):
        tokens = sum(span.num_new for span in spans[name])
        for _ in range(layers):
            q, k, v = (torch.randn(tokens, heads, 16, generator=g) for heads in (4, 2, 2))
            expected = reference.forward(q, k, v, cache.clone(), cache.clone(), reference.plan(spans[name]), 0.25)
            runs.append(torch.allclose(backend.forward(q, k, v, cache.clone(), cache.clone(), metadata[name], 0.25),
                                       expected, atol=1e-5))
    assert all(runs)
    assert [wrapper.plans for wrapper in module.made] == [3]  # second, first, second: not once per layer
    q, k, v = (torch.randn(sum(s.num_new for s in first), heads, 8, generator=g) for heads in (6, 3, 3))
    small = torch.randn(400, 3, 8, generator=g)  # the same pass at another head shape (a draft head's)
    expected = reference.forward(q, k, v, small.clone(), small.clone(), reference.plan(first), 0.3)
    torch.testing.assert_close(backend.forward(q, k, v, small.clone(), small.clone(), metadata["first"], 0.3), expected)
    assert module.made[0].plans == 4


@pytest.fixture(scope="module")
def outputs_by_backend(tiny_llama_dir, head_dir):
    """Greedy outputs, plain and EAGLE-3, of the torch backend and of flashinfer through the stand-in."""
    prompts = random_prompts((5, 11, 2, 19), 256)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    configs = {
        "plain": engine_config(tiny_llama_dir, attention_backend="torch", page_size=4),
        "eagle3": spec_config(tiny_llama_dir, head_dir, 2, 2, 4, attention_backend="torch", page_size=4),
    }
    outputs = {}
    patch = pytest.MonkeyPatch()
    try:
        for backend in ("torch", "flashinfer"):
            if backend == "flashinfer":
                serve_through_stand_in(patch)
            for mode, config in configs.items():
                engine = Engine(config)
                assert engine.runner.attention.name == backend
                outputs[backend, mode] = [r.output_token_ids for r in engine.generate(prompts, greedy)]
    finally:
        patch.undo()
    return outputs


@pytest.mark.parametrize("mode", ["plain", "eagle3"])
def test_greedy_output_through_the_flashinfer_backend_equals_the_torch_backend(outputs_by_backend, mode):
    assert outputs_by_backend["flashinfer", mode] == outputs_by_backend["torch", mode]

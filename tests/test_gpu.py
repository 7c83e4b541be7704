"""GPU checks (`-m gpu`; skipped without CUDA): the Triton and flashinfer attention backends
against the torch reference on the device in bf16 and fp16 at serving-like shapes, greedy
output through them equal to the torch backend (plain and EAGLE-3), and plain decoding and
EAGLE-3 (static and adaptive) with CUDA graphs equal to without. The flashinfer cases are
skipped where flashinfer is not installed (scripts/gpu_check.sh installs it). The mechanism's own replay
check is test_graph_capture.py's `test_cuda_graph_replay_equals_eager`. On a lent GPU
machine `bash scripts/gpu_check.sh` runs them all.

The same cases run on the CPU in Triton's interpreter (test_triton_attention.py,
test_eagle3_device_kernels.py) and flashinfer's through a stand-in that computes from its
arguments (test_flashinfer_backend.py) at small shapes; here they run compiled, where races and
out-of-bounds accesses can show.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import engine_config
from test_eagle3_device_kernels import (
    PAGE,
    children_of,
    compaction_case,
    depth_of,
    directly_compacted,
    random_tree,
)
from test_triton_attention import MIXED, random_batch

from eaglesrv.engine.eagle3.verify import accept_greedy
from eaglesrv.kernels.attention import create_attention_backend
from eaglesrv.kernels.attention.flashinfer_paged import flashinfer_installed
from eaglesrv.kernels.attention.torch_ref import TorchAttentionBackend
from eaglesrv.kernels.eagle3 import compact_kv, greedy_accept

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CPU, CUDA = torch.device("cpu"), torch.device("cuda")

# the small mixed batch plus long decodes, a 32-node tree deep in its context, a long prefill
SERVING_MIX = MIXED + [(700, 1, False), (1500, 1, False), (900, 32, True), (0, 300, False), (64, 64, False)]
DECODE_MIX = [(700, 1, False), (1500, 1, False), (3, 1, False), (64, 1, False)]
FLASHINFER = pytest.param("flashinfer", marks=pytest.mark.skipif(not flashinfer_installed(),
                                                                 reason="flashinfer is not installed"))
DEVICE_BACKENDS = ["triton", FLASHINFER]


@pytest.mark.parametrize("mix", [SERVING_MIX, DECODE_MIX], ids=["serving-mix", "decodes"])
@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("heads", [(32, 8, 128), (9, 3, 64), (8, 8, 64)], ids=lambda h: "q%d-kv%d-d%d" % h)
def test_device_attention_matches_torch(heads, dtype, backend, mix):
    spans, k_cache, v_cache, q, k, v = random_batch(mix, heads, 16, dtype)
    scale = heads[2] ** -0.5
    reference = TorchAttentionBackend(16, CPU)
    expected_k, expected_v = k_cache.float(), v_cache.float()
    expected = reference.forward(q.float(), k.float(), v.float(), expected_k, expected_v, reference.plan(spans), scale)
    backend = create_attention_backend(backend, 16, CUDA)
    k_gpu, v_gpu = k_cache.to(CUDA), v_cache.to(CUDA)
    out = backend.forward(q.to(CUDA), k.to(CUDA), v.to(CUDA), k_gpu, v_gpu, backend.plan(spans), scale)
    torch.testing.assert_close(out.float().cpu(), expected, rtol=2e-2, atol=2e-2)
    assert torch.equal(k_gpu.cpu(), expected_k.to(dtype)) and torch.equal(v_gpu.cpu(), expected_v.to(dtype))


def test_greedy_accept_matches_accept_greedy():
    rng = random.Random(0)
    trees = [random_tree(32, 3, rng) for _ in range(256)]
    tokens = torch.tensor([t for t, _ in trees])
    parents = torch.tensor([p for _, p in trees])
    argmax = torch.randint(0, 3, tokens.shape, generator=torch.Generator().manual_seed(0))
    max_depth = max(depth_of(p) for _, p in trees)
    accepted, length, bonus = (t.cpu() for t in greedy_accept(tokens.to(CUDA), parents.to(CUDA),
                                                              argmax.to(CUDA), max_depth))
    for b in range(len(trees)):
        oracle = accept_greedy(tokens[b].tolist(), children_of(parents[b].tolist()), argmax[b].tolist())
        assert accepted[b, : int(length[b])].tolist() == [0] + oracle.path and int(bonus[b]) == oracle.bonus


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_compact_kv_matches_a_direct_computation(dtype):
    case, paths, roots, page_tables = compaction_case(dtype)
    k, v = case.k.to(CUDA), case.v.to(CUDA)
    compact_kv(k, v, case.accepted.to(CUDA), case.lengths.to(CUDA), case.table.to(CUDA), case.roots.to(CUDA), PAGE)
    assert torch.equal(k.cpu(), directly_compacted(case.k, paths, roots, page_tables))
    assert torch.equal(v.cpu(), directly_compacted(case.v, paths, roots, page_tables))


def _greedy_outputs(config) -> tuple[list[list[int]], dict]:
    from engine_helpers import random_prompts

    from eaglesrv.engine.llm_engine import Engine
    from eaglesrv.sampling_params import SamplingParams

    engine = Engine(config)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = [r.output_token_ids for r in engine.generate(random_prompts((5, 40, 300, 17), 256), greedy)]
    return outputs, engine.spec_stats


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_output_through_device_kernels_equals_torch(tiny_llama_dir, tmp_path, dtype, backend):
    from eagle3_helpers import save_random_head, spec_config

    head_dir = save_random_head(tiny_llama_dir, tmp_path / "head")
    configs = {
        "plain": lambda backend: engine_config(tiny_llama_dir, attention_backend=backend, device="cuda", dtype=dtype),
        "eagle3": lambda backend: spec_config(tiny_llama_dir, head_dir, 3, 2, 6, attention_backend=backend,
                                              device="cuda", dtype=dtype),
    }
    for mode, make in configs.items():
        (torch_out, _), (device_out, stats) = (_greedy_outputs(make(name)) for name in ("torch", backend))
        assert device_out == torch_out, mode
        assert mode == "plain" or stats["spec_verifications"] > 0


@pytest.mark.parametrize("backend", ["triton", "torch", FLASHINFER])
def test_decode_graphs_equal_eager_on_cuda(tiny_llama_dir, backend):
    from engine_helpers import random_prompts, run_staggered

    from eaglesrv.engine.llm_engine import Engine
    from eaglesrv.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = random_prompts((1, 5, 17, 40, 300, 3), 256)
    outputs = {}
    for graphs in (True, False):
        engine = Engine(engine_config(tiny_llama_dir, attention_backend=backend, device="cuda", dtype="bfloat16",
                                      cuda_graph_max_bs=4, disable_cuda_graph=not graphs))
        outputs[graphs] = run_staggered(engine, prompts, greedy, every=2)
        if graphs:
            assert sum(engine.runner.decode_graphs.runner.replays.values()) > 0
    assert outputs[True] == outputs[False]


@pytest.mark.parametrize("adaptive", [False, True], ids=["static", "adaptive"])
@pytest.mark.parametrize("backend", ["triton", "torch", FLASHINFER])
def test_eagle3_graphs_equal_eager_on_cuda(tiny_llama_dir, tmp_path, backend, adaptive):
    from eagle3_helpers import save_random_head, spec_config
    from engine_helpers import random_prompts, run_staggered
    from test_eagle3_graphs import force_the_configured_tree_every_other_step

    from eaglesrv.engine.llm_engine import Engine
    from eaglesrv.sampling_params import SamplingParams

    head_dir = save_random_head(tiny_llama_dir, tmp_path / "head")
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = random_prompts((1, 5, 17, 40, 300, 3), 256)
    outputs = {}
    for graphs in (True, False):
        engine = Engine(spec_config(tiny_llama_dir, head_dir, 4, 4, 12, adaptive=adaptive, attention_backend=backend,
                                    device="cuda", dtype="bfloat16", cuda_graph_max_bs=4,
                                    disable_cuda_graph=not graphs))
        if adaptive:
            force_the_configured_tree_every_other_step(engine)
        outputs[graphs] = run_staggered(engine, prompts, greedy, every=2)
        if graphs:
            assert sum(engine.runner.graphs.tree_runner.replays.values()) > 0
            assert sum(engine.runner.graphs.extend_runner.replays.values()) > 0
    assert outputs[True] == outputs[False]

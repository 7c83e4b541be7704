"""Choosing the attention backend at start-up: each candidate is checked against the torch
reference, auto moves down its list past a wrong one, a backend named explicitly fails loudly.

The CUDA candidates run here as their CPU stand-ins: Triton in its interpreter, flashinfer
through flashinfer_oracle.py's module.
"""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import engine_config
from engine_helpers import random_prompts
from flashinfer_oracle import stand_in_module

from eaglesrv.configs import RuntimeConfig
from eaglesrv.engine.llm_engine import Engine
from eaglesrv.kernels.attention import resolve_backend_name, self_check
from eaglesrv.kernels.attention.flashinfer_paged import FlashinferAttentionBackend
from eaglesrv.kernels.attention.torch_ref import TorchAttentionBackend
from eaglesrv.kernels.attention.triton_paged import TritonAttentionBackend
from eaglesrv.kernels.triton_support import triton_usable
from eaglesrv.sampling_params import SamplingParams

CPU = torch.device("cpu")
SHAPES = [(4, 2, 64), (2, 1, 32)]
pytestmark = pytest.mark.skipif(not triton_usable(CPU), reason="needs triton and TRITON_INTERPRET=1")


class OffByALittle(TritonAttentionBackend):  # a miscompiled kernel: plausible, slightly wrong
    def forward(self, *args):
        return super().forward(*args) * 1.01


class Crashing(TritonAttentionBackend):  # a kernel that fails to compile or launch
    def forward(self, *args):
        raise RuntimeError("PTX assembly aborted\nmore lines")


class NotWriting(TritonAttentionBackend):  # attends correctly but never stores the new K/V
    def forward(self, q, k, v, k_cache, v_cache, metadata, scale):
        return super().forward(q, k, v, k_cache.clone(), v_cache.clone(), metadata, scale)


class WrongInGraphs(TritonAttentionBackend):  # host-planned passes right, passes built on the device wrong
    def uniform_metadata(self, block_table, num_cached, num_new, tree_mask=None):
        return super().uniform_metadata(block_table, num_cached + 1, num_new, tree_mask)


def flashinfer_stand_in(wrong: bool = False, wrong_in_graphs: bool = False):
    """A flashinfer backend over the stand-in module, optionally returning wrong numbers from
    its prefill wrapper, or from its decode wrapper in graph mode."""
    module = stand_in_module()
    name = "BatchDecodeWithPagedKVCacheWrapper" if wrong_in_graphs else "BatchPrefillWithPagedKVCacheWrapper"
    build = getattr(module, name)

    def maybe_off_by_a_little(*args, **kwargs):
        wrapper = build(*args, **kwargs)
        if wrong or (wrong_in_graphs and wrapper.use_cuda_graph):
            run = wrapper.run
            wrapper.run = lambda *a: run(*a) * 1.01
        return wrapper

    setattr(module, name, maybe_off_by_a_little)
    return lambda page, device: FlashinferAttentionBackend(page, device, module=module, workspace_bytes=16)


def test_the_check_passes_correct_backends_and_names_what_a_wrong_one_got_wrong():
    assert self_check.backend_check_failure(TritonAttentionBackend(4, CPU), SHAPES, torch.float32) is None
    assert self_check.backend_check_failure(flashinfer_stand_in()(4, CPU), SHAPES, torch.float32) is None
    wrong = ((OffByALittle, "mixed batch: output differs"), (Crashing, "RuntimeError: PTX"),
             (NotWriting, "not written"), (WrongInGraphs, "graph decode pass"))
    for backend, reason in wrong:
        failure = self_check.backend_check_failure(backend(4, CPU), SHAPES, torch.float32)
        assert reason in failure and "more lines" not in failure and "(4, 2, 64)" in failure
    failure = self_check.backend_check_failure(flashinfer_stand_in(wrong=True)(4, CPU), SHAPES, torch.float32)
    assert "mixed batch: output differs" in failure
    failure = self_check.backend_check_failure(flashinfer_stand_in(wrong_in_graphs=True)(4, CPU), SHAPES,
                                               torch.float32)
    assert "graph decode pass: output differs" in failure
    # the oracle itself is not checked
    assert self_check.backend_check_failure(TorchAttentionBackend(4, CPU), SHAPES, torch.float32) is None


def cuda_like_candidates(monkeypatch, **makers):
    """auto's CUDA list (flashinfer, triton, torch) on the CPU, with the given constructors."""
    monkeypatch.setattr(self_check, "auto_backend_names", lambda device: ["flashinfer", "triton", "torch"])
    makers = {"flashinfer": flashinfer_stand_in(), "triton": TritonAttentionBackend,
              "torch": TorchAttentionBackend, **makers}
    monkeypatch.setattr(self_check, "create_attention_backend", lambda name, page, device: makers[name](page, device))


def select(name: str):
    return self_check.select_attention_backend(name, 4, CPU, SHAPES, torch.float32)


def test_auto_serves_the_first_candidate_that_passes(monkeypatch, caplog):
    cuda_like_candidates(monkeypatch)
    assert select("auto").name == "flashinfer"
    cuda_like_candidates(monkeypatch, flashinfer=flashinfer_stand_in(wrong=True))
    with caplog.at_level(logging.WARNING, logger=self_check.__name__):
        assert type(select("auto")) is TritonAttentionBackend
    assert "flashinfer attention backend cannot serve" in caplog.text and "output differs" in caplog.text
    cuda_like_candidates(monkeypatch, flashinfer=flashinfer_stand_in(wrong=True), triton=WrongInGraphs)
    assert type(select("auto")) is TorchAttentionBackend

    def cannot_import(page, device):
        raise ValueError("the flashinfer attention backend cannot run: importing flashinfer failed (...)")

    cuda_like_candidates(monkeypatch, flashinfer=cannot_import)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=self_check.__name__):
        assert type(select("auto")) is TritonAttentionBackend
    assert "importing flashinfer failed" in caplog.text


def test_a_backend_named_explicitly_fails_start_up_instead_of_falling_back(monkeypatch):
    cuda_like_candidates(monkeypatch, flashinfer=flashinfer_stand_in(wrong=True), triton=Crashing)
    with pytest.raises(self_check.AttentionBackendError, match="--attention-backend flashinfer failed .* differs"):
        select("flashinfer")
    with pytest.raises(self_check.AttentionBackendError, match="--attention-backend triton failed .*PTX"):
        select("triton")
    cuda_like_candidates(monkeypatch)
    assert select("flashinfer").name == "flashinfer"
    monkeypatch.undo()  # the real constructors, on this machine
    with pytest.raises(ValueError, match="runs on CUDA, not cpu"):
        select("flashinfer")


def test_an_engine_whose_first_candidate_is_wrong_serves_the_same_tokens(tiny_llama_dir, monkeypatch):
    prompts = random_prompts((5, 11, 2), 256)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [r.output_token_ids for r in Engine(engine_config(tiny_llama_dir, attention_backend="torch",
                                                                 page_size=4)).generate(prompts, greedy)]
    cuda_like_candidates(monkeypatch, flashinfer=flashinfer_stand_in(wrong=True))
    engine = Engine(engine_config(tiny_llama_dir, attention_backend="auto", page_size=4))
    assert engine.runner.attention.name == "triton"
    assert [r.output_token_ids for r in engine.generate(prompts, greedy)] == expected


def test_auto_tries_flashinfer_then_triton_on_cuda(monkeypatch):
    from eaglesrv.kernels.attention import flashinfer_paged, registry

    cuda = torch.device("cuda")  # only resolved, never allocated on
    monkeypatch.setattr(flashinfer_paged, "flashinfer_installed", lambda: True)
    assert registry.auto_backend_names(cuda) == ["flashinfer", "triton", "torch"]
    assert resolve_backend_name("auto", cuda) == "flashinfer"
    monkeypatch.setattr(flashinfer_paged, "flashinfer_installed", lambda: False)
    assert registry.auto_backend_names(cuda) == ["triton", "torch"]
    monkeypatch.setattr(registry, "triton_installed", lambda: False)
    assert registry.auto_backend_names(cuda) == ["torch"]
    assert RuntimeConfig(attention_backend="flashinfer").attention_backend == "flashinfer"

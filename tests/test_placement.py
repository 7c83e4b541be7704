"""KV pool sizing on a GPU, with a fake memory probe: the arithmetic, the graphs' share,
and the one-line error when a model does not fit."""

from __future__ import annotations

import logging

import pytest
import torch

from eaglesrv.configs import CacheConfig
from eaglesrv.engine.graphs.decode_step import decode_graph_bytes
from eaglesrv.engine.kv_cache import KVPool
from eaglesrv.engine.model.arch import ModelArch
from eaglesrv.engine.placement import EngineSetupError, kv_pool_pages
from eaglesrv.kernels.attention.torch_ref import TorchAttentionBackend
from eaglesrv.kernels.triton_support import triton_usable

GIB = 2**30
CUDA = torch.device("cuda")  # only named, never allocated on
LLAMA_8B = ModelArch.from_hf_config(dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, max_position_embeddings=8192,
))
PER_TOKEN = KVPool.bytes_per_token(LLAMA_8B, torch.bfloat16)  # 128 KiB: 2 x 32 layers x 8 heads x 128 x 2 bytes


def h100(in_use: float):
    """An 80 GiB GPU with `in_use` GiB taken (the weights, by the time the pool is sized)."""
    return lambda device: (int((80 - in_use) * GIB), 80 * GIB)


def test_the_pool_takes_the_fraction_less_what_is_resident_and_what_graphs_keep(caplog):
    assert PER_TOKEN == 128 * 1024
    cache = CacheConfig(page_size=16, mem_fraction_static=0.85)
    weights = 15 * GIB  # resident already: the probe sees it, so weight_bytes does not count twice
    with caplog.at_level(logging.INFO):
        pages = kv_pool_pages(cache, LLAMA_8B, torch.bfloat16, CUDA, weights, probe=h100(15.0))
    assert pages == int((0.85 * 80 - 15) * GIB // PER_TOKEN) // 16  # 53 GiB: 434,176 tokens
    assert "27136 pages of 16 tokens = 434176 tokens" in caplog.text
    with_draft = kv_pool_pages(cache, LLAMA_8B, torch.bfloat16, CUDA, weights, extra_bytes_per_token=PER_TOKEN // 32,
                               probe=h100(15.0))
    assert with_draft == int(53 * GIB // (PER_TOKEN * 33 // 32)) // 16  # a one-layer draft's KV on the same pages
    graphs = 2 * GIB
    assert kv_pool_pages(cache, LLAMA_8B, torch.bfloat16, CUDA, weights, reserved_bytes=graphs,
                         probe=h100(15.0)) == int(51 * GIB // PER_TOKEN) // 16
    assert kv_pool_pages(CacheConfig(max_total_tokens=4096), LLAMA_8B, torch.bfloat16, CUDA, weights,
                         reserved_bytes=graphs, probe=h100(79.0)) == 256  # --max-total-tokens overrides memory


def test_a_model_that_does_not_fit_gets_one_line_naming_the_numbers():
    cache = CacheConfig(mem_fraction_static=0.5)
    with pytest.raises(EngineSetupError) as error:
        kv_pool_pages(cache, LLAMA_8B, torch.bfloat16, CUDA, 0, reserved_bytes=GIB, probe=h100(39.5))
    message = str(error.value)
    assert "\n" not in message and "does not fit" in message
    for figure in ("--mem-fraction-static 0.5", "40.00 GiB", "80.00 GiB", "39.50 GiB", "graphs 1.00 GiB",
                   "--max-total-tokens"):
        assert figure in message, figure


def test_the_graphs_estimate_is_the_largest_batch_s_activations_and_attention_workspace():
    torch_backend = TorchAttentionBackend(16, torch.device("cpu"))
    one = decode_graph_bytes(LLAMA_8B, torch.bfloat16, 1, torch_backend, 0)
    assert decode_graph_bytes(LLAMA_8B, torch.bfloat16, 160, torch_backend, 0) == 160 * one
    assert 128256 * 6 < one < 128256 * 6 + 200_000  # dominated by the logits (bf16 and float32)
    gathered = decode_graph_bytes(LLAMA_8B, torch.bfloat16, 160, torch_backend, 8192) - 160 * one
    assert gathered == 160 * 8192 * (4 * 8 * 128 * 2 + 9)  # the torch backend gathers every key of the table
    if triton_usable(torch.device("cpu")):
        from eaglesrv.kernels.attention.triton_paged import TritonAttentionBackend

        triton = TritonAttentionBackend(16, torch.device("cpu"))
        assert decode_graph_bytes(LLAMA_8B, torch.bfloat16, 160, triton, 8192) == 160 * one  # reads pages in place

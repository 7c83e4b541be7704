"""Tensor parallelism over NCCL (`-m gpu`; needs two CUDA devices, skipped otherwise):
the default model split over 2 GPUs against 1, greedy in float32, plain and EAGLE-3 (static
and adaptive), with CUDA graphs (their NCCL all-reduces and gathers are captured) and
without. The CPU suite proves the same mechanism with gloo (test_tensor_parallel.py,
test_server_tensor_parallel.py); scripts/gpu_check.sh runs this file on a machine with
several GPUs.

The default model's 9 query heads do not divide by 2, so the model here is a random Llama
with the shape of the Llama-3 family's small members, saved once per run.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import engine_config, save_tiny_llama
from eagle3_helpers import save_random_head

from eaglesrv.configs import ParallelConfig, SpeculativeConfig
from eaglesrv.engine.llm_engine import Engine
from eaglesrv.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048)
PROMPTS = [[1, 415, 5565, 302, 4843, 349], [1, 22557, 28725], list(range(1, 200, 3))]
MODES = {"plain": None, "static": False, "adaptive": True}


@pytest.fixture(scope="module")
def model_and_head(tmp_path_factory) -> tuple[str, str]:
    model = save_tiny_llama(tmp_path_factory.mktemp("gpu_tp_model"), seed=1, **SHAPE)
    return model, save_random_head(model, tmp_path_factory.mktemp("gpu_tp_head"))


def _outputs(config, tp_size: int) -> list[list[int]]:
    engine = Engine(dataclasses.replace(config, parallel=ParallelConfig(tp_size=tp_size, dist_timeout=120)))
    try:
        params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
        return [result.output_token_ids for result in engine.generate(PROMPTS, params)]
    finally:
        engine.close()


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("mode", list(MODES))
def test_two_gpus_answer_as_one(model_and_head, mode, graphs):
    model, head = model_and_head
    config = engine_config(model, device="cuda", attention_backend="torch", disable_cuda_graph=not graphs,
                           max_total_tokens=8192)
    plain = _outputs(config, 1)
    if MODES[mode] is not None:
        spec = SpeculativeConfig(algorithm="EAGLE3", draft_model_path=head, num_steps=3, eagle_topk=2,
                                 num_draft_tokens=4, adaptive=MODES[mode])
        config = dataclasses.replace(config, speculative=spec)
    assert _outputs(config, 2) == plain

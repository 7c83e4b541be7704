"""Shared fixtures: a tiny random Llama saved in Hugging Face layout, and engine builders."""

from __future__ import annotations

import os

import pytest
import torch

from eaglesrv.configs import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, RuntimeConfig, SchedulerConfig

# The suite runs on 2 cores beside server subprocesses; with torch splitting every op over
# both cores, two busy processes stall each other (tiny ops measured 60x slower), so the
# test process uses one thread. Speed is measured by the benchmarks, not here.
torch.set_num_threads(1)

# Without a GPU, Triton kernels run in its interpreter, which must be chosen before any
# kernel module is imported (eaglesrv/kernels/triton_support.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_LLAMA = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)


def save_tiny_llama(path, seed: int = 0, **overrides) -> str:
    """A random Llama with weights large enough that greedy choices are not near-ties."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_LLAMA, "initializer_range": 0.2, **overrides})
    model = LlamaForCausalLM(config).float()
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def head_dir(tiny_llama_dir, tmp_path_factory) -> str:
    """A random EAGLE-3 head for the tiny Llama, in the published format."""
    from eagle3_helpers import save_random_head  # it imports this module

    return save_random_head(tiny_llama_dir, tmp_path_factory.mktemp("head"))


@pytest.fixture(scope="session")
def default_tokenizer():
    """The default model's tokenizer (SmolLM2-135M-Instruct's, from its GGUF), loaded once a run."""
    from transformers import AutoTokenizer

    from eaglesrv.engine.loader import default_model_path

    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def default_lltokenizer(default_tokenizer):
    """llguidance's view of the default tokenizer, for checking grammars without a model."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(default_tokenizer, n_vocab=len(default_tokenizer))


def engine_config(model_path: str | None, **kwargs) -> EngineConfig:
    """An fp32 CPU engine config; kwargs go to the config group that has the field."""
    groups = {"model": {"model_path": model_path, "dtype": "float32"}, "cache": {}, "scheduler": {},
              "runtime": {"device": "cpu"}, "parallel": {}}
    for key, value in kwargs.items():
        group = next(g for g, cls in _GROUP_CLASSES.items() if key in cls.__dataclass_fields__)
        groups[group][key] = value
    groups["cache"].setdefault("max_total_tokens", 16384)
    return EngineConfig(
        model=ModelConfig(**groups["model"]), cache=CacheConfig(**groups["cache"]),
        scheduler=SchedulerConfig(**groups["scheduler"]), runtime=RuntimeConfig(**groups["runtime"]),
        parallel=ParallelConfig(**groups["parallel"]),
    )


_GROUP_CLASSES = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "runtime": RuntimeConfig,
                  "parallel": ParallelConfig}

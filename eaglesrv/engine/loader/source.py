"""What a model loader hands the engine: a config, a weight stream and a tokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

WeightStream = Iterator[tuple[str, torch.Tensor]]


@dataclass
class ModelSource:
    """A resolved model, independent of where it came from (HF dir, hub, GGUF, dummy).

    hf_config: the contents of a Hugging Face config.json (for GGUF, rebuilt from its
        metadata under the same key names), e.g. {"architectures": ["LlamaForCausalLM"],
        "hidden_size": 576, ...}.
    iter_weights: yields (Hugging Face parameter name, tensor) pairs, e.g.
        ("model.layers.0.self_attn.q_proj.weight", tensor); None for --load-format dummy.
    load_tokenizer: builds the tokenizer (with its chat template), or None when the
        source has none.
    generation_config: generation_config.json contents ({} when absent).
    description: a short human-readable origin for logs, e.g. "GGUF /path/model.gguf".
    """

    hf_config: dict[str, Any]
    iter_weights: Callable[[], WeightStream] | None
    load_tokenizer: Callable[[], Any] | None
    generation_config: dict[str, Any] = field(default_factory=dict)
    description: str = ""

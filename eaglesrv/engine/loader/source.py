"""What a model loader hands the engine: a config, a weight stream and a tokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from .errors import ModelLoadError

WeightStream = Iterator[tuple[str, torch.Tensor]]
# Which part of a checkpoint tensor to read: (dim, start, length) along one dimension of
# its Hugging Face shape, or None for the whole tensor.
TensorSlice = tuple[int, int, int] | None
# Asked once per tensor, with its Hugging Face name and full Hugging Face shape, before it is read.
SliceChooser = Callable[[str, tuple[int, ...]], TensorSlice]


def choose_slice(choose: SliceChooser | None, name: str, shape: tuple[int, ...]) -> TensorSlice:
    """The chooser's answer for one tensor, checked against its shape (None: the whole tensor)."""
    if choose is None:
        return None
    chosen = choose(name, shape)
    if chosen is None:
        return None
    try:
        dim, start, length = (int(x) for x in chosen)
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"slice {chosen!r} of tensor {name} is not (dim, start, length) or None") from exc
    if not 0 <= dim < len(shape):
        raise ModelLoadError(f"slice {tuple(chosen)} of tensor {name}: dim {dim} is out of range for shape {shape}")
    if start < 0 or length <= 0 or start + length > shape[dim]:
        raise ModelLoadError(
            f"slice {tuple(chosen)} of tensor {name}: [{start}, {start + length}) is not a non-empty range "
            f"within dim {dim} of size {shape[dim]} (shape {shape})"
        )
    return dim, start, length


@dataclass
class ModelSource:
    """A resolved model, independent of where it came from (HF dir, hub, GGUF, dummy).

    hf_config: the contents of a Hugging Face config.json (for GGUF, rebuilt from its
        metadata under the same key names), e.g. {"architectures": ["LlamaForCausalLM"],
        "hidden_size": 576, ...}.
    iter_weights: yields (Hugging Face parameter name, tensor) pairs, e.g.
        ("model.layers.0.self_attn.q_proj.weight", tensor); None for --load-format dummy.
        Its one optional argument, choose (a SliceChooser), picks part of each tensor to
        read (a tensor-parallel rank's shard); the stream then yields that slice alone,
        contiguous, read from the file without reading the rest where the format allows.
    load_tokenizer: builds the tokenizer (with its chat template), or None when the
        source has none.
    generation_config: generation_config.json contents ({} when absent).
    description: a short human-readable origin for logs, e.g. "GGUF /path/model.gguf".
    """

    hf_config: dict[str, Any]
    iter_weights: Callable[..., WeightStream] | None
    load_tokenizer: Callable[[], Any] | None
    generation_config: dict[str, Any] = field(default_factory=dict)
    description: str = ""

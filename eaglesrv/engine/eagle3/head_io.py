"""Reading and writing EAGLE-3 heads in the published checkpoint format.

A head directory holds config.json (architectures ["LlamaForCausalLMEagle3"],
draft_vocab_size, target_hidden_size, eagle_config) and model.safetensors with the
tensors listed in draft_model.py. SGLang and vLLM load the same directory.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from eaglesrv.engine.eagle3.draft_model import DraftHeadError, Eagle3Config, Eagle3DraftModel
from eaglesrv.engine.loader import ModelLoadError, resolve_model
from eaglesrv.engine.model.arch import ModelArch
from eaglesrv.engine.model.llama import fused_part_sizes

logger = logging.getLogger(__name__)


def head_config_for(target: ModelArch, draft_vocab_size: int | None = None, **overrides: Any) -> dict[str, Any]:
    """A config.json for a head on `target`: one layer of the target's own shape."""
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": target.hidden_size,
        "intermediate_size": target.intermediate_size,
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta,
        "rope_scaling": target.rope_scaling,
        "max_position_embeddings": target.max_position_embeddings,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": draft_vocab_size or target.vocab_size,
        "target_hidden_size": target.hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    config.update(overrides)
    return config


def save_head(
    model: Eagle3DraftModel, hf_config: dict[str, Any], directory: str | Path, save_embedding: bool = False
) -> Path:
    """Write `model` as a published-format head (d2t as offsets, t2d as a bool mask)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("embed_tokens") and not save_embedding:
            continue
        for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
            if f".{fused}." in name:  # the published format stores the parts apart
                for part, chunk in zip(parts, tensor.split(fused_part_sizes(name, model.config.arch))):
                    tensors[name.replace(fused, part)] = chunk.float().contiguous()
                break
        else:
            tensors[name] = tensor.float().contiguous()
    mapped = model.draft_to_target.cpu()
    tensors["d2t"] = mapped - torch.arange(len(mapped))
    t2d = torch.zeros(model.config.arch.vocab_size, dtype=torch.bool)
    t2d[mapped] = True
    tensors["t2d"] = t2d
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2))
    return directory


def load_draft_head(
    path: str | None,
    target_arch: ModelArch,
    target_embedding: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
    random_seed: int | None = None,
) -> Eagle3DraftModel:
    """Load a head from a directory or hub id; with random_seed (and no path), a random one."""
    if path is None:
        if random_seed is None:
            raise DraftHeadError("no --speculative-draft-model-path given")
        hf_config = head_config_for(target_arch)
        weights = None
    else:
        try:
            source = resolve_model(path)
        except ModelLoadError as exc:
            raise DraftHeadError(f"cannot load the EAGLE-3 head: {exc}") from exc
        hf_config, weights = source.hf_config, source.iter_weights
        logger.info("EAGLE-3 head: %s", source.description)
    config = _fit_positions(Eagle3Config.from_hf_config(hf_config), target_arch)
    config.capture_layers(target_arch.num_layers)  # refuse layer ids the target lacks now, not at the first request
    if config.target_hidden_size != target_arch.hidden_size:
        raise DraftHeadError(
            f"head expects target hidden size {config.target_hidden_size}, the target has {target_arch.hidden_size}"
        )
    if config.arch.vocab_size != target_arch.vocab_size:
        raise DraftHeadError(f"head vocab_size {config.arch.vocab_size} != target vocab {target_arch.vocab_size}")
    with torch.device("meta"):
        model = Eagle3DraftModel(config)
    model = model.to_empty(device=device).to(dtype)
    model.rotary_emb.reset_tables()
    if weights is None:
        model.init_random_weights(random_seed, target_embedding)
    else:
        model.load_weights(weights(), target_embedding)
    return model.eval()


def _fit_positions(config: Eagle3Config, target: ModelArch) -> Eagle3Config:
    """The draft runs at the target's positions, so its rotary table spans the target's
    context whatever the head declares: the published Llama-3.1 heads say 2,048 (their
    training length) for a 131k-token target. Below the declared length nothing changes."""
    declared = config.arch.max_position_embeddings
    if declared == target.max_position_embeddings:
        return config
    logger.info(
        "EAGLE-3 head declares max_position_embeddings %d; using the target's %d", declared,
        target.max_position_embeddings,
    )
    return config.with_max_positions(target.max_position_embeddings)

"""The model shape, read once from a Hugging Face config dict.

One implementation covers the Llama family; the differences are switches here:
Qwen2 has q/k/v biases, Mistral may have a sliding window and an explicit head_dim,
Llama 3.1/3.2 scale RoPE frequencies ("llama3" rope type).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


class UnsupportedModel(ValueError):
    """The config names an architecture or feature this engine does not implement."""


@dataclass(frozen=True)
class ModelArch:
    family: str  # llama | mistral | qwen2
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None or {"rope_type": "llama3" | "linear", ...}
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> "ModelArch":
        architectures = config.get("architectures") or ["LlamaForCausalLM"]
        family = SUPPORTED_ARCHITECTURES.get(architectures[0])
        if family is None:
            raise UnsupportedModel(
                f"architecture {architectures[0]!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        rope_theta, rope_scaling = _rope(config)
        attention_bias = bool(config.get("attention_bias", False))
        sliding_window = config.get("sliding_window")
        if family == "qwen2" and not config.get("use_sliding_window", False):
            sliding_window = None
        return cls(
            family=family,
            vocab_size=config["vocab_size"],
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or hidden // num_heads,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=True if family == "qwen2" else attention_bias,
            o_bias=False if family == "qwen2" else attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            sliding_window=int(sliding_window) if sliding_window else None,
            eos_token_ids=_as_tuple(config.get("eos_token_id")),
            bos_token_id=config.get("bos_token_id"),
        )

    @property
    def max_context_len(self) -> int:
        """Tokens one sequence may hold: within a sliding window every token sees all others."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings


def _rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers 5 writes "rope_parameters"; older configs use rope_theta + rope_scaling.
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or params)
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in ("llama3", "linear"):
        raise UnsupportedModel(f"rope type {rope_type!r} is not supported; supported: default, llama3, linear")
    scaling["rope_type"] = rope_type
    return theta, scaling


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)

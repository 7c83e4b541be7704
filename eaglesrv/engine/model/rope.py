"""Rotary position embeddings in Hugging Face's half-split layout, with Llama 3 scaling."""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    # float32 throughout, as Hugging Face computes it: fp32 greedy outputs must match theirs.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    return _llama3_scaled(inv_freq, scaling)


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band
    # between low_freq_factor and high_freq_factor interpolated smoothly.
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    in_band = (wavelen <= original / low) & (wavelen >= original / high)
    return torch.where(in_band, interpolated, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin for every position up to max_positions."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.settings = (head_dim, max_positions, theta, scaling)
        self.register_buffer("cos", torch.empty(0), persistent=False)  # [max_positions, head_dim // 2]
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.reset_tables()

    def reset_tables(self) -> None:
        """(Re)compute the float32 tables on the buffers' device; needed after to_empty()."""
        head_dim, max_positions, theta, scaling = self.settings
        device = self.cos.device
        inv_freq = inverse_frequencies(head_dim, theta, scaling).to(device)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=device), inv_freq)
        self.cos = angles.cos()
        self.sin = angles.sin()

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        q: torch.Tensor,  # [num_tokens, heads, head_dim]
        k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Rotate in the activations' dtype, as Hugging Face does, so bf16 runs match it too.
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [num_tokens, 1, head_dim // 2]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)

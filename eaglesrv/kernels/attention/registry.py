"""Attention backends by name. flashinfer is imported only when asked for."""

from __future__ import annotations

import importlib.util

import torch

from eaglesrv.kernels.attention.base import AttentionBackend


def available_backends(device: torch.device) -> list[str]:
    names = ["torch"]
    if device.type == "cuda" and importlib.util.find_spec("flashinfer") is not None:
        names.append("flashinfer")
    return names


def create_attention_backend(name: str, page_size: int, device: torch.device) -> AttentionBackend:
    """name: "auto" (flashinfer on CUDA when installed, else torch), "torch" or "flashinfer"."""
    if name == "auto":
        name = "flashinfer" if "flashinfer" in available_backends(device) else "torch"
    if name == "torch":
        from eaglesrv.kernels.attention.torch_ref import TorchAttentionBackend

        return TorchAttentionBackend(page_size, device)
    if name == "flashinfer":
        raise NotImplementedError(
            "the flashinfer attention backend has not landed yet; use --attention-backend torch"
        )
    raise ValueError(f"unknown attention backend {name!r}; choose from auto, torch, flashinfer")

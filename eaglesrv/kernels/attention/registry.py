"""Attention backends by name. flashinfer and the CPU kernel are loaded only when asked for."""

from __future__ import annotations

import importlib.util

import torch

from eaglesrv.kernels.attention.base import AttentionBackend


def resolve_backend_name(name: str, device: torch.device) -> str:
    """"auto": flashinfer on CUDA when installed; the C++ kernel on the CPU when it builds
    (it compiles once per machine); the torch reference otherwise."""
    if name != "auto":
        return name
    if device.type == "cuda":
        return "flashinfer" if importlib.util.find_spec("flashinfer") is not None else "torch"
    from eaglesrv.kernels.attention.cpu_build import cpu_attention_available

    return "cpu" if device.type == "cpu" and cpu_attention_available() else "torch"


def create_attention_backend(name: str, page_size: int, device: torch.device) -> AttentionBackend:
    """name: "auto", "torch", "cpu" or "flashinfer"."""
    name = resolve_backend_name(name, device)
    if name == "torch":
        from eaglesrv.kernels.attention.torch_ref import TorchAttentionBackend

        return TorchAttentionBackend(page_size, device)
    if name == "cpu":
        from eaglesrv.kernels.attention.cpu_paged import CpuAttentionBackend

        return CpuAttentionBackend(page_size, device)
    if name == "flashinfer":
        raise NotImplementedError(
            "the flashinfer attention backend has not landed yet; use --attention-backend torch"
        )
    raise ValueError(f"unknown attention backend {name!r}; choose from auto, torch, cpu, flashinfer")

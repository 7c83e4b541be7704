"""Attention backends by name. Triton and the CPU kernel are loaded only when asked for."""

from __future__ import annotations

import logging

import torch

from eaglesrv.kernels.attention.base import AttentionBackend
from eaglesrv.kernels.triton_support import triton_installed, triton_unusable_reason, triton_usable

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "torch", "cpu", "triton", "flashinfer")


def resolve_backend_name(name: str, device: torch.device) -> str:
    """"auto": the Triton kernels on CUDA when triton is installed; the C++ kernel on the CPU
    when it builds (it compiles once per machine); the torch reference otherwise.
    "flashinfer" has not landed: it warns and resolves as "auto" does."""
    if name == "flashinfer":
        fallback = resolve_backend_name("auto", device)
        logger.warning("the flashinfer attention backend has not landed yet; using %s", fallback)
        return fallback
    if name != "auto":
        return name
    if device.type == "cuda":
        return "triton" if triton_installed() else "torch"
    from eaglesrv.kernels.attention.cpu_build import cpu_attention_available

    return "cpu" if device.type == "cpu" and cpu_attention_available() else "torch"


def create_attention_backend(name: str, page_size: int, device: torch.device) -> AttentionBackend:
    """name: one of BACKEND_NAMES."""
    name = resolve_backend_name(name, device)
    if name == "torch":
        from eaglesrv.kernels.attention.torch_ref import TorchAttentionBackend

        return TorchAttentionBackend(page_size, device)
    if name == "cpu":
        from eaglesrv.kernels.attention.cpu_paged import CpuAttentionBackend

        return CpuAttentionBackend(page_size, device)
    if name == "triton":
        if not triton_usable(device):  # checked before importing the kernels, which need triton
            raise ValueError(f"the triton attention backend cannot run: {triton_unusable_reason(device)}; "
                             "or choose another --attention-backend (cpu on the CPU)")
        from eaglesrv.kernels.attention.triton_paged import TritonAttentionBackend

        return TritonAttentionBackend(page_size, device)
    raise ValueError(f"unknown attention backend {name!r}; choose from {', '.join(BACKEND_NAMES)}")

"""Attention backends by name. flashinfer, Triton and the CPU kernel are loaded only when asked for."""

from __future__ import annotations

import torch

from eaglesrv.kernels.attention.base import AttentionBackend
from eaglesrv.kernels.triton_support import triton_installed, triton_unusable_reason, triton_usable

BACKEND_NAMES = ("auto", "torch", "cpu", "triton", "flashinfer")


def auto_backend_names(device: torch.device) -> list[str]:
    """What "auto" tries, best first (the start-up self-check moves down the list, see
    self_check.py): on CUDA flashinfer, then the Triton kernels, each when installed; on
    the CPU the C++ kernel when it builds (it compiles once per machine); the torch
    reference last everywhere."""
    if device.type == "cuda":
        from eaglesrv.kernels.attention.flashinfer_paged import flashinfer_installed

        return [name for name, ok in (("flashinfer", flashinfer_installed()), ("triton", triton_installed())) if ok] \
            + ["torch"]
    from eaglesrv.kernels.attention.cpu_build import cpu_attention_available

    return (["cpu"] if device.type == "cpu" and cpu_attention_available() else []) + ["torch"]


def resolve_backend_name(name: str, device: torch.device) -> str:
    return auto_backend_names(device)[0] if name == "auto" else name


def create_attention_backend(name: str, page_size: int, device: torch.device) -> AttentionBackend:
    """name: one of BACKEND_NAMES ("auto": the first of auto_backend_names, unchecked)."""
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
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError(f"the flashinfer attention backend runs on CUDA, not {device.type}; "
                             "choose another --attention-backend (cpu on the CPU)")
        from eaglesrv.kernels.attention.flashinfer_paged import FlashinferAttentionBackend

        return FlashinferAttentionBackend(page_size, device)
    raise ValueError(f"unknown attention backend {name!r}; choose from {', '.join(BACKEND_NAMES)}")

"""Where eaglesrv's Triton kernels can run, and the one thing the interpreter needs.

Triton compiles kernels for CUDA devices. On the CPU its interpreter runs the same kernels
on CPU tensors when TRITON_INTERPRET=1 is set before a kernel module is imported (the flag
is read when `@triton.jit` decorates); the test suite sets it, so every kernel is checked
against its torch reference on a machine without a GPU.

The interpreter keeps bf16 values as raw 16-bit integers, so arithmetic on them is silently
wrong. Kernels take `UPCAST_LOADS=upcast_loads()` as a constexpr and, when it is set,
convert bf16/fp16 values to fp32 right after loading them; on a GPU the flag is off and
the tensor cores see the narrow types.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import torch


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_usable(device: torch.device) -> bool:
    """Whether Triton kernels can run on tensors of this device."""
    if not triton_installed():
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


def triton_unusable_reason(device: torch.device) -> str:
    """One line saying why triton_usable(device) is False, and the fix."""
    if not triton_installed():
        return "triton is not installed: pip install 'triton==3.7.1' (Linux x86_64)"
    return (
        f"Triton kernels run on CUDA, not {device.type}; on the CPU set TRITON_INTERPRET=1 to run them in "
        "Triton's slow interpreter (as the tests do)"
    )


def upcast_loads() -> bool:
    return interpreting()


@dataclass(frozen=True)
class KernelBuild:
    """One configuration of a Triton kernel to compile ahead of time for sm_90 (the
    compile check that runs without a GPU). Each kernel module lists its builds in a
    module-level `SM90_BUILDS`; the argument types use Triton's signature strings
    ("*fp32", "*bf16", "i32", "constexpr"). `aligned` names the arguments that a real
    launch sees 16-byte aligned (pointers) or divisible by 16 (strides): Triton specializes
    on that at run time, and without it the compile vectorizes no loads."""

    name: str
    kernel: Any  # the @triton.jit function
    signature: dict[str, str]
    constexprs: dict[str, Any]
    num_warps: int = 4
    aligned: tuple[str, ...] = ()

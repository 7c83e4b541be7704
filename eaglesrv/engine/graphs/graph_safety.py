"""What a graph cannot hold, as rules the CPU stand-in applies during capture.

A real CUDA capture fails, or worse silently freezes a value, when a step
- reads a tensor's value on the host (`.item()`, `.tolist()`, `if tensor:`, `int(t)`,
  `.cpu()`, `.numpy()`): the value is read once, at capture, and baked in;
- makes an output whose shape depends on tensor values (`nonzero`, boolean-mask indexing,
  `unique`, `masked_select`, `repeat_interleave` without `output_size`): the shape needs a
  host sync and would be frozen anyway;
- draws random numbers (`torch.rand*`, `multinomial`, `bernoulli`, dropout in train mode):
  the draws would depend on generator state a replay does not advance the way eager does.
  eaglesrv passes the sampler's uniforms in as graph inputs instead (see the package doc).

The rules use the operator tags PyTorch keeps for exactly these properties
(`data_dependent_output`, `dynamic_output_shape`, `nondeterministic_seeded`), plus the
few cases where the tag depends on the arguments. A `.to(device)` is not refused: on the
CPU the host and the device are the same, and a copy to the step's own device is a no-op
everywhere. Some CPU kernels check values on the host where their CUDA kernels do not
(`one_hot` does), so the stand-in refuses them; write those with `scatter_`.
"""

from __future__ import annotations

from typing import Any

import torch

# Methods that hand a tensor's value to Python. Some never reach the dispatcher on the CPU
# (`.tolist()`, `.cpu()`, `.numpy()`), so they are refused where Python calls them.
_HOST_READ_METHODS = {
    torch.Tensor.item: ".item()",
    torch.Tensor.tolist: ".tolist()",
    torch.Tensor.cpu: ".cpu()",
    torch.Tensor.numpy: ".numpy()",
    torch.Tensor.__bool__: "bool(tensor) / if tensor:",
    torch.Tensor.__int__: "int(tensor)",
    torch.Tensor.__float__: "float(tensor)",
    torch.Tensor.__index__: "a tensor used as a Python index",
    torch.Tensor.__complex__: "complex(tensor)",
    torch.Tensor.__array__: "numpy.asarray(tensor)",
}

_BOOL_MASK_DTYPES = (torch.bool, torch.uint8)
_MASK_INDEXING_OPS = {
    torch.ops.aten.index.Tensor,
    torch.ops.aten.index_put.default,
    torch.ops.aten.index_put_.default,
    torch.ops.aten._unsafe_index.Tensor,
}


def host_read_refusal(func: Any) -> str | None:
    """Why calling `func` (a torch-function-level callable) cannot be captured, or None."""
    what = _HOST_READ_METHODS.get(func)
    if what is None:
        return None
    return f"host sync during capture: {what} reads a tensor's value on the host, which a graph would freeze"


def op_refusal(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> str | None:
    """Why the aten (or custom) op `func` with these arguments cannot be captured, or None."""
    tags = func.tags
    if torch.Tag.nondeterministic_seeded in tags and not _draws_nothing(func, args, kwargs):
        return (f"random-number op during capture: {func}; a replay would not draw what eager draws. "
                "Pass random numbers in as graph inputs (the sampler's per-request uniforms)")
    if torch.Tag.data_dependent_output in tags:
        return f"host sync during capture: {func} reads a tensor's value on the host, which a graph would freeze"
    if func in _MASK_INDEXING_OPS:
        if _has_mask_index(args):
            return f"data-dependent output shape during capture: boolean-mask indexing ({func})"
        return None
    if torch.Tag.dynamic_output_shape in tags and not _static_despite_tag(func, kwargs):
        return f"data-dependent output shape during capture: {func}"
    return None


def _draws_nothing(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> bool:
    # Attention is tagged seeded for its dropout; without dropout it draws nothing.
    if func is torch.ops.aten.scaled_dot_product_attention.default:
        return float(args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)) == 0.0
    return False


def _has_mask_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in _BOOL_MASK_DTYPES for i in indices)


def _static_despite_tag(func: torch._ops.OpOverload, kwargs: dict) -> bool:
    # repeat_interleave with its output size given needs no sync.
    return func is torch.ops.aten.repeat_interleave.Tensor and kwargs.get("output_size") is not None

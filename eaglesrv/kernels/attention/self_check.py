"""A start-up check of a device backend against the torch reference, at the model's shapes.

Compiled kernels can go wrong in ways no CPU test shows (a Triton or driver version that
miscompiles, a head shape never tried). Before serving, a backend in SELF_CHECKED runs one
small batch (a decode, a prefill chunk over a cached prefix, a tree under a custom mask) on
the device at each head shape and dtype the model uses, and is compared with the torch
reference on the same device. A backend that fails, or raises, is replaced by the torch
reference with the reason in the log: slower, never wrong tokens.
"""

from __future__ import annotations

import logging

import torch

from eaglesrv.kernels.attention.base import AttentionBackend, SequenceSpan
from eaglesrv.kernels.attention.torch_ref import TorchAttentionBackend

logger = logging.getLogger(__name__)

SELF_CHECKED = frozenset({"triton"})
HeadShape = tuple[int, int, int]  # (query heads, kv heads, head dim)


def checked_backend(backend: AttentionBackend, head_shapes: list[HeadShape], dtype: torch.dtype) -> AttentionBackend:
    """`backend` if it passes at every head shape (or needs no check), else the torch reference."""
    if backend.name not in SELF_CHECKED:
        return backend
    for shape in dict.fromkeys(head_shapes):
        failure = self_check_failure(backend, shape, dtype)
        if failure is not None:
            logger.warning("the %s attention backend failed its start-up check at heads %s in %s (%s); "
                           "using the torch reference instead", backend.name, shape, dtype, failure)
            return TorchAttentionBackend(backend.page_size, backend.device)
    logger.info("the %s attention backend passed its start-up check (%s)", backend.name, dtype)
    return backend


def self_check_failure(backend: AttentionBackend, heads: HeadShape, dtype: torch.dtype) -> str | None:
    """None when the backend's output and cache writes match the torch reference, else why not."""
    num_heads, num_kv_heads, head_dim = heads
    page, device = backend.page_size, backend.device
    g = torch.Generator().manual_seed(0)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    shapes = [(37, 1, None), (5, 19, None), (20, 4, tree)]  # (cached, new, mask)
    pages_needed = [-(-(cached + new) // page) for cached, new, _ in shapes]
    order = torch.randperm(sum(pages_needed) + 2, generator=g).tolist()  # scattered pages
    spans = []
    for (cached, new, mask), count in zip(shapes, pages_needed):
        spans.append(SequenceSpan([order.pop() for _ in range(count)], cached, new, mask))
    slots = (sum(pages_needed) + 2) * page
    tokens = sum(new for _, new, _ in shapes)
    k_cache, v_cache = (torch.randn(slots, num_kv_heads, head_dim, generator=g).to(device, dtype) for _ in range(2))
    q = torch.randn(tokens, num_heads, head_dim, generator=g).to(device, dtype)
    k, v = (torch.randn(tokens, num_kv_heads, head_dim, generator=g).to(device, dtype) for _ in range(2))
    scale = head_dim**-0.5
    reference = TorchAttentionBackend(page, device)
    ref_k, ref_v = k_cache.float().clone(), v_cache.float().clone()  # never the backend's own caches
    expected = reference.forward(q.float(), k.float(), v.float(), ref_k, ref_v, reference.plan(spans), scale)
    try:
        out = backend.forward(q, k, v, k_cache, v_cache, backend.plan(spans), scale)
    except Exception as error:  # a compile or launch failure: fall back, say why
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    error = (out.float() - expected).abs().max().item()
    if not error <= tolerance:  # also catches NaN
        return f"output differs from the torch reference by {error:.3g}"
    written = ((k_cache, ref_k), (v_cache, ref_v))
    if not all(torch.equal(cache.float(), ref.to(dtype).float()) for cache, ref in written):
        return "the new K/V were not written where the reference writes them"
    return None

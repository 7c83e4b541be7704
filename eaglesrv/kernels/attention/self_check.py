"""Choosing the attention backend at start-up, each candidate checked against the torch reference.

Compiled kernels can go wrong in ways no CPU test shows (a flashinfer, Triton or driver
version that miscompiles, a head shape never tried). Before serving, a backend in
SELF_CHECKED runs one small mixed batch (a decode, a prefill chunk over a cached prefix, a
tree under a custom mask) on the device at each head shape the model uses, in the serving
dtype, planned on the host as eager passes are; when it can run in graphs, also a decode
pass and a tree pass built as graphs build them (on the device, or for flashinfer's graph
passes planned on the host into fixed buffers). Each is compared with the
torch reference on the same device.

With `--attention-backend auto` a backend that fails, or raises (building it too), is
skipped with the reason in the log and the next one is tried: flashinfer, then Triton,
then the torch reference on CUDA (registry.auto_backend_names). Slower, never wrong tokens.
A backend named explicitly fails start-up instead, with the reason.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext

import torch

from eaglesrv.kernels.attention.base import AttentionBackend, SequenceSpan, padded_block_table
from eaglesrv.kernels.attention.registry import auto_backend_names, create_attention_backend
from eaglesrv.kernels.attention.torch_ref import TorchAttentionBackend

logger = logging.getLogger(__name__)

SELF_CHECKED = frozenset({"flashinfer", "triton"})
HeadShape = tuple[int, int, int]  # (query heads, kv heads, head dim)
_TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)


class AttentionBackendError(ValueError):
    """The backend named by --attention-backend cannot serve on this machine."""


def select_attention_backend(name: str, page_size: int, device: torch.device, head_shapes: list[HeadShape],
                             dtype: torch.dtype) -> AttentionBackend:
    """The first of `name`'s candidates that builds and passes its check ("auto": every
    backend auto_backend_names lists; any other name: that one, or an error)."""
    candidates = auto_backend_names(device) if name == "auto" else [name]
    for candidate in candidates:
        try:
            backend = create_attention_backend(candidate, page_size, device)
        except Exception as error:
            if name != "auto":
                raise
            failure = _one_line(error)
        else:
            failure = backend_check_failure(backend, head_shapes, dtype)
            if failure is None:
                if candidate in SELF_CHECKED:
                    logger.info("the %s attention backend passed its start-up check (%s)", candidate, dtype)
                return backend
        if name != "auto":
            raise AttentionBackendError(f"--attention-backend {name} failed its start-up check: {failure}")
        logger.warning("the %s attention backend cannot serve (%s); trying the next one", candidate, failure)
    raise AssertionError("the torch reference ends every candidate list and is not checked")


def backend_check_failure(backend: AttentionBackend, head_shapes: list[HeadShape], dtype: torch.dtype) -> str | None:
    """None when `backend` needs no check or passes at every head shape, else why not."""
    if backend.name not in SELF_CHECKED:
        return None
    for shape in dict.fromkeys(head_shapes):
        failure = self_check_failure(backend, shape, dtype)
        if failure is not None:
            return f"at heads {shape} in {dtype}: {failure}"
    return None


def self_check_failure(backend: AttentionBackend, heads: HeadShape, dtype: torch.dtype) -> str | None:
    """None when the backend's outputs and cache writes match the torch reference, else why not."""
    case = _Case(heads, backend.page_size, backend.device, dtype)
    shapes = [(37, 1, None), (5, 19, None), (20, 4, _TREE)]  # (cached, new, mask): a decode, an extend, a tree
    try:
        failure = case.compare(backend, case.spans(shapes), "mixed batch")
        if failure is None and backend.graph_safe:
            failure = case.compare(backend, case.spans([(37, 1, None), (3, 1, None)]), "graph decode pass",
                                   uniform=True)
        if failure is None and backend.graph_safe:
            failure = case.compare(backend, case.spans([(20, 4, _TREE), (9, 4, _TREE)]), "graph tree pass",
                                   uniform=True)
    except Exception as error:  # a compile or launch failure: fall back, say why
        return _one_line(error)
    return failure


class _Case:
    """Random caches and queries at one head shape; spans on scattered pages."""

    def __init__(self, heads: HeadShape, page_size: int, device: torch.device, dtype: torch.dtype) -> None:
        self.heads, self.page, self.device, self.dtype = heads, page_size, device, dtype
        self.generator = torch.Generator().manual_seed(0)
        self.num_pages = 0

    def spans(self, shapes) -> list[SequenceSpan]:
        """Spans for these (cached, new, mask) on scattered pages (the caches `compare` makes hold them)."""
        self.num_pages = 2 + sum(-(-(cached + new) // self.page) for cached, new, _ in shapes)
        order = torch.randperm(self.num_pages, generator=self.generator).tolist()
        spans = []
        for cached, new, mask in shapes:
            pages = [order.pop() for _ in range(-(-(cached + new) // self.page))]
            spans.append(SequenceSpan(pages, cached, new, mask))
        return spans

    def _random(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator)

    def compare(self, backend: AttentionBackend, spans: list[SequenceSpan], what: str, uniform: bool = False):
        num_heads, num_kv_heads, head_dim = self.heads
        tokens = sum(span.num_new for span in spans)
        k_cache, v_cache = (self._random(self.num_pages * self.page, num_kv_heads, head_dim) for _ in range(2))
        q = self._random(tokens, num_heads, head_dim)
        k, v = (self._random(tokens, num_kv_heads, head_dim) for _ in range(2))
        scale = head_dim**-0.5
        reference = TorchAttentionBackend(self.page, self.device)
        # copies: .to() returns the tensor itself when nothing changes, and each side writes its own
        ref_k, ref_v = (cache.to(self.device, self.dtype).float().clone() for cache in (k_cache, v_cache))
        expected = reference.forward(*(t.to(self.device) for t in (q, k, v)), ref_k, ref_v,
                                     self._metadata(reference, spans, uniform), scale)
        caches = [cache.to(self.device, self.dtype).clone() for cache in (k_cache, v_cache)]
        with self._planned(backend, spans, uniform) as metadata:
            out = backend.forward(*(t.to(self.device, self.dtype) for t in (q, k, v)), *caches, metadata, scale)
        tolerance = 1e-4 if self.dtype == torch.float32 else 3e-2
        error = (out.float() - expected).abs().max().item()
        if not error <= tolerance:  # also catches NaN
            return f"{what}: output differs from the torch reference by {error:.3g}"
        written = zip(caches, (ref_k, ref_v))
        if not all(torch.equal(cache.float(), ref.to(self.dtype).float()) for cache, ref in written):
            return f"{what}: the new K/V were not written where the reference writes them"
        return None

    def _metadata(self, backend: AttentionBackend, spans: list[SequenceSpan], uniform: bool):
        with self._planned(backend, spans, uniform) as metadata:
            return metadata

    @contextmanager
    def _planned(self, backend: AttentionBackend, spans: list[SequenceSpan], uniform: bool):
        """The pass's metadata, inside a graph planning session as a graph's step runs when
        the backend plans graph passes on the host (the forward must run inside it too)."""
        if not uniform:
            yield backend.plan(spans)
            return
        table = padded_block_table([span.page_table for span in spans])
        num_cached = torch.tensor([span.num_cached for span in spans], dtype=torch.int32)
        masks = None
        if spans[0].custom_mask is not None:
            masks = torch.stack([span.custom_mask for span in spans]).to(self.device)
        step = {"block_table": table.to(self.device), "num_cached": num_cached.to(self.device)}
        planner = backend.uniform_planner()
        with nullcontext() if planner is None else planner.session(
                {"block_table": table, "num_cached": num_cached}, step, graphed=True):
            yield backend.uniform_metadata(step["block_table"], step["num_cached"], spans[0].num_new, masks)


def _one_line(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"

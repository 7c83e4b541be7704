"""Attention backends: one interface, a registry, the torch reference, the CPU kernel and the
Triton kernels."""

from eaglesrv.kernels.attention.base import AttentionBackend, AttentionMetadata, SequenceSpan
from eaglesrv.kernels.attention.registry import create_attention_backend, resolve_backend_name

__all__ = ["AttentionBackend", "AttentionMetadata", "SequenceSpan", "create_attention_backend", "resolve_backend_name"]

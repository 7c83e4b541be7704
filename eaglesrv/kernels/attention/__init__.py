"""Attention backends: one interface, a registry, and the torch reference."""

from eaglesrv.kernels.attention.base import AttentionBackend, AttentionMetadata, SequenceSpan
from eaglesrv.kernels.attention.registry import create_attention_backend, available_backends

__all__ = ["AttentionBackend", "AttentionMetadata", "SequenceSpan", "available_backends", "create_attention_backend"]

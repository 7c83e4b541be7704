"""What one forward pass needs besides its input tensors, passed explicitly (no globals)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the model imports this module; keep it free of engine imports at run time
    from eaglesrv.engine.kv_cache import KVPool
    from eaglesrv.kernels.attention.base import AttentionBackend, AttentionMetadata


@dataclass
class ForwardContext:
    attention: AttentionBackend
    metadata: AttentionMetadata
    kv: KVPool

"""Frozen, validated configuration, grouped by concern and built from CLI flags in cli.py."""

from eaglesrv.configs.cache import CacheConfig
from eaglesrv.configs.engine import EngineConfig
from eaglesrv.configs.model import ModelConfig
from eaglesrv.configs.parallel import ParallelConfig
from eaglesrv.configs.runtime import RuntimeConfig
from eaglesrv.configs.scheduler import SchedulerConfig
from eaglesrv.configs.server import ServerConfig
from eaglesrv.configs.speculative import SpeculativeConfig

__all__ = [
    "CacheConfig",
    "EngineConfig",
    "ModelConfig",
    "ParallelConfig",
    "RuntimeConfig",
    "SchedulerConfig",
    "ServerConfig",
    "SpeculativeConfig",
]

from __future__ import annotations

from dataclasses import dataclass, field

from eaglesrv.configs.cache import CacheConfig
from eaglesrv.configs.model import ModelConfig
from eaglesrv.configs.parallel import ParallelConfig
from eaglesrv.configs.runtime import RuntimeConfig
from eaglesrv.configs.scheduler import SchedulerConfig
from eaglesrv.configs.speculative import SpeculativeConfig


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine process needs, one group per concern."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

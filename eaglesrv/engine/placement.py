"""Where the engine runs and how big its KV pool is: device, dtype and pool size, decided
once at start-up and logged."""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from eaglesrv.configs import CacheConfig, ModelConfig, RuntimeConfig
from eaglesrv.engine.kv_cache import KVPool
from eaglesrv.engine.model.arch import ModelArch

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CPU_DEFAULT_MEM_FRACTION = 0.3
CUDA_DEFAULT_MEM_FRACTION = 0.85


class EngineSetupError(RuntimeError):
    """The engine cannot start with this configuration on this machine."""


def resolve_device(runtime: RuntimeConfig) -> torch.device:
    if runtime.device == "cuda" and not torch.cuda.is_available():
        raise EngineSetupError("--device cuda was given but no CUDA device is available")
    if runtime.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(runtime.device)


def resolve_dtype(model: ModelConfig, hf_config: dict[str, Any], device: torch.device) -> torch.dtype:
    """'auto': on the CPU, bfloat16 where the CPU computes it natively (AVX512-BF16 or AMX)
    and float32 elsewhere; on CUDA the checkpoint's 16-bit dtype, or bfloat16."""
    if model.dtype != "auto":
        return _DTYPES[model.dtype]
    if device.type == "cpu":
        native = cpu_has_native_bf16()
        logger.info("--dtype auto: %s (%s)", "bfloat16" if native else "float32",
                    "the CPU has bf16 units" if native else "no bf16 units on this CPU: bfloat16 would be emulated")
        return torch.bfloat16 if native else torch.float32
    declared = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "")
    return _DTYPES.get(declared.replace("torch.", ""), torch.bfloat16) if "16" in declared else torch.bfloat16


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16 in the CPU's flags. On a 2-core AMD EPYC with AVX512-BF16,
    the default model served 48 ShareGPT prompts at 110 output tok/s in float32 (all at
    once), and at 178 (16 in flight) and 251 (64) in bfloat16. Without bf16 units torch
    emulates it, and float32 is the faster choice."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


# (free, total) bytes of a device's memory now; torch.cuda.mem_get_info on CUDA.
MemoryProbe = Callable[[torch.device], tuple[int, int]]


def kv_pool_pages(
    cache: CacheConfig,
    arch: ModelArch,
    dtype: torch.dtype,
    device: torch.device,
    weight_bytes: int,
    extra_bytes_per_token: int = 0,
    reserved_bytes: int = 0,
    probe: MemoryProbe | None = None,
    ranks_sharing_host: int = 1,
) -> int:
    """How many pages the KV pool gets, from --max-total-tokens or the memory fraction.
    extra_bytes_per_token: other pools indexed by the same pages (the draft's KV, the
    adaptive backlog's features). reserved_bytes: what must stay free for later inside the
    fraction (the graphs' memory pool). probe: the CUDA memory probe (tests pass a fake).
    ranks_sharing_host: tensor-parallel ranks on this host, which share its memory on the CPU
    (the fraction is of the host's, for all of them; on CUDA each rank has its own GPU)."""
    per_token = KVPool.bytes_per_token(arch, dtype) + extra_bytes_per_token
    if cache.max_total_tokens is not None:
        tokens = cache.max_total_tokens
    else:
        budget, spent = _memory_budget(cache, device, weight_bytes, reserved_bytes, probe or torch.cuda.mem_get_info,
                                       ranks_sharing_host)
        tokens = max(0, int(budget // per_token))
        if tokens < cache.page_size:
            raise EngineSetupError(
                f"the KV cache does not fit: {spent}, which leaves room for {tokens} tokens of {per_token} bytes "
                f"(one page is {cache.page_size}); raise --mem-fraction-static, give --max-total-tokens, or use a "
                "smaller model or fewer graphs (--cuda-graph-max-bs)"
            )
    pages = tokens // cache.page_size
    logger.info(
        "KV cache: %d pages of %d tokens = %d tokens (the most the server holds at once), %.2f GiB (%s)%s",
        pages, cache.page_size, pages * cache.page_size, pages * cache.page_size * per_token / 2**30, dtype,
        f"; {reserved_bytes / 2**30:.2f} GiB kept for graphs" if reserved_bytes and cache.max_total_tokens is None
        else "",
    )
    return pages


def _memory_budget(cache: CacheConfig, device: torch.device, weight_bytes: int, reserved_bytes: int,
                   probe: MemoryProbe, ranks_sharing_host: int = 1) -> tuple[float, str]:
    """Bytes left for the KV pools, and how the fraction was spent (for the error message)."""
    gib = 2**30
    if device.type == "cuda":
        fraction = cache.mem_fraction_static or CUDA_DEFAULT_MEM_FRACTION
        free, total = probe(device)
        resident = total - free  # the weights (target and draft) are loaded by now, and whatever else runs there
        spent = (f"--mem-fraction-static {fraction} allows {total * fraction / gib:.2f} GiB of the GPU's "
                 f"{total / gib:.2f} GiB; {resident / gib:.2f} GiB are in use (weights and other processes)")
        budget = total * fraction - resident
    else:
        fraction = cache.mem_fraction_static or CPU_DEFAULT_MEM_FRACTION
        available = _available_host_memory() / ranks_sharing_host
        shared = f" (a share of {ranks_sharing_host} tensor-parallel ranks)" if ranks_sharing_host > 1 else ""
        spent = (f"--mem-fraction-static {fraction} allows {available * fraction / gib:.2f} GiB of the "
                 f"{available / gib:.2f} GiB of host memory available{shared}; the weights take "
                 f"{weight_bytes / gib:.2f} GiB")
        budget = available * fraction - weight_bytes
    if reserved_bytes:
        spent += f" and the graphs {reserved_bytes / gib:.2f} GiB"
    return budget - reserved_bytes, spent


def _available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30  # not Linux: assume a modest machine

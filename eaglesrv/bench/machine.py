"""The machine a benchmark ran on, for the header of its report (bench_offline and bench_compare)."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch


def machine_info() -> dict[str, Any]:
    """CPU model, cores and library versions: a figure means little without them."""
    import transformers

    cpu, flags = platform.processor() or "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    cpu = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass  # not Linux: platform.processor() is the best we have
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "amx_bf16": "amx_bf16" in flags,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "load_average_1m": _load_average(),  # others' jobs on a shared machine skew every figure
    }


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # not available on this platform
        return None

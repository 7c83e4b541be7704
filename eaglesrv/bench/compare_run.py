"""Run every configuration at every concurrency with the same requests (behind `bench_compare`).

One fresh server per configuration; within it, one `bench_serving` run per concurrency
(requests sent all at once, at most that many in flight). The outputs are rewritten after
each configuration, so a failure late in a long run keeps what finished.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from eaglesrv.bench.compare_configs import ServerConfig
from eaglesrv.bench.compare_report import write_outputs
from eaglesrv.bench.server_launcher import ManagedServer
from eaglesrv.bench.serving_dataset import DatasetRow
from eaglesrv.bench.serving_run import BenchSettings, append_jsonl, run_benchmark

RUNS_NAME = "runs.jsonl"  # every run's full record, one line each, as bench_serving --output-file writes


@dataclass(frozen=True)
class CompareSettings:
    concurrencies: tuple[int, ...]
    output_dir: Path
    backend: str = "sglang"
    model_args: tuple[str, ...] = ()  # --model-path and friends, for every server
    server_args: tuple[str, ...] = ()  # --server-args, after each configuration's own flags
    startup_timeout_s: float = 900.0
    seed: int = 1
    show_progress: bool = True


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower() or "config"


def served_model_name(base_url: str) -> str:
    import httpx

    return httpx.get(base_url + "/v1/models", timeout=30.0).json()["data"][0]["id"]


def run_comparison(
    configs: Sequence[ServerConfig], rows: Sequence[DatasetRow], tokenizer: Any, settings: CompareSettings,
    context: dict[str, Any], header: Sequence[str],
) -> list[dict[str, Any]]:
    """Every run's record ({"config", **bench_serving's JSON}), in run order."""
    runs: list[dict[str, Any]] = []
    (settings.output_dir / RUNS_NAME).unlink(missing_ok=True)  # this comparison's runs only
    for config in configs:
        server_args = [*settings.model_args, *config.server_args, *settings.server_args]
        print(f"\n=== {config.name}: python -m eaglesrv.launch {shlex.join(server_args)}", flush=True)
        log_path = settings.output_dir / "logs" / f"{_slug(config.name)}.log"
        with ManagedServer(server_args, log_path, settings.startup_timeout_s) as server:
            model = served_model_name(server.base_url)
            for concurrency in settings.concurrencies:
                bench = BenchSettings(
                    backend=settings.backend, base_url=server.base_url, model=model, max_concurrency=concurrency,
                    seed=settings.seed, show_progress=settings.show_progress,
                    progress_label=f"{config.name}, concurrency {concurrency}",
                )
                result = run_benchmark(bench, rows, tokenizer)
                print(result.report(), flush=True)
                record = {"config": config.name, **result.to_json()}  # its max_concurrency is `concurrency`
                append_jsonl(settings.output_dir / RUNS_NAME, record)
                runs.append(record)
        write_outputs(settings.output_dir, runs, context, header)
    return runs

"""Run every configuration at every concurrency with the same requests (behind `bench_compare`).

A run is one `bench_serving` run (requests sent all at once, at most `concurrency` in
flight) against one configuration's server. Every run flushes the server's prefix cache
after its warm-up, so that no run finds the prompts of the runs before it cached.

One round (the default): one fresh server per configuration, all its concurrencies, then
the next. Several rounds: every server is up from the start (idle ones wait on their
sockets and use no CPU), and for each concurrency the rounds alternate the configurations'
order (A B C, then C B A, ...). A machine whose speed drifts over minutes (a shared VM)
then slows every configuration alike instead of whichever ran in the slow spell, and the
spread across rounds shows how far one ratio can be trusted.

The outputs are rewritten after every run, so a failure late in a long run keeps what
finished.
"""

from __future__ import annotations

import re
import shlex
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from eaglesrv.bench.compare.configs import BASELINE, ServerVariant
from eaglesrv.bench.compare.launcher import ManagedServer
from eaglesrv.bench.compare.report import write_outputs
from eaglesrv.bench.serving.run import BenchSettings, Workload, append_jsonl, run_benchmark

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
    rounds: int = 1  # runs of every configuration at each concurrency, interleaved
    baseline: str = BASELINE  # the configuration the ratios are to


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower() or "config"


def served_model_name(base_url: str) -> str:
    import httpx

    return httpx.get(base_url + "/v1/models", timeout=30.0).json()["data"][0]["id"]


def schedule(configs: Sequence[ServerVariant], concurrencies: Sequence[int],
             rounds: int) -> list[tuple[ServerVariant, int, int]]:
    """(configuration, concurrency, round) in run order; rounds count from 1."""
    if rounds == 1:
        return [(config, c, 1) for config in configs for c in concurrencies]
    order = []
    for c in concurrencies:
        for r in range(1, rounds + 1):
            order += [(config, c, r) for config in (configs if r % 2 else list(reversed(configs)))]
    return order


def run_comparison(
    configs: Sequence[ServerVariant], rows: Workload, tokenizer: Any, settings: CompareSettings,
    context: dict[str, Any], header: Sequence[str],
) -> list[dict[str, Any]]:
    """Every run's record ({"config", "round", **bench_serving's JSON}), in run order."""
    runs: list[dict[str, Any]] = []
    (settings.output_dir / RUNS_NAME).unlink(missing_ok=True)  # this comparison's runs only
    servers: dict[str, tuple[ManagedServer, str]] = {}  # config name -> (server, served model name)
    with ExitStack() as stack:

        def server_for(config: ServerVariant) -> tuple[ManagedServer, str]:
            if config.name not in servers:
                if settings.rounds == 1:  # one server at a time
                    stack.close()
                    servers.clear()
                server_args = [*settings.model_args, *config.server_args, *settings.server_args]
                source = f"  [eaglesrv from {config.source_dir}]" if config.source_dir else ""
                print(f"\n=== {config.name}: python -m eaglesrv.launch {shlex.join(server_args)}{source}", flush=True)
                log_path = settings.output_dir / "logs" / f"{_slug(config.name)}.log"
                server = stack.enter_context(
                    ManagedServer(server_args, log_path, settings.startup_timeout_s, source_dir=config.source_dir))
                servers[config.name] = (server, served_model_name(server.base_url))
            return servers[config.name]

        if settings.rounds > 1:
            for config in configs:
                server_for(config)  # all up before the first run, so no start-up overlaps a run
        for config, concurrency, round_number in schedule(configs, settings.concurrencies, settings.rounds):
            server, model = server_for(config)
            label = f"{config.name}, concurrency {concurrency}"
            if settings.rounds > 1:
                label += f", round {round_number}/{settings.rounds}"
            bench = BenchSettings(
                backend=settings.backend, base_url=server.base_url, model=model, max_concurrency=concurrency,
                seed=settings.seed, show_progress=settings.show_progress, progress_label=label, flush_cache=True,
            )
            result = run_benchmark(bench, rows, tokenizer)
            print(result.report(), flush=True)
            record = {"config": config.name, "round": round_number, **result.to_json()}  # max_concurrency: concurrency
            append_jsonl(settings.output_dir / RUNS_NAME, record)
            runs.append(record)
            write_outputs(settings.output_dir, runs, context, header, settings.baseline)  # the servers idle
    return runs

"""`bench_compare`'s outputs: one table (Markdown and JSON) and a plot of throughput against load.

A run is one configuration at one concurrency: the JSON record of a `bench_serving` run
(whose "max_concurrency" is the concurrency; its "concurrency" is the measured mean number
in flight) plus "config". Ratios are to the plain server at the same concurrency.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

from eaglesrv.bench.compare_configs import BASELINE

MARKDOWN_NAME, JSON_NAME, PLOT_NAME = "bench_compare.md", "bench_compare.json", "throughput.png"
RUN_FIELDS = ("output_throughput", "mean_ttft_ms", "median_ttft_ms", "mean_itl_ms", "median_itl_ms")


def add_ratios(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Set output_throughput_vs_plain on every run (None where plain has no run at that concurrency)."""
    plain = {r["max_concurrency"]: r["output_throughput"] for r in runs if r["config"] == BASELINE}
    for run in runs:
        base = plain.get(run["max_concurrency"])
        run["output_throughput_vs_plain"] = run["output_throughput"] / base if base else None
    return runs


def _num(value: float | None, digits: int = 1, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}{suffix}"


def markdown_table(runs: Sequence[dict[str, Any]], header: Sequence[str] = ()) -> str:
    """Rows grouped by concurrency, configurations in run order; "-": does not apply."""
    lines = [*header, "" if header else None,
             "| concurrency | configuration | output tok/s | vs plain | accept length | TTFT mean (ms) "
             "| TTFT median (ms) | ITL mean (ms) | ITL median (ms) | requests ok |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run in sorted(runs, key=lambda r: r["max_concurrency"]):  # sorted() is stable: run order within
        lines.append(
            f"| {run['max_concurrency']} | {run['config']} | {_num(run['output_throughput'])} "
            f"| {_num(run.get('output_throughput_vs_plain'), 2, 'x')} | {_num(run.get('accept_length'), 2)} "
            f"| {_num(run['mean_ttft_ms'])} | {_num(run['median_ttft_ms'])} | {_num(run['mean_itl_ms'])} "
            f"| {_num(run['median_itl_ms'])} | {run['completed']}/{run['completed'] + run['failed']} |")
    return "\n".join(line for line in lines if line is not None)


def require_matplotlib() -> None:
    """Fail before any server starts, not after the first configuration's hour of runs."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("bench_compare plots with matplotlib: pip install 'eaglesrv[bench]'") from None


def plot_throughput(runs: Sequence[dict[str, Any]], path: Path, title: str = "") -> None:
    """Output tok/s against concurrency (log 2 axis), one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server or in CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for name in dict.fromkeys(r["config"] for r in runs):  # first-seen order
        points = sorted((r["max_concurrency"], r["output_throughput"]) for r in runs if r["config"] == name)
        ax.plot([c for c, _ in points], [t for _, t in points], marker="o", label=name)
    ax.set_xscale("log", base=2)
    concurrencies = sorted({r["max_concurrency"] for r in runs})
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.set_ylim(bottom=0)  # ratios read true only from a zero baseline
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output throughput (tok/s)")
    ax.set_title(title or "Output throughput by concurrency")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_outputs(output_dir: Path, runs: list[dict[str, Any]], context: dict[str, Any],
                  header: Sequence[str]) -> dict[str, Path]:
    """bench_compare.md, bench_compare.json and throughput.png in output_dir; their paths."""
    output_dir.mkdir(parents=True, exist_ok=True)
    add_ratios(runs)
    paths = {"markdown": output_dir / MARKDOWN_NAME, "json": output_dir / JSON_NAME, "plot": output_dir / PLOT_NAME}
    paths["markdown"].write_text(markdown_table(runs, header) + "\n")
    with open(paths["json"], "w") as f:
        json.dump(_strict_json({**context, "runs": runs}), f, indent=1, default=str, allow_nan=False)
    if runs:
        plot_throughput(runs, paths["plot"], context.get("title", ""))
    return paths


def _strict_json(value: Any) -> Any:
    """inf and nan as strings: JSON has no such numbers (Python would write Infinity)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    return value

"""`bench_compare`'s outputs: one table (Markdown and JSON) and a plot of throughput against load.

A run is one configuration at one concurrency in one round: the JSON record of a
`bench_serving` run (whose "max_concurrency" is the concurrency; its "concurrency" is the
measured mean number in flight) plus "config" and "round". Ratios are to the baseline
(the plain server, unless bench_compare's --baseline names another configuration) at the
same concurrency (and, per run, in the same round); their keys keep the name "vs_plain".

With several rounds, the table has one row per configuration and concurrency, pooled over
its rounds: output tok/s is all their tokens over all their time, TTFT and ITL means are
means of the rounds' means, medians the median of the rounds' medians. The "each round"
column gives the lowest and highest of the per-round ratios to plain.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Sequence

from eaglesrv.bench.compare.configs import BASELINE

MARKDOWN_NAME, JSON_NAME, PLOT_NAME = "bench_compare.md", "bench_compare.json", "throughput.png"
RUN_FIELDS = ("output_throughput", "mean_ttft_ms", "median_ttft_ms", "mean_itl_ms", "median_itl_ms")


def add_ratios(runs: Sequence[dict[str, Any]], baseline: str = BASELINE) -> Sequence[dict[str, Any]]:
    """Set output_throughput_vs_plain on every run (or pooled row): to the baseline's at the
    same concurrency and round (None where the baseline has none)."""
    plain = {_slot(r): r["output_throughput"] for r in runs if r["config"] == baseline}
    for run in runs:
        base = plain.get(_slot(run))
        run["output_throughput_vs_plain"] = run["output_throughput"] / base if base else None
    return runs


def _slot(run: dict[str, Any]) -> tuple[int, int]:
    return run["max_concurrency"], run.get("round", 1)


def pool_rounds(runs: Sequence[dict[str, Any]], baseline: str = BASELINE) -> list[dict[str, Any]]:
    """One row per (configuration, concurrency), in first-run order; a configuration run
    once at a concurrency is its own row. Ratios to the baseline are added to the runs first."""
    add_ratios(runs, baseline)
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["config"], run["max_concurrency"]), []).append(run)
    rows = []
    for (config, concurrency), group in groups.items():
        if len(group) == 1:
            rows.append({**{k: v for k, v in group[0].items() if k != "round"}, "rounds": 1})
            continue
        accepts = [r["accept_length"] for r in group if r.get("accept_length") is not None]
        ratios = [r["output_throughput_vs_plain"] for r in group if r["output_throughput_vs_plain"] is not None]
        tokens, seconds = sum(r["total_output_tokens"] for r in group), sum(r["duration"] for r in group)
        rows.append({
            "config": config, "max_concurrency": concurrency, "rounds": len(group),
            "completed": sum(r["completed"] for r in group), "failed": sum(r["failed"] for r in group),
            "total_output_tokens": tokens, "duration": seconds, "output_throughput": tokens / seconds,
            "accept_length": statistics.fmean(accepts) if accepts else None,
            **{f"mean_{m}_ms": statistics.fmean(r[f"mean_{m}_ms"] for r in group) for m in ("ttft", "itl")},
            **{f"median_{m}_ms": statistics.median(r[f"median_{m}_ms"] for r in group) for m in ("ttft", "itl")},
            "vs_plain_each_round": ratios,
        })
    add_ratios(rows, baseline)  # pooled rows have no "round": they pair with the baseline's pooled row
    return rows


def _num(value: float | None, digits: int = 1, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}{suffix}"


def markdown_table(rows: Sequence[dict[str, Any]], header: Sequence[str] = (), baseline: str = BASELINE) -> str:
    """pool_rounds' rows grouped by concurrency, configurations in run order; "-": does
    not apply. With several rounds, a column of the per-round ratios' range."""
    rounds = any(r.get("rounds", 1) > 1 for r in rows)
    lines = [*header, "" if header else None,
             f"| concurrency | configuration | output tok/s | vs {baseline} "
             + (f"| vs {baseline}, each round " if rounds else "")
             + "| accept length | TTFT mean (ms) | TTFT median (ms) | ITL mean (ms) | ITL median (ms) | requests ok |",
             "|---:|---|---:|---:|" + ("---:|" if rounds else "") + "---:|---:|---:|---:|---:|---:|"]
    for run in sorted(rows, key=lambda r: r["max_concurrency"]):  # sorted() is stable: run order within
        spread = run.get("vs_plain_each_round")
        each = (f"| {min(spread):.2f}-{max(spread):.2f}x " if spread else "| - ") if rounds else ""
        lines.append(
            f"| {run['max_concurrency']} | {run['config']} | {_num(run['output_throughput'])} "
            f"| {_num(run.get('output_throughput_vs_plain'), 2, 'x')} {each}| {_num(run.get('accept_length'), 2)} "
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
    """Output tok/s against concurrency (log 2 axis), one line per configuration (rows
    pooled over rounds)."""
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
                  header: Sequence[str], baseline: str = BASELINE) -> dict[str, Path]:
    """bench_compare.md, bench_compare.json and throughput.png in output_dir; their paths.
    The JSON holds every run ("runs") and the table's rows ("table")."""
    output_dir.mkdir(parents=True, exist_ok=True)
    rows = pool_rounds(runs, baseline)
    paths = {"markdown": output_dir / MARKDOWN_NAME, "json": output_dir / JSON_NAME, "plot": output_dir / PLOT_NAME}
    paths["markdown"].write_text(markdown_table(rows, header, baseline) + "\n")
    with open(paths["json"], "w") as f:
        json.dump(_strict_json({**context, "runs": runs, "table": rows}), f, indent=1, default=str, allow_nan=False)
    if rows:
        plot_throughput(rows, paths["plot"], context.get("title", ""))
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

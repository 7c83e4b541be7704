"""Metrics of one `bench_serving` run and the report SGLang's bench_serving prints.

The report's lines and their formats are SGLang's, so that tools reading one read the
other; `parse_report` reads them back (the smoke tests use it). Two additions, printed
only when they apply: "Failed requests:" and "Accept length:" (SGLang prints the latter too).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np

from eaglesrv.bench.serving.client import RequestRecord

REPORT_WIDTH = 50
# Every line a complete report has, in order (section rules aside).
REPORT_LABELS = (
    "Backend:", "Traffic request rate:", "Max request concurrency:", "Successful requests:",
    "Benchmark duration (s):", "Total input tokens:", "Total generated tokens:",
    "Total generated tokens (retokenized):", "Request throughput (req/s):", "Input token throughput (tok/s):",
    "Output token throughput (tok/s):", "Total token throughput (tok/s):", "Concurrency:",
    "Mean E2E Latency (ms):", "Median E2E Latency (ms):",
    "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):",
    "Mean ITL (ms):", "Median ITL (ms):", "P95 ITL (ms):", "P99 ITL (ms):", "Max ITL (ms):",
)
OPTIONAL_LABELS = ("Failed requests:", "Accept length:")


@dataclass(frozen=True)
class ServingMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    total_output_retokenized: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    mean_ttft_ms: float
    median_ttft_ms: float
    std_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    p99_tpot_ms: float
    mean_itl_ms: float
    median_itl_ms: float
    std_itl_ms: float
    p95_itl_ms: float
    p99_itl_ms: float
    max_itl_ms: float
    mean_e2e_latency_ms: float
    median_e2e_latency_ms: float
    std_e2e_latency_ms: float
    p99_e2e_latency_ms: float
    concurrency: float  # mean requests in flight: summed latencies over the duration

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _ms(values: Sequence[float], stat: str, q: float = 0.0) -> float:
    """A statistic in ms; 0 for no values (no stream, or every request failed), as SGLang."""
    if not values:
        return 0.0
    array = np.asarray(values, dtype=np.float64)
    value = np.percentile(array, q) if stat == "percentile" else getattr(np, stat)(array)
    return float(value) * 1000.0


def compute_metrics(outputs: Sequence[RequestRecord], duration_s: float, tokenizer: Any) -> ServingMetrics:
    ok = [o for o in outputs if o.success]
    output_lens = [o.output_len for o in ok]
    retokenized = [len(tokenizer.encode(o.generated_text, add_special_tokens=False)) for o in ok]
    total_input = sum(o.prompt_len for o in ok)
    ttfts = [o.ttft for o in ok]
    tpots = [(o.latency - o.ttft) / (o.output_len - 1) for o in ok if o.output_len > 1]
    itls = [x for o in ok for x in o.itl]
    latencies = [o.latency for o in ok]
    duration_s = max(duration_s, 1e-9)
    return ServingMetrics(
        completed=len(ok), failed=len(outputs) - len(ok), total_input=total_input,
        total_output=sum(output_lens), total_output_retokenized=sum(retokenized),
        request_throughput=len(ok) / duration_s, input_throughput=total_input / duration_s,
        output_throughput=sum(output_lens) / duration_s,
        total_throughput=(total_input + sum(output_lens)) / duration_s,
        mean_ttft_ms=_ms(ttfts, "mean"), median_ttft_ms=_ms(ttfts, "median"), std_ttft_ms=_ms(ttfts, "std"),
        p99_ttft_ms=_ms(ttfts, "percentile", 99),
        mean_tpot_ms=_ms(tpots, "mean"), median_tpot_ms=_ms(tpots, "median"),
        p99_tpot_ms=_ms(tpots, "percentile", 99),
        mean_itl_ms=_ms(itls, "mean"), median_itl_ms=_ms(itls, "median"), std_itl_ms=_ms(itls, "std"),
        p95_itl_ms=_ms(itls, "percentile", 95), p99_itl_ms=_ms(itls, "percentile", 99),
        max_itl_ms=_ms(itls, "max"),
        mean_e2e_latency_ms=_ms(latencies, "mean"), median_e2e_latency_ms=_ms(latencies, "median"),
        std_e2e_latency_ms=_ms(latencies, "std"), p99_e2e_latency_ms=_ms(latencies, "percentile", 99),
        concurrency=sum(latencies) / duration_s,
    )


def _line(label: str, value: Any) -> str:
    text = f"{value:<10.2f}" if isinstance(value, float) else f"{value!s:<10}"
    return f"{label:<40} {text}".rstrip()


def _rule(title: str, fill: str) -> str:
    return f"{title:{fill}^{REPORT_WIDTH}}"


def format_report(backend: str, request_rate: float, max_concurrency: int | None, duration_s: float,
                  m: ServingMetrics, accept_length: float | None) -> str:
    """SGLang's report, line for line."""
    lines = [
        "", _rule(" Serving Benchmark Result ", "="),
        _line("Backend:", backend),
        _line("Traffic request rate:", str(request_rate)),  # "inf", as SGLang prints it
        _line("Max request concurrency:", max_concurrency if max_concurrency else "not set"),
        _line("Successful requests:", m.completed),
    ]
    if m.failed:
        lines.append(_line("Failed requests:", m.failed))
    lines += [
        _line("Benchmark duration (s):", float(duration_s)),
        _line("Total input tokens:", m.total_input),
        _line("Total generated tokens:", m.total_output),
        _line("Total generated tokens (retokenized):", m.total_output_retokenized),
        _line("Request throughput (req/s):", m.request_throughput),
        _line("Input token throughput (tok/s):", m.input_throughput),
        _line("Output token throughput (tok/s):", m.output_throughput),
        _line("Total token throughput (tok/s):", m.total_throughput),
        _line("Concurrency:", m.concurrency),
    ]
    if accept_length:
        lines.append(_line("Accept length:", float(accept_length)))
    lines += [
        _rule("End-to-End Latency", "-"),
        _line("Mean E2E Latency (ms):", m.mean_e2e_latency_ms),
        _line("Median E2E Latency (ms):", m.median_e2e_latency_ms),
        _rule("Time to First Token", "-"),
        _line("Mean TTFT (ms):", m.mean_ttft_ms),
        _line("Median TTFT (ms):", m.median_ttft_ms),
        _line("P99 TTFT (ms):", m.p99_ttft_ms),
        _rule("Inter-Token Latency", "-"),
        _line("Mean ITL (ms):", m.mean_itl_ms),
        _line("Median ITL (ms):", m.median_itl_ms),
        _line("P95 ITL (ms):", m.p95_itl_ms),
        _line("P99 ITL (ms):", m.p99_itl_ms),
        _line("Max ITL (ms):", m.max_itl_ms),
        "=" * REPORT_WIDTH,
    ]
    return "\n".join(lines)


_REPORT_LINE = re.compile(r"^(?P<label>[A-Z][^:]*:)\s+(?P<value>\S.*?)\s*$")


def parse_report(text: str) -> dict[str, float | str]:
    """{label: value} for every report line in text; numbers as floats, the rest as strings."""
    known = set(REPORT_LABELS) | set(OPTIONAL_LABELS)
    values: dict[str, float | str] = {}
    for line in text.splitlines():
        match = _REPORT_LINE.match(line)
        if match and match["label"] in known:
            raw = match["value"]
            try:
                values[match["label"]] = float(raw)
            except ValueError:
                values[match["label"]] = raw
    return values


def missing_report_lines(text: str) -> list[str]:
    """The labels a complete report has that `text` lacks (numbers where numbers belong)."""
    values = parse_report(text)
    textual = {"Backend:", "Max request concurrency:"}
    return [label for label in REPORT_LABELS
            if label not in values or (label not in textual and not isinstance(values[label], float))]
